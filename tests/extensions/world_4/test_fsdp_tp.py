"""FSDP x tensor parallel on a 2x2 (dp, tp) mesh through the shardweave.extensions plugin.

Oracles: *compatibility* (torch's fully_shard on the same parallelize_module'd copy: same
placements incl. ``_StridedShard``, same local shards and grads, bitwise), *reference* (an
unsharded model on the global batch: ``full_tensor()`` of params and grads), and the state
dict / DCP round trip.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from shardweave.fsdp import MixedPrecisionPolicy, fully_shard
from tests._dist import WorkerPool, assert_close
from tests.extensions._tp_models import MLP, Stack, build_tp_stack
from tests.fsdp._oracle import assert_same_as_torch, sgd_step


def fsdp_tp_parity(rank: int, world: int, use_mp: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build_tp_stack(
        fully_shard, mesh, MixedPrecisionPolicy(torch.bfloat16, torch.float32) if use_mp else None
    )
    tmodel = build_tp_stack(
        torch_fully_shard, mesh, TorchMP(torch.bfloat16, torch.float32) if use_mp else None
    )
    torch.manual_seed(0)
    ref = Stack()
    dp_rank = mesh["dp"].get_local_rank()
    placements = {n: p.placements for n, p in model.named_parameters()}
    assert isinstance(placements["blocks.0.in_proj.weight"][0], _StridedShard), placements
    for step in range(2):
        xs = [
            torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + r))
            for r in range(2)
        ]
        for m in (model, tmodel):
            m(xs[dp_rank]).float().sum().backward()
        (sum(ref(x).sum() for x in xs) / 2).backward()  # type: ignore[union-attr]
        assert_same_as_torch(model, tmodel, f"step {step}")
        if not use_mp:
            for (name, p), rp in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert_close(p.grad.full_tensor(), rp.grad, msg=name)  # type: ignore[union-attr, arg-type]
        sgd_step(model, tmodel, ref)
        if not use_mp:
            for (name, p), rp in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert_close(p.full_tensor(), rp, msg=name)  # type: ignore[attr-defined]


@pytest.mark.parametrize("use_mp", [False, True])
def test_fsdp_tp_parity(world4: WorkerPool, use_mp: bool) -> None:
    """Oracles: compatibility (bitwise, placements) and reference (full tensors)."""
    world4.run(fsdp_tp_parity, use_mp)


class SPBlock(nn.Module):
    """A pre-norm residual MLP as torchtitan parallelizes it: the LayerNorm sequence parallel
    (its weight and bias replicated on tp, their gradients ``Partial`` there), colwise in,
    rowwise out back to sequence shards."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _sp_model(api: object, policy: object, mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(SPBlock(), SPBlock())
    plan = {
        "norm": SequenceParallel(),
        "mlp.in_proj": ColwiseParallel(input_layouts=Shard(1)),  # gathers the sequence
        "mlp.out_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model:
        parallelize_module(block, mesh["tp"], plan)
        api(block, mesh=mesh["dp"], mp_policy=policy)  # type: ignore[operator]
    api(model, mesh=mesh["dp"], mp_policy=policy)  # type: ignore[operator]
    return model


def sequence_parallel_norms(rank: int, world: int, reduce_dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _sp_model(fully_shard, MixedPrecisionPolicy(torch.bfloat16, reduce_dtype), mesh)
    tmodel = _sp_model(torch_fully_shard, TorchMP(torch.bfloat16, reduce_dtype), mesh)
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    for step in range(2):
        x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(10 * step + dp))
        mine = x.chunk(2, dim=1)[tp]  # this tp rank's sequence shard
        for m in (model, tmodel):
            m(mine).float().pow(2).sum().backward()
        assert_same_as_torch(model, tmodel, f"step {step}")
        sgd_step(model, tmodel)


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32], ids=["default-reduce", "fp32"])
def test_sequence_parallel_norms_bf16(world4: WorkerPool, reduce_dtype: torch.dtype | None) -> None:
    """Oracle: compatibility, bitwise with torch's fully_shard on the same model (torchtitan's
    layout: sequence-parallel norms, colwise/rowwise MLP) in bf16. From torch 2.15 a norm's
    ``Partial`` tp gradient is made, and all-reduced over tp, in the reduce dtype, where the
    other gradients stay in bf16 until the copy-in (``may_reduce_grad_outside_dp``)."""
    world4.run(sequence_parallel_norms, reduce_dtype)


def fsdp_tp_state_dict(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build_tp_stack(fully_shard, mesh)
    torch.manual_seed(0)
    ref = Stack()
    sd = model.state_dict()
    for key, value in ref.state_dict().items():
        assert isinstance(sd[key], DTensor), key
        assert sd[key].device_mesh.ndim == (2 if key.startswith("blocks") else 1), key
        assert torch.equal(sd[key].full_tensor(), value), key
    paths = [tempfile.mkdtemp(prefix="sw-tp-") if rank == 0 else ""]
    dist.broadcast_object_list(paths, src=0)
    dcp.save(sd, checkpoint_id=paths[0])
    torch.manual_seed(5)
    other = build_tp_stack(fully_shard, mesh)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    target = other.state_dict()
    dcp.load(target, checkpoint_id=paths[0])
    other.load_state_dict(target)
    for key, value in ref.state_dict().items():
        assert torch.equal(other.state_dict()[key].full_tensor(), value), key


def test_fsdp_tp_state_dict_and_dcp(world4: WorkerPool) -> None:
    """Oracle: reference (full values) through state_dict and a DCP save/load."""
    world4.run(fsdp_tp_state_dict)


def int_reshard_with_tp(rank: int, world: int) -> None:
    # a 4-way data-parallel dim (so 2 is a real smaller group) beside a size-1 TP dim
    tp_mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    types = []
    for api in (torch_fully_shard, fully_shard):
        torch.manual_seed(0)
        block = MLP()
        parallelize_module(
            block, tp_mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        )
        with pytest.raises(Exception) as err:
            api(block, mesh=tp_mesh["dp"], reshard_after_forward=2)
            block(torch.randn(2, 8))
            block(torch.randn(2, 8))
        types.append(type(err.value))
    assert types[0] is types[1], types


def test_int_reshard_after_forward_with_tp_raises_like_torch(world4: WorkerPool) -> None:
    """Oracle: compatibility (NotImplementedError at the first post-forward reshard)."""
    world4.run(int_reshard_with_tp)


def replicate_tp_parity(rank: int, world: int) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

    from shardweave.replicate import replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, tmodel = build_tp_stack(replicate, mesh), build_tp_stack(torch_replicate, mesh)
    torch.manual_seed(0)
    ref = Stack()
    dp_rank = mesh["dp"].get_local_rank()
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    for m in (model, tmodel):
        m(xs[dp_rank]).sum().backward()
    (sum(ref(x).sum() for x in xs) / 2).backward()  # type: ignore[union-attr]
    assert_same_as_torch(model, tmodel)
    for (name, p), rp in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad.full_tensor(), rp.grad, msg=name)  # type: ignore[union-attr, arg-type]


def test_replicate_tp_parity(world4: WorkerPool) -> None:
    """Oracles: compatibility (torch's replicate on the TP model) and reference."""
    world4.run(replicate_tp_parity)
