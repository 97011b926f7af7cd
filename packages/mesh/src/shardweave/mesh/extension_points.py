"""The extension points the shardweave engine looks up, and the Protocols their plugins satisfy.

The FSDP engine and the plugins meet only here: the engine asks a point for a plugin, a
distribution provides one through the point's entry-point group in its ``pyproject.toml``::

    [project.entry-points."shardweave.all_gather"]
    float8 = "my_package.all_gather:Float8AllGather"   # a zero-argument factory

or code registers one explicitly (which wins over discovery)::

    from shardweave.mesh.extension_points import ALL_GATHER

    ALL_GATHER.register("float8", Float8AllGather())

Type-keyed points (``handled_type``) are looked up with ``get_for_type(type(tensor))``, so a
plugin for a class also covers its subclasses.

Where the engine consults each point:

- ``PARAM_HANDLING``: at ``fully_shard``, for each DTensor parameter.
- ``COLLECTIVES``: in the engine's collective seam, once per device type. ``shardweave-fsdp``
  ships the c10d default under the key ``"default"``.
- ``ALL_GATHER``: at the root's lazy init, for a sharded local tensor of a class that does not
  define torch's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torch's methods win).
- ``STATE_DICT``: in ``set_full_state_dict``, for a full value that is not a plain tensor
  (a tensor-parallel DTensor from a TP-only checkpoint).

The words *sharded*, *unsharded* and *all-gather input / output* are the engine's: see Design
note: tensor vocabulary (``shardweave/fsdp/_fsdp_common.py`` in ``shardweave-fsdp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from shardweave.mesh._mesh_info import DataParallelMeshInfo
from shardweave.mesh._registry import ExtensionPoint

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

__all__ = [
    "ALL_GATHER",
    "COLLECTIVES",
    "PARAM_HANDLING",
    "STATE_DICT",
    "AllGatherExtension",
    "Collectives",
    "ParamHandler",
    "StateDictTransform",
]


@runtime_checkable
class ParamHandler(Protocol):
    """How FSDP shards one parameter of ``handled_type`` and rebuilds it.

    Provisional: the engine's needs may still change this Protocol before 1.0.

    The engine shards ``local_tensor(param)`` on dim ``shard_dim`` over the shard dim of
    the mesh info, all-gathers it for forward and backward, and calls ``unsharded`` to turn
    the gathered tensor back into a parameter of the original kind. The built-in handler
    (plain ``torch.Tensor``) returns tensors unchanged and shards on the data-parallel mesh;
    ``shardweave-extensions`` handles DTensor parameters with tensor-parallel placements.

    ``reduce_grad`` runs for every parameter in every backward, so any redistribute it does
    is a collective per parameter per step; the other methods run once, at ``fully_shard``.

    Example::

        handler = PARAM_HANDLING.get_for_type(type(param))  # a TP DTensor parameter
        local = handler.local_tensor(param)  # what FSDP chunks on shard_dim
        template = handler.template(param, mesh_info)
        mesh, placements = handler.sharded_spec(param, mesh_info, 0)
        unsharded = handler.unsharded(template, gathered_local)  # after the all-gather
        to_reduce = handler.reduce_grad(template, unsharded_grad)  # before the reduce-scatter
    """

    handled_type: type
    """The parameter class this handler decides for (subclasses included)."""

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """The data FSDP shards: ``param`` itself, or, say, a DTensor's local tensor."""
        ...

    def sharded_spec(
        self, param: torch.Tensor, mesh_info: DataParallelMeshInfo, shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """The global mesh and placements of the FSDP-sharded DTensor for ``param``.

        For a plain tensor that is ``mesh_info.mesh`` with ``(Shard(shard_dim),)`` (HSDP:
        ``(Replicate(), Shard(shard_dim))``); for a tensor-parallel DTensor it is the full
        SPMD mesh with the data-parallel placements in front of the TP ones.
        """
        ...

    def template(self, param: torch.Tensor, mesh_info: DataParallelMeshInfo) -> object:
        """What ``unsharded`` and ``reduce_grad`` need to know of ``param`` (e.g. its DTensor
        spec, and which of its mesh dims are data parallel when ``mesh_info.is_spmd_mesh``),
        kept for the parameter's lifetime; it must not hold ``param``'s storage."""
        ...

    def unsharded(self, template: object, local_unsharded: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter rebuilt from the all-gathered ``local_unsharded`` (whose
        dtype may be a mixed-precision ``param_dtype``), e.g. wrapped into the TP DTensor."""
        ...

    def reduce_grad(self, template: object, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor to reduce-scatter, from the unsharded parameter's gradient (e.g.
        a TP gradient redistributed to the parameter's placements, then its local tensor)."""
        ...


@runtime_checkable
class AllGatherExtension(Protocol):
    """What a tensor subclass contributes to the all-gather, and how it is rebuilt after.

    For tensor classes that do not define torch's ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather`` themselves (those are used as-is, as
    :func:`shardweave.extensions.all_gather_in_dtype` does). The engine looks the sharded local
    tensor's class up at the root's lazy init. With uneven shards every input must already have
    the padded shard size (``ceil(rows / world)`` rows).

    Example::

        class BF16AllGather:
            handled_type = MyTensor  # a torch.Tensor subclass

            def pre_all_gather(self, local, mesh):
                return (local.to(torch.bfloat16),), None  # half the bytes of fp32

            def post_all_gather(self, outs, meta, dtype):
                return outs[0].to(dtype)

        ALL_GATHER.register("bf16", BF16AllGather())
    """

    handled_type: type
    """The tensor subclass this extension gathers (subclasses included)."""

    def pre_all_gather(
        self, local: torch.Tensor, mesh: DeviceMesh
    ) -> tuple[tuple[torch.Tensor, ...], object]:
        """The all-gather inputs for this rank's sharded ``local`` tensor, plus metadata.

        The metadata (any object) is handed back to ``post_all_gather`` unchanged.
        """
        ...

    def post_all_gather(
        self, outs: Sequence[torch.Tensor], meta: object, dtype: torch.dtype
    ) -> torch.Tensor:
        """The unsharded tensor (of ``dtype``) from the all-gather outputs, in input order."""
        ...


@runtime_checkable
class StateDictTransform(Protocol):
    """How a tensor of ``handled_type`` is chunked for a sharded state dict and gathered back.

    ``chunk`` needs no communication; ``gather`` is a collective over the sharded tensor's
    mesh. The engine calls ``chunk`` in ``set_full_state_dict`` for full values of
    ``handled_type`` that are not plain tensors (say a TP-only checkpoint's DTensors);
    ``gather`` is for state-dict code of your own.

    Example::

        def load_full(param, full):  # param: a sharded DTensor parameter
            transform = STATE_DICT.find_for_type(type(full))
            mesh, placements = param.device_mesh, param.placements
            if transform is None:  # a plain tensor: every rank has it, so cut it locally
                return distribute_tensor(full, mesh, placements, src_data_rank=None)
            return transform.chunk(full, mesh, placements)
    """

    handled_type: type
    """The tensor class this transform chunks (subclasses included)."""

    def chunk(
        self, full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
    ) -> torch.Tensor:
        """This rank's chunk of the unsharded ``full`` as a DTensor on ``mesh``/``placements``.

        ``mesh`` and ``placements`` are those of the sharded parameter
        (``ParamHandler.sharded_spec``); used to load a full state dict into sharded params.
        """
        ...

    def gather(self, sharded: torch.Tensor) -> torch.Tensor:
        """The unsharded tensor (of the parameter's original kind) from a sharded DTensor.

        A collective: every rank of the sharded tensor's mesh must call it.
        """
        ...


@runtime_checkable
class Collectives(Protocol):
    """The engine's collectives for one device type (the registry key, e.g. ``"cpu"``).

    Each takes explicit buffers and a process group and never looks at modules. With
    ``async_op=True`` return the ``Work`` to wait on, otherwise None (as c10d does). The
    engine's collective seam looks the point up once per device type and process: a plugin
    under the device type's key wins over the ``"default"`` one that ``shardweave-fsdp``
    ships (plain c10d calls). The engine calls it inside ``stream(...)`` of the stream the
    collective belongs to, with ``async_op=False`` on accelerators (the backend orders the
    collective on that stream) and ``async_op=True`` on CPU. To replace one module's
    all-gather or reduce-scatter only, use ``FSDPModule.set_custom_all_gather`` /
    ``set_custom_reduce_scatter``, which sit on top of this point.

    Example::

        class C10dCollectives:
            def all_gather_into_tensor(self, output, input, group, *, async_op=False):
                return dist.all_gather_single(output, input, group=group, async_op=async_op)
            def reduce_scatter_tensor(self, output, input, group, *, op, async_op=False):
                return dist.reduce_scatter_single(
                    output, input, op=op, group=group, async_op=async_op
                )
            def all_reduce(self, tensor, group, *, op, async_op=False):
                return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

        COLLECTIVES.register("cuda", C10dCollectives())
    """

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather every rank's ``input`` into ``output`` (``group.size()`` times as long, in rank order)."""
        ...

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input`` over ``group`` with ``op`` and keep this rank's chunk in ``output``."""
        ...

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``tensor`` in place over ``group`` with ``op``."""
        ...


PARAM_HANDLING: Final[ExtensionPoint[ParamHandler]] = ExtensionPoint(
    "shardweave.param_handling", ParamHandler, install="shardweave-extensions"
)
"""Per parameter type: how it is sharded and rebuilt (plain tensors are built in)."""

ALL_GATHER: Final[ExtensionPoint[AllGatherExtension]] = ExtensionPoint(
    "shardweave.all_gather", AllGatherExtension, install="shardweave-extensions"
)
"""Per tensor subclass: what it sends through the all-gather."""

STATE_DICT: Final[ExtensionPoint[StateDictTransform]] = ExtensionPoint(
    "shardweave.state_dict", StateDictTransform, install="shardweave-extensions"
)
"""Per tensor type: chunking for sharded state dicts and gathering back."""

COLLECTIVES: Final[ExtensionPoint[Collectives]] = ExtensionPoint(
    "shardweave.collectives", Collectives, install="shardweave-fsdp"
)
"""Per device type (key ``"cpu"``, ``"cuda"``, ...): the collectives the engine issues."""
