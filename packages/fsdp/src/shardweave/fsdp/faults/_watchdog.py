"""The watchdog: one thread per process that tells a fault from a pause.

Design note: the watchdog
    The collective seam registers every collective it issues (``track``): its step and
    sequence number within the step, its kind, the group (module) that issued it, and what
    tells its completion (the ``Work``, or on stream-ordered devices the event recorded after
    it). The watchdog thread never waits on either and never blocks the training thread.

    Completion, not issue. On CPU the host waits for each collective, so the entry the
    training thread is blocked on is the one that can stall, and its stall is timed from the
    start of that wait (gloo's reduce-scatter reports completion only when waited). On
    accelerators the host runs ahead: an entry is done when its event (or ``Work``) reports
    the device finished it, polled from this thread, and its stall is timed from its issue. A
    host wait there only orders streams, so it never marks an entry done.

    Liveness and position. Every heartbeat period (a fifth of the stall threshold, 0.1-1 s)
    the thread reads the failure channel, so every rank adopts a published failure within a
    period on every backend (see Design note: the failure channel, ``_failures``), and the
    heartbeat requests of the cross-rank channel (``_channel``). While some rank waits on a
    stalled collective (it requests beats each period), every rank publishes its heartbeat
    with its position: the step and phase (in the forward, between forward and backward, in
    the backward, between steps), the last collective it issued, the collectives not yet
    complete, and how long the engine has been idle.

    Diagnosis. Once a collective has stalled for the stall threshold (``set_stall_timeout``,
    ``SHARDWEAVE_STALL_TIMEOUT``, default 10 s) the thread judges each peer of its group from
    the peer's last heartbeat (watched since the stall began):

    - *exited*: it wrote an exit record, or its heartbeat stood still for the stall threshold
      (at least 2 s): ``PeerExitedError``;
    - *at another collective*: the peer's collective with the same number is another one, or
      the peer already finished (or skipped) it, or it finished this step's backward with
      fewer collectives: ``CollectiveMismatchError``. "Already finished" alone is confirmed by
      a second look a period later (gloo can finish a collective on one rank a moment before
      another, and that rank's heartbeat may show its next collective already);
    - *raised*: it published an exception (every rank raises ``PeerFailureError`` at once), or
      its backward stopped half-way with no thread left in autograd (an exception escaped
      ``backward()``): ``PeerFailureError``;
    - *at the same collective*, or itself waiting in the engine: slow, logged once;
    - *alive and idle* (behind, no collective pending, heartbeat moving): a pause. A warning on
      every waiting rank names it and where it is, repeated at doubling intervals; the error,
      ``PeerIdleError``, comes only when the wait reaches the idle timeout
      (``set_idle_timeout``, ``SHARDWEAVE_IDLE_TIMEOUT``, default the process group's own
      timeout), or at once if that peer exits meanwhile.

    A verdict is published once through the failure channel; every rank raises it at its next
    engine call or wait, and logs it at once at ERROR level. On CPU the training thread's
    0.5 s wait poll raises it. On accelerators a collective blocked on the device holds the
    host only where the host synchronizes; the watchdog aborts the stalled process group
    (``ProcessGroup.abort()`` on that group alone, so no other group and no torch bookkeeping
    is torn down under the training thread) only where torch documents a user abort:
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``. Under torch's default (3) it leaves the group to
    torch: the training thread raises the verdict at its next engine call, or, if it is stuck
    in a device synchronization behind the dead collective, torch's NCCL watchdog ends the
    process at the process group's timeout, with the verdict already in every rank's log.

    Cost while healthy: two small store reads (the failure record, the heartbeat requests)
    per heartbeat period and no write, a deque append per collective, and an
    ``is_completed()`` or event query per collective in flight per poll. While a collective is
    stalled, its rank requests beats and reads its group's heartbeat records once per period,
    and every rank writes its heartbeat once per period. Measured in the migration guide
    ("What it costs a healthy job").
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import torch.distributed as dist

from shardweave.fsdp._fsdp_common import CollectiveKind
from shardweave.fsdp.faults import _channel, _failures

__all__ = [
    "IDLE_ENV",
    "STALL_ENV",
    "Tracked",
    "explain",
    "new_epoch",
    "set_idle_timeout",
    "set_stall_timeout",
    "track",
]

logger = logging.getLogger("shardweave.fsdp")

STALL_ENV: Final = _channel.STALL_ENV
IDLE_ENV: Final = _channel.IDLE_ENV
DEFAULT_STALL_S: Final = _channel.DEFAULT_STALL_S
POLL_S: Final = 0.5  # completion checks: local, cheap
MAX_PENDING: Final = 16  # collectives in flight named in a heartbeat (oldest first)
BEAT_FOR: Final = 5  # heartbeat periods a process keeps beating after a request
_NCCL_ERROR_HANDLING: Final = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@dataclass
class Tracked:
    """One collective the seam issued (see Design note: the watchdog)."""

    step: int
    seq: int
    kind: CollectiveKind
    group: str  # the issuing group's module FQN
    pg: dist.ProcessGroup
    device_type: str
    work: Any  # dist.Work or an event wrapper; polled with is_completed(), never waited here
    device_side: bool = False  # completion is the device's (stream-ordered devices)
    check: bool = False  # the collective check's signature all-gather before this collective
    epoch: int = field(default_factory=_failures.current_epoch)  # the failure scope
    phase: _failures.Phase = field(default_factory=_failures.current_phase)  # at its issue
    issued: float = field(default_factory=time.monotonic)
    finished: bool = False
    waiting_since: float | None = None  # when the host began to block on it (CPU)
    next_warning: float = 0.0  # stall age of the next idle warning (0: the stall threshold)
    reported_slow: bool = False
    seen_passed: bool = False  # a peer looked past it once (confirmed by the next look)

    def pending(self) -> bool:
        """Not yet complete: not waited on the host (CPU), nor reported complete."""
        if self.finished:
            return False
        try:
            done = bool(self.work.is_completed())
        except Exception:  # an aborted or failed Work: not ours to judge here
            done = True
        if done:
            self.finish()
        return not done

    def finish(self) -> None:
        """Done: let go of the Work, which keeps its tensors (gradients, say) alive."""
        self.finished = True
        self.work = None

    def host_waits(self) -> None:
        """The training thread blocks on it now (CPU): its stall is timed from here."""
        self.waiting_since = time.monotonic()

    def stalled_since(self) -> float | None:
        """When its stall began: the host's wait on CPU, the issue on devices."""
        return self.issued if self.device_side else self.waiting_since

    def brief(self) -> list[Any]:
        return [self.step, self.seq, self.kind, self.group, self.check]

    def describe(self) -> str:
        what = f"the {self.kind} of group '{self.group}' (step {self.step}, collective #{self.seq})"
        return f"the collective check before {what}" if self.check else what


# --- positions: what a rank publishes and how a peer reads it --------------------------------
_KIND_WORDS: Final = {kind.value: kind.words for kind in CollectiveKind}


def _brief_text(brief: list[Any]) -> str:
    step, seq, kind, group, check = brief
    what = f"{_KIND_WORDS.get(kind, kind)} of group '{group}' (step {step}, #{seq})"
    return f"collective check before the {what}" if check else what


def describe(pos: dict[str, Any]) -> str:
    """Where a rank is, in words: "between steps, after step 2's last reduce-scatter"."""
    step = int(pos.get("step", 0))
    try:
        phase = _failures.Phase[str(pos.get("phase", "INIT"))]
    except KeyError:
        phase = _failures.Phase.INIT
    last = pos.get("last")
    in_step = last is not None and int(last[0]) == step
    waiting = pos.get("waiting")
    if waiting is not None:
        where = f"waiting in the {_brief_text(waiting)}"
    elif phase is _failures.Phase.INIT:
        where = "before its first step"
    elif phase is _failures.Phase.AFTER_BACKWARD:
        where = f"between steps, after step {step}'s " + (
            f"last {_KIND_WORDS.get(last[2], last[2])} (group '{last[3]}', #{last[1]})"
            if in_step and last is not None
            else "backward"
        )
    else:
        where = f"{phase.value} of step {step}, " + (
            f"after its {_brief_text(last)}"
            if in_step and last is not None
            else "before its first collective"
        )
    if pos.get("abandoned"):
        where += " (its backward stopped there: no thread is in autograd any more)"
    idle = float(pos.get("idle_s", 0.0))
    return f"{where}; engine idle for {idle:.0f} s" if idle >= 1 else where


def _backward_running() -> bool:
    """Some thread is inside autograd's engine (``torch.autograd.backward`` / ``grad``)."""
    for frame in sys._current_frames().values():
        f: Any = frame
        while f is not None:
            if f.f_code.co_name == "_engine_run_backward":
                return True
            f = f.f_back
    return False


@dataclass
class _Judgement:
    """One diagnosis of a stalled collective."""

    exited: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    raised: list[str] = field(default_factory=list)
    idle: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)  # at the collective, or waiting elsewhere
    unheard: list[int] = field(default_factory=list)  # no fresh heartbeat yet
    passed: int = 0  # how many of the mismatched are peers already past the collective

    def verdict(self, where: str) -> tuple[str, str] | None:
        """(error class name, message) for a fault; None for a pause or a slow collective."""
        if self.exited:
            return (
                "PeerExitedError",
                f"stall diagnosis: {where}, but " + "; ".join(self.exited) + ". The job cannot "
                "continue without it: destroy the process group and restart",
            )
        if self.mismatched:
            return (
                "CollectiveMismatchError",
                f"stall diagnosis: {where}, but "
                + "; ".join(self.mismatched + self.raised)
                + ". A rank skipped a module or ran another number of collectives; make every "
                "rank run the same modules in the same order (for modules some ranks skip, call "
                "them with empty inputs)",
            )
        if self.raised:
            return (
                "PeerFailureError",
                f"stall diagnosis: {where}, but " + "; ".join(self.raised) + ". Wrap the step "
                "in failure_guard() to publish such errors at once; destroy the process group "
                "and restart",
            )
        return None


def _judge_position(
    out: _Judgement, entry: Tracked, rank: int, pos: dict[str, Any], stall: float
) -> None:
    """Add to ``out`` what the position ``pos`` that a live peer ``rank`` published, in this
    model's steps, says about the stalled collective ``entry``."""
    here = (entry.step, entry.seq)
    pending = {(int(b[0]), int(b[1])): b for b in pos.get("pending") or []}
    last = pos.get("last")
    if here in pending:
        theirs = pending[here]
        if (theirs[2], theirs[3]) != (entry.kind, entry.group):
            out.mismatched.append(f"rank {rank} is waiting in the {_brief_text(theirs)}")
        else:
            out.busy.append(f"rank {rank} is at the same collective")
        return
    if (
        last is not None
        and (int(last[0]), int(last[1])) == here
        and (last[2], last[3]) == (entry.kind, entry.group)
    ):
        # Its last collective is this one, no longer pending there: it completed on
        # its side just now, or failed there too (a backend timeout). Not a mismatch.
        out.busy.append(f"rank {rank} is at the same collective (ended on its side)")
        return
    if last is not None and (int(last[0]), int(last[1])) >= here:
        out.passed += 1
        out.mismatched.append(
            f"rank {rank} is already past it (its last collective is the "
            f"{_brief_text(last)}): it skipped this one, or its collective #{entry.seq} "
            "was another one"
        )
        return
    if pos.get("abandoned"):
        out.raised.append(
            f"rank {rank} left the backward of step {pos.get('step')} half-way (an "
            "exception escaped backward(), or it was interrupted) and issues nothing"
        )
        return
    idle_s = float(pos.get("idle_s", 0.0))
    if (
        # This rank is still in the step's forward or backward (not, say, in an
        # unshard() between steps, which the peer may simply not have reached yet)...
        entry.phase in (_failures.Phase.FORWARD, _failures.Phase.BACKWARD)
        # ...and the peer finished that step's backward with fewer collectives.
        and pos.get("phase") == _failures.Phase.AFTER_BACKWARD.name
        and int(pos.get("step", 0)) == entry.step
        and idle_s >= stall
    ):
        out.mismatched.append(
            f"rank {rank} finished the backward of step {entry.step} after "
            f"{pos.get('seq')} collectives, where this rank is at #{entry.seq}"
        )
    elif pos.get("waiting") is not None or pos.get("pending"):
        out.busy.append(f"rank {rank} is {describe(pos)}")
    else:
        out.idle.append(
            f"rank {rank} is alive but has issued no collective for {idle_s:.0f} s: it is "
            f"{describe(pos)}"
        )


class Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tracked: deque[Tracked] = deque()
        self._last: Tracked | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._epoch = 0
        self._failed_epoch = 0  # a verdict is final: no more diagnoses in that epoch
        self._peers = _channel.Peers()  # the thread's view of a stalled group's heartbeats
        self._watching: Tracked | None = None  # the stalled entry whose peers it watches
        self._next_beat = 0.0
        self._next_observe = 0.0
        self._requests_seen: int | None = None
        self._beat_until = 0.0
        self._adopted: _failures.Failure | None = None
        self._backward_left: tuple[int, int] | None = None  # (epoch, step) seen once

    # --- the training thread's side ---------------------------------------------------------
    def new_epoch(self, epoch: int) -> None:
        with self._lock:
            self._tracked.clear()
            self._last = None
            self._epoch = epoch
            self._watching = None
            self._backward_left = None
        self._next_beat = 0.0
        self._requests_seen = 0  # the new scope's request counter starts at 0
        if epoch != 0 and _channel.TIMEOUTS.stall is not None:
            self._ensure_started()

    def track(self, entry: Tracked) -> None:
        if self._thread is None:
            # No thread reads these (none started yet: new_epoch and set_stall_timeout start
            # it, on the training thread; or stopped): no lock for the collective the seam
            # issues. From the thread's start on, every track takes the lock. Checked by
            # test_watchdog_rules (what was tracked before the start is what the thread sees).
            self._track(entry)
            return
        with self._lock:
            self._track(entry)

    def _track(self, entry: Tracked) -> None:
        self._last = entry  # this rank's position, published with its heartbeat
        if _channel.TIMEOUTS.stall is not None:  # else no thread pops: keep nothing
            # Drop what is already complete, so the deque never outgrows the collectives
            # actually in flight.
            while self._tracked and self._tracked[0].finished:
                self._tracked.popleft()
            self._tracked.append(entry)

    # --- the thread -----------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="shardweave-watchdog", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * POLL_S)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(min(POLL_S, _channel.heartbeat_period())):
            try:
                self._tick()
            except Exception:  # never let a store hiccup kill the watchdog
                logger.debug("shardweave watchdog: tick failed", exc_info=True)

    def _tick(self) -> None:
        client = _channel.thread_store()
        if client is None or self._epoch == 0 or self._epoch != _failures.current_epoch():
            return
        now = time.monotonic()
        period = _channel.heartbeat_period()
        if now >= self._next_beat:
            self._next_beat = now + period
            requests = _channel.beat_requests(client, self._epoch)
            if requests != self._requests_seen:  # a peer waits on a stall: beat for a while
                self._requests_seen = requests
                self._beat_until = now + max(BEAT_FOR * period, 1.0)
            if now < self._beat_until:
                _channel.publish_beat(client, self._position(period))
            failure = _failures.poll_failure(client)
            if failure is not None and failure is not self._adopted:
                self._adopted = failure
                self._on_failure(failure)
        stall = _channel.TIMEOUTS.stall
        if stall is None:
            return
        entry, since = self._stalled()
        if entry is None or since is None or entry.epoch == self._failed_epoch:
            self._watching = None
            self._peers.forget()
            return
        age = now - since
        if age < period:
            return
        if entry is not self._watching:  # a new stall: watch its peers from now on
            self._watching = entry
            self._peers.forget()
        if now < self._next_observe:
            return
        self._next_observe = now + period
        _channel.request_beats(client, self._epoch)  # the peers beat while this one waits
        states = self._peers.observe(client, self._peer_ranks(entry))
        if age >= stall:
            self._diagnose(entry, age, states, stall)

    def _stalled(self) -> tuple[Tracked | None, float | None]:
        """The entry stalled longest (and since when), dropping completed ones."""
        with self._lock:
            while self._tracked and (
                self._tracked[0].epoch != self._epoch or not self._tracked[0].pending()
            ):
                self._tracked.popleft()
            best: tuple[Tracked | None, float | None] = (None, None)
            for entry in self._tracked:
                since = entry.stalled_since() if entry.pending() else None
                if since is not None and (best[1] is None or since < best[1]):
                    best = (entry, since)
            return best

    @staticmethod
    def _peer_ranks(entry: Tracked) -> list[int]:
        me = dist.get_rank()
        return [r for r in dist.get_process_group_ranks(entry.pg) if r != me]

    def _position(self, period: float) -> dict[str, Any]:
        progress = _failures.progress()
        with self._lock:
            last = self._last
            pending = [e for e in self._tracked if e.epoch == progress.epoch and e.pending()]
        waiting = [e for e in pending if e.waiting_since is not None]
        abandoned = False
        if progress.phase is _failures.Phase.BACKWARD and progress.idle_s >= period:
            # Seen twice a heartbeat apart, so a backward just entering or leaving the
            # autograd engine is never taken for one that an exception ended.
            here = (progress.epoch, progress.step)
            if _backward_running():
                self._backward_left = None
            elif self._backward_left == here:
                abandoned = True
            else:
                self._backward_left = here
        return {
            "epoch": progress.epoch,
            "step": progress.step,
            "seq": progress.seq,
            "phase": progress.phase.name,
            "last": last.brief() if last is not None and last.epoch == progress.epoch else None,
            "pending": [e.brief() for e in pending[:MAX_PENDING]],
            "waiting": waiting[-1].brief() if waiting else None,
            "idle_s": round(progress.idle_s, 1),
            "abandoned": abandoned,
        }

    # --- diagnosis -----------------------------------------------------------------------
    def _judge(
        self,
        entry: Tracked,
        states: dict[int, _channel.PeerState],
        stall: float,
        lost: float,
    ) -> _Judgement:
        out = _Judgement()
        for rank, state in sorted(states.items()):
            pos = state.position
            seen = describe(pos) if pos is not None else "never seen"
            if state.exit is not None:
                out.exited.append(f"rank {rank} {state.exit}; it was last {seen}")
            elif state.exited(lost):
                out.exited.append(
                    f"rank {rank} stopped answering: its heartbeat has not moved for "
                    f"{state.silent_s:.0f} s (its process exited, was killed, or is frozen); it "
                    f"was last {seen}"
                )
            elif not state.answered:  # not heard from since the request: judged next time
                out.unheard.append(rank)
            elif pos is None or int(pos.get("epoch", 0)) != entry.epoch:
                out.idle.append(f"rank {rank} is alive but not running this model's steps")
            else:
                _judge_position(out, entry, rank, pos, stall)
        return out

    def _where(self, entry: Tracked, waited: float, failed: bool = False) -> str:
        state = "failed after" if failed else "has waited"
        return f"rank {dist.get_rank()} {state} {waited:.0f} s in {entry.describe()}"

    def _diagnose(
        self, entry: Tracked, age: float, states: dict[int, _channel.PeerState], stall: float
    ) -> None:
        judged = self._judge(entry, states, stall, _channel.lost_after())
        if not entry.pending() or entry.epoch != _failures.current_epoch():
            return  # it finished (or its model was dropped) while we looked
        where = self._where(entry, age)
        verdict = judged.verdict(where)
        if verdict is not None and not judged.exited and judged.passed == len(judged.mismatched):
            # Only peers "past it": gloo may complete a collective on one rank a moment before
            # another, and a peer's heartbeat may show its next collective while ours is still
            # finishing. A real skip persists; a finish in flight does not: confirm it one
            # period later, while ours is still pending.
            if not entry.seen_passed:
                entry.seen_passed = True
                return
        else:
            entry.seen_passed = False
        if verdict is not None:
            self._fail(entry, *verdict)
            return
        if judged.idle:
            idle_timeout = _channel.TIMEOUTS.idle_for(entry.pg)
            if age >= idle_timeout:
                self._fail(
                    entry,
                    "PeerIdleError",
                    f"idle peer: {where}, and "
                    + "; ".join(judged.idle)
                    + f". The idle timeout ({idle_timeout:g} s; set_idle_timeout, "
                    f"{IDLE_ENV}, default the process group's timeout) is reached; destroy the "
                    "process group and restart, or raise the idle timeout (and the process "
                    "group's timeout) for longer pauses",
                )
            elif age >= max(entry.next_warning, stall):
                entry.next_warning = 2 * max(entry.next_warning, stall)
                logger.warning(
                    "shardweave: %s for its peers; %s. Not an error yet: a pause (a checkpoint, "
                    "an eval, data loading, a compile) ends by itself. PeerIdleError after the "
                    "idle timeout (%g s; set_idle_timeout, %s, default the process group's "
                    "timeout), at once if it exits. Next notice at %.0f s.",
                    where,
                    "; ".join(judged.idle),
                    idle_timeout,
                    IDLE_ENV,
                    entry.next_warning,
                )
            return
        if judged.unheard:
            return  # judged once they answer (or once their silence makes them exited)
        if not entry.reported_slow:
            entry.reported_slow = True
            logger.warning(
                "shardweave: %s; %s: a slow collective or a slow rank, not a hang. Still waiting.",
                where,
                "; ".join(judged.busy) or "every rank of its group is at it",
            )

    def explain(self, entry: Tracked) -> Exception | None:
        """The training thread's collective failed in the backend (gloo's "Connection closed
        by peer", or its timeout): name the rank that is gone, elsewhere or idle."""
        client = _channel.store()
        if client is None or entry.epoch == 0 or entry.epoch != _failures.current_epoch():
            return None
        entry.finish()
        period = _channel.heartbeat_period()
        stall = _channel.TIMEOUTS.stall or DEFAULT_STALL_S
        # An alive peer answers the request within a period or two; one that just died does
        # not: watch for a few periods (at least the floor: a loaded host delays threads).
        lost = max(4 * period, _channel.LOST_FLOOR_S)
        peers = _channel.Peers()
        ranks = self._peer_ranks(entry)
        deadline = time.monotonic() + lost + 2 * period
        while True:
            _channel.request_beats(client, entry.epoch)
            states = peers.observe(client, ranks)
            judged = self._judge(entry, states, stall, lost)
            settled = all(s.answered for s in states.values())
            if judged.exited or judged.mismatched or judged.raised or settled:
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(period / 2)
        since = entry.stalled_since() or entry.issued
        where = self._where(entry, time.monotonic() - since, failed=True)
        verdict = judged.verdict(where)
        if verdict is None and judged.idle:
            verdict = (
                "PeerIdleError",
                f"idle peer: {where} (the backend gave up: the process group's timeout), and "
                + "; ".join(judged.idle)
                + ". Destroy the process group and restart, or raise the process group's "
                "timeout for longer pauses",
            )
        if verdict is None:
            return None
        self._fail(entry, *verdict)
        return _failures.verdict_error(*verdict)

    def _fail(self, entry: Tracked, kind: str, message: str) -> None:
        self._failed_epoch = entry.epoch
        on_thread = threading.current_thread() is self._thread
        client = _channel.thread_store() if on_thread else None  # see Design note: the channel
        _failures.publish_verdict(kind, message, entry.epoch, client)

    def _on_failure(self, failure: _failures.Failure) -> None:
        """A failure was adopted: say so at once on every rank (the training thread may be
        blocked where it cannot raise yet), and abort where torch supports it."""
        if _failures.raisable(failure):
            logger.error(
                "shardweave: %s (this rank raises it at its next engine call or wait)",
                failure.message,
            )
        self._failed_epoch = failure.epoch
        with self._lock:
            stalled = [e for e in self._tracked if e.device_side and not e.finished]
        for pg in {id(e.pg): e.pg for e in stalled if e.device_type != "cpu"}.values():
            abort_if_supported(pg)


def abort_if_supported(pg: dist.ProcessGroup) -> bool:
    """Abort ``pg``'s communicators where torch documents a user abort: an NCCL group with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (torch's ``_abort_process_group`` notes this mode).
    Only this group: not the default group's world-wide teardown, and no change to torch's
    bookkeeping under the training thread. Returns whether it aborted."""
    if os.environ.get(_NCCL_ERROR_HANDLING, "").strip() != "0":
        return False
    try:
        if pg._get_backend_name() != "nccl":
            return False
        pg.abort()
    except Exception:  # already torn down: nothing left to abort
        logger.debug("shardweave watchdog: abort failed", exc_info=True)
        return False
    return True


WATCHDOG = Watchdog()
atexit.register(WATCHDOG.stop)


def track(entry: Tracked) -> None:
    """The seam issued ``entry``'s collective."""
    WATCHDOG.track(entry)


def explain(entry: Tracked) -> Exception | None:
    """See ``Watchdog.explain``."""
    return WATCHDOG.explain(entry)


def new_epoch() -> None:
    """A root finished lazy init (after ``_failures.new_epoch``): watch in its failure scope."""
    WATCHDOG.new_epoch(_failures.current_epoch())


def set_stall_timeout(seconds: float | None) -> None:
    """The stall threshold: how long a collective may wait before the watchdog judges it.

    Process-wide, the same on every rank; also ``SHARDWEAVE_STALL_TIMEOUT`` (seconds, or
    ``off``). Default 10 s. At the threshold every rank still waiting asks where its peers
    are: a fault (a peer at another collective, one that raised or exited) is an error on
    every rank within a few seconds; a peer that is alive but idle (a checkpoint, an eval, a
    slow data loader or compile) is a warning, repeated at doubling intervals, and an error
    only at the idle timeout (``set_idle_timeout``). ``None`` turns the watchdog off (no
    heartbeat either: turn it off on every rank or none). This is the one stall knob:
    ``FSDPModule.set_collective_checks(stall_timeout=...)`` sets it too (deprecated).

    Example::

        from shardweave.fsdp import set_stall_timeout

        set_stall_timeout(30.0)  # warn about idle peers after 30 s instead of 10 s
    """
    value = _channel.check_seconds("set_stall_timeout", seconds, "or None to turn it off")
    _channel.TIMEOUTS.stall = value
    if value is None:
        WATCHDOG.stop()
    elif WATCHDOG._epoch != 0:
        WATCHDOG._ensure_started()


def set_idle_timeout(seconds: float | None) -> None:
    """How long ranks wait for a peer that is alive but issues no collective.

    Process-wide, the same on every rank; also ``SHARDWEAVE_IDLE_TIMEOUT`` (seconds). Default
    ``None``: the timeout of the process group the ranks wait in (what ``init_process_group``
    or ``new_group`` was given: 10 minutes on NCCL, 30 on gloo by default), as torch would
    time out. Until then such a peer is a warning, never an error (see ``set_stall_timeout``);
    at the idle timeout every waiting rank raises ``PeerIdleError`` naming it. It also bounds
    the first forward's consistency check (unless ``SHARDWEAVE_CONSISTENCY_TIMEOUT`` is set).

    Example::

        from shardweave.fsdp import set_idle_timeout

        set_idle_timeout(1800.0)  # rank 0 may spend up to 30 minutes writing a checkpoint
    """
    _channel.TIMEOUTS.idle = _channel.check_seconds(
        "set_idle_timeout", seconds, "or None for the process group's timeout"
    )
