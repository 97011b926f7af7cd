"""The FSDP tracer: what the engine gathers, reduces, copies and keeps alive, per step and group.

Design note: tracing hooks
    Each instrumentation point in the engine reads ``if _trace.ACTIVE is not None:`` and only
    then calls a method of the active tracer. With no tracer that is one module-attribute load
    and one identity test per point: nothing is allocated, no clock is read, no function is
    called. One tracer is active per process at a time (``FSDPTracer.start`` refuses a second).
    All times are ``time.perf_counter_ns()`` minus the tracer's start, on the host thread
    that runs the engine; a collective's completion is when the engine's wait for it returned.

Design note: traced quantities
    The planner predicts the same numbers; both sides use these definitions.

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
      counted) or when an unconsumed prefetch is discarded. The transient second copy while
      copy-out splits the buffer into the parameters is not counted. *Gathered bytes alive* is
      the sum over groups.
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

import importlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from shardweave.fsdp._fsdp_common import COLLECTIVE_KINDS

if TYPE_CHECKING:
    from shardweave.fsdp._fsdp_param_group import FSDPParamGroup

__all__ = [
    "ACTIVE",
    "CollectiveRecord",
    "FSDPTracer",
    "MemoryRecord",
    "SpanRecord",
    "StepRecord",
    "trace",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")

# The tracer the engine reports to; see Design note: tracing hooks.
ACTIVE: FSDPTracer | None = None

HOOK_NAMES: Final = ("pre_forward", "post_forward", "pre_backward", "post_backward")
_PLOT_INSTALL: Final = "pip install 'shardweave-fsdp[plot]'"


@dataclass(slots=True)
class CollectiveRecord:
    """One all-gather, reduce-scatter or all-reduce (see Design note: traced quantities).

    Example::

        with trace() as tracer:
            model(batch).sum().backward()
        for c in tracer.collectives:
            if c.kind == "all_gather" and c.exposed_ns is not None:
                print(c.group, c.step, c.nbytes, len(c.ranks), c.exposed_ns / 1e6, "ms exposed")
    """

    kind: str  # one of COLLECTIVE_KINDS
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


def group_key(group: FSDPParamGroup) -> str:
    """The tracer's key for ``group`` (see Design note: traced quantities)."""
    return _group_key(group)


def _group_key(group: FSDPParamGroup) -> str:
    fqn = group._fqn
    return fqn if group._num_param_groups == 1 else f"{fqn}#{group._param_group_index}"


def _owner_key(owner: object) -> str:
    groups = getattr(owner, "_fsdp_param_groups", None)
    if groups is None:  # a param group
        return _group_key(owner)  # type: ignore[arg-type]
    return str(groups[0]._fqn) if groups else "<no params>"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FSDPTracer:
    """Records what ``fully_shard`` modules communicate, copy and keep gathered.

    Use it as a context manager (or ``start()`` / ``stop()``) around training steps, and call
    ``step()`` after each optimizer step to delimit steps. Only this process is traced: each
    rank records its own trace (``pid`` = rank in the Chrome export). See the module's Design
    note: traced quantities for what every number means.

    Example::

        with trace() as tracer:
            for batch in batches:
                model(batch).sum().backward()
                optim.step()
                optim.zero_grad()
                tracer.step()
        tracer.export_chrome_trace("trace-rank{rank}.json")
        print(tracer.summary_table())
    """

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
        self._reducing = ""  # the group whose gradient reduction is starting
        self._reducing_grad_bytes = 0
        self._ranks: dict[int, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        self._running = False

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> FSDPTracer:
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

    def __enter__(self) -> FSDPTracer:
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
    def unshard_begin(self, group: FSDPParamGroup) -> None:
        self._unshards[_group_key(group)] = _Unshard(self.now())

    def copy_in_end(
        self, group: FSDPParamGroup, all_gather_input: torch.Tensor, world: int
    ) -> None:
        now = self.now()
        key = _group_key(group)
        pending = self._unshards.get(key)
        if pending is not None:
            self.spans.append(
                SpanRecord("copy_in", "copy_in", key, self._step, pending.begin_ns, now)
            )
        self._change(now, key, "unshard", world * _nbytes(all_gather_input))

    def collective_issue(
        self, kind: str, key: str, tensor: torch.Tensor, pg: dist.ProcessGroup
    ) -> CollectiveRecord:
        """The collective seam issued ``kind`` for ``key`` (its wait completes the record)."""
        record = CollectiveRecord(
            kind, key, self._step, _nbytes(tensor), self._group_ranks(pg), self.now()
        )
        self.collectives.append(record)
        if kind == "all_gather":
            pending = self._unshards.get(key)
            if pending is not None:
                pending.collective = record
        return record

    def wait_begin(self, group: FSDPParamGroup) -> None:
        pending = self._unshards.get(_group_key(group))
        if pending is not None:
            pending.wait_ns = self.now()
            if pending.collective is not None:
                pending.collective.wait_ns = pending.wait_ns

    def all_gather_done(self, group: FSDPParamGroup) -> None:
        now = self.now()
        key = _group_key(group)
        pending = self._unshards.get(key)
        if pending is None:
            return
        pending.copy_out_ns = now
        if pending.collective is not None and pending.wait_ns is not None:
            self.spans.append(SpanRecord("wait", "wait", key, self._step, pending.wait_ns, now))

    def unshard_end(self, group: FSDPParamGroup) -> None:
        now = self.now()
        key = _group_key(group)
        pending = self._unshards.pop(key, None)
        if pending is None:
            return
        if pending.copy_out_ns is not None:
            self.spans.append(
                SpanRecord("copy_out", "copy_out", key, self._step, pending.copy_out_ns, now)
            )
        self.spans.append(SpanRecord("unshard", "unshard", key, self._step, pending.begin_ns, now))

    def reshard(self, group: FSDPParamGroup) -> None:
        key = _group_key(group)
        self._change(self.now(), key, "reshard", -self._live.get(key, 0))

    def discard_unshard(self, group: FSDPParamGroup) -> None:
        """An issued all-gather dropped without copy-out (an unconsumed prefetch, a reset)."""
        now = self.now()
        key = _group_key(group)
        pending = self._unshards.pop(key, None)
        if pending is not None and pending.collective is not None:
            pending.collective.complete_ns = now
        self._change(now, key, "discard", -self._live.get(key, 0))

    def grads_taken(self, group: FSDPParamGroup, grads: Iterable[torch.Tensor]) -> None:
        self._reducing = _group_key(group)
        self._reducing_grad_bytes = sum(_nbytes(g) for g in grads)
        self._change(self.now(), self._reducing, "grads_taken", self._reducing_grad_bytes)

    def grads_reduced(self) -> None:
        self._change(self.now(), self._reducing, "grads_reduced", -self._reducing_grad_bytes)
        self._reducing_grad_bytes = 0

    # Replicate gradient buckets (``_grad_buckets``): one all-reduce for several groups, issued
    # asynchronously and waited at the end of backward.
    def bucket_grads(self, group: FSDPParamGroup, nbytes: int) -> str:
        key = _group_key(group)
        self._change(self.now(), key, "grads_taken", nbytes)
        return key

    def bucket_grads_copied(self, key: str, nbytes: int) -> None:
        self._change(self.now(), key, "grads_reduced", -nbytes)

    def time_hook(
        self, name: str, owner: object, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
    ) -> _R:
        """Run the hook ``fn`` (which re-enters itself untimed) and record its times."""
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
                    _owner_key(owner),
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
            else:
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

    # --- analysis -----------------------------------------------------------------------------
    def gathered_bytes_timeline(self) -> list[tuple[int, int]]:
        """``(t_ns, gathered bytes alive)`` after each change, starting at ``(0, 0)``."""
        return [(0, 0), *((r.t_ns, r.gathered_bytes) for r in self.memory)]

    def grad_bytes_timeline(self) -> list[tuple[int, int]]:
        """``(t_ns, unsharded gradient bytes alive)`` after each change, starting at ``(0, 0)``."""
        return [(0, 0), *((r.t_ns, r.grad_bytes) for r in self.memory)]

    def summary(self) -> dict[str, Any]:
        """Per-group counts, bytes and times, over all steps (``total``) and per step.

        Returns a JSON-serializable dict::

            {"rank", "world_size", "num_steps",
             "total": {...}, "steps": [{...}, ...]}   # each {...} as below
            {"groups": {key: {"unshard": n, "reshard": n,
                              "all_gather" | "reduce_scatter" | "all_reduce":
                                  {"count", "bytes", "time_ms", "exposed_ms", "unwaited"},
                              "copy_in_ms", "copy_out_ms", "unshard_ms",
                              "hooks": {name: {"count", "wall_ms", "cpu_ms"}},
                              "peak_gathered_bytes"}},
             "collectives": {kind: {"count", "bytes"}},
             "peak_gathered_bytes", "peak_grad_bytes",
             "end_gathered_bytes", "end_grad_bytes"}

        Times are summed over records; a collective never waited counts in ``count`` and
        ``bytes`` and in ``unwaited``, not in the times.
        """
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "num_steps": self.num_steps,
            "total": self._summarize(None),
            "steps": [self._summarize(s.index) for s in self.steps],
        }

    def _summarize(self, step: int | None) -> dict[str, Any]:
        groups: dict[str, dict[str, Any]] = {}

        def entry(key: str) -> dict[str, Any]:
            if key not in groups:
                groups[key] = {
                    "unshard": 0,
                    "reshard": 0,
                    **{
                        k: {
                            "count": 0,
                            "bytes": 0,
                            "time_ms": 0.0,
                            "exposed_ms": 0.0,
                            "unwaited": 0,
                        }
                        for k in COLLECTIVE_KINDS
                    },
                    "copy_in_ms": 0.0,
                    "copy_out_ms": 0.0,
                    "unshard_ms": 0.0,
                    "hooks": {},
                    "peak_gathered_bytes": 0,
                }
            return groups[key]

        def mine(record_step: int) -> bool:
            return step is None or record_step == step

        totals = {k: {"count": 0, "bytes": 0} for k in COLLECTIVE_KINDS}
        for c in self.collectives:
            if not mine(c.step):
                continue
            stats = entry(c.group)[c.kind]
            stats["count"] += 1
            stats["bytes"] += c.nbytes
            totals[c.kind]["count"] += 1
            totals[c.kind]["bytes"] += c.nbytes
            if c.duration_ns is None:
                stats["unwaited"] += 1
            else:
                stats["time_ms"] += c.duration_ns / 1e6
                stats["exposed_ms"] += (c.exposed_ns or 0) / 1e6
        for s in self.spans:
            if not mine(s.step):
                continue
            g = entry(s.group)
            ms = (s.end_ns - s.begin_ns) / 1e6
            if s.category == "hook":
                hook = g["hooks"].setdefault(s.name, {"count": 0, "wall_ms": 0.0, "cpu_ms": 0.0})
                hook["count"] += 1
                hook["wall_ms"] += ms
                hook["cpu_ms"] += (s.cpu_ns or 0) / 1e6
            elif s.category in ("copy_in", "copy_out", "unshard"):
                g[f"{s.category}_ms"] += ms
        # Replay the counters up to the end of the step; the level carried into the step
        # counts toward its peaks.
        live: dict[str, int] = {}
        gathered = grads = peak_gathered = peak_grads = 0
        carried = step is None

        def carry_in() -> None:
            nonlocal peak_gathered, peak_grads
            peak_gathered, peak_grads = gathered, grads
            for key, nbytes in live.items():
                if nbytes:
                    entry(key)["peak_gathered_bytes"] = nbytes

        for r in self.memory:
            if step is not None and r.step > step:
                break
            in_step = mine(r.step)
            if in_step and not carried:
                carry_in()
                carried = True
            if r.event in ("unshard", "reshard", "discard"):
                live[r.group] = live.get(r.group, 0) + r.delta
            gathered, grads = r.gathered_bytes, r.grad_bytes
            if in_step:
                g = entry(r.group)
                if r.event in ("unshard", "reshard"):
                    g[r.event] += 1
                g["peak_gathered_bytes"] = max(g["peak_gathered_bytes"], live.get(r.group, 0))
                peak_gathered = max(peak_gathered, gathered)
                peak_grads = max(peak_grads, grads)
        if not carried:
            carry_in()
        return {
            "groups": groups,
            "collectives": totals,
            "peak_gathered_bytes": peak_gathered,
            "peak_grad_bytes": peak_grads,
            "end_gathered_bytes": gathered,
            "end_grad_bytes": grads,
        }

    def summary_table(self, step: int | None = None) -> str:
        """``summary()`` as a text table, over all steps or for one."""
        data = self._summarize(step)
        header = (
            "group",
            "unshard",
            "AG n",
            "AG bytes",
            "AG ms (exposed)",
            "RS n",
            "RS bytes",
            "RS ms",
            "AR n",
            "AR bytes",
            "AR ms",
            "copy-in ms",
            "copy-out ms",
            "hooks ms",
            "peak gathered",
        )
        rows = [header]
        for key, g in data["groups"].items():
            ag, rs, ar = (g[k] for k in COLLECTIVE_KINDS)
            hooks = sum(h["wall_ms"] for h in g["hooks"].values())
            rows.append(
                (
                    key,
                    str(g["unshard"]),
                    str(ag["count"]),
                    str(ag["bytes"]),
                    f"{ag['time_ms']:.3f} ({ag['exposed_ms']:.3f})",
                    str(rs["count"]),
                    str(rs["bytes"]),
                    f"{rs['time_ms']:.3f}",
                    str(ar["count"]),
                    str(ar["bytes"]),
                    f"{ar['time_ms']:.3f}",
                    f"{g['copy_in_ms']:.3f}",
                    f"{g['copy_out_ms']:.3f}",
                    f"{hooks:.3f}",
                    str(g["peak_gathered_bytes"]),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        which = "all steps" if step is None else f"step {step}"
        lines.insert(
            0, f"FSDP trace, rank {self.rank}/{self.world_size}, {which} of {self.num_steps}"
        )
        lines.append(
            f"peak gathered bytes {data['peak_gathered_bytes']}, peak unsharded grad bytes "
            f"{data['peak_grad_bytes']}, gathered at end {data['end_gathered_bytes']}"
        )
        return "\n".join(lines)

    # --- exports ------------------------------------------------------------------------------
    def chrome_trace(self) -> dict[str, Any]:
        """The trace as a Trace Event Format object (``traceEvents``; times in microseconds)."""
        pid = self.rank
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
        ]
        lanes = _Lanes(events, pid)
        for s in self.steps:
            end = s.end_ns if s.end_ns is not None else self.now()
            lanes.complete("step", f"step {s.index}", "step", s.begin_ns, end, {"step": s.index})
        for sp in self.spans:
            name = sp.name if sp.category == "hook" else sp.category
            args: dict[str, Any] = {"group": sp.group, "step": sp.step}
            if sp.cpu_ns is not None:
                args["cpu_us"] = sp.cpu_ns / 1e3
            category = "copy" if sp.category.startswith("copy") else sp.category
            lanes.complete(
                category, f"{name} {sp.group}", sp.category, sp.begin_ns, sp.end_ns, args
            )
        for c in self.collectives:
            if c.complete_ns is None:
                continue
            args = {
                "group": c.group,
                "step": c.step,
                "bytes": c.nbytes,
                "ranks": list(c.ranks),
                "group_size": len(c.ranks),
            }
            if c.exposed_ns is not None:
                args["exposed_us"] = c.exposed_ns / 1e3
            lanes.complete(c.kind, f"{c.kind} {c.group}", c.kind, c.issue_ns, c.complete_ns, args)
        for name in ("gathered params", "unsharded grads"):
            events.append({"name": name, "ph": "C", "ts": 0.0, "pid": pid, "args": {"bytes": 0}})
        for r in self.memory:
            ts = r.t_ns / 1e3
            if r.event in ("reshard", "discard"):
                events.append(
                    {
                        "name": f"{r.event} {r.group}",
                        "cat": r.event,
                        "ph": "i",
                        "s": "t",
                        "ts": ts,
                        "pid": pid,
                        "tid": lanes.tid("reshard", 0),
                        "args": {"group": r.group, "freed_bytes": -r.delta, "step": r.step},
                    }
                )
            gathered = r.event in ("unshard", "reshard", "discard")
            events.append(
                {
                    "name": "gathered params" if gathered else "unsharded grads",
                    "ph": "C",
                    "ts": ts,
                    "pid": pid,
                    "args": {"bytes": r.gathered_bytes if gathered else r.grad_bytes},
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"rank": self.rank, "world_size": self.world_size, "source": "shardweave"},
        }

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write this rank's trace as Chrome / Perfetto JSON (load it in ui.perfetto.dev or
        chrome://tracing). ``{rank}`` in ``path`` is replaced by the rank. Returns the path."""
        out = Path(str(path).replace("{rank}", str(self.rank)))
        out.write_text(json.dumps(self.chrome_trace()))
        return out

    def plot_memory(self, path: str | Path) -> Path:
        """Draw gathered-parameter and unsharded-gradient bytes alive over time as a PNG.

        Needs matplotlib: ``pip install 'shardweave-fsdp[plot]'``. ``{rank}`` in ``path`` is
        replaced by the rank. Returns the path.
        """
        try:
            # No pyplot: a bare Figure draws with Agg and leaves the user's backend alone.
            figure: Any = importlib.import_module("matplotlib.figure")
        except ImportError as e:
            raise ImportError(
                f"FSDPTracer.plot_memory needs matplotlib, which is not installed; install the "
                f"plot extra: {_PLOT_INSTALL}"
            ) from e
        out = Path(str(path).replace("{rank}", str(self.rank)))
        fig = figure.Figure(figsize=(10, 4))
        ax = fig.add_subplot()
        for label, series in (
            ("gathered params", self.gathered_bytes_timeline()),
            ("unsharded grads", self.grad_bytes_timeline()),
        ):
            ax.step(
                [t / 1e6 for t, _ in series],
                [b / 2**20 for _, b in series],
                where="post",
                label=label,
            )
        for s in self.steps[1:]:
            ax.axvline(s.begin_ns / 1e6, color="grey", linewidth=0.5, linestyle="--")
        ax.set_xlabel("time since trace start (ms)")
        ax.set_ylabel("MiB alive")
        ax.set_title(f"FSDP memory, rank {self.rank} ({self.num_steps} steps)")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        return out


class _Lanes:
    """Puts complete events on threads (``tid``) so none overlaps another on the same thread,
    as the Trace Event Format requires: one base tid per category, extra lanes for overlaps."""

    _ORDER: Final = (
        "step",
        "hook",
        "copy",
        "wait",
        "unshard",
        "reshard",
        *COLLECTIVE_KINDS,
    )

    def __init__(self, events: list[dict[str, Any]], pid: int) -> None:
        self._events = events
        self._pid = pid
        self._ends: dict[str, list[int]] = {}
        self._named: set[int] = set()

    def tid(self, category: str, lane: int) -> int:
        tid = (self._ORDER.index(category) + 1) * 100 + lane
        if tid not in self._named:
            self._named.add(tid)
            label = category if lane == 0 else f"{category} ({lane + 1})"
            self._events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": tid,
                    "args": {"name": label},
                }
            )
            self._events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        return tid

    def complete(
        self, category: str, name: str, cat: str, begin_ns: int, end_ns: int, args: dict[str, Any]
    ) -> None:
        ends = self._ends.setdefault(category, [])
        lane = next((i for i, end in enumerate(ends) if end <= begin_ns), len(ends))
        if lane == len(ends):
            ends.append(end_ns)
        else:
            ends[lane] = end_ns
        self._events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": begin_ns / 1e3,
                "dur": (end_ns - begin_ns) / 1e3,
                "pid": self._pid,
                "tid": self.tid(category, lane),
                "args": args,
            }
        )


def trace() -> FSDPTracer:
    """A tracer for the ``fully_shard`` modules of this process; use it as a context manager.

    While it is active the engine records every unshard, reshard and collective (kind, bytes,
    process group, issue and completion times), the copy-in/copy-out and hook times, and the
    gathered-parameter and unsharded-gradient bytes alive. Disabled (no active tracer), the
    engine pays one ``is None`` test per instrumentation point.

    Example::

        from shardweave.fsdp import trace

        with trace() as tracer:
            loss = model(batch).sum()
            loss.backward()
            tracer.step()
        print(tracer.summary_table())
        tracer.export_chrome_trace("fsdp-rank{rank}.json")
    """
    return FSDPTracer()
