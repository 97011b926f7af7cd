"""The one seam every engine collective passes through: ``issue`` and ``InFlight``.

Functions here take explicit process groups, tensors and streams; they never look at
modules or training state (the param group and the reduction schedule decide *when*, this
module decides *how*). See Design note: stream ordering (``_streams``).

Design note: the collective seam
    Every collective the engine issues (all-gather, reduce-scatter, the HSDP all-reduce,
    replicate's bucketed all-reduce) goes through ``issue``, and is finished through
    ``InFlight.wait``. Issuing runs the opt-in collective check, opens the tracer's record,
    and calls the comm inside ``stream(...)`` of the stream it belongs to, then records an
    event there. Waiting makes the consuming stream wait for that event and, where the
    backend completes work on its own threads (CPU: gloo, the threaded test group), waits for
    the ``Work`` on the host, polling the failure channel (``_failures.wait``). On stream-ordered
    devices (``CommStreams.stream_ordered``: accelerators, and the test accelerator) the comm
    is called with ``async_op=False`` inside the stream context, as torch's FSDP2 does: the
    backend runs it on that stream, the host never blocks, and buffers live by the engine's
    own references (see Design note: stream ordering); only ``unshard(async_op=True)`` keeps
    a ``Work`` for later, waited without a timeout (stream-ordered on NCCL). The watchdog
    (``_watchdog``) polls each ``Work``, or the event after a stream-ordered collective, for
    completion to diagnose stalls; on stream-ordered devices a wait here never marks a
    collective done (see Design note: the watchdog). Before issuing, the seam raises a
    failure or verdict this rank adopted (``_failures.raise_if_failed``). The c10d calls themselves come
    from the ``COLLECTIVES`` extension point (c10d by default, shipped by this package;
    see ``_collectives``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardweave.fsdp._fsdp_common import CollectiveKind
from shardweave.fsdp.comm._streams import CommStreams, wait_event
from shardweave.fsdp.faults import _failures, _watchdog
from shardweave.fsdp.tracing import _recorder
from shardweave.fsdp.tracing._recorder import CollectiveRecord

__all__ = ["InFlight", "issue"]


class _EventCompletion:
    """What the watchdog polls for a stream-ordered collective: its event, device-side."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def is_completed(self) -> bool:
        return bool(self._event.query())


@dataclass
class InFlight:
    """An issued collective: what its consumer waits on before reading the output."""

    what: str | Callable[[], str]  # names the collective in errors
    device: torch.device
    work: dist.Work | None  # waited on the host (CPU backends, async unshards); else None
    event: Any  # recorded on the issuing stream after the collective; None on CPU
    record: CollectiveRecord | None = None  # the tracer's, when tracing
    tracked: _watchdog.Tracked | None = None  # the watchdog's entry
    ignores_timeout: bool = False  # see _failures._wait_on_thread (gloo's reduce-scatter)
    done: bool = field(default=False, init=False)
    # Its Work was waited on the host on a device whose streams do not order collectives
    # (CPU): the collective has finished writing, and its buffers may be released early.
    finished_on_host: bool = field(default=False, init=False)

    def wait(self, streams: CommStreams, stream: Any) -> None:
        """Make ``stream`` wait for the collective (idempotent); see Design note: the
        collective seam."""
        if self.done:
            return
        self.done = True
        wait_event(stream, self.event)
        if self.work is not None:
            self.finished_on_host = not streams.stream_ordered
            record = self.record
            if record is not None and record.wait_ns is None:
                record.wait_ns = _recorder.now()
            if self.tracked is not None and self.finished_on_host:
                self.tracked.host_waits()  # the watchdog times a CPU stall from here
            with streams.use(stream):  # NCCL orders an untimed wait on the current stream
                try:
                    _failures.wait(
                        self.work, self.what, self.device, ignores_timeout=self.ignores_timeout
                    )
                except (_failures.PeerFailureError, _failures.CollectiveMismatchError):
                    raise
                except RuntimeError as error:
                    # The backend gave up (a peer's connection closed): name the rank.
                    named = _watchdog.explain(self.tracked) if self.tracked else None
                    if named is None:
                        raise
                    raise named from error
        if self.record is not None:
            self.record.complete_ns = _recorder.now()
        if self.tracked is not None and not streams.stream_ordered:
            # Waited on the host: done, whatever is_completed() says (gloo's reduce-scatter
            # finishes its copy inside wait() and its Work never reports completion). On
            # stream-ordered devices the wait only ordered streams: the watchdog keeps
            # polling the device-side completion (see Design note: the watchdog).
            self.tracked.finish()
        self.work = None  # a finished Work only keeps its tensors alive

    def abandon(self) -> None:
        """Wait for the work after a failed step, swallowing its error (nothing reads it)."""
        if self.work is not None and not self.done:
            self.done = True
            with contextlib.suppress(Exception):
                _failures.wait(self.work, self.what, self.device)
        if self.tracked is not None:
            self.tracked.finish()


def _check(
    kind: CollectiveKind,
    group: dist.ProcessGroup,
    name: str,
    tensor: torch.Tensor,
    device: torch.device,
    device_type: str,
    step: int,
    seq: int,
) -> None:
    """The opt-in collective check before collective ``seq`` (see Design note: collective
    checks, ``faults/_failures``): its signature all-gather, watched like any collective."""
    checks: list[_watchdog.Tracked] = []

    def watch_check(work: dist.Work) -> None:
        entry = _watchdog.Tracked(step, seq, kind, name, group, device_type, work, check=True)
        entry.host_waits()  # the check is waited at once, on the host
        _watchdog.track(entry)
        checks.append(entry)

    try:
        _failures.check_collective(
            group, kind, name, tensor.numel(), tensor.dtype, device, seq, watch_check
        )
    except (_failures.PeerFailureError, _failures.CollectiveMismatchError):
        raise
    except RuntimeError as error:  # the backend gave up under the check: name the rank
        named = _watchdog.explain(checks[0]) if checks else None
        if named is None:
            raise
        raise named from error
    for entry in checks:
        entry.finish()  # its result was read on the host


def issue(
    kind: CollectiveKind,
    launch: Callable[[bool], dist.Work | None],
    *,
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    name: str,
    trace_key: str | Callable[[], str],
    streams: CommStreams,
    stream: Any,
    what: str | Callable[[], str],
    host_wait: bool = False,
) -> InFlight:
    """Issue one collective on ``stream`` (see Design note: the collective seam).

    ``launch(async_op)`` calls the comm; ``tensor`` is what the check and the tracer
    describe (the all-gather output, the reduce-scatter input, the all-reduced tensor).
    On stream-ordered devices the comm is called with ``async_op=False`` inside the stream
    context, as torch's FSDP2 does: the backend runs it on ``stream`` (NCCL on the current
    stream, no hop through its internal one) and nothing waits on the host; the watchdog
    then polls the event recorded after it. ``host_wait`` keeps a ``Work`` for a later wait
    there too (torch's ``unshard(async_op=True)``); on CPU the ``Work`` is always kept.
    """
    _failures.raise_if_failed(what)  # a published failure or verdict: see faults/_failures
    step, seq = _failures.next_collective()
    # The streams' device is the tensor's (every collective runs on its group's device); it
    # has the type read already, which costs as much as the rest of this prologue.
    device, device_type = streams.device, streams.device_type
    if _failures.checks_enabled():
        _check(kind, group, name, tensor, device, device_type, step, seq)
    record = None
    if _recorder.ACTIVE is not None:  # see Design note: tracing hooks (tracing/_recorder)
        key = trace_key if isinstance(trace_key, str) else trace_key()
        record = _recorder.ACTIVE.collective_issue(kind, key, tensor, group)
    host_side = host_wait or not streams.stream_ordered
    with streams.use(stream):
        work = launch(host_side)
        event = stream.record_event()
    if not host_side:
        work = None  # a backend may return one anyway; the event is what orders it
    tracked = None
    polled = work if work is not None else _EventCompletion(event) if event is not None else None
    if polled is not None:
        tracked = _watchdog.Tracked(
            step,
            seq,
            kind,
            name,
            group,
            device_type,
            polled,
            device_side=streams.stream_ordered,
        )
        _watchdog.track(tracked)
    return InFlight(
        what,
        device,
        work,
        event,
        record,
        tracked,
        # gloo's reduce-scatter blocks in a timed wait; other CPU collectives honor it.
        ignores_timeout=kind == CollectiveKind.REDUCE_SCATTER and device_type == "cpu",
    )
