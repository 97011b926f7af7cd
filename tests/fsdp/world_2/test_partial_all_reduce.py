"""HSDP accumulation with ``set_requires_all_reduce(False)`` when the parameters with gradients
change between microbatches (a layer used in one microbatch and not in another).

A parameter with a slot in the pending partial sum is reduced in every later microbatch, as
zeros where it has no gradient, and a parameter that first gets a gradient partway through
gets a slot of its own (the partial is repacked), as torch 2.15 does; a group that the last
microbatch leaves without any gradient still reduces its partial. Before 2.15 torch added the
partial slot by slot to whatever parameters the next microbatch had (a shape error deep in an
add, or, with equal sizes, gradients silently added to other parameters).

Oracles: compatibility. On every release, torch's ``fully_shard`` with
``set_reduce_scatter_unused_params(True)``, whose layout never changes (every parameter is
reduced in every microbatch, as zeros without a gradient): the same arithmetic, bitwise. On
torch 2.15, also torch's own zero-fill (the same scenario without that setting), bitwise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import fully_shard
from shardweave.fsdp._torch_compat import TORCH_RELEASE
from tests._dist import WorkerPool
from tests.fsdp._oracle import assert_same_as_torch

# torch 2.15 repacks the partial itself; before, only the fixed-layout oracle applies.
TORCH_ZERO_FILLS = TORCH_RELEASE >= (2, 15)


class Body(nn.Module):
    """Two equal layers (a misplaced partial would fit), either or both used."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use: str) -> torch.Tensor:
        for name in use:  # "a" or "ab"
            x = getattr(self, name)(x)
        return x


class Layers(nn.Module):
    """A child group (the body) and the root's head; "" leaves the body out of the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use: str) -> torch.Tensor:
        return self.head(self.body(x, use) if use else x)


# Each microbatch: the body layers it uses; the last one all-reduces.
SCENARIOS: dict[str, tuple[str, ...]] = {
    "grows": ("a", "ab"),  # b's first gradient partway through: the partial is repacked
    "shrinks": ("ab", "a"),  # b pending, no gradient now: reduced as zeros
    "grows-then-shrinks": ("a", "ab", "a"),
    "body-unused-last": ("ab", ""),  # the body group has no gradient at all at the end
}


def _hsdp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))


def _train(model: nn.Module, api: Callable[..., object], uses: tuple[str, ...], rank: int, *,
           unused: bool) -> None:  # fmt: skip
    mesh = _hsdp_mesh()
    api(model.body, mesh=mesh)
    api(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(unused)  # type: ignore[operator]
    for i, use in enumerate(uses):
        model.set_requires_all_reduce(i == len(uses) - 1)  # type: ignore[operator]
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * i + rank))
        model(x, use).sum().backward()


def changed_layout(rank: int, world: int, scenario: str) -> None:
    uses = SCENARIOS[scenario]
    torch.manual_seed(0)
    model = Layers()
    fixed, zero_filled = copy.deepcopy(model), copy.deepcopy(model)
    _train(model, fully_shard, uses, rank, unused=False)
    _train(fixed, torch_fully_shard, uses, rank, unused=True)
    assert_same_as_torch(model, fixed, f"{scenario}: vs torch's fixed layout")
    if TORCH_ZERO_FILLS:
        _train(zero_filled, torch_fully_shard, uses, rank, unused=False)
        assert_same_as_torch(model, zero_filled, f"{scenario}: vs torch 2.15's zero-fill")
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{scenario}: {name} has no gradient after the last microbatch"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_changed_layout_as_torch(world2: WorkerPool, scenario: str) -> None:
    if not hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params"):
        pytest.skip("torch's FSDPModule has no set_reduce_scatter_unused_params on this release")
    world2.run(changed_layout, scenario)
