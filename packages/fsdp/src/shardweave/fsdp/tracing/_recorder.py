"""The FSDP tracer's recording half: what the engine gathers, reduces, copies and keeps alive,
per step and group, as records. Engine code calls only this module; the reports (summary,
table, Chrome trace, memory plot) are ``_report``'s ``FSDPTracer``.

Design note: tracing hooks
    Each instrumentation point in the engine reads ``if _recorder.ACTIVE is not None:`` and only
    then calls a method of the active tracer. With no tracer that is one module-attribute load
    and one identity test per point: nothing is allocated, no clock is read, no function is
    called. One tracer is active per process at a time (``FSDPTracer.start`` refuses a second).
    All times are ``time.perf_counter_ns()`` minus the tracer's start, on the host thread
    that runs the engine; a collective's completion is when the engine's wait for it returned.

Design note: traced quantities
    The planner predicts the same numbers (the gathered bytes aside, below); both sides use
    these definitions.

    - *Step*: the records between two ``FSDPTracer.step()`` calls (the first step starts at
      ``start()``, the last ends at ``stop()``). A step with no records at ``stop()`` is dropped.
    - *Group key*: the group's module FQN (``"<root>"`` for the root module); a state holding
      several groups (per-parameter meshes) appends ``#<index>``. Hook times of such a state
      are filed under the bare FQN.
    - *All-gather bytes*: the gathered output, ``world * numel(input) * element_size``, where
      the input is the rank's padded flat shard in the all-gather dtype (``param_dtype`` under
      mixed precision; bytes when dtypes are mixed) and ``world`` the shard group's size
      (the post-forward group's when regathering after an int ``reshard_after_forward``).
    - *Reduce-scatter bytes*: the unreduced input, ``world * sum(padded shard numel) *
      element_size(reduce dtype)``.
    - *All-reduce bytes*: the reduced tensor (HSDP: the reduce-scatter output; replicate-only:
      the whole padded gradient buffer), in the reduce dtype.
    - *Gathered bytes* of a group: the all-gather output bytes above (also on a size-1 group,
      where no collective runs). They become live when the unshard's copy-in is done (the
      output buffer is allocated right after, before the collective is issued) and are freed
      when the group reshards (to sharded, or to its post-forward shards, which are not
      counted) or when an unconsumed prefetch is discarded. A group that keeps its unsharded
      storage (``set_keep_unsharded_storage(True)``) frees nothing at reshard: its gathered
      bytes stay alive from its first unshard on, and later unshards add nothing. The
      transient second copy while copy-out splits the buffer into the parameters is not
      counted. *Gathered bytes alive* is the sum over groups; the memory plot and the Chrome
      trace label it "all-gathered (issue to reshard)". It is not the planner's *gathered
      params* (copy-out to reshard), which leaves the output in flight to its communication
      buffers: a prefetched group's all-gather counts here from its issue.
    - *Unsharded gradient bytes*: ``sum(numel * element_size)`` of the unsharded gradients a
      group's post-backward takes for reduction; live from the moment they are taken until
      they have been copied into the reduce-scatter input. Gradients accumulated unreduced
      (``set_requires_gradient_sync(False)``) are not counted.
    - *Collective time*: issue (just before the call) to completion (the wait returned).
      *Exposed* time: the part the host thread spent blocked in the wait: for the all-gather
      from entering ``wait_for_unshard`` to completion; for the reduce-scatter and all-reduce
      from entering their wait (at a later group's post-backward or the end of backward) to
      completion. On accelerators nothing waits on the host, so nothing is exposed there.
    - *Copy-in*: building the all-gather input (a cast of the flat shard buffer, or a
      per-parameter concatenation). *Copy-out*: from all-gather completion until the
      unsharded parameters are registered (allocating them, splitting the output into them).
      *Unshard*: from the unshard call (a prefetch, possibly in another group's hook) until
      the parameters are registered.
    - *Hook time*: wall time in the ``fully_shard`` hooks (pre/post forward, pre-backward, the
      group's post-backward), including the waits and copies they run, and the thread's CPU
      time over the same interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Final, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from shardweave.fsdp._fsdp_common import CollectiveKind

__all__ = [
    "ACTIVE",
    "CollectiveRecord",
    "MemoryRecord",
    "SpanRecord",
    "StepRecord",
    "TraceRecorder",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Recorder = TypeVar("_Recorder", bound="TraceRecorder")

# The tracer the engine reports to; see Design note: tracing hooks.
ACTIVE: TraceRecorder | None = None

HOOK_NAMES: Final = ("pre_forward", "post_forward", "pre_backward", "post_backward")


@dataclass(slots=True)
class CollectiveRecord:
    """One all-gather, reduce-scatter or all-reduce (see Design note: traced quantities).

    Example::

        with trace() as tracer:
            model(batch).sum().backward()
        for c in tracer.collectives:
            if c.kind == CollectiveKind.ALL_GATHER and c.exposed_ns is not None:
                print(c.group, c.step, c.nbytes, len(c.ranks), c.exposed_ns / 1e6, "ms exposed")
    """

    kind: CollectiveKind
    group: str
    step: int
    nbytes: int
    ranks: tuple[int, ...]  # global ranks of the process group
    issue_ns: int
    wait_ns: int | None = None  # when the host thread began waiting
    complete_ns: int | None = None  # when the wait returned; None if never waited

    @property
    def duration_ns(self) -> int | None:
        return None if self.complete_ns is None else self.complete_ns - self.issue_ns

    @property
    def exposed_ns(self) -> int | None:
        if self.complete_ns is None or self.wait_ns is None:
            return None
        return self.complete_ns - self.wait_ns


@dataclass(slots=True)
class SpanRecord:
    """A timed interval: ``category`` is ``hook``, ``copy_in``, ``copy_out``, ``wait`` (an
    all-gather's exposed wait) or ``unshard``; ``name`` is the hook name or the category.

    Example::

        hooks = [s for s in tracer.spans if s.category == "hook"]
        wall_ms = sum(s.end_ns - s.begin_ns for s in hooks) / 1e6
        cpu_ms = sum(s.cpu_ns or 0 for s in hooks) / 1e6
        print(f"hooks: {wall_ms:.2f} ms wall, {cpu_ms:.2f} ms CPU")
    """

    category: str
    name: str
    group: str
    step: int
    begin_ns: int
    end_ns: int
    cpu_ns: int | None = None  # hooks only: the thread's CPU time over the span


@dataclass(slots=True)
class MemoryRecord:
    """One change of the live byte counters, with the totals after it.

    ``event`` is ``unshard`` (+gathered), ``reshard`` / ``discard`` (-gathered; a reshard from
    the post-forward state frees 0), ``grads_taken`` (+grads) or ``grads_reduced`` (-grads).

    Example::

        peak = max(tracer.memory, key=lambda r: r.gathered_bytes)
        print(f"{peak.gathered_bytes} B gathered in step {peak.step}, after the "
              f"{peak.event} of {peak.group!r} at {peak.t_ns / 1e6:.1f} ms")
    """

    t_ns: int
    step: int
    group: str
    event: str
    delta: int
    gathered_bytes: int
    grad_bytes: int


@dataclass(slots=True)
class StepRecord:
    """One traced step: from ``start()`` or a ``step()`` call to the next ``step()`` or
    ``stop()``; ``end_ns`` is None while the step runs.

    Example::

        for s in tracer.steps:
            n = sum(c.step == s.index for c in tracer.collectives)
            print(f"step {s.index}: {(s.end_ns - s.begin_ns) / 1e6:.1f} ms, {n} collectives")
    """

    index: int
    begin_ns: int
    end_ns: int | None = None


@dataclass(slots=True)
class _Unshard:
    begin_ns: int
    collective: CollectiveRecord | None = None
    wait_ns: int | None = None
    copy_out_ns: int | None = None


def now() -> int:
    """The active tracer's clock (0 with none): for records completed outside the tracer."""
    return ACTIVE.now() if ACTIVE is not None else 0


def group_key(fqn: str, index: int, count: int) -> str:
    """The tracer's key for group ``index`` of the ``count`` groups of the state at module
    ``fqn`` (see Design note: traced quantities). Engine code passes keys, never groups."""
    return fqn if count == 1 else f"{fqn}#{index}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TraceRecorder:
    """The records of one trace and the instrumentation points the engine calls while it is
    ``ACTIVE`` (see Design note: tracing hooks). Users get the subclass ``FSDPTracer``
    (``_report``), which adds the reports."""

    def __init__(self) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self.collectives: list[CollectiveRecord] = []
        self.spans: list[SpanRecord] = []
        self.memory: list[MemoryRecord] = []
        self.steps: list[StepRecord] = []
        self.hook_depth = 0  # > 0 while a hook is being timed (the re-entered call runs it)
        self._t0 = time.perf_counter_ns()
        self._step = 0
        self._gathered = 0
        self._grads = 0
        self._live: dict[str, int] = {}  # group key -> gathered bytes it holds
        self._unshards: dict[str, _Unshard] = {}
        self._ranks: dict[int, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        self._running = False

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self: _Recorder) -> _Recorder:
        global ACTIVE
        if ACTIVE is not None:
            raise RuntimeError(
                "FSDPTracer.start: another tracer is already active in this process; stop it "
                "first (tracers do not nest)"
            )
        if self._running or self.steps:
            raise RuntimeError("FSDPTracer.start: a tracer records once; create a new one")
        self._t0 = time.perf_counter_ns()
        self.steps.append(StepRecord(0, 0))
        self._running = True
        ACTIVE = self
        return self

    def stop(self) -> None:
        global ACTIVE
        if not self._running:
            return
        if ACTIVE is self:
            ACTIVE = None
        self._running = False
        self.steps[-1].end_ns = self.now()
        last = self.steps[-1].index
        steps_seen = {r.step for r in self.collectives}
        steps_seen.update(r.step for r in self.spans)
        steps_seen.update(r.step for r in self.memory)
        if len(self.steps) > 1 and last not in steps_seen:
            self.steps.pop()  # the empty step opened by a final step() call

    def __enter__(self: _Recorder) -> _Recorder:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def step(self) -> None:
        """End the current step and start the next."""
        now = self.now()
        self.steps[-1].end_ns = now
        self._step += 1
        self.steps.append(StepRecord(self._step, now))

    @property
    def active(self) -> bool:
        """Whether this tracer is recording (between ``start()`` and ``stop()``)."""
        return self._running

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def now(self) -> int:
        return time.perf_counter_ns() - self._t0

    # --- engine instrumentation points (see Design note: tracing hooks) -----------------------
    def unshard_begin(self, key: str) -> None:
        self._unshards[key] = _Unshard(self.now())

    def copy_in_end(self, key: str, gathered_nbytes: int) -> None:
        now = self.now()
        pending = self._unshards.get(key)
        if pending is not None:
            self.spans.append(
                SpanRecord("copy_in", "copy_in", key, self._step, pending.begin_ns, now)
            )
        # Kept unsharded storage (set_keep_unsharded_storage) is refilled in place: its bytes
        # never stopped being alive, so the unshard is recorded with no change.
        nbytes = 0 if key in self._live else gathered_nbytes
        self._change(now, key, "unshard", nbytes)

    def collective_issue(
        self, kind: CollectiveKind, key: str, tensor: torch.Tensor, pg: dist.ProcessGroup
    ) -> CollectiveRecord:
        """The collective seam issued ``kind`` for ``key`` (its wait completes the record)."""
        record = CollectiveRecord(
            kind, key, self._step, _nbytes(tensor), self._group_ranks(pg), self.now()
        )
        self.collectives.append(record)
        if kind == CollectiveKind.ALL_GATHER:
            pending = self._unshards.get(key)
            if pending is not None:
                pending.collective = record
        return record

    def wait_begin(self, key: str) -> None:
        pending = self._unshards.get(key)
        if pending is not None:
            pending.wait_ns = self.now()
            if pending.collective is not None:
                pending.collective.wait_ns = pending.wait_ns

    def all_gather_done(self, key: str) -> None:
        now = self.now()
        pending = self._unshards.get(key)
        if pending is None:
            return
        pending.copy_out_ns = now
        if pending.collective is not None and pending.wait_ns is not None:
            self.spans.append(SpanRecord("wait", "wait", key, self._step, pending.wait_ns, now))

    def unshard_end(self, key: str) -> None:
        now = self.now()
        pending = self._unshards.pop(key, None)
        if pending is None:
            return
        if pending.copy_out_ns is not None:
            self.spans.append(
                SpanRecord("copy_out", "copy_out", key, self._step, pending.copy_out_ns, now)
            )
        self.spans.append(SpanRecord("unshard", "unshard", key, self._step, pending.begin_ns, now))

    def reshard(self, key: str, kept: bool = False) -> None:
        """The group resharded; with ``kept`` its unsharded storage stays allocated, so its
        gathered bytes stay alive (until a reshard without it)."""
        self._change(self.now(), key, "reshard", 0 if kept else -self._live.get(key, 0))

    def discard_unshard(self, key: str) -> None:
        """An issued all-gather dropped without copy-out (an unconsumed prefetch, a reset)."""
        now = self.now()
        pending = self._unshards.pop(key, None)
        if pending is not None and pending.collective is not None:
            pending.collective.complete_ns = now
        self._change(now, key, "discard", -self._live.get(key, 0))

    def grads_taken(self, key: str, nbytes: int) -> None:
        """A group's post-backward took ``nbytes`` of unsharded gradients to reduce."""
        self._change(self.now(), key, "grads_taken", nbytes)

    def grads_reduced(self, key: str, nbytes: int) -> None:
        """They were copied into a reduction's input (for a bucket, when it started)."""
        self._change(self.now(), key, "grads_reduced", -nbytes)

    def time_hook(
        self, name: str, key: str, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
    ) -> _R:
        """Run the hook ``fn`` (which re-enters itself untimed) and record its times under
        ``key`` (a group's key; a state's hooks under its bare FQN)."""
        self.hook_depth += 1
        wall = time.perf_counter_ns()
        cpu = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu = time.thread_time_ns() - cpu
            end = time.perf_counter_ns()
            self.hook_depth -= 1
            self.spans.append(
                SpanRecord(
                    "hook",
                    name,
                    key,
                    self._step,
                    wall - self._t0,
                    end - self._t0,
                    cpu,
                )
            )

    def _change(self, t_ns: int, key: str, event: str, delta: int) -> None:
        if event in ("unshard", "reshard", "discard"):
            self._gathered += delta
            if delta > 0:
                self._live[key] = delta
            elif delta < 0:
                self._live.pop(key, None)
        else:
            self._grads += delta
        self.memory.append(
            MemoryRecord(t_ns, self._step, key, event, delta, self._gathered, self._grads)
        )

    def _group_ranks(self, pg: dist.ProcessGroup) -> tuple[int, ...]:
        cached = self._ranks.get(id(pg))
        if cached is None:
            cached = (pg, tuple(dist.get_process_group_ranks(pg)))
            self._ranks[id(pg)] = cached  # holding pg keeps its id from being reused
        return cached[1]
