"""A CPU stream sanitizer: fake device streams and events checked by torch's stream-race checker.

No GPU is lent to this project, yet the engine orders its CUDA work with several streams (the
all-gather copy-in, all-gather, reduce-scatter and all-reduce streams beside the current one)
and events between them. This module proves that ordering on CPU:

* :class:`FakeDeviceModule` quacks like ``torch.get_device_module(device)`` for what the engine
  uses (``Stream``, ``Event``, ``current_stream``, ``stream``, ``synchronize``). Its streams and
  events do nothing on the host; every creation, record, wait and synchronization is fed to
  ``torch.cuda._sanitizer.EventHandler``, the pure-Python core of torch's CUDA sanitizer (CSAN),
  which keeps, per stream, the last kernel of every other stream it is ordered after.
* :class:`SanitizerMode`, a ``TorchDispatchMode``, reports every op as a kernel launch on the
  fake *current* stream, with its reads and writes split by the op schema's alias info (CSAN's
  own ``ArgumentHandler``, taught to accept CPU tensors). The checker reports an access that is
  not ordered after a conflicting access from another stream.
* :func:`stream_sanitizer` installs both (the fake module into the engine through
  ``shardweave.fsdp.comm._streams.use_device_module``) and raises :class:`StreamRaceError` with
  CSAN's own text on exit, or leaves the errors in the report for the test to assert on.

Collectives. c10d's ops (``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``,
``c10d::allreduce_``, reached from ``dist.all_gather_single``, ``dist.reduce_scatter_single``
and ``dist.all_reduce``) *do* reach a Python dispatch mode on CPU with gloo: the
ProcessGroup's C++ methods call them through the dispatcher, and the Python key's fallback
sends them here (checked in ``tests/harness/test_stream_sanitizer.py``). Nothing is wrapped.
Their schemas carry no alias annotations, so they are modelled explicitly: one kernel on the
stream that is current at issue time, reading the input and writing the output (all-reduce:
reading and writing its tensors). This is how a collective behaves on the stream it is issued
on with ``async_op=False`` or when the issuing stream is then awaited through an event, which is
the pattern of torch's FSDP2.

What is not modelled:

* Host-side waits: ``Work.wait()`` and the blocking of gloo order no stream. On NCCL,
  ``Work.wait()`` makes the *current* stream wait for NCCL's internal stream; here the
  collective already runs on the issuing stream, so an engine that relied on ``Work.wait()``
  from another stream (instead of an event) would be reported. gloo finishes some
  collectives inside ``Work.wait()`` on the calling thread (the reduce-scatter copies its
  result into the output there); the ops run inside ``dist.Work.wait`` are not recorded,
  since the collective's write was recorded at issue (``Work.wait`` is wrapped while the
  sanitizer is active).
* Memory reuse across streams *is* modelled (:class:`CachingAllocatorModel`), as CSAN on
  CUDA does not: a block belongs to the stream current when it was allocated; when it is
  freed (its storage dies, or is resized to 0 bytes) while some other stream's last use of it
  is not yet ordered before that stream, it is kept as a pending free; the next allocation
  on the owning stream that the block could serve (same pool, large enough) while that use
  is still unordered is reported as an :class:`UnsafeReuseError`, with the other stream's
  access and the reallocation, each with its stack. This is what the CUDA caching allocator
  does with a block freed without ``record_stream``: it goes back to its stream's pool and
  may be handed out by the very next allocation there. The model is conservative about
  *which* block the allocator picks (any fitting pending block counts), and exact about
  ordering: a wait on the owning stream between the free and the reallocation makes it safe.
* Memory lifetime: CPU has no caching-allocator callbacks. A storage's address is its identity,
  and freed addresses come back, so an old access at a reused address would look like a race
  on the new tensor. Allocation is therefore inferred: an op output that aliases no input
  (its schema return has no alias info and its storage is no input's), ``empty``/factory
  outputs and ``lift_fresh`` (``torch.tensor``) are fresh allocations, and
  ``UntypedStorage.resize_`` (the engine's free/refill of unsharded storage) deallocates and
  allocates. A storage allocated under the sanitizer carries a finalizer, so its death is
  seen as a free (whichever thread drops the last reference: gloo frees some buffers on its
  own threads). Like CSAN on CUDA, a use after free across streams is not reported.
* Granularity: accesses are keyed by storage (its base address), not by ``data_ptr()`` as CSAN
  does on CUDA, so a read of ``x[1:]`` conflicts with a write of ``x``. This is conservative:
  two streams using disjoint slices of one storage without ordering are reported too.
* Tensor subclasses (DTensor) are recorded at the outer op, with their inner tensors' storages;
  the ops a subclass runs inside its own ``__torch_dispatch__`` are not seen one by one.
* Only the thread that entered the sanitizer is observed (dispatch modes are thread-local; on
  CPU the autograd engine runs backward on the calling thread).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import traceback
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]
from torch.cuda._sanitizer import (
    Access,
    ArgumentHandler,
    CUDASanitizerErrors,
    EventHandler,
    SynchronizationError,
    TensorInfo,
    UnsynchronizedAccessError,
    zip_arguments,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [
    "CachingAllocatorModel",
    "FakeDeviceModule",
    "FakeEvent",
    "FakeStream",
    "SanitizerMode",
    "SanitizerReport",
    "StreamRaceError",
    "UnsafeReuseError",
    "stream_sanitizer",
]

aten = torch.ops.aten

# CSAN's EventHandler creates stream 0 as the default stream; the fake default stream uses it.
DEFAULT_STREAM_ID: Final[int] = 0

# The collectives the engine issues, by schema name: (arguments read, arguments written).
# Their schemas have no alias annotations, so CSAN's ArgumentHandler alone would not know that
# the output argument is written in place.
_COLLECTIVES: Final[dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "c10d::_allgather_base_": (("input_tensor",), ("output_tensor",)),
    "c10d::_reduce_scatter_base_": (("input_tensor",), ("output_tensor",)),
    "c10d::allreduce_": ((), ("tensors",)),
}
# CSAN's regex for factory ops that take a tensor only for its metadata (``empty_like``...).
_FACTORY_PREFIXES: Final[tuple[str, ...]] = ("new_",)
_FACTORY_SUFFIXES: Final[tuple[str, ...]] = ("_like",)
# Ops whose output is a new tensor even though the schema says it aliases the input:
# ``torch.tensor(data)`` builds its storage outside dispatch and then calls these.
_LIFT_OPS: Final[frozenset[str]] = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy"})


class StreamRaceError(CUDASanitizerErrors):
    """Races the sanitizer found; ``errors`` holds CSAN's error objects.

    The message is CSAN's full text for the first race (both accesses with their stacks) and a
    one-line summary for each further one, so a report from several ranks stays readable.
    """

    def __str__(self) -> str:
        lines = [f"stream sanitizer: {len(self.errors)} possible data race(s) between streams"]
        if self.errors:
            lines.append(str(self.errors[0]))
        lines.extend(f"also: {summarize(e)}" for e in self.errors[1:])
        return "\n".join(lines)


def summarize(error: SynchronizationError) -> str:
    """One line for a race: which stream accessed what after which unordered access."""
    if isinstance(error, UnsafeReuseError):
        use = error.use
        return (
            f"unsafe reuse: block {error.data_ptr} of stream {error.owner_stream} freed while "
            f"{use.type} by stream {use.stream} in {_op_name(use.operator)} was unordered, "
            f"then reallocated in {_op_name(error.reuse_operator)}"
        )
    if not isinstance(error, UnsynchronizedAccessError):
        return str(error)
    cur, prev = error.current_access, error.previous_access
    return (
        f"storage {error.data_ptr}: {cur.type} by stream {cur.stream} in "
        f"{_op_name(cur.operator)} after {prev.type} by stream {prev.stream} in "
        f"{_op_name(prev.operator)}"
    )


def _op_name(schema: str) -> str:
    return schema.split("(", 1)[0]


class SanitizerReport:
    """What one sanitizer run saw; a test asserts on it (see :func:`stream_sanitizer`).

    Attributes:
        errors: CSAN's race errors, in the order found.
        device: the fake device module (for code that is not the engine: toy tests).
        streams: every fake stream created, the default stream first.
        kernels: how many ops were recorded as kernel launches.
        collectives: ``(schema name, stream id)`` of every collective, in issue order.
        events_recorded: how many times an event was recorded on a stream.
        waits: how many stream-on-event waits were applied (``wait_stream`` included).
        dropped_waits: the qualified names of the callers whose waits were dropped on purpose.
        frees: how many blocks allocated under the sanitizer were freed.
        pending_frees: how many of them were freed while another stream's use was unordered
            (not an error by itself: only handing such a block out again is; but the engine's
            discipline is to release a buffer only after its owner waited, so its tests
            expect none).
        unordered_frees: one line per such free, naming the engine function that freed it.
    """

    def __init__(self, device: FakeDeviceModule) -> None:
        self.errors: list[SynchronizationError] = []
        self.device = device
        self.streams: list[FakeStream] = []
        self.kernels = 0
        self.collectives: list[tuple[str, int]] = []
        self.events_recorded = 0
        self.waits = 0
        self.dropped_waits: list[str] = []
        self.frees = 0
        self.pending_frees = 0
        self.unordered_frees: list[str] = []

    @property
    def unsafe_reuses(self) -> list[str]:
        """One line per unsafe reuse (a subset of ``races``)."""
        return [summarize(e) for e in self.errors if isinstance(e, UnsafeReuseError)]

    @property
    def races(self) -> list[str]:
        """One line per race (see :func:`summarize`); picklable, for results from workers."""
        return [summarize(e) for e in self.errors]

    def __repr__(self) -> str:
        return (
            f"SanitizerReport(races={len(self.errors)}, "
            f"unsafe_reuses={len(self.unsafe_reuses)}, streams={len(self.streams)}, "
            f"kernels={self.kernels}, collectives={len(self.collectives)}, "
            f"events_recorded={self.events_recorded}, waits={self.waits}, "
            f"dropped_waits={len(self.dropped_waits)})"
        )


class FakeEvent:
    """An event: remembers, when recorded, how far every stream had got (in CSAN's handler)."""

    def __init__(self, device: FakeDeviceModule) -> None:
        self._device = device
        self.id = next(device._event_ids)
        device.handler._handle_event_creation(self.id)
        self.collectives: list[_PendingCollective] = []  # test accelerator: before the event

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self._device.current_stream()
        self._device.handler._handle_event_record(self.id, stream.id)
        self._device.report.events_recorded += 1
        self.collectives = [c for c in stream.collectives if not c.done]

    def wait(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self._device.current_stream()
        if not self._device._drops_wait(_caller_qualname()):
            stream._wait(self)

    def synchronize(self) -> None:
        # The host waited for the event: every stream's later work is ordered after it.
        self._device.handler._handle_event_synchronization(self.id)
        self._device.finish(self.collectives)

    def query(self) -> bool:
        # Called by the engine's watchdog thread too: only asks the backend.
        return all(c.completed() for c in self.collectives)

    def __repr__(self) -> str:
        return f"FakeEvent(id={self.id})"


class FakeStream:
    """A stream: only an id that CSAN's handler tracks; work is attributed to it while current."""

    def __init__(self, device: FakeDeviceModule, stream_id: int, priority: int = 0) -> None:
        self._device = device
        self.id = stream_id
        self.priority = priority
        # Test accelerator: collectives this stream's next op must find finished (issued on
        # it, or reached through a waited event).
        self.collectives: list[_PendingCollective] = []

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else FakeEvent(self._device)
        event.record(self)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        if not self._device._drops_wait(_caller_qualname()):
            self._wait(event)

    def wait_stream(self, stream: FakeStream) -> None:
        # As torch does it: record an event on ``stream`` now and wait for that event.
        if not self._device._drops_wait(_caller_qualname()):
            self._wait(stream.record_event())

    def synchronize(self) -> None:
        self._device.handler._handle_stream_synchronization(self.id)
        self._device.finish(self.collectives)

    def query(self) -> bool:
        return True

    def _wait(self, event: FakeEvent) -> None:
        self._device.handler._handle_event_wait(event.id, self.id)
        self._device.report.waits += 1
        self.collectives += [c for c in event.collectives if c not in self.collectives]

    def __repr__(self) -> str:
        return f"FakeStream(id={self.id}, priority={self.priority})"


class FakeDeviceModule:
    """Stands in for ``torch.get_device_module(device)``: streams and events for the checker.

    Args:
        drop_waits_from: qualified names of functions (``"FSDPParamGroup.wait_for_unshard"``)
            whose stream waits are silently skipped: the mutation tests remove one wait of the
            engine this way and expect a race. Matched against the function that called
            ``wait_event`` / ``wait_stream`` / ``FakeEvent.wait``, directly or through the
            engine's one-line helper ``comm/_streams.wait_event``.
        accelerator: the test accelerator (see :func:`stream_sanitizer`): collectives run on
            their stream as they do on a GPU, finished only when a stream ordered after them
            runs its next op (or the host synchronizes an event after them).
    """

    def __init__(self, drop_waits_from: Collection[str] = (), accelerator: bool = False) -> None:
        self.accelerator = accelerator
        self.mode: SanitizerMode | None = None
        self.handler = EventHandler()
        self.report = SanitizerReport(self)
        self.allocator = CachingAllocatorModel(self.handler, self.report)
        self._drop_waits_from = frozenset(drop_waits_from)
        self._stream_ids = itertools.count(DEFAULT_STREAM_ID + 1)
        self._event_ids = itertools.count(1)
        default = FakeStream(self, DEFAULT_STREAM_ID)  # the handler already knows stream 0
        self.report.streams.append(default)
        # The current stream is a stack so that ``stream(s)`` contexts nest.
        self._current: list[FakeStream] = [default]

    # torch.cuda's names, hence the capitalized methods.
    def Stream(self, device: object = None, priority: int = 0, **kwargs: object) -> FakeStream:
        stream = FakeStream(self, next(self._stream_ids), priority)
        self.handler._handle_stream_creation(stream.id)
        self.report.streams.append(stream)
        return stream

    def Event(self, enable_timing: bool = False, **kwargs: object) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self, device: object = None) -> FakeStream:
        return self._current[-1]

    def default_stream(self, device: object = None) -> FakeStream:
        return self._current[0]

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        """Make ``stream`` current inside the block (``None``: leave the current one)."""
        if stream is None:
            yield
            return
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def synchronize(self, device: object = None) -> None:
        self.handler._handle_device_synchronization()
        for stream in self.report.streams:
            self.finish(stream.collectives)

    def finish(self, collectives: list[_PendingCollective]) -> None:
        """Test accelerator: the host waits for ``collectives`` (the device ran them)."""
        if not collectives:
            return
        mode = self.mode
        if mode is not None:
            mode.in_work_wait += 1  # the backend's own copies are not kernels of ours
        try:
            for collective in collectives:
                collective.finish()
        finally:
            if mode is not None:
                mode.in_work_wait -= 1
        collectives.clear()

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def _drops_wait(self, caller: str) -> bool:
        if caller in self._drop_waits_from:
            self.report.dropped_waits.append(caller)
            return True
        return False


class _PendingCollective:
    """A collective issued on a test-accelerator stream and not yet finished.

    gloo runs it on staging copies of its tensors (so the backend's references never extend
    the engine's buffers' lifetimes, which the allocator model judges); ``finish`` waits for
    the Work and writes the result into the engine's output, if that storage is still alive.
    Until then the output holds whatever was there: an op that reads it without having waited
    sees wrong numbers, as on a GPU.
    """

    def __init__(self, work: Any, results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.work: Any = dist.Work.unbox(work)
        # (staging result, engine output) pairs; the engine output by weak reference to its
        # storage, with its geometry, so this record never keeps it alive.
        self._results = [
            (
                staged,
                weakref.ref(out.untyped_storage()),
                out.storage_offset(),
                out.size(),
                out.stride(),
                out.dtype,
            )
            for staged, out in results
        ]
        self.done = False
        self._waiting: Any = None  # the Work while the host blocks on it in finish()

    def completed(self) -> bool:
        # Asked from the engine's watchdog thread too: a host blocked in finish() has not
        # made the collective complete, so ask the backend until the wait returned.
        work = self.work if self.work is not None else self._waiting
        return work is None or bool(work.is_completed())

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        work, self.work = self.work, None
        self._waiting = work
        try:
            work.wait()
        finally:
            self._waiting = None
        for staged, storage_ref, offset, size, stride, dtype in self._results:
            storage = storage_ref()
            if storage is None or storage.nbytes() == 0:
                continue  # freed: nothing reads it any more
            out = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
            out.copy_(staged)
        self._results = []


def _staged_collective(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, _PendingCollective]:
    """Run a c10d collective on staging copies; return its outputs for the caller (the engine's
    own tensors and a completed Work) and the record that finishes it."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    results: list[tuple[torch.Tensor, torch.Tensor]] = []
    if "tensors" in bound:  # all-reduce: in place
        tensors = list(bound["tensors"])
        staged = [t.clone() for t in tensors]
        bound["tensors"] = staged
        results = list(zip(staged, tensors, strict=True))
        ret: Any = tensors
    else:
        out = bound["output_tensor"]
        staged_out = torch.empty_like(out)
        bound["output_tensor"] = staged_out
        bound["input_tensor"] = bound["input_tensor"].clone()
        results = [(staged_out, out)]
        ret = out
    _, work = func(**bound)
    done = torch.futures.Future()  # type: ignore[var-annotated]
    done.set_result(None)
    fake_work = _create_work_from_future(done).boxed()
    return (ret, fake_work), _PendingCollective(work, results)


# Modules of one-line wait helpers (``comm/_streams.wait_event`` skips None events): the
# caller that matters for ``drop_waits_from`` is the engine function that called the helper.
_WAIT_HELPER_MODULES: Final[frozenset[str]] = frozenset({"shardweave.fsdp.comm._streams"})


def _caller_qualname() -> str:
    """The qualified name of the function that asked for a wait, past the wait helpers."""
    # Frame 0 is this function, 1 the fake's wait method, 2 the code that asked for the wait.
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_globals.get("__name__") in _WAIT_HELPER_MODULES:
        frame = frame.f_back
    code = frame.f_code
    return str(getattr(code, "co_qualname", code.co_name))  # co_qualname: Python >= 3.11


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The base address of a tensor's storage, or None when it has no memory to race on."""
    if tensor.device.type == "meta":
        return None
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse or other storage-less layouts
        return None
    return ptr or None  # 0: an empty storage, nothing to race on


def _plain_tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors holding ``value``'s memory: itself, or a wrapper subclass's inner tensors."""
    if is_traceable_wrapper_subclass(value):
        attrs, _ = value.__tensor_flatten__()
        for attr in attrs:
            yield from _plain_tensors(getattr(value, attr))
    elif isinstance(value, torch.Tensor):
        yield value


def _storages(tree: object) -> dict[int, torch.UntypedStorage]:
    """The storages holding ``tree``'s tensors, by key (see ``_storage_key``)."""
    found: dict[int, torch.UntypedStorage] = {}
    for leaf in pytree.tree_leaves(tree):
        for t in _plain_tensors(leaf):
            key = _storage_key(t)
            if key is not None:
                found[key] = t.untyped_storage()
    return found


def _storage_keys(tree: object) -> set[int]:
    keys: set[int] = set()
    for leaf in pytree.tree_leaves(tree):
        for t in _plain_tensors(leaf):
            key = _storage_key(t)
            if key is not None:
                keys.add(key)
    return keys


class _StorageArgumentHandler(ArgumentHandler):
    """CSAN's argument handler, for tensors on any device, keyed by storage (see module doc);
    a storage over part of a block's memory is keyed by that block (``block_of``)."""

    def __init__(self, block_of: Callable[[int], int]) -> None:
        super().__init__()
        self._block_of = block_of

    def _handle_argument(
        self,
        value: Any,
        is_write: bool,
        metadata_only: bool,
        name: str | None = None,
        is_output: bool = False,
    ) -> None:
        for tensor in _plain_tensors(value):
            key = _storage_key(tensor)
            if key is None:
                continue
            key = self._block_of(key)
            if is_write:
                self.dataptrs_written.add(key)
            elif not metadata_only:
                self.dataptrs_read.add(key)
            self.tensor_aliases.setdefault(key, [])
            if name is not None:
                self.tensor_aliases[key].append(name)
            if is_output:
                self.outputs.add(key)


# ------------------------------------------------------------------ the caching allocator model
# The CUDA caching allocator's pools: blocks up to 1 MiB are carved from the small pool, larger
# ones from the large pool; sizes are rounded up to 512 bytes. A block serves a request of its
# own pool that it is large enough for (it may be split).
_SMALL_POOL_BYTES: Final[int] = 1 << 20
_ROUND_BYTES: Final[int] = 512


def _rounded(nbytes: int) -> int:
    return max(_ROUND_BYTES, -(-nbytes // _ROUND_BYTES) * _ROUND_BYTES)


def _engine_frame() -> str:
    """The innermost ``shardweave`` frame on the stack (else the innermost frame)."""
    first = sys._getframe(1)
    frame: FrameType | None = first
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("shardweave."):
            break
        frame = frame.f_back
    found = frame or first
    code = found.f_code
    return f"{getattr(code, 'co_qualname', code.co_name)} ({found.f_globals.get('__name__')}:{found.f_lineno})"


def _stack_here() -> traceback.StackSummary:
    stack = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
    stack.reverse()
    return stack


class UnsafeReuseError(SynchronizationError):
    """A block handed out again on its stream while another stream's use of it was unordered.

    Attributes:
        data_ptr: the freed block's address.
        owner_stream: the stream that allocated the block (whose pool it went back to).
        nbytes: the block's size, rounded as the caching allocator rounds it.
        use: the other stream's access (CSAN's ``Access``, with its stack) not ordered before
            ``owner_stream`` when the block was handed out again.
        reuse_operator, reuse_stack: the op that took the block again, and where.
        allocation_stack: where the freed block had been allocated.
    """

    def __init__(
        self,
        data_ptr: int,
        owner_stream: int,
        nbytes: int,
        use: Access,
        reuse_operator: str,
        reuse_stack: traceback.StackSummary,
        allocation_stack: traceback.StackSummary | None,
    ) -> None:
        self.data_ptr = data_ptr
        self.owner_stream = owner_stream
        self.nbytes = nbytes
        self.use = use
        self.reuse_operator = reuse_operator
        self.reuse_stack = reuse_stack
        self.allocation_stack = allocation_stack

    def __str__(self) -> str:
        use = self.use
        lines = [
            "============================",
            f"Unsafe reuse of a freed block (data pointer {self.data_ptr}, {self.nbytes} bytes) "
            f"owned by stream {self.owner_stream}: it was freed while stream {use.stream}'s "
            f"access was not ordered before stream {self.owner_stream}, and stream "
            f"{self.owner_stream} handed it out again.",
            f"Use by stream {use.stream} during kernel:",
            f"{use.operator}\n{use.type}",
            f"With stack trace:\n{''.join(use.stack_trace.format())}",
            f"Reallocated on stream {self.owner_stream} during kernel:",
            self.reuse_operator,
            f"With stack trace:\n{''.join(self.reuse_stack.format())}",
        ]
        if self.allocation_stack:
            lines.append(
                f"Block was allocated with stack trace:\n{''.join(self.allocation_stack.format())}"
            )
        return "\n".join(lines)


@dataclass
class _Block:
    ptr: int
    nbytes: int  # rounded
    stream: int  # the allocating stream: the block goes back to its pool when freed
    uses: list[Access] = field(default_factory=list)  # other streams' unordered accesses
    info: TensorInfo | None = None  # CSAN's record at the free (for the allocation stack)


def _storage_died(
    model_ref: weakref.ref[CachingAllocatorModel], cdata: int, ptr: list[int]
) -> None:
    model = model_ref()
    if model is not None:
        model.storage_died(cdata, ptr[0])


class CachingAllocatorModel:
    """The CUDA caching allocator's stream rule, over CPU storages (see the module doc).

    ``allocated`` is told of every fresh storage (an op's new output, a storage resized up)
    with the stream current at the time; ``freed`` of every block that dies (a finalizer on the
    storage, or a resize to 0 bytes). A freed block whose last uses by other streams are all
    ordered before its owning stream is forgotten; otherwise it waits in its stream's pending
    list until those uses become ordered (a wait on the owning stream), or until an allocation
    on that stream that the block could serve: then it is reported.
    """

    def __init__(self, handler: EventHandler, report: SanitizerReport) -> None:
        self._handler = handler
        self._report = report
        self._live: dict[int, _Block] = {}  # by address
        self._extent: dict[int, int] = {}  # each live block's address -> its exact bytes
        self._inside: dict[int, int] = {}  # block_of's answers, until the next alloc or free
        self._storages: dict[int, list[int]] = {}  # StorageImpl address -> [current block address]
        self._pending: dict[int, list[_Block]] = {}  # by owning stream
        self.active = True

    def allocated(self, storage: torch.UntypedStorage, stream: int, operator: str) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if not self.active or not ptr:
            return
        if ptr in self._live:  # its free was not seen (a storage from before the sanitizer)
            self.freed(ptr)
        self._hand_out(stream, _rounded(nbytes), operator)
        self._live[ptr] = _Block(ptr, _rounded(nbytes), stream)
        self._extent[ptr] = nbytes
        self._inside.clear()
        cdata = storage._cdata
        holder = self._storages.get(cdata)
        if holder is None:
            holder = self._storages[cdata] = [ptr]
            weakref.finalize(storage, _storage_died, weakref.ref(self), cdata, holder)
        else:
            holder[0] = ptr

    def storage_died(self, cdata: int, ptr: int) -> None:
        self._storages.pop(cdata, None)
        if ptr:
            self.freed(ptr)

    def resized_to_zero(self, storage: torch.UntypedStorage, ptr: int) -> None:
        holder = self._storages.get(storage._cdata)
        if holder is not None:
            holder[0] = 0
        self.freed(ptr)

    def block_of(self, key: int) -> int:
        """The live block whose memory holds address ``key``, else ``key`` itself.

        A storage may be a window on part of a block (the engine hands each sharded gradient
        out over a storage of its own, a DLPack alias of its slot of the reduced output:
        ``own_storage``); its accesses are the block's, as on CUDA they touch its memory.
        """
        if key in self._live:
            return key
        found = self._inside.get(key)
        if found is None:
            found = next((b for b, n in self._extent.items() if b < key < b + n), key)
            self._inside[key] = found
        return found

    def freed(self, ptr: int) -> None:
        self._extent.pop(ptr, None)
        self._inside.clear()
        block = self._live.pop(ptr, None)
        if block is None or not self.active:
            return
        self._report.frees += 1
        info = self._handler.tensors_accessed.accesses.get(ptr)
        if info is None:
            return
        last_uses = [info.write, *info.reads] if info.reads else [info.write]
        block.uses = [
            a
            for a in last_uses
            if a is not None and a.stream != block.stream and not self._ordered(block.stream, a)
        ]
        if block.uses:
            block.info = info
            self._report.pending_frees += 1
            use = block.uses[0]
            self._report.unordered_frees.append(
                f"block {ptr} of stream {block.stream} freed at {_engine_frame()} while "
                f"{use.type} by stream {use.stream} in {_op_name(use.operator)} was unordered"
            )
            self._pending.setdefault(block.stream, []).append(block)

    def _ordered(self, stream: int, access: Access) -> bool:
        return self._handler.syncs.is_ordered_after(stream, access.seq_num, access.stream)

    def _hand_out(self, stream: int, nbytes: int, operator: str) -> None:
        """The allocator serves ``nbytes`` on ``stream``: a pending block that fits is taken."""
        pending = self._pending.get(stream)
        if not pending:
            return
        still: list[_Block] = []
        for block in pending:
            block.uses = [a for a in block.uses if not self._ordered(stream, a)]
            if block.uses:
                still.append(block)
        small = nbytes <= _SMALL_POOL_BYTES
        fits = [b for b in still if b.nbytes >= nbytes and (b.nbytes <= _SMALL_POOL_BYTES) == small]
        if fits:
            block = min(fits, key=lambda b: b.nbytes)  # best fit, as the allocator picks
            still.remove(block)
            self._report.errors.append(
                UnsafeReuseError(
                    block.ptr,
                    stream,
                    block.nbytes,
                    block.uses[0],
                    operator,
                    _stack_here(),
                    block.info.allocation_stack_trace if block.info is not None else None,
                )
            )
        self._pending[stream] = still


# torch's TorchDispatchMode is untyped; the ignores below are for its __init__/__init_subclass__.
class SanitizerMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every op as a kernel on ``device``'s current stream; errors go to its report."""

    def __init__(self, device: FakeDeviceModule) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device = device
        self.in_work_wait = 0  # > 0 inside ``dist.Work.wait`` (see _quiet_work_waits)

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if func is aten.record_stream.default:  # bookkeeping, not a kernel (as in CSAN)
            return func(*args, **kwargs)
        if self.in_work_wait:
            # gloo finishes some collectives on the waiting thread (the reduce-scatter copies
            # its result into the output in ``Work.wait()``). The collective was already
            # recorded as one kernel at issue, as it runs on a GPU; these host copies are not.
            return func(*args, **kwargs)
        device = self.device
        stream_now = device.current_stream()
        if stream_now.collectives:  # test accelerator: the stream is ordered after them
            device.finish(stream_now.collectives)
        handler = _StorageArgumentHandler(device.allocator.block_of)
        input_keys = _storage_keys((args, kwargs))
        collective = _COLLECTIVES.get(schema.name)
        is_factory = False
        if collective is not None:
            reads, writes = collective
            for argument, value in zip_arguments(schema, args, kwargs):
                if argument.name in reads or argument.name in writes:
                    is_write = argument.name in writes
                    pytree.tree_map_(
                        functools.partial(
                            handler._handle_argument,
                            is_write=is_write,
                            metadata_only=False,
                            name=argument.name,
                            is_output=is_write,
                        ),
                        value,
                    )
        else:
            base = schema.name.split("::", 1)[-1]
            is_factory = base.startswith(_FACTORY_PREFIXES) or base.endswith(_FACTORY_SUFFIXES)
            handler.parse_inputs(schema, args, kwargs, is_factory=is_factory)

        if collective is not None and device.accelerator:
            outputs, pending = _staged_collective(func, args, kwargs)
            stream_now.collectives.append(pending)
        else:
            outputs = func(*args, **kwargs)

        if collective is None:
            handler.parse_outputs(schema, outputs, is_factory=is_factory)
            # On CUDA the caching allocator tells CSAN about every new block; on CPU a new
            # storage is recognised here, so an address freed earlier and handed out again
            # starts with no access history instead of the dead tensor's.
            if schema.name in _LIFT_OPS:
                fresh = _storages(outputs)
            elif all(r.alias_info is None for r in schema.returns):
                fresh = {k: v for k, v in _storages(outputs).items() if k not in input_keys}
            else:
                fresh = {}
            stream_id = self.device.current_stream().id
            for key, storage in fresh.items():
                self.device.allocator.allocated(storage, stream_id, str(schema))
                self.device.handler._handle_memory_allocation(key)
        stream = self.device.current_stream().id
        report = self.device.report
        report.kernels += 1
        if collective is not None:
            report.collectives.append((schema.name, stream))
        report.errors += self.device.handler._handle_kernel_launch(
            stream,
            handler.dataptrs_read - handler.dataptrs_written,
            handler.dataptrs_written,
            handler.outputs,
            str(schema),
            handler.tensor_aliases,
        )
        return outputs


@contextlib.contextmanager
def _track_storage_resizes(device: FakeDeviceModule) -> Iterator[None]:
    """Report ``UntypedStorage.resize_`` (not a dispatched op) as deallocation / allocation.

    The engine frees an unsharded parameter by resizing its storage to 0 bytes and refills it
    by resizing it back; the refilled storage is a new allocation, often at an address another
    tensor used before. The allocator model sees the same: a free, then an allocation on the
    current stream.
    """
    handler, allocator = device.handler, device.allocator
    cls = torch.UntypedStorage
    own = cls.__dict__.get("resize_")  # normally inherited from torch._C.StorageBase
    original = cls.resize_

    @functools.wraps(original)
    def resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        old = self.data_ptr() if self.nbytes() else 0
        result: torch.UntypedStorage = original(self, size)
        new = self.data_ptr() if self.nbytes() else 0
        if old != new:
            if old:
                if new:
                    allocator.freed(old)
                else:
                    allocator.resized_to_zero(self, old)
                handler._handle_memory_deallocation(old)
            if new:
                allocator.allocated(self, device.current_stream().id, "UntypedStorage.resize_")
                handler._handle_memory_allocation(new)
        return result

    setattr(cls, "resize_", resize_)  # noqa: B010  (mypy forbids assigning to a method)
    try:
        yield
    finally:
        if own is None:
            delattr(cls, "resize_")
        else:
            setattr(cls, "resize_", own)  # noqa: B010


@contextlib.contextmanager
def _quiet_work_waits(mode: SanitizerMode) -> Iterator[None]:
    """Ops run inside ``dist.Work.wait()`` are not recorded (see ``SanitizerMode``)."""
    cls = dist.Work
    original = cls.wait

    @functools.wraps(original)
    def wait(self: dist.Work, *args: Any, **kwargs: Any) -> bool:
        mode.in_work_wait += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            mode.in_work_wait -= 1

    setattr(cls, "wait", wait)  # noqa: B010
    try:
        yield
    finally:
        setattr(cls, "wait", original)  # noqa: B010


@contextlib.contextmanager
def stream_sanitizer(
    *,
    raise_on_race: bool = True,
    install: bool = True,
    drop_waits_from: Collection[str] = (),
    accelerator: bool = False,
) -> Iterator[SanitizerReport]:
    """Check stream ordering of everything run inside the block; yields the report.

    Enter it before the model's first forward (the engine creates its streams at the root's
    lazy init) and leave it after the last optimizer step.

    Args:
        raise_on_race: on a normal exit, raise :class:`StreamRaceError` if races were found.
            With False the test asserts on ``report.errors`` itself.
        install: make the engine use the fake device module
            (``shardweave.fsdp.comm._streams.use_device_module``). False for code that uses
            ``report.device`` directly.
        drop_waits_from: see :class:`FakeDeviceModule` (mutation tests).
        accelerator: the test accelerator. The engine takes its accelerator branches
            (``use_device_module(..., stream_ordered=True)``: collectives issued with
            ``async_op=False`` inside the stream context, no host wait on a Work, buffers
            released by stream order), and every c10d collective behaves as on a GPU: it
            runs on the stream current at its issue (gloo, on staging copies), its caller
            gets a completed Work, and its result lands in the output only when a stream
            ordered after it runs its next op, or the host synchronizes an event after it.
            A missing wait is then a race in the report *and* wrong numbers.

    Example::

        with stream_sanitizer() as report:
            for _ in range(2):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        assert len(report.streams) > 1  # the engine really used the fake streams
    """
    device = FakeDeviceModule(drop_waits_from, accelerator)
    with contextlib.ExitStack() as stack:
        if install:
            # Imported here: the harness self-tests run without shardweave installed.
            from shardweave.fsdp.comm._streams import use_device_module

            stack.enter_context(use_device_module(device, stream_ordered=accelerator))
        stack.enter_context(_track_storage_resizes(device))
        mode = SanitizerMode(device)
        device.mode = mode
        stack.enter_context(_quiet_work_waits(mode))
        stack.enter_context(mode)
        try:
            yield device.report
            device.synchronize()  # test accelerator: what is still in flight lands
        finally:
            device.allocator.active = False
    if raise_on_race and device.report.errors:
        raise StreamRaceError(device.report.errors)
