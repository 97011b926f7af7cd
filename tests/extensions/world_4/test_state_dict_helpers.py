"""State-dict helpers for TP tensors (shardweave.extensions.state_dict) on a 2x2 (dp, tp) mesh.

Oracles: *compatibility* (torch's own ``torch.distributed.tensor.parallel.fsdp`` helpers on the
same inputs: type, placements, mesh, metadata and local values bitwise, wherever torch's helper
works; see the module docstring of ``state_dict.py`` for where it deliberately differs),
*closed form* (local chunks are ``torch.chunk`` pieces of the TP-local tensor), round trips
(chunk then gather gives the input back bitwise), and a real FSDP x TP flow (the model's own
sharded state dict, exported to TP-only tensors and re-chunked, then loaded into a fresh model).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardweave.extensions import (
    DTensorStateDictTransform,
    all_gather_dtensor,
    chunk_dtensor,
    chunk_tensor,
    dtensor_kind,
    pre_load_state_dict_transform,
)
from shardweave.fsdp import fully_shard, set_full_state_dict
from shardweave.mesh.extension_points import PARAM_KINDS, StateDictTransform
from tests._dist import WorkerPool
from tests.extensions._tp_models import Stack, build_tp_stack

SHAPES = [(4, 6), (5, 6), (6, 5)]  # even; uneven over dp (rows); uneven over TP on dim 1
TP_PLACEMENTS: list[Placement] = [Shard(0), Shard(1), Replicate()]


def _torch_helpers() -> object:
    # torch.distributed.fsdp first: importing the tensor/parallel/fsdp module alone is circular.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel.fsdp as torch_tp_fsdp

    return torch_tp_fsdp


def _full(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _torch_can_chunk(shape: tuple[int, int], tp: Placement) -> bool:
    # torch builds the 2-D DTensor with from_local(run_check=False) and no shape, so TP ranks
    # disagree on the global shape when TP shards unevenly and its redistribute aborts.
    return not (isinstance(tp, Shard) and shape[tp.dim] % 2)


def _check_dtensor_helpers(rank: int, mesh: DeviceMesh, tf: object) -> None:
    dp, tp = mesh["dp"], mesh["tp"]
    dp_rank = dp.get_local_rank()
    for seed, shape in enumerate(SHAPES):
        full = _full(shape, seed)
        for tp_placement in TP_PLACEMENTS:
            case = f"{shape} {tp_placement}"
            d = distribute_tensor(full, tp, [tp_placement])
            ours = chunk_dtensor(d, rank, dp)
            assert isinstance(ours, DTensor) and ours.device_mesh == mesh, case
            assert ours.shape == full.shape and not ours.requires_grad, case
            # closed form: dp chunk of the TP-local tensor (FSDP2's layout)
            expected_local = torch.chunk(d.to_local(), 2, dim=0)
            want = expected_local[dp_rank] if dp_rank < len(expected_local) else None
            assert want is not None and torch.equal(ours.to_local(), want), case
            assert torch.equal(ours.full_tensor(), full), case
            if tp_placement == Shard(0):
                assert ours.placements == (_StridedShard(0, split_factor=2), Shard(0)), case
            else:
                assert ours.placements == (Shard(0), tp_placement), case
            if _torch_can_chunk(shape, tp_placement):
                theirs = tf._chunk_dtensor(d, rank, dp)  # type: ignore[attr-defined]
                assert theirs.device_mesh == ours.device_mesh, case
                assert torch.equal(theirs.full_tensor(), full), case
                if tp_placement != Shard(0):  # Shard(0): (Shard(0), Shard(0)) in torch
                    assert theirs.placements == ours.placements, case
                    assert torch.equal(theirs.to_local(), ours.to_local()), case
                # torch's gather on our strided layout gives the TP-local tensor back too
                gathered = tf._all_gather_dtensor(ours, mesh)  # type: ignore[attr-defined]
                assert torch.equal(gathered, d.to_local()), case
            back = all_gather_dtensor(ours, mesh)
            assert isinstance(back, DTensor) and back.device_mesh == tp, case
            assert back.placements == d.placements and back.shape == d.shape, case
            assert back.stride() == d.stride(), case
            assert torch.equal(back.to_local(), d.to_local()), case
        # a layer TP left alone: a plain tensor, (Shard(0), Replicate()) on the root mesh
        ours = chunk_dtensor(full, rank, dp)
        theirs = tf._chunk_dtensor(full, rank, dp)  # type: ignore[attr-defined]
        assert ours.placements == theirs.placements == (Shard(0), Replicate()), shape
        assert torch.equal(ours.to_local(), theirs.to_local()), shape
    with pytest.raises(ValueError, match="parent_mesh"):
        all_gather_dtensor(ours, dp)
    with pytest.raises(RuntimeError, match="root mesh"):
        chunk_dtensor(_full((4, 4), 0), rank, init_device_mesh("cpu", (4,)))


def _check_sharded_tensor_helpers(rank: int, mesh: DeviceMesh, tf: object) -> None:
    dp, tp = mesh["dp"], mesh["tp"]
    dp_rank, dp_pg = dp.get_local_rank(), dp.get_group()
    # plain tensors: identical to torch, but for the local shard's placement (our global rank)
    for seed, shape in enumerate(SHAPES):
        full = _full(shape, 10 + seed)
        ours = chunk_tensor(full, dp_rank, 2, 1, dp_pg)
        theirs = tf._chunk_tensor(full, dp_rank, 2, 1, dp_pg)  # type: ignore[attr-defined]
        assert type(ours) is ShardedTensor and ours.metadata() == theirs.metadata(), shape
        (o,), (t,) = ours.local_shards(), theirs.local_shards()
        assert torch.equal(o.tensor, t.tensor), shape
        assert o.metadata.shard_offsets == t.metadata.shard_offsets, shape
        assert o.metadata.shard_sizes == t.metadata.shard_sizes, shape
        assert str(o.metadata.placement) == f"rank:{rank}/cpu", shape
        o_pre, t_pre = pre_load_state_dict_transform(ours), tf._pre_load_state_dict(theirs)  # type: ignore[attr-defined]
        assert o_pre[0] is ours and [s.tensor for s in o_pre[1]] == [o.tensor], shape
        assert t_pre[0] is theirs and len(t_pre[1]) == 1, shape
    # ShardedTensor input (one shard per rank over the TP group): nested like torch's
    outer = chunk_tensor(_full((4, 6), 20), tp.get_local_rank(), 2, 1, tp.get_group())
    ours = chunk_tensor(outer, dp_rank, 2, 1, dp_pg)
    theirs = tf._chunk_tensor(outer, dp_rank, 2, 1, dp_pg)  # type: ignore[attr-defined]
    assert ours.metadata() == theirs.metadata()
    o_inner, o_shards = pre_load_state_dict_transform(ours)
    t_inner, t_shards = tf._pre_load_state_dict(theirs)  # type: ignore[attr-defined]
    assert o_inner.metadata() == t_inner.metadata()  # type: ignore[attr-defined]
    assert len(o_shards) == len(t_shards) == 1
    assert torch.equal(o_shards[0].tensor, t_shards[0].tensor)
    assert torch.equal(o_shards[0].tensor, outer.local_tensor().chunk(2)[dp_rank])
    # TP DTensors: torch's metadata names TP-group ranks as global ranks, so it only works on
    # the TP group of global ranks 0 and 1 (and only for even sizes); compare there.
    for seed, shape in enumerate(SHAPES):
        full = _full(shape, 30 + seed)
        for tp_placement in TP_PLACEMENTS:
            case = f"{shape} {tp_placement}"
            d = distribute_tensor(full, tp, [tp_placement])
            ours = chunk_tensor(d, dp_rank, 2, 1, dp_pg)
            assert ours.size() == full.size() and ours._process_group is tp.get_group(), case
            (outer_shard,) = ours.local_shards()
            md = outer_shard.metadata
            box = full[tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))]
            assert torch.equal(box, d.to_local()), case
            assert str(md.placement) == f"rank:{rank}/cpu", case
            inner, shards = pre_load_state_dict_transform(ours)
            assert isinstance(inner, ShardedTensor) and inner.size() == d.to_local().size(), case
            assert torch.equal(shards[0].tensor, d.to_local().chunk(2)[dp_rank]), case
            if rank < 2 and _torch_can_chunk(shape, tp_placement):
                theirs = tf._chunk_tensor(d, dp_rank, 2, 1, dp_pg)  # type: ignore[attr-defined]
                (t_shard,) = theirs.local_shards()
                assert md.shard_offsets == t_shard.metadata.shard_offsets, case
                assert md.shard_sizes == t_shard.metadata.shard_sizes, case
                t_inner, t_shards = tf._pre_load_state_dict(theirs)  # type: ignore[attr-defined]
                assert inner.metadata() == t_inner.metadata(), case
                assert torch.equal(shards[0].tensor, t_shards[0].tensor), case
    with pytest.raises(TypeError, match="ShardedTensor"):
        pre_load_state_dict_transform(torch.zeros(2))


def state_dict_helpers_vs_torch(rank: int, world: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # ShardedTensor's deprecation
    # torch's chunk_tensor asks the process group for its default device (deprecated)
    warnings.filterwarnings("ignore", message=".*_get_pg_default_device|Multiple backends")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tf = _torch_helpers()
    _check_dtensor_helpers(rank, mesh, tf)
    _check_sharded_tensor_helpers(rank, mesh, tf)


def test_state_dict_helpers_match_torch(world4: WorkerPool) -> None:
    """Oracles: compatibility (torch's helpers), closed form (chunks) and round trips."""
    world4.run(state_dict_helpers_vs_torch)


def fsdp_tp_state_dict_flow(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build_tp_stack(fully_shard, mesh)
    sd = model.state_dict()
    # the oracle for TP-only values: the same model, parallelized but not sharded
    torch.manual_seed(0)
    tp_only = Stack()
    for block in tp_only.blocks:
        parallelize_module(
            block, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        )
    tp_sd = tp_only.state_dict()
    transform = DTensorStateDictTransform()
    assert isinstance(transform, StateDictTransform)
    rechunked = {}
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        if value.device_mesh.ndim == 1:  # not TP: FSDP's 1-D data-parallel DTensor
            rechunked[key] = value
            continue
        exported = all_gather_dtensor(value, value.device_mesh)
        want = tp_sd[key]
        assert exported.placements == want.placements and exported.shape == want.shape, key
        assert torch.equal(exported.to_local(), want.to_local()), key
        again = chunk_dtensor(exported, rank, mesh["dp"])
        assert again.placements == value.placements and again.shape == value.shape, key
        assert again.device_mesh == value.device_mesh, key
        assert torch.equal(again.to_local(), value.to_local()), key
        # the plugin object: same both ways, and from a plain full tensor too
        via_plugin = transform.chunk(exported, value.device_mesh, value.placements)
        assert isinstance(via_plugin, DTensor) and via_plugin.placements == value.placements
        assert torch.equal(via_plugin.to_local(), value.to_local()), key
        from_full = transform.chunk(want.full_tensor(), value.device_mesh, value.placements)
        assert torch.equal(from_full.to_local(), value.to_local()), key
        gathered = transform.gather(value)
        assert isinstance(gathered, DTensor) and torch.equal(gathered.to_local(), want.to_local())
        rechunked[key] = again
    torch.manual_seed(5)
    other = build_tp_stack(fully_shard, mesh)
    other.load_state_dict(rechunked)
    for key, value in other.state_dict().items():
        assert torch.equal(value.to_local(), sd[key].to_local()), key
        assert torch.equal(value.full_tensor(), sd[key].full_tensor()), key


def test_fsdp_tp_state_dict_export_and_rechunk(world4: WorkerPool) -> None:
    """Oracle: reference (a parallelize_module'd copy without FSDP for the TP-only values) and
    the model's own sharded state dict (re-chunked values, then a load into a fresh model)."""
    world4.run(fsdp_tp_state_dict_flow)


def load_tp_only_checkpoint(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    want = build_tp_stack(fully_shard, mesh).state_dict()
    torch.manual_seed(0)  # the same values, parallelized but not sharded: a TP-only checkpoint
    tp_only = Stack()
    for block in tp_only.blocks:
        parallelize_module(
            block, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        )
    tp_sd = tp_only.state_dict()
    assert any(isinstance(v, DTensor) for v in tp_sd.values())
    torch.manual_seed(5)
    model = build_tp_stack(fully_shard, mesh)
    with pytest.raises(TypeError, match="no StateDictTransform is registered"):
        set_full_state_dict(model, tp_sd)
    # The DTensor kind with its state-dict part, under the entry point's key: it replaces the
    # installed kind (handler alone). The pool restores the registry after the body.
    PARAM_KINDS.register("dtensor", dtensor_kind(state_dict=True))
    set_full_state_dict(model, tp_sd)
    for key, value in model.state_dict().items():
        assert torch.equal(value.to_local(), want[key].to_local()), key


def test_full_state_dict_load_consults_state_dict_plugin(world4: WorkerPool) -> None:
    """Oracle: reference (the FSDP x TP model built from the same seed). A TP-only checkpoint,
    whose values are tensor-parallel DTensors, loads through ``set_full_state_dict`` into
    FSDP x TP parameters once the DTensor kind is registered with its ``StateDictTransform``,
    and is a clear ``TypeError`` before."""
    world4.run(load_tp_only_checkpoint)
