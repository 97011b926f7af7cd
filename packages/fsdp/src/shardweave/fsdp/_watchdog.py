"""The watchdog: one thread per process that notices a stalled collective and asks every rank
where it is, so a job that would hang says which rank and which module instead.

Design note: stall diagnosis
    The collective seam registers every collective it issues (``track``): a process-wide
    sequence number within the step, its kind, the group (module) that issued it, the step,
    and its ``Work``. The watchdog thread polls ``Work.is_completed()`` every ``POLL_S``; it
    never waits on a ``Work`` and never blocks the training thread.

    When the oldest collective has been pending for the stall threshold (``set_stall_timeout``,
    ``SHARDWEAVE_STALL_TIMEOUT``, default 10 s: well under NCCL's 10 minutes and gloo's 30 s),
    the watchdog starts a diagnosis: it bumps a generation counter in the c10d store. Every
    rank's watchdog looks at that counter on each poll and answers with its position: the
    last collective it issued, whether it is still pending, and the step. The stalled rank
    then judges each rank of the stalled collective's group:

    - at the same collective, still pending: merely slow. Logged once, and the wait goes on.
    - ahead (a later collective or step) without having issued the stalled collective, or at
      another collective with the same number: ``CollectiveMismatchError``. It skipped a
      module. (Ahead after issuing it is no fault of its own: gloo completes a reduce-scatter
      on some ranks before others.)
    - behind (an earlier collective or step), having issued no collective for the threshold:
      idle outside the engine. That is ordinary (rank 0 writing a checkpoint or evaluating,
      host work between backward and the optimizer step, a slow data loader or first
      compile), so it is a warning on every waiting rank, naming the idle rank and where it
      last was, repeated with doubling gaps; only once the peer has been idle for the idle
      timeout (``set_idle_timeout``, ``SHARDWEAVE_IDLE_TIMEOUT``, default: the process group's
      own timeout, which torch's users already set) is it ``PeerIdleError``: it left the
      training loop, or waits on something that never comes.
    - no answer within ``ANSWER_S``: ``PeerExitedError``. Its process exited (an exit record
      says why when it could write one) or hangs outside Python. A paused rank still
      answers: its watchdog thread runs while its training thread sleeps or computes.

    An error is published once through the failure channel (``_fault``), so every rank still
    waiting in the engine raises the same text. On CPU the training thread's 0.5 s wait poll
    picks it up. On accelerators the watchdog also aborts the stalled collective's process
    group, so the blocked work returns and the training thread raises at its next sync point.
    After such an error the process group cannot be used again: destroy it and exit (or build
    a new group).

    Cost while healthy: one store read per rank every ``STORE_POLL_S`` (the generation
    counter), one deque append per collective, and a ``Work.is_completed()`` per pending
    collective every ``POLL_S``. Measured on the benchmark GPT (gloo, world 2): 1.00-1.01 x
    the step time with the watchdog off (``benchmarks/watchdog_overhead.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardweave.fsdp import _fault

__all__ = [
    "IDLE_ENV",
    "STALL_ENV",
    "Tracked",
    "new_epoch",
    "process_group_timeout",
    "set_idle_timeout",
    "set_stall_timeout",
    "track",
]

logger = logging.getLogger("shardweave.fsdp")

STALL_ENV = "SHARDWEAVE_STALL_TIMEOUT"
IDLE_ENV = "SHARDWEAVE_IDLE_TIMEOUT"
DEFAULT_STALL_S = 10.0
POLL_S = 0.5  # completion checks: local, cheap
# Reading the store for peers' diagnosis requests is not cheap (a FileStore replays its log):
# every 2 s cost nothing measurable where every 0.5 s cost 1.7% of the benchmark GPT's step.
STORE_POLL_S = 2.0
ANSWER_S = 3.0  # how long a diagnosis waits for the peers' answers (> STORE_POLL_S)


def _env_stall_timeout() -> float | None:
    raw = os.environ.get(STALL_ENV, "").strip()
    if not raw:
        return DEFAULT_STALL_S
    if raw.lower() in ("0", "off", "none"):
        return None
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{STALL_ENV} must be positive seconds or 'off', got {raw!r}")
    return value


def _env_idle_timeout() -> float | None:
    """The idle timeout from the environment; None: the process group's own timeout."""
    raw = os.environ.get(IDLE_ENV, "").strip()
    if not raw:
        return None
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{IDLE_ENV} must be positive seconds, got {raw!r}")
    return value


def process_group_timeout(pg: dist.ProcessGroup, device_type: str) -> float:
    """Seconds: the timeout ``pg``'s backend for ``device_type`` was created with (the
    ``timeout`` of ``init_process_group`` / ``new_group``), else c10d's default."""
    try:
        backend = pg._get_backend(torch.device(device_type))
        return float(backend.options._timeout.total_seconds())
    except Exception:  # a backend without options (a test or fake group)
        return float(dist.default_pg_timeout.total_seconds())


@dataclass
class Tracked:
    """One collective the seam issued (see Design note: stall diagnosis)."""

    step: int
    seq: int
    kind: str
    group: str  # the issuing group's module FQN
    pg: dist.ProcessGroup
    device_type: str
    work: Any  # dist.Work; polled with is_completed(), never waited here
    epoch: int = field(default_factory=lambda: _fault._STATE.epoch)  # the failure scope
    issued: float = field(default_factory=time.monotonic)
    finished: bool = False
    reported_slow: bool = False
    diagnosed_at: float | None = None  # when the last diagnosis of this collective ran
    next_idle_warning: float = 0.0  # when an idle peer may be warned about again
    idle_warning_gap: float = 0.0  # doubles after each warning

    def pending(self) -> bool:
        """Not yet waited on by the engine, nor reported complete by its backend."""
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

    def position(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seq": self.seq,
            "kind": self.kind,
            "group": self.group,
            "pending": self.pending(),
            "idle_s": time.monotonic() - self.issued,  # since the rank's last engine collective
        }


def describe(pos: dict[str, Any]) -> str:
    if pos.get("seq", 0) == 0:
        return f"step {pos.get('step', 0)}, no collective issued yet"
    state = "waiting in" if pos.get("pending") else "past (completed)"
    return (
        f"{state} the {pos['kind']} of group '{pos['group']}' (step {pos['step']}, "
        f"collective #{pos['seq']})"
    )


class Watchdog:
    def __init__(self) -> None:
        self.stall_timeout = _env_stall_timeout()
        self.idle_timeout = _env_idle_timeout()  # None: the process group's timeout
        self._lock = threading.Lock()
        self._tracked: deque[Tracked] = deque()
        self._last: Tracked | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._answered = 0  # the last diagnosis generation this rank answered
        self._next_store_poll = 0.0
        self._epoch = 0
        self._failed_epoch = 0  # a verdict is final: no more diagnoses in that epoch
        # The last collectives this rank issued, answered with its position: a peer ahead of
        # a stalled collective that issued it too got past it (gloo completes a reduce-scatter
        # on some ranks before others) and skipped nothing.
        self._issued: deque[list[Any]] = deque(maxlen=32)

    # --- the training thread's side ---------------------------------------------------------
    def new_epoch(self, epoch: int) -> None:
        with self._lock:
            self._tracked.clear()
            self._last = None
            self._issued.clear()
            self._answered = 0
            self._epoch = epoch
        if epoch != 0 and self.stall_timeout is not None:
            self._ensure_started()

    def track(self, entry: Tracked) -> None:
        with self._lock:
            self._last = entry  # this rank's position, answered even with diagnosis off
            self._issued.append([entry.step, entry.seq, entry.kind, entry.group])
            if self.stall_timeout is not None:  # else no thread pops: keep nothing
                # Drop what the engine already waited on, so the deque never outgrows the
                # collectives actually in flight.
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

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * POLL_S)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._tick()
            except Exception:  # never let a store hiccup kill the watchdog
                logger.debug("shardweave watchdog: tick failed", exc_info=True)

    def _tick(self) -> None:
        store = _fault._store()
        if store is None or self._epoch == 0 or self._epoch != _fault._STATE.epoch:
            return
        if time.monotonic() >= self._next_store_poll:
            self._next_store_poll = time.monotonic() + STORE_POLL_S
            self._answer(store)
        timeout = self.stall_timeout
        if timeout is None:
            return
        with self._lock:
            while self._tracked and (
                self._tracked[0].epoch != self._epoch or not self._tracked[0].pending()
            ):
                self._tracked.popleft()
            oldest = self._tracked[0] if self._tracked else None
            if self._last is not None:
                self._last.pending()  # lets go of its Work once complete (accelerators)
        if oldest is None or oldest.epoch == self._failed_epoch:
            return
        now = time.monotonic()
        if now - oldest.issued < timeout:
            return
        if oldest.diagnosed_at is not None and now - oldest.diagnosed_at < timeout:
            return  # one diagnosis per threshold: a slow rank is asked again, not hammered
        oldest.diagnosed_at = now
        self._diagnose(store, oldest, now - oldest.issued)

    def _position(self) -> dict[str, Any]:
        with self._lock:
            last = self._last
        if last is None:
            return {"step": _fault._STATE.step, "seq": 0}
        with self._lock:
            issued = list(self._issued)
        return {**last.position(), "issued": issued}

    def _answer(self, store: Any, generation: int | None = None) -> None:
        """Answer every diagnosis started since the last answer: several ranks may stall at
        once, each starting its own, and each waits for its own generation's answers."""
        if generation is None:
            generation = int(store.add(_fault._key("diag", "generation"), 0))
        if generation <= self._answered:
            return
        position = json.dumps(self._position())
        rank = dist.get_rank()
        for g in range(self._answered + 1, generation + 1):
            store.set(_fault._key("diag", g, rank), position)
        self._answered = generation

    # --- diagnosis -----------------------------------------------------------------------
    def _diagnose(self, store: Any, entry: Tracked, waited: float) -> None:
        verdict = self._judge(store, entry, waited)
        if verdict is not None:
            self._fail(entry, *verdict)

    def explain(self, entry: Tracked) -> Exception | None:
        """The training thread's collective failed in the backend (gloo's "Connection closed
        by peer", say): ask every rank now, and name the one that is gone or elsewhere."""
        store = _fault._store()
        if store is None or entry.epoch == 0 or entry.epoch != _fault._STATE.epoch:
            return None
        entry.finished = False  # it did not complete: judge it as pending
        verdict = self._judge(store, entry, time.monotonic() - entry.issued, failed=True)
        entry.finish()
        if verdict is None:
            return None
        self._fail(entry, *verdict)
        return _fault.verdict_error(*verdict)

    def _judge(
        self, store: Any, entry: Tracked, waited: float, failed: bool = False
    ) -> tuple[str, str] | None:
        """(error class name, message), or None: merely slow (logged once) or finished."""
        me = dist.get_rank()
        generation = int(store.add(_fault._key("diag", "generation"), 1))
        self._answer(store, generation)
        peers = [r for r in dist.get_process_group_ranks(entry.pg) if r != me]
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + ANSWER_S
        while len(answers) < len(peers) and time.monotonic() < deadline:
            for rank in peers:
                key = _fault._key("diag", generation, rank)
                if rank not in answers and store.check([key]):
                    answers[rank] = json.loads(store.get(key).decode())
            if len(answers) < len(peers):
                # Peers that stalled at the same moment diagnose too, and wait for this
                # rank's answer as it waits for theirs.
                self._answer(store)
                time.sleep(0.05)
        if (not failed and not entry.pending()) or entry.epoch != _fault._STATE.epoch:
            return None  # it finished (or its model was dropped) while we asked
        exited: list[str] = []
        mismatched: list[str] = []
        idle: list[tuple[float, str]] = []  # (idle seconds, description) per idle peer
        threshold = self.stall_timeout or DEFAULT_STALL_S
        for rank in peers:
            pos = answers.get(rank)
            if pos is None:
                record = _fault.exit_record(rank)
                exited.append(
                    f"rank {rank} {record}"
                    if record
                    else f"rank {rank} did not answer within {ANSWER_S:.0f} s (its process "
                    "exited, or hangs outside Python)"
                )
                continue
            here = (pos.get("step", 0), pos.get("seq", 0))
            if here == (entry.step, entry.seq):
                if (pos.get("kind"), pos.get("group")) != (entry.kind, entry.group):
                    mismatched.append(f"rank {rank} is {describe(pos)}")
                continue  # the same collective: slow at worst
            if here > (entry.step, entry.seq):
                stalled = [entry.step, entry.seq, entry.kind, entry.group]
                if stalled not in pos.get("issued", []):  # it skipped what this rank waits in
                    mismatched.append(f"rank {rank} is already {describe(pos)}")
                continue  # it issued this collective too and got past it
            # Behind: computing, or paused outside the engine; idle once it has issued no
            # collective for the threshold (see Design note: stall diagnosis).
            idle_s = float(pos.get("idle_s", 0.0))
            if not pos.get("pending") and idle_s >= threshold:
                idle.append(
                    (
                        idle_s,
                        f"rank {rank} has issued no collective for {idle_s:.0f} s and is "
                        f"{describe(pos)}",
                    )
                )
        state = "failed after" if failed else "has waited"
        where = (
            f"rank {me} {state} {waited:.0f} s in the {entry.kind} of group "
            f"'{entry.group}' (step {entry.step}, collective #{entry.seq})"
        )
        if exited:
            return (
                "PeerExitedError",
                f"stall diagnosis: {where}, but " + "; ".join(exited) + ". The job cannot "
                "continue without it: destroy the process group and restart",
            )
        if mismatched:
            return (
                "CollectiveMismatchError",
                f"stall diagnosis: {where}, but " + "; ".join(mismatched) + ". A rank "
                "skipped a module or left the step; make every rank run the same modules in "
                "the same order (for modules some ranks skip, call them with empty inputs)",
            )
        if idle:
            return self._judge_idle(entry, where, idle, failed)
        if not entry.reported_slow and not failed:
            entry.reported_slow = True
            logger.warning(
                "shardweave: %s; every rank of its group is at the same collective (or on the "
                "way to it): a slow rank, not a hang. Still waiting.",
                where,
            )
        return None

    def idle_limit(self, entry: Tracked) -> float:
        """Seconds a peer may stay idle before it is an error (see ``set_idle_timeout``)."""
        if self.idle_timeout is not None:
            return self.idle_timeout
        return process_group_timeout(entry.pg, entry.device_type)

    def _judge_idle(
        self, entry: Tracked, where: str, idle: list[tuple[float, str]], failed: bool
    ) -> tuple[str, str] | None:
        """Idle peers: an error once one has been idle for the idle timeout (or this rank's
        collective already failed), else a warning, repeated with doubling gaps."""
        limit = self.idle_limit(entry)
        text = "; ".join(d for _, d in idle)
        if failed or max(s for s, _ in idle) >= limit:
            return (
                "PeerIdleError",
                f"stall diagnosis: {where}, but {text}, past the idle timeout of {limit:.0f} s "
                "(set_idle_timeout, SHARDWEAVE_IDLE_TIMEOUT; default the process group's "
                "timeout). It left the training loop or waits on something that never comes; "
                "the job cannot continue: destroy the process group and restart",
            )
        now = time.monotonic()
        if now >= entry.next_idle_warning:
            gap = entry.idle_warning_gap or (self.stall_timeout or DEFAULT_STALL_S)
            entry.idle_warning_gap = 2 * gap
            entry.next_idle_warning = now + gap
            logger.warning(
                "shardweave: %s; %s: paused outside the engine (a checkpoint, an evaluation, "
                "a slow data loader or compile?). Not an error until it has been idle for "
                "%.0f s (set_idle_timeout). Still waiting.",
                where,
                text,
                limit,
            )
        return None

    def _fail(self, entry: Tracked, kind: str, message: str) -> None:
        self._failed_epoch = entry.epoch
        _fault.publish_verdict(kind, message, entry.epoch)
        if entry.device_type != "cpu":
            # Accelerators: the training thread is not polling; abort the group so its
            # blocked work returns with an error and the next sync raises the verdict.
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group(entry.pg)


WATCHDOG = Watchdog()
atexit.register(WATCHDOG.stop)


def track(entry: Tracked) -> None:
    """The seam issued ``entry``'s collective."""
    WATCHDOG.track(entry)


def explain(entry: Tracked) -> Exception | None:
    """See ``Watchdog.explain``."""
    return WATCHDOG.explain(entry)


def new_epoch() -> None:
    """A root finished lazy init (after ``_fault.new_epoch``): watch in its failure scope."""
    WATCHDOG.new_epoch(_fault._STATE.epoch)


def set_stall_timeout(seconds: float | None) -> None:
    """How long a collective may wait before the watchdog asks every rank where it is.

    Process-wide; also ``SHARDWEAVE_STALL_TIMEOUT`` (seconds, or ``off``). ``None`` turns the
    diagnosis off (the watchdog still answers peers' questions). Default 10 s. Faults (ranks
    at different collectives, a rank that raised or exited) are errors within about this
    threshold plus a few seconds. A rank that is merely slow (every rank at the same
    collective) is logged; a peer paused outside the engine is a warning until the idle
    timeout (``set_idle_timeout``), so a checkpoint write on rank 0 needs no change here.

    Example::

        from shardweave.fsdp import set_stall_timeout

        set_stall_timeout(30.0)  # diagnose later (e.g. a very slow interconnect)
    """
    if seconds is not None and (isinstance(seconds, bool) or not seconds > 0):
        raise ValueError(
            f"set_stall_timeout: seconds must be positive (or None to turn the diagnosis "
            f"off), got {seconds!r}"
        )
    WATCHDOG.stall_timeout = None if seconds is None else float(seconds)
    if seconds is not None and WATCHDOG._epoch != 0:
        WATCHDOG._ensure_started()


def set_idle_timeout(seconds: float | None) -> None:
    """How long a peer may stay idle outside the engine before the ranks waiting for it raise.

    A rank that issues no collective while its peers wait for it (rank 0 writing a checkpoint
    or evaluating, host work between backward and the optimizer step, a slow data loader or
    first compile) is logged as a warning from the stall threshold on, naming it and where it
    last was; it becomes ``PeerIdleError`` on every waiting rank only after it has been idle
    for this long. ``None`` (the default) uses the process group's own timeout (the
    ``timeout`` given to ``init_process_group``), which torch's users already set for long
    pauses. Process-wide; also ``SHARDWEAVE_IDLE_TIMEOUT`` (seconds).

    Example::

        from shardweave.fsdp import set_idle_timeout

        set_idle_timeout(3600.0)  # rank 0 may evaluate for up to an hour between steps
    """
    if seconds is not None and (isinstance(seconds, bool) or not seconds > 0):
        raise ValueError(
            f"set_idle_timeout: seconds must be positive (or None for the process group's "
            f"timeout), got {seconds!r}"
        )
    WATCHDOG.idle_timeout = None if seconds is None else float(seconds)
