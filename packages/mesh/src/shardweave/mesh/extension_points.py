"""The extension points the shardweave engine looks up, and the types their plugins provide.

The FSDP engine and the plugins meet only here: the engine asks a point for a plugin, a
distribution provides one through the point's entry-point group in its ``pyproject.toml``::

    [project.entry-points."shardweave.param_kinds"]
    float8 = "my_package.kinds:float8_kind"   # a zero-argument factory returning a ParamKind

or code registers one explicitly (which wins over discovery)::

    from shardweave.mesh.extension_points import PARAM_KINDS, ParamKind

    PARAM_KINDS.register("float8", ParamKind(Float8Tensor, all_gather=Float8AllGather()))

There are two points:

- ``PARAM_KINDS``: one ``ParamKind`` per parameter kind (a tensor class, subclasses
  included), which bundles everything the engine asks of that kind: its ``ParamHandler``, its
  ``AllGatherExtension`` and its ``StateDictTransform``, each optional. A kind is registered
  once; see Design note: one registration per kind.
- ``COLLECTIVES``: in the engine's collective seam, once per device type. ``shardweave-fsdp``
  ships the c10d default under the key ``"default"``.

Design note: one registration per kind
    The engine asks ``PARAM_KINDS.find_for_type(cls)`` (MRO-aware: a kind for a base class
    covers its subclasses, the most specific kind wins) at three places, each with the class
    that matters there, and uses the part it needs of the kind found:

    - at ``fully_shard``, the *parameter's* class, for ``ParamKind.handler``. A kind without
      a handler, or a class no kind covers, gets the engine's built-in plain-tensor handler,
      unless it is a DTensor: with no kind that raises ``MissingExtensionError`` naming
      ``shardweave-extensions``, with a kind that has no handler ``TypeError``.
    - at the root's lazy init, the *sharded local tensor's* class, for
      ``ParamKind.all_gather``, when that tensor does not define torch's
      ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torch's methods win).
    - in ``set_full_state_dict``, the class of a *full value* that is not a plain tensor (a
      tensor-parallel DTensor from a TP-only checkpoint), for ``ParamKind.state_dict``.

    The most specific kind decides alone: a part it leaves out (None) is not taken from a
    kind registered for a base class. So what the engine does with a class is read off one
    registration, and a kind for a subclass cannot be half-mixed with its base's.

The words *sharded*, *unsharded* and *all-gather input / output* are the engine's: see Design
note: tensor vocabulary (``shardweave/fsdp/_fsdp_common.py`` in ``shardweave-fsdp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from shardweave.mesh._mesh_info import DataParallelMeshInfo
from shardweave.mesh._registry import ExtensionPoint

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

__all__ = [
    "COLLECTIVES",
    "PARAM_KINDS",
    "AllGatherExtension",
    "Collectives",
    "ParamHandler",
    "ParamKind",
    "StateDictTransform",
]


@runtime_checkable
class ParamHandler(Protocol):
    """How FSDP shards one parameter of ``handled_type`` and rebuilds it.

    Provisional: the engine's needs may still change this Protocol before 1.0.

    The engine shards ``local_tensor(param)`` on dim ``shard_dim`` over the shard dim of
    the mesh info, all-gathers it for forward and backward, and calls ``unsharded`` to turn
    the gathered tensor back into a parameter of the original kind. ``shardweave-fsdp``'s
    built-in ``PlainTensorHandler`` (for every class but DTensor that no plugin handles; it is
    the engine's default, not a registration) returns tensors unchanged and shards on the
    data-parallel mesh; ``shardweave-extensions`` handles DTensor parameters with
    tensor-parallel placements.

    ``reduce_grad`` runs for every parameter in every backward, so any redistribute it does
    is a collective per parameter per step; the other methods run once, at ``fully_shard``.

    Example::

        handler = PARAM_KINDS.get_for_type(type(param)).handler  # a TP DTensor parameter
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

    def may_reduce_grad_outside_dp(self, template: object) -> bool:
        """Whether ``reduce_grad`` may reduce the gradient over a mesh dim that is not data
        parallel, in the gradient's own dtype: a replicated tensor-parallel parameter's
        ``Partial`` gradient (a SequenceParallel norm's) is all-reduced there. From torch 2.15
        such a gradient is always made in the dtype FSDP reduces in, so that reduction runs
        in it too."""
        ...


@runtime_checkable
class AllGatherExtension(Protocol):
    """What a tensor subclass contributes to the all-gather, and how it is rebuilt after.

    For tensor classes that do not define torch's ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather`` themselves (those are used as-is, as
    :func:`shardweave.extensions.all_gather_in_dtype` does). The ``all_gather`` part of a
    ``ParamKind``: the engine looks the sharded local tensor's class up at the root's lazy
    init. With uneven shards every input must already have the padded shard size
    (``ceil(rows / world)`` rows).

    Example::

        class BF16AllGather:
            handled_type = MyTensor  # a torch.Tensor subclass

            def pre_all_gather(self, local, mesh):
                return (local.to(torch.bfloat16),), None  # half the bytes of fp32

            def post_all_gather(self, outs, meta, dtype):
                return outs[0].to(dtype)

        PARAM_KINDS.register("bf16", ParamKind(MyTensor, all_gather=BF16AllGather()))
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
    mesh. The ``state_dict`` part of a ``ParamKind``: the engine calls ``chunk`` in
    ``set_full_state_dict`` for full values of ``handled_type`` that are not plain tensors
    (say a TP-only checkpoint's DTensors); ``gather`` is for state-dict code of your own.

    Example::

        def load_full(param, full):  # param: a sharded DTensor parameter
            kind = PARAM_KINDS.find_for_type(type(full))
            transform = None if kind is None else kind.state_dict
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


@dataclass(frozen=True)
class ParamKind:
    """A parameter kind: the one registration that says how the engine treats a tensor class.

    Register one per kind on ``PARAM_KINDS`` (see Design note: one registration per kind);
    each part is optional and is used where the engine looks the kind up:

    Attributes:
        handled_type: the tensor class of the kind (subclasses included).
        handler: how a parameter of the kind is sharded and rebuilt; None means the engine's
            built-in plain-tensor handler (say a float8-like subclass that only changes the
            all-gather). DTensor kinds need one.
        all_gather: what a sharded local tensor of the kind sends through the all-gather,
            when its class does not define torch's ``fsdp_pre/post_all_gather``.
        state_dict: how ``set_full_state_dict`` cuts a full value of the kind.

    Each part must satisfy its Protocol, and its own ``handled_type`` must be the kind's
    class or a base of it (a part written for ``DTensor`` serves a kind for a DTensor
    subclass); otherwise construction raises ``TypeError``.

    Example::

        PARAM_KINDS.register(
            "tagged", ParamKind(Tagged, all_gather=TaggedAllGather(), state_dict=None)
        )
        kind = PARAM_KINDS.get_for_type(SubTagged)  # the same kind: subclasses included
        kind.handler  # None: parameters are sharded as plain tensors
    """

    handled_type: type
    handler: ParamHandler | None = None
    all_gather: AllGatherExtension | None = None
    state_dict: StateDictTransform | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.handled_type, type):
            raise TypeError(f"ParamKind: handled_type must be a class, got {self.handled_type!r}")
        parts: tuple[tuple[str, object, type], ...] = (
            ("handler", self.handler, ParamHandler),
            ("all_gather", self.all_gather, AllGatherExtension),
            ("state_dict", self.state_dict, StateDictTransform),
        )
        for name, part, protocol in parts:
            if part is None:
                continue
            where = f"ParamKind({self.handled_type.__qualname__}).{name}"
            if not isinstance(part, protocol):
                raise TypeError(
                    f"{where}: {part!r} does not satisfy the {protocol.__name__} protocol"
                )
            handled = getattr(part, "handled_type", None)
            if not isinstance(handled, type) or not issubclass(self.handled_type, handled):
                raise TypeError(
                    f"{where}: {part!r} handles "
                    f"{getattr(handled, '__qualname__', repr(handled))}, which is not "
                    f"{self.handled_type.__qualname__} or a base of it"
                )


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
                return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
            def reduce_scatter_tensor(self, output, input, group, *, op, async_op=False):
                return dist.reduce_scatter_tensor(
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


PARAM_KINDS: Final[ExtensionPoint[ParamKind]] = ExtensionPoint(
    "shardweave.param_kinds", ParamKind, install="shardweave-extensions"
)
"""Per tensor class: the ``ParamKind`` (handler, all-gather, state-dict transform) of the kind."""

COLLECTIVES: Final[ExtensionPoint[Collectives]] = ExtensionPoint(
    "shardweave.collectives", Collectives, install="shardweave-fsdp"
)
"""Per device type (key ``"cpu"``, ``"cuda"``, ...): the collectives the engine issues."""
