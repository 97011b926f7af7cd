"""HSDP accumulation with ``set_requires_all_reduce(False)`` when the parameters with gradients
change between microbatches (a layer used in one microbatch and not in the other).

The kept partial sum is added slot by slot to the next reduction's output. torch 2.15
zero-fills the parameters the new microbatch left without a gradient and rebuilds the partial
for new ones; shardweave does not yet, so the change is a clear error on every rank (it
was a shape error deep in an add, or, with equal sizes, gradients silently added to other
parameters). ``set_reduce_scatter_unused_params(True)`` keeps the layout fixed, and then both
engines agree bitwise.

Oracles: closed form (the error and its advice) and compatibility (torch's ``fully_shard``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool
from tests.fsdp._oracle import assert_same_as_torch


class TwoLayers(nn.Module):
    """One group, two layers; the second used only when asked (equal sizes: a misplaced
    partial would fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if use_b else h


def _hsdp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))


def _microbatches(model: nn.Module, rank: int) -> None:
    """A first microbatch using only ``a`` without the all-reduce, then one using both."""
    for i, (use_b, last) in enumerate(((False, False), (True, True))):
        model.set_requires_all_reduce(last)  # type: ignore[operator]
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * i + rank))
        model(x, use_b).sum().backward()


def changed_layout(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = TwoLayers()
    fully_shard(model, mesh=_hsdp_mesh())
    with pytest.raises(RuntimeError, match="changed between microbatches") as info:
        _microbatches(model, rank)
    model.reset_iter_state()  # type: ignore[operator]
    return str(info.value)


def test_changed_layout_is_a_clear_error(world2: WorkerPool) -> None:
    for message in world2.run(changed_layout):
        assert isinstance(message, str)
        assert "only now: ['b.bias', 'b.weight']" in message, message
        assert "set_reduce_scatter_unused_params(True)" in message, message


def unused_zeros(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    tmodel = copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        api(m, mesh=_hsdp_mesh())
        m.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
        _microbatches(m, rank)
    assert_same_as_torch(model, tmodel, "unused parameters reduced as zeros")


def test_unused_params_keep_the_layout(world2: WorkerPool) -> None:
    if not hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params"):
        pytest.skip("torch's FSDPModule has no set_reduce_scatter_unused_params on this release")
    world2.run(unused_zeros)
