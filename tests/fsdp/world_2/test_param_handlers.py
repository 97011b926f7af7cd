"""Parameter kinds: how the engine picks a parameter's ``ParamHandler`` and asks it.

Oracles: *closed form* (the error a DTensor parameter gets when no plugin handles DTensor, and
how often each handler method runs), *reference* (a kind added by registering a handler alone
trains bitwise like the same model with plain parameters).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from shardweave.fsdp import fully_shard
from shardweave.mesh import DataParallelMeshInfo, MissingExtensionError
from shardweave.mesh.extension_points import PARAM_KINDS, ParamHandler, ParamKind
from tests._dist import WorkerPool
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks


def dtensor_param_without_its_plugin(rank: int, world: int) -> str:
    for key, kind in dict(PARAM_KINDS.registered()).items():
        if issubclass(DTensor, kind.handled_type):
            PARAM_KINDS.unregister(key)  # as if shardweave-extensions were not installed
    # The built-in plain handler must not answer for DTensor (it derives from torch.Tensor).
    assert PARAM_KINDS.find_for_type(DTensor) is None
    mesh = init_device_mesh("cpu", (world,))
    tp = nn.Linear(4, 4, bias=False)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Replicate()]))
    with pytest.raises(MissingExtensionError) as err:
        fully_shard(tp, mesh=mesh)
    return str(err.value)


def test_dtensor_param_without_its_plugin(world2: WorkerPool) -> None:
    """Oracle: closed form. With the DTensor plugin gone (the pool restores registries after
    the body), every rank gets MissingExtensionError naming the package and the parameter,
    as tests/isolation checks where the plugin is really absent."""
    for message in world2.run(dtensor_param_without_its_plugin):
        assert "pip install shardweave-extensions" in str(message), message
        assert "Linear.weight" in str(message), message


class Marked(torch.Tensor):
    """A parameter kind of a user's: a plain tensor subclass no built-in code knows."""


class MarkedHandler:
    """Stores ``Marked`` parameters as plain shards and hands back plain unsharded tensors,
    counting each call, to show the engine asks the registered handler for everything."""

    handled_type = Marked

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        self.calls["local_tensor"] += 1
        return param.as_subclass(torch.Tensor)

    def sharded_spec(
        self, param: torch.Tensor, mesh_info: DataParallelMeshInfo, shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        self.calls["sharded_spec"] += 1
        return mesh_info.mesh, (Shard(shard_dim),)

    def template(self, param: torch.Tensor, mesh_info: DataParallelMeshInfo) -> object:
        self.calls["template"] += 1
        return type(param)

    def unsharded(self, template: object, local_unsharded: torch.Tensor) -> torch.Tensor:
        assert template is Marked, template
        self.calls["unsharded"] += 1
        return local_unsharded

    def reduce_grad(self, template: object, grad: torch.Tensor) -> torch.Tensor:
        self.calls["reduce_grad"] += 1
        return grad

    def may_reduce_grad_outside_dp(self, template: object) -> bool:
        return False


def registered_handler_for_a_new_kind(rank: int, world: int) -> dict[str, int]:
    handler = MarkedHandler()
    assert isinstance(handler, ParamHandler)
    # restored by the pool after the body
    PARAM_KINDS.register("marked-test", ParamKind(Marked, handler=handler))
    model, ref = make_model("mlp"), make_model("mlp")
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            assert p is not None
            module._parameters[name] = nn.Parameter(p.detach().clone().as_subclass(Marked))
    assert all(type(p) is Marked for p in model.parameters())
    shard_blocks(model, fully_shard)
    shard_blocks(ref, fully_shard)
    optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    steps = 2
    for step in range(steps):
        batch = make_batch("mlp", 10 * step + rank)
        for m in (model, ref):
            loss_fn("mlp", m(batch), batch).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.placements == q.placements, name  # type: ignore[attr-defined]
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"step {step} {name}"  # type: ignore[union-attr]
        for optim in optims:
            optim.step()
            optim.zero_grad()
    n = len(list(model.parameters()))
    assert handler.calls["reduce_grad"] == n * steps, handler.calls
    return dict(copy.copy(handler.calls))


def test_registered_handler_for_a_new_kind(world2: WorkerPool) -> None:
    """Oracles: reference (bitwise the gradients of the same model with plain parameters) and
    closed form (the handler is asked once per parameter at fully_shard, the unsharded
    parameter is built once and refilled after, and every gradient passes reduce_grad)."""
    for calls in world2.run(registered_handler_for_a_new_kind):
        n = calls["local_tensor"]
        assert n > 0, calls
        assert calls == {
            "local_tensor": n,
            "template": n,
            "sharded_spec": n,
            "unsharded": n,
            "reduce_grad": 2 * n,
        }, calls
