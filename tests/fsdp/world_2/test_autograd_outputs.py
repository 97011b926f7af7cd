"""Forward outputs the loss does not use, modules that are sharded but never called, and
activations wrapped in containers with non-tensor fields, on 2 ranks: the cases torch's
``test_fully_shard_autograd.py`` checks on GPU only.

Oracles: *compatibility* (torch's own ``fully_shard`` on a copy in the same processes: bitwise
equal outputs, shards and grads) and *reference* (an unsharded copy on the global batch, loss
averaged over ranks).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool
from tests.fsdp._oracle import assert_matches_reference, assert_same_as_torch

DIM = 6
Pair = namedtuple("Pair", "x extra")


@dataclasses.dataclass
class Boxed:
    """A container torch's pytree does not flatten: its tensor reaches autograd unhooked."""

    x: torch.Tensor
    note: str


def _batches(step: int, world: int) -> list[torch.Tensor]:
    return [
        torch.randn(2, DIM, generator=torch.Generator().manual_seed(100 * step + r))
        for r in range(world)
    ]


def _train(
    model: nn.Module,
    tmodel: nn.Module,
    ref: nn.Module,
    loss: Any,
    rank: int,
    world: int,
    tag: str,
    steps: int = 4,
) -> None:
    """SGD steps on all three; ``loss(model, x, step)`` is the scalar to backpropagate."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, tmodel, ref)]
    for step in range(steps):
        xs = _batches(step, world)
        ours, theirs = loss(model, xs[rank], step), loss(tmodel, xs[rank], step)
        assert torch.equal(ours, theirs), f"{tag} step {step}: loss {ours} vs torch's {theirs}"
        ours.backward()
        theirs.backward()
        (sum(loss(ref, x, step) for x in xs) / world).backward()
        assert_same_as_torch(model, tmodel, f"{tag} step {step}")
        assert_matches_reference(model, ref, "grad", rank, world, f"{tag} step {step}")
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=step % 2 == 1)
        assert_same_as_torch(model, tmodel, f"{tag} step {step} after the optimizer step")


class TwoOutputs(nn.Module):
    """Returns two outputs; ``lin2`` exists always but runs only if ``use_second``."""

    def __init__(self, use_second: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)
        self.use_second = use_second

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.lin1(x))
        return h, (self.lin2(h) if self.use_second else h * 2)


def unused_forward_output(rank: int, world: int, reshard: bool) -> None:
    torch.manual_seed(0)
    model = TwoOutputs(use_second=True)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        api(m.lin1, reshard_after_forward=reshard)
        api(m, reshard_after_forward=reshard)

    def loss(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        out1, out2 = m(x)
        # Both outputs for two steps, then only the first: lin2 (in the root's group, whose
        # output is dropped) gets no gradient from those steps on.
        return (out1 * out2).sum() if step < 2 else out1.sum()

    _train(model, tmodel, ref, loss, rank, world, f"unused output reshard={reshard}")


@pytest.mark.parametrize("reshard", [True, False])
def test_unused_forward_output(world2: WorkerPool, reshard: bool) -> None:
    """Oracles: compatibility (bitwise) and reference; the loss uses both outputs, then one."""
    world2.run(unused_forward_output, reshard)


def never_called_module(rank: int, world: int, reshard: bool) -> None:
    torch.manual_seed(0)
    model = TwoOutputs(use_second=False)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        api(m.lin1, reshard_after_forward=reshard)
        api(m.lin2, reshard_after_forward=reshard)  # sharded, never called
        api(m, reshard_after_forward=reshard)

    def loss(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        out1, out2 = m(x)
        return (out1 + out2).sum()

    _train(model, tmodel, ref, loss, rank, world, f"never called reshard={reshard}")
    assert model.lin2.weight.grad is None and tmodel.lin2.weight.grad is None


@pytest.mark.parametrize("reshard", [True, False])
def test_sharded_module_never_called(world2: WorkerPool, reshard: bool) -> None:
    """Oracles: compatibility (bitwise) and reference; a sharded module that never runs."""
    world2.run(never_called_module, reshard)


def _wrap(kind: str, x: torch.Tensor) -> Any:
    if kind == "list":
        return [x, None]
    if kind == "tuple":
        return (x, 3)
    if kind == "namedtuple":
        return Pair(x, torch.ones_like(x))  # a tensor that needs no grad next to one that does
    if kind == "dict":
        return {"x": x, "meta": "text"}
    if kind == "nested":
        return {"items": [(x, {"scale": 0.5})], "n": 1}
    if kind == "dataclass":
        return Boxed(x, "text")
    raise ValueError(kind)


def _unwrap(kind: str, c: Any) -> torch.Tensor:
    if kind in ("list", "tuple", "namedtuple"):
        return c[0]  # type: ignore[no-any-return]
    if kind == "dict":
        return c["x"]  # type: ignore[no-any-return]
    if kind == "nested":
        return c["items"][0][0] * c["items"][0][1]["scale"]  # type: ignore[no-any-return]
    return c.x  # type: ignore[no-any-return]


class ContainerBlock(nn.Module):
    """Takes and returns the same container kind, computing on the tensor inside."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)

    def forward(self, c: Any) -> Any:
        x = _unwrap(self.kind, c)
        return _wrap(self.kind, F.relu(self.lin2(F.relu(self.lin1(x)))))


class ContainerModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(ContainerBlock(kind) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = _wrap(self.kind, x)
        for block in self.blocks:
            c = block(c)
        return _unwrap(self.kind, c)


def container_activations(rank: int, world: int, kind: str) -> None:
    torch.manual_seed(0)
    model = ContainerModel(kind)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        for block in m.blocks:
            api(block)
        api(m)

    def loss(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        return m(x).pow(2).sum()

    _train(model, tmodel, ref, loss, rank, world, f"container {kind}")


@pytest.mark.parametrize("kind", ["list", "tuple", "namedtuple", "dict", "nested", "dataclass"])
def test_container_activations(world2: WorkerPool, kind: str) -> None:
    """Oracles: compatibility (bitwise) and reference; blocks pass their activations in
    containers with non-tensor fields (for a dataclass, which torch's pytree does not flatten,
    the backward hooks are found another way or not at all: the result must still be torch's)."""
    world2.run(container_activations, kind)
