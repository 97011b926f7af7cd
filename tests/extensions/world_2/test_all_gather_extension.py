"""The fsdp_pre/post_all_gather protocol, through the example low-precision all-gather.

Oracles: *compatibility* (torch's fully_shard with the same hooks: bitwise equal params and
grads), *closed form* (all-gather bytes halve for bf16 over fp32), *reference* (an unsharded
model whose forward uses bf16-rounded parameters).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.extensions.all_gather import all_gather_in_dtype
from shardweave.fsdp import fully_shard
from shardweave.mesh.extension_points import PARAM_KINDS, ParamKind
from tests._dist import WorkerPool
from tests.fsdp._counting import count_collectives
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import assert_same_as_torch


def low_precision_all_gather(rank: int, world: int) -> None:
    model = make_model("gpt")
    tmodel, plain = copy.deepcopy(model), copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    shard_blocks(tmodel, torch_fully_shard)
    shard_blocks(plain, fully_shard)
    assert all_gather_in_dtype(model, torch.bfloat16) == len(list(model.parameters()))
    all_gather_in_dtype(tmodel, torch.bfloat16)
    batch = make_batch("gpt", rank)
    loss_fn("gpt", plain(batch), batch).backward()  # warm-up (lazy init) outside the count
    with count_collectives() as plain_counts:
        loss_fn("gpt", plain(batch), batch).backward()
    for step in range(3):
        batch = make_batch("gpt", 10 * step + rank)
        with count_collectives() as counts:
            out = model(batch)
            loss_fn("gpt", out, batch).backward()
        loss_fn("gpt", tmodel(batch), batch).backward()
        assert out.dtype == torch.float32  # compute stays fp32
        assert_same_as_torch(model, tmodel, f"step {step}")
        if step > 0:  # after lazy init: bf16 all-gather carries half of fp32's payload
            assert counts["all_gather_single"] == plain_counts["all_gather_single"]
            ratio = counts["all_gather_single_bytes"] / plain_counts["all_gather_single_bytes"]
            assert 0.45 < ratio < 0.55, ratio
        for m in (model, tmodel):
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.05 * p.grad)  # type: ignore[operator]
            m.zero_grad(set_to_none=True)


def test_low_precision_all_gather_extension(world2: WorkerPool) -> None:
    """Oracles: compatibility (bitwise vs torch with the same hooks) and closed form (bytes)."""
    world2.run(low_precision_all_gather)


def one_sided_hooks(rank: int, world: int) -> None:
    model = make_model("mlp")
    fully_shard(model)
    local = model.in_proj.weight._local_tensor  # type: ignore[union-attr]
    local.fsdp_pre_all_gather = lambda mesh: ((local,), None)  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="must define both"):
        model(make_batch("mlp", 0))


def test_hooks_must_come_in_pairs(world2: WorkerPool) -> None:
    """Oracle: closed form (torch raises AssertionError for a one-sided extension)."""
    world2.run(one_sided_hooks)


class Tagged(torch.Tensor):
    """A tensor class with no fsdp_pre/post_all_gather methods of its own."""


class BF16AllGather:
    """The all-gather part of the ``Tagged`` kind: all-gather in bf16, rebuild in the compute
    dtype (what ``all_gather_in_dtype`` does through torch's methods, for even shards)."""

    handled_type = Tagged

    def __init__(self) -> None:
        self.calls = 0

    def pre_all_gather(
        self, local: torch.Tensor, mesh: object
    ) -> tuple[tuple[torch.Tensor, ...], object]:
        self.calls += 1
        return (local.as_subclass(torch.Tensor).to(torch.bfloat16),), None

    def post_all_gather(
        self, outs: Sequence[torch.Tensor], meta: object, dtype: torch.dtype
    ) -> torch.Tensor:
        return outs[0].to(dtype)


def registered_all_gather_plugin(rank: int, world: int) -> int:
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))  # even shards
        for unit in (model[0], model[2], model):
            fully_shard(unit)
        return model

    model, ref = build(), build()
    plugin = BF16AllGather()
    # A kind without a handler: sharded as a plain tensor, gathered by the plugin. The pool
    # restores registries after the body.
    PARAM_KINDS.register("bf16-test", ParamKind(Tagged, all_gather=plugin))
    for p in model.parameters():
        local = p._local_tensor  # type: ignore[attr-defined]
        p._local_tensor = local.as_subclass(Tagged)  # type: ignore[attr-defined]
    all_gather_in_dtype(ref, torch.bfloat16)  # the same rounding through torch's methods
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for m in (model, ref):
            m(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"step {step} {name}"  # type: ignore[union-attr]
        for m in (model, ref):
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.05 * p.grad)  # type: ignore[operator]
            m.zero_grad(set_to_none=True)
    return plugin.calls


def test_all_gather_plugin_is_consulted(world2: WorkerPool) -> None:
    """Oracle: compatibility. A tensor class without torch's methods gets them from its
    ``PARAM_KINDS`` kind's ``all_gather`` part: bitwise the gradients of the same bf16
    all-gather done through torch's methods (``all_gather_in_dtype``), which plain fp32
    gathering would not give; the plugin runs once per parameter per unshard (4 params x 2
    unshards x 3 steps)."""
    assert world2.run(registered_all_gather_plugin) == [24, 24]
