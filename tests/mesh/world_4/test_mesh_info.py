"""Mesh info resolution on real 4-rank gloo meshes.

Oracles: *closed form* (a rank's coordinates on a row-major mesh give its shard / replicate
sizes, ranks and group members) and *compatibility* (torch's own ``_get_mesh_info`` on the
same mesh gives the same kind of info, sizes, ranks and groups).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

try:  # the oracle: torch's own DataParallelMeshDims, which torch 2.11 and 2.12 do not have
    from torch.distributed.fsdp._fully_shard._fsdp_api import (
        DataParallelMeshDims as TorchDataParallelMeshDims,
    )
except ImportError:
    pytest.skip(
        f"torch {torch.__version__} has no DataParallelMeshDims to compare with",
        allow_module_level=True,
    )
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

from shardweave.mesh import (
    DataParallelMeshDims,
    DataParallelMeshInfo,
    DDPMeshInfo,
    FSDPMeshInfo,
    HSDPMeshInfo,
    as_own_mesh_info,
    resolve_mesh_info,
)
from tests._dist import WorkerPool


def _summary(info: object) -> dict[str, object]:
    """What a mesh info decides, in a form that compares across implementations."""
    out: dict[str, object] = {
        "type": type(info).__name__,
        "mesh_shape": tuple(info.mesh.shape),  # type: ignore[attr-defined]
        "mesh_dim_names": info.mesh.mesh_dim_names,  # type: ignore[attr-defined]
        "shard_mesh_dim": info.shard_mesh_dim,  # type: ignore[attr-defined]
        "replicate_mesh_dim": info.replicate_mesh_dim,  # type: ignore[attr-defined]
        "is_spmd_mesh": info.is_spmd_mesh,  # type: ignore[attr-defined]
    }
    for role in ("shard", "replicate"):
        if hasattr(info, f"{role}_process_group"):
            group = getattr(info, f"{role}_process_group")
            out[f"{role}_size"] = getattr(info, f"{role}_mesh_size")
            out[f"{role}_rank"] = getattr(info, f"{role}_mesh_rank")
            out[f"{role}_group_ranks"] = dist.get_process_group_ranks(group)
    return out


def _torch_dims(dims: DataParallelMeshDims | None) -> TorchDataParallelMeshDims | None:
    if dims is None:
        return None
    return TorchDataParallelMeshDims(shard=dims.shard, replicate=dims.replicate)


def _check_against_torch(
    mesh: DeviceMesh, dims: DataParallelMeshDims | None = None
) -> DataParallelMeshInfo:
    ours = resolve_mesh_info(mesh, dims)
    theirs = _get_mesh_info(mesh, _torch_dims(dims))
    assert _summary(ours) == _summary(theirs)
    assert ours.spmd_mesh is theirs.spmd_mesh
    return ours


# --- bodies (module level so workers can import them) -------------------------------------


def _one_dim(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    info = _check_against_torch(mesh)
    assert type(info) is FSDPMeshInfo
    assert (info.shard_mesh_dim, info.replicate_mesh_dim) == (0, None)
    assert info.shard_mesh_size == world_size
    assert info.shard_mesh_rank == rank
    assert info.shard_process_group is mesh.get_group(0)
    assert dist.get_process_group_ranks(info.shard_process_group) == list(range(world_size))
    assert not info.is_spmd_mesh and info.spmd_mesh is None
    # Names are optional for a 1-D mesh.
    unnamed = resolve_mesh_info(init_device_mesh("cpu", (world_size,)))
    assert type(unnamed) is FSDPMeshInfo and unnamed.shard_mesh_rank == rank


def _hsdp_2x2(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    info = _check_against_torch(mesh)
    assert type(info) is HSDPMeshInfo
    assert (info.shard_mesh_dim, info.replicate_mesh_dim) == (1, 0)
    # Row-major 2x2: rank = 2 * replicate_coord + shard_coord.
    assert (info.shard_mesh_size, info.shard_mesh_rank) == (2, rank % 2)
    assert (info.replicate_mesh_size, info.replicate_mesh_rank) == (2, rank // 2)
    shard_ranks = dist.get_process_group_ranks(info.shard_process_group)
    replicate_ranks = dist.get_process_group_ranks(info.replicate_process_group)
    assert shard_ranks == [rank - rank % 2, rank - rank % 2 + 1]
    assert replicate_ranks == [rank % 2, rank % 2 + 2]


def _hsdp_without_names(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    with pytest.raises(ValueError, match="needs dim names") as info:
        resolve_mesh_info(mesh)
    assert isinstance(info.value, AssertionError)  # what torch's FSDP2 raises here


def _three_dims_need_dp_mesh_dims(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    with pytest.raises(ValueError, match="dp_mesh_dims"):
        resolve_mesh_info(mesh)


def _dp_mesh_dims_roles(rank: int, world_size: int) -> None:
    # rank = 4 * rep + 2 * shard + tp on a (1, 2, 2) mesh.
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    shard_coord = rank // 2

    shard_only = _check_against_torch(mesh, DataParallelMeshDims(shard="dp_shard"))
    assert type(shard_only) is FSDPMeshInfo
    assert shard_only.mesh.mesh_dim_names == ("dp_shard",)
    assert (shard_only.shard_mesh_size, shard_only.shard_mesh_rank) == (2, shard_coord)
    assert dist.get_process_group_ranks(shard_only.shard_process_group) == [rank % 2, rank % 2 + 2]
    assert shard_only.is_spmd_mesh and shard_only.spmd_mesh is mesh

    replicate_only = _check_against_torch(mesh, DataParallelMeshDims(replicate="dp_shard"))
    assert type(replicate_only) is DDPMeshInfo
    assert (replicate_only.replicate_mesh_size, replicate_only.replicate_mesh_rank) == (
        2,
        shard_coord,
    )
    assert replicate_only.is_spmd_mesh and replicate_only.spmd_mesh is mesh

    both = _check_against_torch(
        mesh, DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    )
    assert type(both) is HSDPMeshInfo
    assert both.mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert (both.shard_mesh_dim, both.replicate_mesh_dim) == (1, 0)
    assert (both.shard_mesh_size, both.shard_mesh_rank) == (2, shard_coord)
    assert (both.replicate_mesh_size, both.replicate_mesh_rank) == (1, 0)
    assert both.spmd_mesh is mesh


def _dp_mesh_dims_hsdp_2x2_with_tp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    info = _check_against_torch(
        mesh, DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    )
    assert type(info) is HSDPMeshInfo
    assert (info.shard_mesh_size, info.shard_mesh_rank) == (2, rank % 2)
    assert (info.replicate_mesh_size, info.replicate_mesh_rank) == (2, rank // 2)
    assert dist.get_process_group_ranks(info.replicate_process_group) == [rank % 2, rank % 2 + 2]


def _torch_objects_converted(rank: int, world_size: int) -> None:
    # torchtitan passes torch's DataParallelMeshDims to fully_shard, and torch's mesh infos
    # (from _get_mesh_info) in its ShardPlacementResults: both become ours, the same layout
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    for dims in (
        DataParallelMeshDims(shard="dp_shard"),
        DataParallelMeshDims(replicate="dp_replicate"),
        DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"),
    ):
        theirs = _get_mesh_info(mesh, _torch_dims(dims))
        ours = resolve_mesh_info(mesh, _torch_dims(dims))  # type: ignore[arg-type]
        assert _summary(ours) == _summary(theirs) and ours.dp_mesh_dims == dims, dims
        converted = as_own_mesh_info(theirs)
        assert isinstance(converted, DataParallelMeshInfo), type(converted)
        assert type(converted).__name__ == type(theirs).__name__
        assert _summary(converted) == _summary(theirs) and converted.dp_mesh_dims == dims
        assert converted.spmd_mesh is theirs.spmd_mesh
        assert as_own_mesh_info(converted) is converted
    plain = _get_mesh_info(init_device_mesh("cpu", (world_size,)), None)
    assert type(as_own_mesh_info(plain)) is FSDPMeshInfo
    assert as_own_mesh_info("not a mesh info") == "not a mesh info"


def _dp_mesh_dims_flatten(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("a", "b", "tp"))
    info = resolve_mesh_info(mesh, DataParallelMeshDims(shard=("a", "b")))
    assert type(info) is FSDPMeshInfo
    assert info.mesh.ndim == 1 and info.mesh.mesh_dim_names == ("a_b",)
    assert (info.shard_mesh_size, info.shard_mesh_rank) == (4, rank)
    assert dist.get_process_group_ranks(info.shard_process_group) == [0, 1, 2, 3]
    # torch flattens the same way; a second flatten under the same name reuses the mesh.
    _check_against_torch(mesh, DataParallelMeshDims(shard=("a", "b")))

    replicate = resolve_mesh_info(mesh, DataParallelMeshDims(shard="tp", replicate=("a", "b")))
    assert type(replicate) is HSDPMeshInfo
    assert replicate.mesh.mesh_dim_names == ("a_b", "tp")
    assert (replicate.replicate_mesh_size, replicate.replicate_mesh_rank) == (4, rank)
    assert (replicate.shard_mesh_size, replicate.shard_mesh_rank) == (1, 0)


def _dp_mesh_dims_errors(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    with pytest.raises(ValueError, match=r"'nope' not found in mesh\.mesh_dim_names"):
        resolve_mesh_info(mesh, DataParallelMeshDims(shard="nope"))
    with pytest.raises(ValueError, match="'missing' not found"):
        resolve_mesh_info(mesh, DataParallelMeshDims(shard="dp_shard", replicate="missing"))
    with pytest.raises(ValueError, match="'dp_shard' is named as both a shard and a replicate"):
        resolve_mesh_info(mesh, DataParallelMeshDims(shard="dp_shard", replicate="dp_shard"))
    with pytest.raises(ValueError, match="'tp' is named as both"):
        resolve_mesh_info(mesh, DataParallelMeshDims(shard=("dp_shard", "tp"), replicate="tp"))
    unnamed = init_device_mesh("cpu", (2, 2))
    with pytest.raises(ValueError, match="the mesh has no dim names"):
        resolve_mesh_info(unnamed, DataParallelMeshDims(shard="dp_shard"))


# --- tests ---------------------------------------------------------------------------------


def test_one_dim_mesh_is_fsdp(world4: WorkerPool) -> None:
    """Closed form plus compatibility with torch's ``_get_mesh_info``."""
    world4.run(_one_dim)


def test_two_dim_named_mesh_is_hsdp(world4: WorkerPool) -> None:
    """Closed form (row-major 2x2 coordinates) plus compatibility with torch."""
    world4.run(_hsdp_2x2)


def test_two_dim_mesh_without_names_is_an_error(world4: WorkerPool) -> None:
    world4.run(_hsdp_without_names)


def test_three_dim_mesh_needs_dp_mesh_dims(world4: WorkerPool) -> None:
    world4.run(_three_dims_need_dp_mesh_dims)


def test_dp_mesh_dims_shard_replicate_and_both(world4: WorkerPool) -> None:
    """Closed form plus compatibility with torch on a (1, 2, 2) dp_replicate/dp_shard/tp mesh."""
    world4.run(_dp_mesh_dims_roles)


def test_dp_mesh_dims_hsdp_with_tp(world4: WorkerPool) -> None:
    """Closed form plus compatibility with torch on a (2, 2, 1) mesh."""
    world4.run(_dp_mesh_dims_hsdp_2x2_with_tp)


def test_dp_mesh_dims_flattens_several_names(world4: WorkerPool) -> None:
    """Closed form: shard=("a", "b") is one 1-D dim of size 4 named "a_b"."""
    world4.run(_dp_mesh_dims_flatten)


def test_dp_mesh_dims_errors_name_the_dim(world4: WorkerPool) -> None:
    world4.run(_dp_mesh_dims_errors)


def test_torch_dims_and_mesh_infos_become_ours(world4: WorkerPool) -> None:
    """Compatibility: torch's DataParallelMeshDims given to resolve_mesh_info, and torch's mesh
    infos given to as_own_mesh_info, give what torch's _get_mesh_info gives, in our classes."""
    world4.run(_torch_objects_converted)
