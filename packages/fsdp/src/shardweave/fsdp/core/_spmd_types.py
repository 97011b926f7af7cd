"""Plain parameters annotated by the ``spmd_types`` package, on a full SPMD mesh (``dp_mesh_dims``).

torchtitan's default SPMD backend leaves parameters as plain tensors and records, with
``spmd_types``, how each is laid out on every axis of its mesh (``R`` replicated, ``S(d)``
sharded, ``I`` invariant, ``P`` partial). From torch 2.14, ``fully_shard(..., dp_mesh_dims=...)``
accepts such parameters (``SPMD_TYPES_PARAMS`` in ``_torch_compat``); we do the same:

* storage: the parameter becomes a DTensor on the SPMD mesh, ``Replicate()`` on the
  data-parallel dims (an annotation there must be ``R``: FSDP owns that gradient reduction) and
  the annotated placement on every other dim (one is required). From there the DTensor kind
  (``shardweave-extensions``) shards it as it does a ``distribute_module`` parameter;
* compute: the unsharded parameter stays a plain tensor, as the module was written for; while
  ``spmd_types`` type checking is on (torchtitan's ``debug.spmd_typechecking``) its annotation
  is put back on it after each unshard (``restore``), on the axes of the mesh current at
  ``fully_shard`` (else the SPMD mesh's), ``R`` where it had none, and FSDP's own work (the
  unshard, the reshard, the gradient reduction) runs outside type checking
  (``outside_typecheck``): that work moves shards, not the module's values;
* gradient: the plain gradient is wrapped in the placements of the backward types (``R`` ->
  ``Partial()``, ``I`` -> ``Replicate()``, ``S(d)`` -> ``Shard(d)``), so the reduce-scatter
  over the data-parallel dims is the pending ``Partial`` reduction, as for a DTensor parameter.

shardweave never imports ``spmd_types`` first: a parameter carries an annotation only when
that package has been loaded, so the module found in ``sys.modules`` is the one that made it
(and its submodules are imported only to read such a parameter).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from shardweave.fsdp._torch_compat import SPMD_TYPES_PARAMS
from shardweave.mesh import DataParallelMeshInfo
from shardweave.mesh.extension_points import ParamHandler

__all__ = [
    "SpmdTypesHandler",
    "activate_outside_typecheck",
    "as_storage_param",
    "outside_typecheck",
    "register_local_function",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def _spmd() -> ModuleType | None:
    """The loaded ``spmd_types`` package where this torch converts its annotations, else None."""
    return sys.modules.get("spmd_types") if SPMD_TYPES_PARAMS else None


class _OutsideTypecheck:
    """Class-body marker of an ``outside_typecheck`` method: at class creation it puts the
    plain function back in the class and remembers where, for ``activate_outside_typecheck``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        setattr(owner, name, self.fn)
        _OUTSIDE_TYPECHECK.append((owner, name, self.fn))


_OUTSIDE_TYPECHECK: list[tuple[type, str, Callable[..., Any]]] = []
_ACTIVE = False


def outside_typecheck(fn: _F) -> _F:
    """``fn`` (an FSDP hook or step method) to run under ``spmd_types.no_typecheck()``, as torch
    runs its own, once ``spmd_types`` is loaded under a torch that converts its annotations.
    Until then the method is the plain function: these run several times per group and step,
    and a wrapper on every call was 1 to 2% of the engine's host time (``host_time.py``)."""
    return cast("_F", _OutsideTypecheck(fn))


def activate_outside_typecheck() -> None:
    """Wrap every ``outside_typecheck`` method, where ``spmd_types`` is loaded (called when a
    state is made, at ``fully_shard``, and at lazy init; idempotent)."""
    global _ACTIVE
    if _ACTIVE or _spmd() is None:
        return
    _ACTIVE = True
    for owner, name, fn in _OUTSIDE_TYPECHECK:
        setattr(owner, name, _run_outside_typecheck(fn))


def _run_outside_typecheck(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        spmd = _spmd()
        if spmd is None:
            return fn(*args, **kwargs)
        with spmd.no_typecheck():
            return fn(*args, **kwargs)

    return run


_REGISTERED: set[type] = set()


def register_local_function(fn_cls: type) -> None:
    """Tell ``spmd_types`` (once it is loaded) that the autograd function ``fn_cls`` passes
    its inputs' types through; type checking refuses an unregistered one in forward. torch
    registers its own at import; we wait for the package, never importing it ourselves."""
    if fn_cls in _REGISTERED:
        return
    spmd = _spmd()
    if spmd is None:
        return
    spmd.register_local_autograd_function(fn_cls)
    _REGISTERED.add(fn_cls)


@dataclass(frozen=True)
class SpmdTypesInfo:
    """What the conversion keeps: the storage mesh and the gradient's placements on it, and
    the annotation to put back on the unsharded parameter."""

    mesh: DeviceMesh
    grad_placements: tuple[Placement, ...]
    restore_type: dict[Any, Any]
    partition_spec: object
    # A backward type is partial on a non-data-parallel axis: the gradient is reduced there
    # (``ParamHandler.may_reduce_grad_outside_dp``).
    partial_outside_dp: bool = False


def as_storage_param(
    param: nn.Parameter, mesh_info: DataParallelMeshInfo, fqn: str
) -> tuple[nn.Parameter, SpmdTypesInfo] | None:
    """``param`` as a DTensor on the SPMD mesh when it is a plain tensor annotated by
    ``spmd_types`` (and this torch converts those), else None.

    Raises:
        ValueError: the mesh is not a named full SPMD mesh with ``dp_mesh_dims``; a
            data-parallel axis is annotated other than ``R``; an annotated axis is not on the
            mesh; a non-data-parallel mesh axis is not annotated.
    """
    spmd = _spmd()
    if spmd is None or isinstance(param, DTensor):
        return None
    local_type = spmd.get_local_type(param)
    if not local_type:
        return None
    mesh, dims = mesh_info.spmd_mesh, mesh_info.dp_mesh_dims
    if mesh is None or dims is None or mesh.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard: '{fqn}' carries spmd_types annotations, which need the full named "
            "SPMD mesh and dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...) naming "
            "the data-parallel dims FSDP shards and replicates over"
        )
    from spmd_types.runtime import get_partition_spec
    from spmd_types.types import partition_spec_to_shard_types

    partition_spec = get_partition_spec(param)
    annotated: dict[Any, Any] = dict(local_type)
    if partition_spec is not None:
        annotated.update(partition_spec_to_shard_types(partition_spec))
    dp_names = set(dims.shard_names) | set(dims.replicate_names)
    axes = [(name, spmd.MeshAxis.of(mesh.get_group(name))) for name in mesh.mesh_dim_names]
    dp_axes = [axis for name, axis in axes if name in dp_names]
    types: dict[Any, Any] = {axis: spmd.R for axis in dp_axes}
    for axis, axis_type in annotated.items():
        if axis in dp_axes or _within(spmd, axis, dp_axes):
            if axis_type is not spmd.R:
                raise ValueError(
                    f"fully_shard: '{fqn}' is annotated {axis_type} on the data-parallel axis "
                    f"{axis}; FSDP reduces its gradient over that axis, so annotate it R"
                )
            continue
        if axis not in {a for n, a in axes if n not in dp_names}:
            raise ValueError(
                f"fully_shard: '{fqn}' is annotated on the axis {axis}, which is neither a "
                f"data-parallel dim nor another dim of the mesh {mesh.mesh_dim_names}"
            )
        types[axis] = axis_type
    missing = [name for name, axis in axes if axis not in types]
    if missing:
        raise ValueError(
            f"fully_shard: '{fqn}' has no spmd_types annotation on the mesh dims {missing} "
            f"(not data parallel under {dims}); annotate it there (e.g. R or S(d))"
        )
    placements = tuple(spmd.spmd_type_to_dtensor_placement(types[a]) for _, a in axes)
    grads = tuple(spmd.spmd_type_to_dtensor_placement(types[a].backward_type()) for _, a in axes)
    # The axes the module computes on: those of the mesh current at fully_shard (torchtitan
    # sets its dense mesh) or, without one, the storage mesh's; R where not annotated.
    current = spmd.current_mesh()
    restore_axes = tuple(current) if current is not None else tuple(a for _, a in axes)
    info = SpmdTypesInfo(
        mesh=mesh,
        grad_placements=grads,
        restore_type={a: local_type.get(a, spmd.R) for a in restore_axes},
        partition_spec=partition_spec,
        partial_outside_dp=any(
            g.is_partial() for (name, _), g in zip(axes, grads, strict=True) if name not in dp_names
        ),
    )
    storage = nn.Parameter(
        DTensor.from_local(param.data, mesh, placements, run_check=False),
        requires_grad=param.requires_grad,
    )
    return storage, info


def _within(spmd: ModuleType, axis: object, dp_axes: list[Any]) -> bool:
    """Whether ``axis`` lies inside the flattened data-parallel axes (a sub-axis of them)."""
    if len(dp_axes) == 0:
        return False
    from spmd_types._mesh_axis import flatten_axes

    return bool(axis <= flatten_axes(tuple(dp_axes)))  # type: ignore[operator,unused-ignore]


class SpmdTypesHandler:
    """The ``ParamHandler`` of an annotated plain parameter: its storage DTensor's handler for
    sharding, a plain unsharded parameter, and a gradient wrapped in the backward placements
    before that handler reduces it."""

    def __init__(self, inner: ParamHandler, info: SpmdTypesInfo) -> None:
        self.inner = inner
        self.info = info
        self.handled_type: type = inner.handled_type

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        return self.inner.local_tensor(param)

    def template(self, param: torch.Tensor, mesh_info: DataParallelMeshInfo) -> object:
        return self.inner.template(param, mesh_info)

    def sharded_spec(
        self, param: torch.Tensor, mesh_info: DataParallelMeshInfo, shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        return self.inner.sharded_spec(param, mesh_info, shard_dim)

    def unsharded(self, template: object, local_unsharded: torch.Tensor) -> torch.Tensor:
        return local_unsharded  # the module computes on the plain tensor it was written for

    def reduce_grad(self, template: object, grad: torch.Tensor) -> torch.Tensor:
        dgrad = DTensor.from_local(grad, self.info.mesh, self.info.grad_placements, run_check=False)
        return self.inner.reduce_grad(template, dgrad)

    def may_reduce_grad_outside_dp(self, template: object) -> bool:
        return self.info.partial_outside_dp

    def restore(self, unsharded: torch.Tensor) -> None:
        """Put the annotation back on the unsharded parameter while type checking is on."""
        spmd = _spmd()
        if spmd is None or not spmd.is_type_checking() or not self.info.restore_type:
            return
        spmd.assert_type(unsharded, self.info.restore_type, partition_spec=self.info.partition_spec)
