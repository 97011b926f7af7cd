"""Frozen parameters (``requires_grad=False``) mixed with trainable ones, inside one FSDP group
and across groups, on 2 ranks: the behaviors torch's ``test_fully_shard_frozen.py`` checks on GPU
only.

Oracles: *compatibility* (torch's own ``fully_shard`` on a copy in the same processes: bitwise
equal shards and gradients, and the same collectives with the same byte counts) and *reference*
(an unsharded copy trained on the global batch, loss averaged over ranks).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.checkpoint import checkpoint

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool
from tests.fsdp._counting import count_collectives
from tests.fsdp._oracle import (
    assert_matches_reference,
    assert_same_as_torch,
    registered_sharded,
)


class Layer(nn.Module):
    """Odd widths, so shards are padded at 2 ranks; optionally activation-checkpointed."""

    def __init__(self, dim: int = 5, hidden: int = 7) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.checkpoint = False

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            out = checkpoint(self._body, x, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out
        return self._body(x)


def _compare_then_step(
    models: tuple[nn.Module, nn.Module, nn.Module],
    opts: list[torch.optim.Optimizer],
    rank: int,
    world: int,
    tag: str,
    step: int,
) -> None:
    """Gradients bitwise equal to torch's and close to the reference, then an optimizer step on
    all three (grads kept as zeros on odd steps), and the parameters bitwise equal to torch's."""
    model, tmodel, ref = models
    assert_same_as_torch(model, tmodel, tag)
    assert_matches_reference(model, ref, "grad", rank, world, tag)
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=step % 2 == 0)
    assert_same_as_torch(model, tmodel, tag)


def _batches(step: int, world: int, dim: int = 5) -> list[torch.Tensor]:
    return [
        torch.randn(3, dim, generator=torch.Generator().manual_seed(100 * step + r))
        for r in range(world)
    ]


def _freeze_weights(model: nn.Module) -> None:
    """Train biases only (BitFit): every group holds frozen and trainable params."""
    for name, p in model.named_parameters():
        if "bias" not in name:
            p.requires_grad_(False)


def mixed_requires_grad_per_group(rank: int, world: int, cfg: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(Layer() for _ in range(3)))
    if cfg["checkpoint"]:
        for layer in model:
            layer.checkpoint = True  # type: ignore[assignment]
    if not cfg["freeze_after_init"]:
        _freeze_weights(model)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        for layer in m:
            api(layer, reshard_after_forward=cfg["reshard_after_forward"])
        api(m, reshard_after_forward=cfg["reshard_after_forward"])
    if cfg["freeze_after_init"]:
        for m in (model, tmodel, ref):
            _freeze_weights(m)
    models = (model, tmodel, ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for step in range(3):
        xs = _batches(step, world)
        with count_collectives() as ours:
            model(xs[rank]).sum().backward()
        with count_collectives() as theirs:
            tmodel(xs[rank]).sum().backward()
        (sum(ref(x).sum() for x in xs) / world).backward()  # type: ignore[union-attr]
        tag = f"{cfg} step {step}"
        # Only the trainable (bias) part of each group is reduce-scattered, as torch does.
        assert ours == theirs, f"{tag}: ours {dict(ours)} vs torch {dict(theirs)}"
        # One per layer (the root holds no params), each the padded biases only: fc1's 7 and
        # fc2's 5 elements pad to 8 and 6 at 2 ranks, fp32.
        assert ours["reduce_scatter_single"] == 3, f"{tag}: one per group, {dict(ours)}"
        assert ours["reduce_scatter_single_bytes"] == 3 * (8 + 6) * 4, f"{tag}: {dict(ours)}"
        assert_same_as_torch(model, tmodel, tag)
        assert_matches_reference(model, ref, "grad", rank, world, tag)
        for p in model.parameters():
            assert (p.grad is None) == (not p.requires_grad), f"{tag}: frozen params get no grad"
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
        assert_same_as_torch(model, tmodel, tag)
        assert_matches_reference(model, ref, "param", rank, world, tag)


PER_GROUP_CASES = [
    {"reshard_after_forward": raf, "checkpoint": ckpt, "freeze_after_init": after}
    for raf in (True, False)
    for ckpt in (False, True)
    for after in (False, True)
]


@pytest.mark.parametrize(
    "cfg", PER_GROUP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_mixed_requires_grad_per_group(world2: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracles: compatibility (bitwise, same reduce-scatter count and bytes) and reference.
    Frozen weights and trainable biases share each group, frozen before or after
    ``fully_shard``, with and without activation checkpointing."""
    world2.run(mixed_requires_grad_per_group, cfg)


def _set_even_linears(model: nn.Sequential, requires_grad: bool) -> None:
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for i, lin in enumerate(linears):
        if i % 2 == 0:
            lin.requires_grad_(requires_grad)


def mixed_requires_grad_across_groups(rank: int, world: int, reshard: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(5, 5), nn.ReLU())))
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        for lin in m:
            if isinstance(lin, nn.Linear):
                api(lin, reshard_after_forward=reshard)  # no root: each linear is a root
    models = (model, tmodel, ref)
    for m in models:
        _set_even_linears(m, False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    steps, no_grad_step = 4, 1
    for step in range(steps):
        if step == steps - 1:  # fine-tuning that unfreezes layers for the last step
            for m in models:
                _set_even_linears(m, True)
        xs = _batches(step, world)
        tag = f"reshard={reshard} step {step}"
        if step == no_grad_step:
            with torch.no_grad():
                outs = [m(xs[rank]) for m in (model, tmodel)]
            assert torch.equal(outs[0], outs[1]), f"{tag}: no_grad outputs differ from torch"
            continue
        model(xs[rank]).sum().backward()
        tmodel(xs[rank]).sum().backward()
        (sum(ref(x).sum() for x in xs) / world).backward()  # type: ignore[union-attr]
        # With reshard_after_forward=False, the frozen first linear (no grad flows into it, so
        # no backward hook of its runs) stays unsharded after backward, in torch as in ours.
        kinds = registered_sharded(model)
        assert kinds == registered_sharded(tmodel), f"{tag}: {kinds}"
        for m in (model, tmodel):
            for lin in m:
                if isinstance(lin, nn.Linear):
                    lin.reshard()  # type: ignore[operator]
        _compare_then_step(models, opts, rank, world, tag, step)
        assert_matches_reference(model, ref, "param", rank, world, tag)


@pytest.mark.parametrize("reshard", [True, False])
def test_mixed_requires_grad_across_groups(world2: WorkerPool, reshard: bool) -> None:
    """Oracles: compatibility (bitwise) and reference. Frozen and trainable groups interleave,
    a step runs under ``no_grad``, and the frozen groups are unfrozen for the last step."""
    world2.run(mixed_requires_grad_across_groups, reshard)


class MultiForward(nn.Module):
    """A trainable and a frozen layer called several times, some calls under ``no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 5)
        self.frozen = nn.Linear(5, 5)
        self.trained = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for _ in range(3):
            x = self.frozen(F.relu(self.trained(x)))
            with torch.no_grad():  # in place: x keeps its autograd history
                x += F.relu(self.trained(x))
        return x


def multi_forward_mixed_requires_grad(rank: int, world: int, reshard: bool) -> None:
    torch.manual_seed(0)
    model = MultiForward()
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        for lin in (m.first, m.frozen, m.trained):
            api(lin, reshard_after_forward=reshard)
        api(m, reshard_after_forward=reshard)
    models = (model, tmodel, ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(3):
        xs = _batches(step, world)
        model(xs[rank]).sum().backward()
        tmodel(xs[rank]).sum().backward()
        (sum(ref(x).sum() for x in xs) / world).backward()  # type: ignore[union-attr]
        tag = f"reshard={reshard} step {step}"
        _compare_then_step(models, opts, rank, world, tag, step)


@pytest.mark.parametrize("reshard", [True, False])
def test_multi_forward_mixed_requires_grad(world2: WorkerPool, reshard: bool) -> None:
    """Oracles: compatibility (bitwise) and reference. A module used several times per forward,
    with and without grad, next to a frozen one."""
    world2.run(multi_forward_mixed_requires_grad, reshard)
