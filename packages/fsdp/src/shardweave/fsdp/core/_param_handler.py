"""Parameter kinds: the built-in plain-tensor handler and the rule that picks each parameter's.

``FSDPParam`` owns a parameter's lifecycle (sharded, sharded post-forward, unsharded) and asks
one ``ParamHandler`` (``shardweave.mesh.extension_points``) what is particular to the
parameter's kind: which tensor is sharded, where the sharded DTensor lives, how the gathered
tensor becomes the unsharded parameter, and which local tensor a gradient reduces.

Adding a parameter kind: write a class satisfying ``ParamHandler`` whose ``handled_type`` is
the parameter class (subclasses included), and register it as the ``handler`` of the kind's
one ``ParamKind`` on ``PARAM_KINDS`` (which also carries the kind's all-gather extension and
state-dict transform, if any): from the distribution that owns the kind, as an entry point in
its ``pyproject.toml``::

    [project.entry-points."shardweave.param_kinds"]
    my_kind = "my_package.kinds:my_kind"  # returns ParamKind(MyKind, handler=...)

or in code with ``PARAM_KINDS.register("my_kind", ParamKind(MyKind, handler=MyHandler()))``.
Nothing in ``FSDPParam`` changes; ``dtensor_kind`` in ``shardweave-extensions`` is the worked
example. (How a tensor *subclass* travels through the all-gather is the kind's ``all_gather``
part, or torch's ``fsdp_pre_all_gather`` protocol: see ``_subclass_gather``.)

Design note: handler resolution
    ``resolve_param_handler`` answers, in order: the handler of the kind ``PARAM_KINDS`` finds
    for the parameter's class (by its MRO, so a plugin or a ``register()`` wins, even for a
    plain tensor subclass); else, for a class that is not a DTensor (no kind, or a kind
    without a handler), ``PLAIN_TENSOR_HANDLER``; else, for a DTensor,
    ``MissingExtensionError`` from the point naming the package to install (no kind), or
    ``TypeError`` (a kind without a handler).

    The plain handler is deliberately not put into the point's registry as a kind of
    ``torch.Tensor``. Lookups follow the MRO, and ``DTensor`` derives from
    ``torch.Tensor``: without ``shardweave-extensions`` the point would then answer a
    DTensor parameter with the plain handler, which shards the DTensor itself and yields
    wrong placements, instead of the error naming the package; and every other caller of
    ``PARAM_KINDS.find_for_type(DTensor)`` would be told a DTensor plugin exists. A
    registration is also process state that tests snapshot and restore and users may
    ``unregister``; every model has plain parameters, and their handling must not depend on
    it. An entry point in ``shardweave-fsdp``'s ``pyproject.toml`` would have the first
    problem too (and is only seen once the package is reinstalled). So the point holds the
    plugins and the engine holds the default, as the collective seam keeps its own c10d
    object for when no ``COLLECTIVES`` plugin is found: one rule, in this one function. A
    registry feature (exact-type registration) was the other way out; it would not cover
    ``nn.Parameter`` and the tensor subclasses the plain handler also serves without the
    same fallback, so it would add a feature to ``shardweave-mesh`` and keep the rule anyway.
"""

from __future__ import annotations

from typing import Final

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardweave.mesh import DataParallelMeshInfo, FSDPMeshInfo, HSDPMeshInfo
from shardweave.mesh.extension_points import PARAM_KINDS, ParamHandler

__all__ = ["PLAIN_TENSOR_HANDLER", "PlainTensorHandler", "resolve_param_handler"]


class PlainTensorHandler:
    """The ``ParamHandler`` of plain tensors (and of tensor subclasses no plugin claims).

    FSDP shards the parameter itself on the data-parallel mesh: ``(Shard(d),)``, with HSDP
    ``(Replicate(), Shard(d))``, and ``(Replicate(),)`` on a replicate-only mesh. The gathered
    tensor is the unsharded parameter and its gradient is reduced as it is; there is nothing
    to remember about the parameter, so the template is None.
    """

    handled_type: type = torch.Tensor

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        return param

    def template(self, param: torch.Tensor, mesh_info: DataParallelMeshInfo) -> object:
        return None

    def sharded_spec(
        self, param: torch.Tensor, mesh_info: DataParallelMeshInfo, shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        placements: tuple[Placement, ...]
        if isinstance(mesh_info, HSDPMeshInfo):
            placements = (Replicate(), Shard(shard_dim))
        elif isinstance(mesh_info, FSDPMeshInfo):
            placements = (Shard(shard_dim),)
        else:  # replicate-only data parallelism: every rank holds the whole tensor
            placements = (Replicate(),)
        return mesh_info.mesh, placements

    def unsharded(self, template: object, local_unsharded: torch.Tensor) -> torch.Tensor:
        return local_unsharded

    def reduce_grad(self, template: object, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def may_reduce_grad_outside_dp(self, template: object) -> bool:
        return False


PLAIN_TENSOR_HANDLER: Final[ParamHandler] = PlainTensorHandler()
"""The one plain handler every plain parameter shares (it holds no state)."""


def resolve_param_handler(
    param: torch.Tensor, mesh_info: DataParallelMeshInfo, fqn: str
) -> ParamHandler:
    """The handler for ``param`` (see Design note: handler resolution).

    Raises:
        ValueError: ``mesh_info`` is a full SPMD mesh (``dp_mesh_dims``) and ``param`` is
            not a DTensor on it.
        MissingExtensionError: ``param`` is a DTensor and no plugin handles its class.
        TypeError: ``param`` is a DTensor and the kind found for its class has no handler.
        ExtensionLoadError: an installed ``shardweave.param_kinds`` plugin is broken.
    """
    if mesh_info.is_spmd_mesh and not isinstance(param, DTensor):
        raise ValueError(
            f"fully_shard: when dp_mesh_dims is provided, all parameters must be DTensors on "
            f"the SPMD mesh, but '{fqn}' is a plain {type(param).__name__}; "
            "distribute it first, e.g. distribute_tensor(param, mesh, [Replicate()] * mesh.ndim)"
        )
    kind = PARAM_KINDS.find_for_type(type(param))
    if kind is not None and kind.handler is not None:
        return kind.handler
    if not isinstance(param, DTensor):
        return PLAIN_TENSOR_HANDLER
    if kind is None:
        PARAM_KINDS.get_for_type(type(param), what=f"parameter '{fqn}'")  # raises: no kind
    raise TypeError(
        f"fully_shard: parameter '{fqn}' is a {type(param).__name__} and its parameter kind "
        f"(for {type(param).__name__}) has no ParamHandler; a DTensor parameter needs one, "
        "e.g. shardweave.extensions.DTensorParamHandler"
    )
