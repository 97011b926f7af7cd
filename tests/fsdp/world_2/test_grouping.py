"""Grouped fully_shard([a, b]) and tied parameters.

Oracles: *reference* and *compatibility* (torch's fully_shard with the same grouping).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool
from tests.fsdp._models import TinyGPT, loss_fn, make_batch, make_model
from tests.fsdp._oracle import assert_matches_reference, assert_same_as_torch


def grouped_norm_and_head(rank: int, world: int) -> None:
    model = make_model("gpt")
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        assert isinstance(m, TinyGPT)
        for layer in m.layers:
            api(layer)
        # the tied embedding/head must be one group: group the embedding with the head
        grouped = [m.tok, m.norm, m.head]
        assert api(grouped) is grouped
        api(m)
    for step in range(3):
        batches = [make_batch("gpt", 1000 * step + r) for r in range(world)]
        for m in (model, tmodel):
            loss_fn("gpt", m(batches[rank]), batches[rank]).backward()
        (sum(loss_fn("gpt", ref(b), b) for b in batches) / world).backward()  # type: ignore[union-attr]
        assert_same_as_torch(model, tmodel, f"step {step}")
        assert_matches_reference(model, ref, "grad", rank, world, f"step {step}")
        for m in (model, tmodel, ref):
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)  # type: ignore[operator]
            m.zero_grad(set_to_none=True)
        assert_matches_reference(model, ref, "param", rank, world, f"step {step}")
        # every rank's shard of the tied weight moved (torch once updated only some ranks)
        assert model.head.weight is model.tok.weight  # type: ignore[union-attr]


def test_grouped_modules_with_tied_weights(world2: WorkerPool) -> None:
    """Oracles: reference and compatibility; the tied weight stays tied and every shard trains."""
    world2.run(grouped_norm_and_head)


def tied_across_groups(rank: int, world: int, api_name: str) -> str:
    api = {"ours": fully_shard, "torch": torch_fully_shard}[api_name]
    model = make_model("gpt")
    api(model.head)  # type: ignore[arg-type]  # the tied weight now sits in two groups
    api(model)
    batch = make_batch("gpt", 0)
    with pytest.raises(ValueError, match="shared") as err:
        model(batch)
    return str(err.value)


@pytest.mark.parametrize("api_name", ["ours", "torch"])
def test_tied_parameter_across_groups_raises(world2: WorkerPool, api_name: str) -> None:
    """Oracle: compatibility (torch raises ValueError at lazy init, and so do we)."""
    messages = world2.run(tied_across_groups, api_name)
    if api_name == "ours":
        assert all("fully_shard([module_a, module_b])" in str(m) for m in messages), messages


class TwoHeads(nn.Module):
    """Chunked-loss style: forward skips `head`, which is called per chunk afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)
        self.aux = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def partial_group_forward(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        api([m.head, m.aux])
        api(m)
    xs = [torch.randn(4, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for m in (model, tmodel):
        hidden = m(xs[rank])
        loss = sum(m.head(chunk).sum() for chunk in hidden.chunk(2))
        loss.backward()  # type: ignore[union-attr]
    (sum(sum(ref.head(c).sum() for c in ref(x).chunk(2)) for x in xs) / world).backward()  # type: ignore[union-attr]
    assert_same_as_torch(model, tmodel)
    assert_matches_reference(model, ref, "grad", rank, world)


def test_partial_group_forward(world2: WorkerPool) -> None:
    """Oracles: reference and compatibility; a grouped state whose modules do not all run."""
    world2.run(partial_group_forward)


def per_chunk_backward(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    tmodel = copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        api([m.head, m.aux])
        api(m)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    seen: dict[str, list[torch.Tensor | None]] = {}
    for name, m in (("ours", model), ("torch", tmodel)):
        seen[name] = []
        for step in range(2):
            hidden = m(x)
            chunk_grads = []
            for chunk in hidden.detach().chunk(2):
                chunk.requires_grad_(True)
                m.head(chunk).sum().backward()  # the head alone: no hook of the forward above
                grad = m.head.weight.grad  # type: ignore[union-attr]
                seen[name].append(None if grad is None else grad.full_tensor())  # type: ignore[union-attr]
                chunk_grads.append(chunk.grad)
            hidden.backward(torch.cat(chunk_grads))  # type: ignore[arg-type]
            m.zero_grad(set_to_none=step == 0)
    for i, (ours, theirs) in enumerate(zip(seen["ours"], seen["torch"], strict=True)):
        assert theirs is not None and ours is not None, f"backward {i}: head gradient missing"
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=f"backward {i}")
    assert_same_as_torch(model, tmodel)


def test_grouped_module_backward_on_its_own(world2: WorkerPool) -> None:
    """Oracle: compatibility. A module of a grouped call run and backpropagated on its own (the
    chunked-loss head) has its reduced gradient at the end of each such backward, as torch's."""
    world2.run(per_chunk_backward)
