"""Small shared pieces of the engine: lifecycle enums, tensor-tree walking, chunking and storage
helpers.

Design note: tensor vocabulary
    *sharded*: this rank's piece of a parameter, registered on the module as a DTensor between
    steps. *padded*: a shard extended with zeros on dim 0 so every rank holds the same numel
    (torch.chunk semantics leave trailing ranks short or empty). *unsharded*: the full
    parameter, rebuilt from the all-gather output for forward and backward. *all-gather input*:
    the padded shards of one group laid end to end (a parameter with an all-gather extension,
    torch's ``fsdp_pre_all_gather`` or a ``PARAM_KINDS`` kind's ``all_gather``, contributes the
    tensors its pre-all-gather returns instead, several of mixed dtypes if it likes);
    *all-gather output*:
    every rank's input, rank-major. *reduce-scatter input*: the unsharded gradients chunked per
    rank, rank-major; its *output* is this rank's padded gradient shards laid end to end.

Design note: hooks run eagerly
    Every callable the engine hands to torch (forward pre/post hooks, the pre-backward tensor
    hook, the post-backward autograd function's work, the root's final callback) goes through
    ``run_eagerly`` where it is registered, so dynamo never traces into it: the hooks issue
    asynchronous collectives, swap parameter storage and keep Python-side state, none of which
    dynamo can capture. Compiling a block, or the whole model, then graph-breaks around the
    hooks (or, for a compiled block whose hooks sit outside its compiled forward, not at all)
    and the hooks run as in eager mode, as torch's FSDP2 does with its own. Dynamo is imported
    (about a second, once per process) when ``fully_shard`` builds its first state, not when
    this package is imported; torch's FSDP2 pays the same import at its first hook call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from enum import Enum, auto
from typing import Any, ParamSpec, TypeVar, cast

import torch
from torch.distributed.tensor import Shard

from shardweave.mesh import FSDPMeshInfo

__all__ = [
    "CollectiveKind",
    "ShardPlacementResult",
    "ShardedState",
    "TrainingState",
    "alloc_storage",
    "apply_to_tensors",
    "cast_floating",
    "chunk_with_empty",
    "collect_grad_tensors",
    "contiguous_strides",
    "free_storage",
    "in_backward",
    "own_storage",
    "replace_grad_tensors",
    "run_eagerly",
]


class CollectiveKind(str, Enum):
    """The collectives the engine issues, by the names the tracer, the planner and the
    watchdog report (a ``str``: ``kind == "all_gather"`` and JSON output read the name).

    Every place that counts or names kinds iterates over this enum, so a new kind is one
    member here (plus its c10d call in ``comm/_collectives`` and the code that issues it through the
    seam, ``_seam.issue``). It lives in this bottom module, not in ``_seam``, because the
    modules the seam calls (the fault check, the watchdog, the tracer) name kinds too. The
    fault checker's signatures carry a kind as its ``code`` (declaration order), so every
    rank must see the same order: append new members.
    """

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return str(self.value).__format__(spec)

    @property
    def code(self) -> int:
        """Its index in declaration order (the fault checker's signature field)."""
        return list(CollectiveKind).index(self)

    @property
    def abbrev(self) -> str:
        """Its initials, for table headers: ``"AG"``."""
        return "".join(word[0] for word in str(self.value).split("_")).upper()

    @property
    def words(self) -> str:
        """The name in prose: ``"all-gather"``."""
        return str(self.value).replace("_", "-")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def run_eagerly(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` such that dynamo runs it, and all it calls, without tracing (see Design note:
    hooks run eagerly)."""
    # torch.compiler.disable imports dynamo, which is heavy: only once hooks are registered.
    disabled = torch.compiler.disable(  # type: ignore[no-untyped-call]
        fn, recursive=True, reason="shardweave FSDP hooks run eagerly"
    )
    return cast("Callable[_P, _R]", disabled)


class TrainingState(Enum):
    """Where a state or parameter group is in the training step."""

    FORWARD = auto()  # from pre-forward until post-forward
    PRE_BACKWARD = auto()  # unsharding for backward
    POST_BACKWARD = auto()  # resharding and reducing gradients
    IDLE = auto()


class ShardedState(Enum):
    """Which form of the parameters is registered on the module."""

    SHARDED = auto()  # sharded DTensors; only the shards hold memory
    SHARDED_POST_FORWARD = auto()  # smaller-group shards after an int reshard_after_forward
    UNSHARDED = auto()  # full parameters for compute


@dataclasses.dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return to put a parameter on another mesh (e.g. experts).

    Each distinct mesh becomes its own parameter group of the module: one more all-gather and
    reduce-scatter per step, each over the smaller mesh. Return the same ``FSDPMeshInfo``
    object for every parameter of one mesh.

    Example::

        ep_mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("ep", "efsdp"))
        expert_info = FSDPMeshInfo(ep_mesh["efsdp"], shard_mesh_dim=0)

        def placement(param):  # stacked expert weights are 3-D
            return ShardPlacementResult(Shard(1), expert_info) if param.ndim == 3 else None

        fully_shard(moe_layer, shard_placement_fn=placement)
    """

    placement: Shard | None
    mesh_info: FSDPMeshInfo


def in_backward() -> bool:
    """Whether autograd is currently running a backward graph task."""
    return bool(torch._C._current_graph_task_id() != -1)


def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> list[torch.Tensor]:
    """``torch.chunk`` padded with empty chunks so there is exactly one per rank."""
    chunks = list(torch.chunk(tensor, num_chunks, dim=dim))
    while len(chunks) < num_chunks:
        chunks.append(chunks[0].new_empty(0))
    return chunks


def contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size`` (a zero-size dim counts as 1)."""
    strides = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(size[i + 1], 1)
    return tuple(strides)


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s storage but keep the tensor (see Design note: storage resize in
    ``core/_param``)."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view``'s elements as a tensor whose storage is just its own bytes (offset 0), over
    the same memory, which it keeps alive: no copy, no allocation (a DLPack round trip).

    Design note: what users hold. A sharded gradient is a slot of its group's reduced output,
    as in torch's FSDP2; as a plain view it would carry the slot's offset onto its DTensor
    wrapper, which then cannot be pickled, saved or deep-copied ('invalid python storage',
    torch's sharded gradients fail the same way), and saving one gradient would write the
    whole group's. Over a storage of its own it behaves as a tensor of its own allocation.
    A device whose tensors have no DLPack form keeps the view (torch's behaviour).
    """
    try:
        return torch._C._from_dlpack(torch._C._to_dlpack(view))
    except (RuntimeError, BufferError):
        return view


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give a freed ``tensor`` its bytes back, in the same storage object.

    See Design note: storage resize (``core/_param``): autograd saved views of this storage in
    the forward; refilling the same storage keeps those references valid.
    """
    storage = tensor.untyped_storage()
    nbytes = tensor.nbytes  # numel * element_size, one call
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def cast_floating(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def cast(x: torch.Tensor) -> torch.Tensor:
        if torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return cast


def apply_to_tensors(fn: Callable[[torch.Tensor], torch.Tensor], container: Any) -> Any:
    """Apply ``fn`` to every tensor in nested lists, tuples, namedtuples, dicts and dataclasses."""
    # Runs on every hooked module's inputs and outputs each step: plain tuples, lists and dicts
    # (what forward arguments nearly always are) first, by exact type; subclasses below.
    kind = type(container)
    if kind is tuple or kind is list:
        return kind([apply_to_tensors(fn, v) for v in container])
    if kind is dict:
        return {k: apply_to_tensors(fn, v) for k, v in container.items()}
    if isinstance(container, torch.Tensor):
        return fn(container)
    if isinstance(container, dict):
        return type(container)((k, apply_to_tensors(fn, v)) for k, v in container.items())
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # namedtuple
        return type(container)(*(apply_to_tensors(fn, v) for v in container))
    if isinstance(container, (list, tuple)):
        return type(container)(apply_to_tensors(fn, v) for v in container)
    if dataclasses.is_dataclass(container) and not isinstance(container, type):
        changes = {
            f.name: apply_to_tensors(fn, getattr(container, f.name))
            for f in dataclasses.fields(container)
            if f.init
        }
        return dataclasses.replace(container, **changes)
    return container


def moves_forward_inputs(device: torch.device) -> bool:
    """Whether a root on ``device`` moves its forward inputs there: the accelerator types
    torch's FSDP2 (and DDP) move them for, so a loop that hands over CPU batches works alike
    (not CPU, meta or MPS)."""
    return device.type in ("cuda", "hpu", "xpu", "mtia", torch._C._get_privateuse1_backend_name())


def inputs_to_device(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every tensor not on ``device`` copied there (a tensor
    already there is passed as it is)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.to(device)

    return apply_to_tensors(move, args), apply_to_tensors(move, kwargs)


def _walk_tensors(container: Any) -> Iterator[torch.Tensor]:
    if isinstance(container, torch.Tensor):
        yield container
    elif isinstance(container, dict):
        for v in container.values():
            yield from _walk_tensors(v)
    elif isinstance(container, (list, tuple)):
        for v in container:
            yield from _walk_tensors(v)
    elif dataclasses.is_dataclass(container) and not isinstance(container, type):
        for f in dataclasses.fields(container):
            if f.init:  # the fields apply_to_tensors can rebuild, in the same order
                yield from _walk_tensors(getattr(container, f.name))


def collect_grad_tensors(container: Any) -> list[torch.Tensor]:
    """Every tensor in ``container`` that requires grad, in a stable walk order (the order of
    ``_walk_tensors``, which this follows without its generators: it runs on every hooked
    module's inputs and outputs each step)."""
    found: list[torch.Tensor] = []
    _collect_grad_tensors(container, found)
    return found


def _collect_grad_tensors(container: Any, found: list[torch.Tensor]) -> None:
    kind = type(container)
    if kind is tuple or kind is list:
        for v in container:
            _collect_grad_tensors(v, found)
    elif isinstance(container, torch.Tensor):
        if container.requires_grad:
            found.append(container)
    elif kind is dict:
        for v in container.values():
            _collect_grad_tensors(v, found)
    else:
        found.extend(t for t in _walk_tensors(container) if t.requires_grad)


def replace_grad_tensors(container: Any, replacements: Iterator[torch.Tensor]) -> Any:
    """Swap grad-requiring tensors in walk order (the order ``collect_grad_tensors`` used)."""

    def swap(t: torch.Tensor) -> torch.Tensor:
        return next(replacements) if t.requires_grad else t

    return apply_to_tensors(swap, container)
