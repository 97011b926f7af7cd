"""FSDP on top of tensor parallelism: DTensor parameters from ``parallelize_module``.

Registered as the ``shardweave.param_handling`` plugin for ``DTensor`` (see this package's
``pyproject.toml``). The engine shards each parameter's *local* TP tensor on the data-parallel
mesh; this plugin says how the result is placed on the combined (data-parallel, tensor-
parallel) mesh and how the unsharded parameter and its gradient are rebuilt.

Design note: strided sharding
    When TP already shards tensor dim ``d`` (e.g. ``ColwiseParallel``'s ``Shard(0)``) and FSDP
    shards the same dim of the local tensor, rank (dp=i, tp=j) holds chunk i of TP chunk j:
    the global rows are interleaved, not contiguous. ``_StridedShard(d, split_factor=tp)``
    on the data-parallel dim records exactly that, so ``full_tensor()``, ``state_dict()`` and
    ``torch.distributed.checkpoint`` reassemble the right values (torch's FSDP2 uses the same
    placement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardweave.mesh import DataParallelMeshInfo, FSDPMeshInfo, HSDPMeshInfo

__all__ = ["DTensorParamHandler"]


@dataclass(frozen=True)
class _TPTemplate:
    """The TP layout of a parameter: enough to rebuild it, and none of its storage."""

    spec: DTensorSpec


class DTensorParamHandler:
    """Shards tensor-parallel DTensor parameters on the data-parallel mesh."""

    handled_type: type = DTensor

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        return _as_dtensor(param)._local_tensor

    def template(self, param: torch.Tensor) -> object:
        return _TPTemplate(_as_dtensor(param)._spec)

    def sharded_spec(
        self, param: torch.Tensor, mesh_info: DataParallelMeshInfo, shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        spec = _as_dtensor(param)._spec
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

    def reduce_grad(self, template: object, grad: torch.Tensor) -> torch.Tensor:
        spec = _template(template).spec
        dgrad = _as_dtensor(grad)
        if dgrad.placements != spec.placements:
            # e.g. a naturally replicated grad of a TP-sharded parameter
            dgrad = dgrad.redistribute(spec.mesh, spec.placements)
        local = dgrad.to_local()
        wait = getattr(local, "wait", None)  # AsyncCollectiveTensor from a redistribute
        if callable(wait):
            local = wait()
        return local


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
