"""Parameter kinds: one ``PARAM_KINDS`` registration gives the engine every part of a kind.

Oracles: *closed form* (which part the engine asks at each of its three lookups, and how
often: its handler at ``fully_shard``, its all-gather at every unshard, its state-dict
transform once per loaded entry) and *reference* (the same model with plain parameters: at
world size 1 the gradients and loaded values are bitwise those of plain tensors).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from shardweave.fsdp import fully_shard, set_full_state_dict
from shardweave.fsdp.core._param_handler import PLAIN_TENSOR_HANDLER, resolve_param_handler
from shardweave.mesh import DataParallelMeshInfo, resolve_mesh_info
from shardweave.mesh.extension_points import PARAM_KINDS, ParamKind
from tests._dist import WorkerPool


class Fancy(torch.Tensor):
    """A parameter kind no built-in code knows."""


class FancyHandler:
    handled_type = Fancy

    def __init__(self, calls: Counter[str]) -> None:
        self.calls = calls

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        self.calls["handler"] += 1
        return param.as_subclass(torch.Tensor)

    def sharded_spec(
        self, param: torch.Tensor, mesh_info: DataParallelMeshInfo, shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        return mesh_info.mesh, (Shard(shard_dim),)

    def template(self, param: torch.Tensor, mesh_info: DataParallelMeshInfo) -> object:
        return None

    def unsharded(self, template: object, local_unsharded: torch.Tensor) -> torch.Tensor:
        return local_unsharded

    def reduce_grad(self, template: object, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def may_reduce_grad_outside_dp(self, template: object) -> bool:
        return False


class FancyAllGather:
    handled_type = Fancy

    def __init__(self, calls: Counter[str]) -> None:
        self.calls = calls

    def pre_all_gather(
        self, local: torch.Tensor, mesh: DeviceMesh
    ) -> tuple[tuple[torch.Tensor, ...], object]:
        self.calls["all_gather"] += 1
        return (local.as_subclass(torch.Tensor),), None

    def post_all_gather(
        self, outs: Sequence[torch.Tensor], meta: object, dtype: torch.dtype
    ) -> torch.Tensor:
        return outs[0].to(dtype)


class FancyStateDict:
    handled_type = Fancy

    def __init__(self, calls: Counter[str]) -> None:
        self.calls = calls

    def chunk(
        self, full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
    ) -> torch.Tensor:
        self.calls["state_dict"] += 1
        return distribute_tensor(
            full.as_subclass(torch.Tensor), mesh, placements, src_data_rank=None
        )

    def gather(self, sharded: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the engine never gathers through the transform")


def linear(fancy: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    for name, p in list(model._parameters.items()):
        assert p is not None
        if fancy:
            model._parameters[name] = nn.Parameter(p.detach().clone().as_subclass(Fancy))
    return model


def one_registration_three_parts(rank: int, world: int) -> dict[str, int]:
    calls: Counter[str] = Counter()
    kind = ParamKind(
        Fancy,
        handler=FancyHandler(calls),
        all_gather=FancyAllGather(calls),
        state_dict=FancyStateDict(calls),
    )
    PARAM_KINDS.register("fancy-test", kind)  # once; the pool restores the registry after
    model, ref = linear(fancy=True), linear(fancy=False)
    # 1. fully_shard asks the parameter's class: the handler (once per parameter here).
    fully_shard(model)
    fully_shard(ref)
    handler_calls = calls["handler"]
    # 2. The root's lazy init asks the sharded local tensor's class: the all-gather.
    for p in model.parameters():
        local = p._local_tensor  # type: ignore[attr-defined]
        p._local_tensor = local.as_subclass(Fancy)  # type: ignore[attr-defined]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for m in (model, ref):
        m(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad.to_local(), q.grad.to_local())  # type: ignore[union-attr]
    # 3. set_full_state_dict asks a full value's class: the state-dict transform.
    full = {
        "weight": torch.arange(12.0).view(3, 4).as_subclass(Fancy),
        "bias": torch.arange(3.0).as_subclass(Fancy),
    }
    set_full_state_dict(model, full)
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), full[name].as_subclass(torch.Tensor)), name
    return {"handler": handler_calls, **{k: v for k, v in calls.items() if k != "handler"}}


def test_a_kind_registered_once_gives_the_engine_all_three_parts(world1: WorkerPool) -> None:
    """Oracles: closed form (2 parameters: the handler at fully_shard, the all-gather once
    per parameter per unshard, of which the root has one per step, as it keeps its parameters
    from forward to backward; the transform once per loaded entry)
    and reference (bitwise the gradients of the same plain model)."""
    (calls,) = world1.run(one_registration_three_parts)
    assert calls == {"handler": 2, "all_gather": 2, "state_dict": 2}, calls


def kind_without_handler(rank: int, world: int) -> str:
    calls: Counter[str] = Counter()
    PARAM_KINDS.register("fancy-test", ParamKind(Fancy, all_gather=FancyAllGather(calls)))
    mesh = init_device_mesh("cpu", (world,))
    info = resolve_mesh_info(mesh)
    param = nn.Parameter(torch.zeros(4, 2).as_subclass(Fancy))
    assert resolve_param_handler(param, info, "w") is PLAIN_TENSOR_HANDLER
    # A DTensor kind without a handler is refused: the plain handler would shard the DTensor
    # itself. (Registered under the entry point's key, so it replaces an installed kind.)
    PARAM_KINDS.register("dtensor", ParamKind(DTensor))
    dparam = nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()]))
    with pytest.raises(TypeError) as err:
        resolve_param_handler(dparam, info, "tp.w")
    return str(err.value)


def test_a_kind_without_a_handler_gets_the_plain_handler(world1: WorkerPool) -> None:
    """Oracle: closed form (the engine's own plain handler; for a DTensor, an error that
    names the parameter and what is missing)."""
    (message,) = world1.run(kind_without_handler)
    assert "'tp.w'" in message and "has no ParamHandler" in message, message
