"""Turning a user's mesh argument into mesh info: 1-D, HSDP, or data-parallel dims of a full SPMD mesh."""

from __future__ import annotations

import dataclasses
import sys
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardweave.mesh._mesh_info import (
    DataParallelMeshDims,
    DataParallelMeshInfo,
    DDPMeshInfo,
    FSDPMeshInfo,
    HSDPMeshInfo,
)

__all__ = [
    "ArgumentTypeError",
    "MeshValidationError",
    "as_own_mesh_info",
    "check_mesh_argument",
    "default_mesh",
    "mesh_device",
    "resolve_mesh_info",
]


class MeshValidationError(ValueError, AssertionError):
    """A mesh argument that cannot be used.

    It is a ``ValueError`` (what a caller validating input expects) and also an
    ``AssertionError``, because torch's FSDP2 raises ``AssertionError`` for some of these
    cases (a 2-D mesh without dim names) and code written against torch catches that.

    Example::

        mesh = init_device_mesh("cuda", (2, 4))  # 2-D, but without dim names
        try:
            resolve_mesh_info(mesh)
        except MeshValidationError as e:  # `except ValueError` or `AssertionError` also works
            print(e)  # asks for mesh_dim_names=("replicate", "shard")
    """


class ArgumentTypeError(TypeError, AttributeError):
    """An argument of the wrong type (a string where a module or mesh belongs, ...).

    It is a ``TypeError`` (what the mistake is) and also an ``AttributeError``, because torch's
    FSDP2 does not check these types and fails on the first missing attribute instead, so code
    written against torch catches that.

    Example::

        try:
            fully_shard(model, mesh=dist.group.WORLD)  # a process group, not a DeviceMesh
        except ArgumentTypeError as e:  # `except AttributeError`, as for torch, also works
            print(e)  # suggests DeviceMesh.from_group(group, device_type)
    """


class _OverlappingDimsError(MeshValidationError, RuntimeError):
    # One mesh dim named as both shard and replicate: torch fails (RuntimeError) when it
    # concatenates the two overlapping submeshes; we say why before getting there.
    pass


def default_mesh(mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A 1-D mesh over the default process group on the accelerator (CPU when there is none).

    Initializes the default process group from the environment (``env://``) if needed, as
    torch's ``fully_shard`` does when called without a mesh. It always has one dim over every
    rank, so for HSDP or tensor parallelism build the mesh with ``init_device_mesh`` instead.

    Example::

        mesh = default_mesh()  # under torchrun; what fully_shard(model) uses
        assert mesh.size() == dist.get_world_size()
        replicate_mesh = default_mesh(mesh_dim_names=("replicate",))  # replicate()'s default
    """
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = torch._C._get_accelerator().type
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=mesh_dim_names)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh implies: ``cpu``, or its device type at the current device index.

    ``fully_shard`` moves parameters and buffers there, so set the current device (e.g.
    ``torch.cuda.set_device(local_rank)``) before calling it.

    Example::

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        mesh_device(init_device_mesh("cuda", (8,)))  # device(type='cuda', index=LOCAL_RANK)
        mesh_device(init_device_mesh("cpu", (8,)))  # device(type='cpu')
    """
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    current = getattr(module, "current_device", None)
    if current is None:
        return torch.device(mesh.device_type)
    return torch.device(mesh.device_type, int(current()))


def check_mesh_argument(mesh: object, *, api: str) -> None:
    """Raise ``ArgumentTypeError`` (naming ``api`` and how to build a mesh) unless ``mesh`` is a
    ``DeviceMesh``; for APIs that take a ``mesh`` argument, as ``replicate`` does."""
    if isinstance(mesh, DeviceMesh):
        return
    hint = (
        " (a process group converts with DeviceMesh.from_group(group, device_type))"
        if isinstance(mesh, dist.ProcessGroup)
        else ""
    )
    raise ArgumentTypeError(
        f"{api}: mesh must be a DeviceMesh, got {type(mesh).__name__} {mesh!r}; create one with "
        f"init_device_mesh(device_type, (world_size,)){hint}, or pass mesh=None for all ranks"
    )


def _torch_dims_type() -> type | None:
    """torch's ``DataParallelMeshDims`` (torch.distributed.fsdp, torch 2.13+) when that package
    is loaded and has it, else None: then no object can be one, and shardweave never loads
    torch's FSDP package itself."""
    module = sys.modules.get("torch.distributed.fsdp")
    found = getattr(module, "DataParallelMeshDims", None)
    return found if isinstance(found, type) else None


def _as_own_dims(dims: object) -> object:
    """torch's ``DataParallelMeshDims`` converted to ours, field by field (torchtitan passes
    torch's); anything else is returned unchanged for ``_check_dims_argument``. A field torch
    adds later fails here, loudly, instead of being dropped."""
    torch_dims = _torch_dims_type()
    if torch_dims is None or not isinstance(dims, torch_dims):
        return dims
    fields = {f.name: getattr(dims, f.name) for f in dataclasses.fields(dims)}  # type: ignore[arg-type]
    return DataParallelMeshDims(**fields)


_OWN_MESH_INFOS: dict[str, type[DataParallelMeshInfo]] = {
    "HSDPMeshInfo": HSDPMeshInfo,
    "FSDPMeshInfo": FSDPMeshInfo,
    "DDPMeshInfo": DDPMeshInfo,
}


def as_own_mesh_info(info: object) -> object:
    """torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo`` / ``DDPMeshInfo`` converted to ours, field
    by field; ours and anything else are returned unchanged (for the caller to check).

    torchtitan's expert-parallel path builds torch's mesh infos (with torch's
    ``_get_mesh_info``) and hands them to ``fully_shard`` in its ``ShardPlacementResult`` objects; the
    process groups come from the same mesh, so ours is the same layout. torch's classes are
    recognized by their module and name (shardweave never imports torch's FSDP engine); a
    field torch adds later fails here, loudly, instead of being dropped. A fresh object per
    call: callers that group parameters by mesh-info identity convert each object once.

    Example (``theirs``: a mesh info torchtitan built with torch's own helper)::

        ours = as_own_mesh_info(theirs)
        assert isinstance(ours, shardweave.mesh.FSDPMeshInfo)
    """
    if isinstance(info, DataParallelMeshInfo) or not dataclasses.is_dataclass(info):
        return info
    cls = type(info)
    if not cls.__module__.startswith("torch.distributed.fsdp."):
        return info
    own = _OWN_MESH_INFOS.get(cls.__name__)
    if own is None:
        return info
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.init}
    fields["dp_mesh_dims"] = _as_own_dims(fields.get("dp_mesh_dims"))
    return own(**fields)


def _check_dims_argument(dims: object, api: str) -> None:
    if dims is None or isinstance(dims, DataParallelMeshDims):
        return
    example = (
        f"DataParallelMeshDims(shard={dims!r})"
        if isinstance(dims, str)
        else "DataParallelMeshDims(shard=..., replicate=...)"
    )
    raise ArgumentTypeError(
        f"{api}: dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__} "
        f"{dims!r}; pass dp_mesh_dims={example}"
    )


def resolve_mesh_info(
    mesh: DeviceMesh,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    *,
    api: str = "fully_shard",
) -> DataParallelMeshInfo:
    """The mesh info for ``api``'s ``mesh`` argument.

    A 1-D mesh shards over its only dim (``FSDPMeshInfo``); a 2-D mesh is ``(replicate,
    shard)`` (``HSDPMeshInfo``). With ``dp_mesh_dims``, ``mesh`` is a full SPMD mesh and only
    the named dims are data parallel: shard only gives ``FSDPMeshInfo``, replicate only
    ``DDPMeshInfo``, both ``HSDPMeshInfo``; several names for one role are flattened into one
    dim (a new process group, so every rank must make the same call). Flattening costs a
    process-group creation each time: resolve once and reuse the mesh info.

    Raises:
        MeshValidationError: the mesh has the wrong number of dims, lacks dim names where they
            are needed, or ``dp_mesh_dims`` names an unknown dim or one dim in both roles.
        ArgumentTypeError: ``mesh`` is not a ``DeviceMesh`` or ``dp_mesh_dims`` is not a
            ``DataParallelMeshDims`` (ours or torch's, which is converted field by field).

    Example::

        resolve_mesh_info(init_device_mesh("cuda", (8,)))  # FSDPMeshInfo over the only dim
        mesh = init_device_mesh("cuda", (2, 4, 8), mesh_dim_names=("dp_rep", "dp_shard", "tp"))
        info = resolve_mesh_info(mesh, DataParallelMeshDims(shard="dp_shard", replicate="dp_rep"))
        assert isinstance(info, HSDPMeshInfo) and info.is_spmd_mesh
        info.shard_mesh_size, info.replicate_mesh_size  # (4, 2); the "tp" dim is left to DTensor
    """
    check_mesh_argument(mesh, api=api)
    dp_mesh_dims = cast("DataParallelMeshDims | None", _as_own_dims(dp_mesh_dims))
    _check_dims_argument(dp_mesh_dims, api)
    if dp_mesh_dims is None:
        if mesh.ndim == 1:
            return FSDPMeshInfo(mesh, shard_mesh_dim=0)
        if mesh.ndim == 2:
            if mesh.mesh_dim_names is None:
                # both messages start with torch 2.13's sentence (what users match on)
                raise MeshValidationError(
                    "Please init the 2D mesh for HSDP with mesh_dim_names specified; "
                    f"{api}: a 2-D mesh means HSDP (replicate, shard) and needs dim names; "
                    "create it with init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
                )
            return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
        raise MeshValidationError(
            f"{api} expects a 1D or 2D DeviceMesh but got {mesh}; "
            "for a mesh with tensor- or pipeline-parallel dims pass "
            "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...) naming the data-parallel dims"
        )
    return _resolve_named_dims(mesh, dp_mesh_dims, api)


def _resolve_named_dims(
    mesh: DeviceMesh, dims: DataParallelMeshDims, api: str
) -> DataParallelMeshInfo:
    names = mesh.mesh_dim_names
    if names is None:
        raise MeshValidationError(
            f"{api}: dp_mesh_dims names mesh dims, but the mesh has no dim names; "
            "create it with init_device_mesh(..., mesh_dim_names=(...))"
        )
    shard, replicate = dims.shard_names, dims.replicate_names
    for name in (*shard, *replicate):
        if name not in names:
            raise MeshValidationError(
                f"{api}: Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}; "
                "use one of those names in dp_mesh_dims"
            )
    both = sorted(set(shard) & set(replicate))
    if both:
        raise _OverlappingDimsError(
            f"{api}: mesh dim '{both[0]}' is named as both a shard and a replicate dim in "
            "dp_mesh_dims; each data-parallel dim plays one role: name it in shard= or in "
            "replicate=, not both"
        )
    for role, group in (("shard", shard), ("replicate", replicate)):
        if len(set(group)) != len(group):
            raise MeshValidationError(
                f"{api}: dp_mesh_dims.{role} repeats a dim name: {group}; name each dim once"
            )

    def submesh(group: tuple[str, ...]) -> DeviceMesh:
        if len(group) == 1:
            return mesh[group[0]]
        # Several dims act as one: flatten them (a new 1-D mesh and process group).
        return mesh[group]._flatten("_".join(group))

    if not shard:
        return DDPMeshInfo(
            submesh(replicate), replicate_mesh_dim=0, dp_mesh_dims=dims, spmd_mesh=mesh
        )
    if not replicate:
        return FSDPMeshInfo(submesh(shard), shard_mesh_dim=0, dp_mesh_dims=dims, spmd_mesh=mesh)
    dp_mesh = DeviceMesh._concatenate([submesh(replicate), submesh(shard)])
    return HSDPMeshInfo(
        dp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0, dp_mesh_dims=dims, spmd_mesh=mesh
    )
