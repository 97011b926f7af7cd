"""The streams and events of one comm context, and the device module they come from.

Design note: stream ordering
    Four side streams per comm context (one root's groups), from the device module
    ``torch.get_device_module(device)``. On CPU that is ``torch.cpu``, whose streams are no-ops
    and whose ``record_event()`` returns None, so the same code runs everywhere; every event
    below is optional for that reason (``wait_event`` skips None).

    ========================  ==========================================================
    stream                    runs
    ========================  ==========================================================
    current (compute)         forward/backward, all-gather copy-out, reduce-scatter
                              copy-in, the optimizer
    all-gather copy-in        building the all-gather input (cast, offload H2D copy)
    all-gather                the all-gather
    reduce-scatter            pre-divide, the reduce-scatter, then (no HSDP) post-divide,
                              cast, sharded-gradient views, offload D2H copy
    all-reduce                the HSDP / replicate all-reduce, the all-reduce hook (unless
                              the user gave its own stream), then post-divide and the rest
    ========================  ==========================================================

    Who waits for what, in the order of a step:

    1. The root's pre-forward: both all-gather streams wait for the current stream (the
       optimizer wrote the shards there), or only for the user's post-optim event.
    2. A synchronous unshard in forward or pre-backward: the all-gather stream waits for the
       copy-in's event; the current stream waits for the all-gather's event before copy-out.
       An async or idle unshard (``unshard(async_op=True)``, outside forward) uses the current
       stream for both, as torch's FSDP2 does.
    3. An all-gather output is read by the current stream's copy-out, so it is not freed
       before the all-gather streams have waited for the copy-out's event: in forward the
       comm context keeps the last output and its event until the next group's copy-out
       (then both all-gather streams wait for the event and drop it), so the next group's
       copy-in and all-gather, issued before, overlap this copy-out, as torch's FSDP2 does (at
       most two gathered outputs alive); elsewhere the all-gather streams wait at once.
    4. An int ``reshard_after_forward`` copies the post-forward shards on the current stream
       and records an event that the next unshard's streams wait for.
    5. A post-backward: the reduce-scatter stream waits for the current stream (the
       reduce-scatter input was filled there); the all-reduce stream waits for the
       reduce-scatter stream; a hook stream given by the user waits for the last of them.
    6. The reduce-scatter input is allocated on the current stream and read on the
       reduce-scatter stream, so it stays referenced until the current stream waited for the
       reduce-scatter's event: at a later group's post-backward, keeping at most
       ``reduce_scatter_max_input_buffers``, or at the end of backward.
    7. The end of backward: the current stream waits for every post-reduce event (the
       optimizer reads the sharded gradients there); with CPU offload to pinned memory, the
       host waits for the event after every reduction's non-blocking device-to-host copies
       before the CPU optimizer runs (they may end on different streams). A copy that the
       host reads during backward (accumulation, a post-accumulate-grad hook) is blocking.
    8. The reduce-scatter output is allocated on the reduce-scatter stream (with one shard
       rank too: the input is copied into it, as torch's FSDP2 does, so the current stream
       never has to wait for an all-reduce before reusing its own block). When another
       stream uses it (the HSDP / replicate all-reduce, an all-reduce hook, the casts after
       them), the comm context keeps it until the reduce-scatter stream waited for the
       post-reduce event: before the next reduction allocates there, or at the end of
       backward.

    Every buffer one stream allocates and another uses, who keeps it alive, and until which
    wait (on CUDA a freed block goes back to its allocating stream's pool and may be handed
    out by that stream's next allocation, so the wait must come before the release):

    ======================  ===========  =================================  =====================
    buffer                  owner        kept by                            until
    ======================  ===========  =================================  =====================
    all-gather input kept   copy-in      ``AllGatherResult.input``, then    the all-gather streams
    apart (one parameter's               the comm context's                 wait for the copy-out
    cast; a device copy                  ``all_gather_state`` (forward)     event (point 3)
    with one shard rank)
    all-gather output       all-gather   ``AllGatherResult.output``, then   same (point 3)
                            (copy-in     ``all_gather_state`` (forward)
                            when it
                            writes a
                            slot)
    post-forward shards     current      the FSDPParams                     the next unshard's
    (int reshard)                                                           streams wait (point 4)
    reduce-scatter input    current      ``GradientReduction.               the current stream
                                         reduce_scatter_input``, in the     waits for the
                                         ``ReductionSchedule``'s queue      reduce-scatter event
                                                                            (point 6)
    reduce-scatter output   reduce-      ``ReductionSchedule.               the reduce-scatter
    used on another stream  scatter      _all_reduce_buffers``              stream waits for the
                                                                            post-reduce event
                                                                            (point 8)
    sharded gradients       reduce-      the parameters (``.grad``)         the user's
    (views or casts of the  scatter /                                       ``zero_grad``; the
    output)                 all-reduce                                      next reduction's
                                                                            streams wait for the
                                                                            current one (point 5)
    offloaded gradients     reduce-      the parameters (``.grad``); the    read by the host only
    (pinned host memory,    scatter /    comm context's offload events      after it synchronized
    non-blocking copy)      all-reduce                                      every offload event
                                                                            (point 7)
    replicate bucket: its   current /    as the reduce-scatter input and    points 6 and 8: a
    input and its output    reduce-      output above (a bucket is one      bucket is one
                            scatter      ``GradientReduction``)             reduction
    kept unsharded storage  current      ``FSDPParam.all_gather_output``,   never released; only
    (``set_keep_unsharded_               also while sharded                 the copy-out writes
    storage``)                                                              it, on the stream of
                                                                            all its readers
    ======================  ===========  =================================  =====================

    The copy-in writes an input it builds (a cast, a concatenation, a copy to the device, and
    any input with symmetric memory) straight into this rank's slot of the output, as torch's
    FSDP2 does, so then the output is the copy-in stream's and no input is kept apart.

    The kept unsharded storage needs no wait of its own, as in torch's FSDP2: the next
    unshard writes it only in its copy-out, on the current stream, after every op that read
    the previous contents there (forward, backward, the post-forward clone of point 4); the
    all-gather streams never touch it (they write the gathered buffer, ``AllGatherResult.output``).

    Collectives are issued as torch's FSDP2 issues them: on stream-ordered devices with
    ``async_op=False`` inside ``stream(...)`` (``_seam.issue``), so the backend
    runs them on that stream and the event recorded after them orders every consumer;
    nothing here relies on the backend keeping tensors alive (NCCL's own stashing is an
    implementation detail): the table above does. On CPU (``CommStreams.stream_ordered`` is
    False) the host waits each ``Work`` instead, and the engine may free a buffer's storage
    at once after that wait (``release_finished_buffer``), but only at the same points, after
    the owning stream's wait (a no-op on CPU). The watchdog polls the ``Work`` on CPU and the
    event on accelerators.

    Nothing calls ``record_stream``. This ordering is checked on CPU by the stream sanitizer
    of the test suite (``tests/_dist/stream_sanitizer.py``), which substitutes a fake device
    module through ``use_device_module`` and models the caching allocator; with
    ``stream_ordered=True`` (its test accelerator) the engine takes its accelerator branches
    with gloo underneath, and a collective lands only when a stream ordered after it runs, so
    a missing wait is a race in the report and, for the collectives' outputs, a wrong number.
    It has not yet run on a GPU.

    Branches still taken on one kind of device only (``stream_ordered`` or the device type):
    the host wait on a ``Work`` and the early storage release (CPU; gloo completes on the
    host), ``faults/_failures.wait``'s timed polling and the collective checks' timed waits (CPU; NCCL times
    a wait from the issue), the watchdog's abort of the process group (accelerators), the
    stream priorities (CUDA), pinned flat storage and the non-blocking host-to-device /
    device-to-host copies of CPU offload (only when the compute device is not the CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CommStreams", "device_module", "stream_ordered", "use_device_module", "wait_event"]

_override: Any = None
_override_stream_ordered = False


def device_module(device: torch.device) -> Any:
    """``torch.get_device_module(device)``, unless a test substituted one."""
    if _override is not None:
        return _override
    return torch.get_device_module(device)


def stream_ordered(device_type: str) -> bool:
    """Whether the engine takes its accelerator branches on ``device_type`` (see
    ``CommStreams.stream_ordered``): on every device but the CPU, and under a substituted
    device module as ``use_device_module`` says (the test accelerator: CPU tensors)."""
    return _override_stream_ordered if _override is not None else device_type != "cpu"


@contextlib.contextmanager
def use_device_module(module: object, *, stream_ordered: bool = False) -> Iterator[None]:
    """Make every comm context created inside use ``module``'s streams and events.

    The seam of the CPU stream sanitizer: it passes a fake device module whose streams are
    distinct, so a missing wait shows up as a race even though CPU streams are no-ops.
    ``stream_ordered`` (the test accelerator): the engine takes the accelerator branches
    (see ``CommStreams.stream_ordered``) although its tensors are on CPU; the fake module then
    finishes each collective when a stream that waited for it next runs an op.
    """
    global _override, _override_stream_ordered
    previous = _override, _override_stream_ordered
    _override, _override_stream_ordered = module, stream_ordered
    try:
        yield
    finally:
        _override, _override_stream_ordered = previous


def wait_event(stream: Any, event: Any) -> None:
    """``stream.wait_event(event)``; CPU streams record no events (None)."""
    if event is not None:
        stream.wait_event(event)


_NO_OP: contextlib.nullcontext[None] = contextlib.nullcontext()


class CommStreams:
    """The side streams of one comm context; see Design note: stream ordering."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Read once: ``torch.device.type`` builds a new string on every read (the seam needs
        # it at every collective).
        self.device_type = device.type
        self.device_handle = device_module(device)
        # Whether streams order the collectives (accelerators, and the test accelerator): they
        # are issued inside stream(...) and finished by events, the host never waits, and a
        # buffer is released when its Python references go. Otherwise (CPU: gloo, the threaded
        # test group) a collective is finished by a host wait on its Work, and buffers the
        # engine allocated may be freed at once after that wait, once the streams that would
        # reuse them have waited too (a no-op on CPU, checked by the sanitizer).
        self.stream_ordered = stream_ordered(self.device_type)
        # High priority for the communication streams on CUDA, as torch's FSDP2: their kernels
        # are short and gate compute; other backends take the default.
        high = -1 if device.type == "cuda" else 0
        self.all_gather_copy_in = self.device_handle.Stream(priority=high)
        self.all_gather = self.device_handle.Stream(priority=high)
        self.reduce_scatter = self.device_handle.Stream(priority=high)
        self.all_reduce = self.device_handle.Stream(priority=0)
        # torch.cpu's streams are no-ops: entering one only swaps a module global that no CPU
        # kernel reads, so ``use`` skips building the context there (hundreds per step). A
        # substituted module (the stream sanitizer's) is never torch.cpu: it runs the real thing.
        self._no_op_streams = self.device_handle is torch.cpu

    def current(self) -> Any:
        return self.device_handle.current_stream()

    def all_gather_waits(self, event: Any) -> None:
        """Both all-gather streams wait for ``event`` (points 1 and 3): a copy-out or the
        optimizer, whose memory they are about to reuse or read."""
        wait_event(self.all_gather_copy_in, event)
        wait_event(self.all_gather, event)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current for the ops inside."""
        if self._no_op_streams:
            return _NO_OP
        return self.device_handle.stream(stream)  # type: ignore[no-any-return]
