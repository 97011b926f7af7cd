"""FSDP on top of tensor parallelism: DTensor parameters from ``parallelize_module``.

Registered as the ``shardweave.param_kinds`` plugin for ``DTensor`` (:func:`dtensor_kind`, see
this package's ``pyproject.toml``). The engine shards each parameter's *local* TP tensor on the
data-parallel mesh; this plugin says how the result is placed on the combined (data-parallel,
tensor-parallel) mesh and how the unsharded parameter and its gradient are rebuilt.

Design note: strided sharding
    When TP already shards tensor dim ``d`` (e.g. ``ColwiseParallel``'s ``Shard(0)``) and FSDP
    shards the same dim of the local tensor, rank (dp=i, tp=j) holds chunk i of TP chunk j:
    the global rows are interleaved, not contiguous. ``_StridedShard(d, split_factor=tp)``
    on the data-parallel dim records exactly that, so ``full_tensor()``, ``state_dict()`` and
    ``torch.distributed.checkpoint`` reassemble the right values (torch's FSDP2 uses the same
    placement).

Design note: full SPMD meshes
    With ``dp_mesh_dims`` the parameter is already a DTensor on the whole mesh, replicated on
    its data-parallel dims. FSDP shards the local tensor over the data-parallel shard group
    and swaps each data-parallel shard dim's ``Replicate()`` for ``Shard(d)`` (strided by the
    number of later mesh dims that shard ``d`` too); several shard dims are flattened into
    the one data-parallel submesh. Gradients keep their ``Partial`` on the data-parallel dims:
    FSDP's reduce-scatter (and the HSDP all-reduce) is that reduction, so redistributing
    first would reduce twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardweave.extensions.state_dict import DTensorStateDictTransform
from shardweave.mesh import DataParallelMeshInfo, FSDPMeshInfo, HSDPMeshInfo
from shardweave.mesh.extension_points import ParamKind

__all__ = ["DTensorParamHandler", "dtensor_kind"]


def dtensor_kind(*, state_dict: bool = False) -> ParamKind:
    """The DTensor parameter kind: :class:`DTensorParamHandler`, and optionally the state dict.

    Installing ``shardweave-extensions`` registers ``dtensor_kind()`` (entry point ``dtensor``
    of ``shardweave.param_kinds``), the handler alone. ``state_dict=True`` adds
    :class:`DTensorStateDictTransform`, which ``set_full_state_dict`` then uses to load a
    TP-only checkpoint; it assumes one TP mesh dim (see its docstring), so register that kind
    yourself, under the same key, where that holds.

    Example::

        from shardweave.mesh.extension_points import PARAM_KINDS

        PARAM_KINDS.register("dtensor", dtensor_kind(state_dict=True))  # wins over the entry point
        set_full_state_dict(model, tp_only_checkpoint)  # TP DTensor values
    """
    transform = DTensorStateDictTransform() if state_dict else None
    return ParamKind(DTensor, handler=DTensorParamHandler(), state_dict=transform)


@dataclass(frozen=True)
class _TPTemplate:
    """The TP layout of a parameter: enough to rebuild it, and none of its storage."""

    spec: DTensorSpec
    # Mesh dims of ``spec.mesh`` that are data parallel (full SPMD meshes only): a gradient's
    # placement there is left for FSDP's own reduction.
    dp_dims: frozenset[int] = frozenset()


class DTensorParamHandler:
    """Shards tensor-parallel DTensor parameters on the data-parallel mesh.

    Installing ``shardweave-extensions`` registers it (as the handler of :func:`dtensor_kind`,
    entry point ``dtensor``), so nothing needs to be called. Each rank then keeps
    ``1/(dp*tp)`` of a TP-sharded parameter and all-gathers only over the data-parallel group.

    Example::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])  # finds this handler for the DTensor parameters
        block.w1.weight.placements  # (_StridedShard(dim=0, sf=4), Shard(dim=0))
    """

    handled_type: type = DTensor

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        return _as_dtensor(param)._local_tensor

    def template(self, param: torch.Tensor, mesh_info: DataParallelMeshInfo) -> object:
        spec = _as_dtensor(param)._spec
        if not mesh_info.is_spmd_mesh:
            return _TPTemplate(spec)
        shard, replicate = _spmd_dp_dims(spec, mesh_info)
        return _TPTemplate(spec, frozenset((*shard, *replicate)))

    def sharded_spec(
        self, param: torch.Tensor, mesh_info: DataParallelMeshInfo, shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        spec = _as_dtensor(param)._spec
        if mesh_info.is_spmd_mesh:
            return _spmd_sharded_spec(spec, mesh_info, shard_dim)
        dp_mesh, tp_mesh = mesh_info.mesh, spec.mesh
        if dp_mesh.device_type != tp_mesh.device_type:
            raise ValueError(
                f"fully_shard: the data-parallel mesh is on '{dp_mesh.device_type}' but the "
                f"parameter's tensor-parallel mesh is on '{tp_mesh.device_type}'; build both "
                "from one init_device_mesh call"
            )
        if len(spec.placements) > 2:
            raise NotImplementedError(
                "fully_shard supports DTensor parameters with 1 or 2 tensor/expert-parallel "
                f"mesh dims, got placements {spec.placements}"
            )
        mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
        dp: Placement
        if isinstance(mesh_info, FSDPMeshInfo):
            # see Design note: strided sharding
            split = spec.num_shards_map[shard_dim]
            dp = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        else:  # replicate-only data parallelism
            dp = Replicate()
        placements: tuple[Placement, ...] = (dp, *spec.placements)
        if isinstance(mesh_info, HSDPMeshInfo):
            placements = (Replicate(), *placements)
        return mesh, placements

    def unsharded(self, template: object, local_unsharded: torch.Tensor) -> torch.Tensor:
        spec = _template(template).spec
        meta = spec.tensor_meta
        assert meta is not None
        # Mixed precision gathers in param_dtype: the wrapper must say so too.
        new_spec = DTensorSpec(
            spec.mesh,
            spec.placements,
            tensor_meta=TensorMeta(meta.shape, meta.stride, local_unsharded.dtype),
        )
        return DTensor(local_unsharded, new_spec, requires_grad=False)  # type: ignore[no-untyped-call]

    def may_reduce_grad_outside_dp(self, template: object) -> bool:
        # A replicated placement's gradient is only known when backward makes it, and may be
        # Partial (a SequenceParallel norm's), so any such dim counts, as in torch 2.15.
        tp = _template(template)
        return any(
            isinstance(p, Replicate)
            for i, p in enumerate(tp.spec.placements)
            if i not in tp.dp_dims
        )

    def reduce_grad(self, template: object, grad: torch.Tensor) -> torch.Tensor:
        tp = _template(template)
        dgrad = _as_dtensor(grad)
        # See Design note: full SPMD meshes (data-parallel dims keep the grad's placement).
        target = tuple(
            dgrad.placements[i] if i in tp.dp_dims else p for i, p in enumerate(tp.spec.placements)
        )
        if dgrad.placements != target:
            # e.g. a naturally replicated grad of a TP-sharded parameter
            dgrad = dgrad.redistribute(tp.spec.mesh, target)
        local = dgrad.to_local()
        wait = getattr(local, "wait", None)  # AsyncCollectiveTensor from a redistribute
        if callable(wait):
            local = wait()
        return local


def _spmd_dp_dims(
    spec: DTensorSpec, mesh_info: DataParallelMeshInfo
) -> tuple[list[int], list[int]]:
    """Indices of the data-parallel shard and replicate dims of ``spec.mesh``, validated."""
    mesh, dims = spec.mesh, mesh_info.dp_mesh_dims
    assert dims is not None and mesh_info.spmd_mesh is not None
    # Equality, not identity: DTensor caches may hand back an equal mesh object (same ranks,
    # layout and dim names), which is the same mesh for every purpose here.
    if mesh != mesh_info.spmd_mesh:
        raise ValueError(
            "fully_shard: with dp_mesh_dims every parameter must be a DTensor on the mesh "
            f"passed to fully_shard, but one lives on {mesh}; distribute it on that same "
            "DeviceMesh (not another mesh or a submesh)"
        )
    names = mesh.mesh_dim_names
    assert names is not None  # resolve_mesh_info checked the mesh has names
    indices: list[list[int]] = []
    for role, group in (("shard", dims.shard_names), ("replicate", dims.replicate_names)):
        found = [names.index(n) for n in group]
        for i in found:
            if not isinstance(spec.placements[i], Replicate):
                raise ValueError(
                    f"fully_shard: Expected Replicate() on DP {role} dim '{names[i]}' (index "
                    f"{i}) but got {spec.placements[i]}; FSDP shards the data-parallel dims "
                    "itself, so distribute the parameter with Replicate() there"
                )
        indices.append(found)
    return indices[0], indices[1]


def _spmd_sharded_spec(
    spec: DTensorSpec, mesh_info: DataParallelMeshInfo, shard_dim: int
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The FSDP-sharded layout of a parameter on a full SPMD mesh."""
    shard, _ = _spmd_dp_dims(spec, mesh_info)
    mesh = spec.mesh
    orig = spec.placements
    placements = list(orig)
    for i in shard:
        # Later mesh dims sharding the same tensor dim interleave with FSDP's chunks.
        later = [
            mesh.size(j)
            for j in range(i + 1, mesh.ndim)
            if isinstance(p := orig[j], (Shard, _StridedShard)) and p.dim == shard_dim
        ]
        split = math.prod(later)
        placements[i] = (
            _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        )
    if len(shard) <= 1:
        return mesh, tuple(placements)
    # Several shard dims act as one: the flattened data-parallel submesh takes their place.
    names = mesh.mesh_dim_names
    assert names is not None
    dims = mesh_info.dp_mesh_dims
    assert dims is not None
    hsdp = isinstance(mesh_info, HSDPMeshInfo)
    submeshes: list[DeviceMesh] = []
    out: list[Placement] = []
    first = min(shard)
    for i, name in enumerate(names):
        if i == first:
            submeshes.append(mesh_info.mesh)
            out.extend((Replicate(), placements[i]) if hsdp else (placements[i],))
        elif i in shard or (hsdp and name in dims.replicate_names):
            continue  # folded into the data-parallel submesh
        else:
            submeshes.append(mesh[name])
            out.append(placements[i])
    return DeviceMesh._concatenate(submeshes), tuple(out)


def _as_dtensor(tensor: torch.Tensor) -> DTensor:
    if not isinstance(tensor, DTensor):
        raise TypeError(f"expected a DTensor, got {type(tensor).__name__}")
    return tensor


def _template(template: object) -> _TPTemplate:
    if not isinstance(template, _TPTemplate):
        raise TypeError(
            f"expected the template from DTensorParamHandler.template, got {template!r}"
        )
    return template
