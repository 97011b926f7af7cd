"""Never hang: a failed rank tells its peers, and collectives that would not match are refused.

Design note: the failure channel
    Collectives cannot carry "I failed": a rank that raised mid-step simply never joins the
    next one, and its peers wait out the process-group timeout (or, on a size mismatch, gloo
    aborts the process). So a rank that raises publishes the error through the cross-rank
    channel (``_channel``: the c10d store every rank already shares), and the watchdog's
    verdicts (``_watchdog``) go the same way. The record is scoped to the current root lazy
    init (``epoch``), so a failure in one job does not leak into a model built later; the
    first record of a scope wins on every rank.

    Every rank reads it the same way on every backend: its watchdog thread reads it once per
    heartbeat and adopts it, and a rank waiting on a collective on CPU also reads it at each
    ``POLL_INTERVAL`` wake-up. The training thread raises an adopted record at its next engine
    call (``raise_if_failed``, before every collective the seam issues) or wait. A rank's own
    exception is not raised back on that rank, nor on a rank that raised one of its own in the
    same scope (every rank may raise, catch its own and go on; whose record won the publish is
    a race); a verdict is raised on every rank, the judge and the culprit included. A verdict keeps its error class (``CollectiveMismatchError``,
    ``PeerExitedError``, ``PeerIdleError``); a peer's exception becomes ``PeerFailureError``.

    This module also keeps the rank's progress in the engine (step, collective number,
    phase), which the watchdog publishes and the collective checks compare.

Design note: collective checks (opt-in)
    With checks on (``FSDPModule.set_collective_checks`` or ``SHARDWEAVE_CHECK_COLLECTIVES=1``)
    every engine collective is preceded by an all-gather of its signature (step, sequence
    number, group, kind, element count, dtype) over the same process group, so a rank that
    skipped a module, reached another step or computed another shape is named on every rank
    before any mismatched collective can abort or silently mix data. The signature all-gather
    is watched like any collective: a peer that never arrives is judged by the watchdog
    (idle: a warning, then ``PeerIdleError`` at the idle timeout; exited: ``PeerExitedError``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardweave.fsdp._fsdp_common import CollectiveKind
from shardweave.fsdp._torch_compat import all_gather_single
from shardweave.fsdp.faults import _channel
from shardweave.fsdp.faults._consistency import FSDPConsistencyError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "CHECK_ENV",
    "CollectiveMismatchError",
    "Failure",
    "PeerExitedError",
    "PeerFailureError",
    "PeerIdleError",
    "Phase",
    "Progress",
    "checks_enabled",
    "current_epoch",
    "current_phase",
    "enter_phase",
    "failure_guard",
    "new_epoch",
    "new_step",
    "next_collective",
    "poll_failure",
    "progress",
    "publish_failure",
    "publish_verdict",
    "raisable",
    "raise_if_failed",
    "set_checks",
    "verdict_error",
    "wait",
]

CHECK_ENV = "SHARDWEAVE_CHECK_COLLECTIVES"
POLL_INTERVAL = datetime.timedelta(seconds=0.5)
_SCOPE = "fault"
# Signature layout: step, sequence number, group hash, kind (``CollectiveKind.code``), numel,
# dtype.
_SIG_LEN = 6


class PeerFailureError(RuntimeError):
    """Another rank raised while this rank waited for it in a collective.

    The message names the failed rank, its error and the collective this rank was in. The
    process group cannot be used again after an abandoned collective.

    Example::

        try:
            with failure_guard():
                model(batch).sum().backward()
        except PeerFailureError as e:
            print(e)  # "rank 3 raised ValueError: ...; this rank (0) was waiting for it in ..."
            dist.destroy_process_group()
            raise
    """


class PeerExitedError(PeerFailureError):
    """A peer's process exited (or stopped answering) while this rank waited for it.

    Raised on every rank when the watchdog finds that a rank of a stalled collective's group
    is gone: it wrote an exit record (an uncaught exception, the interpreter ended), its
    heartbeat stood still for the stall threshold (killed, crashed, the node lost), or its
    connection closed under a collective. The message names the rank, where it was last seen,
    and the collective, group and step this rank waited in. The process group cannot be used
    again.

    Example::

        try:
            train_step()
        except PeerExitedError as e:
            print(e)  # "... rank 3 stopped answering 10 s ago (its process exited ...)"
            dist.destroy_process_group()
            raise SystemExit(1)
    """


class PeerIdleError(PeerFailureError):
    """A peer was alive but issued no collective for the idle timeout while this rank waited.

    A pause is not a fault: a rank writing a checkpoint, evaluating, loading data or compiling
    while its peers wait in a collective is logged as a warning at the stall threshold
    (``set_stall_timeout``), naming it and where it was, and again at doubling intervals.
    Only when the wait reaches the idle timeout (``set_idle_timeout``, by default the process
    group's own timeout, as torch would time out) does every rank raise this, naming the idle
    rank and where it was last seen. The process group cannot be used again.

    Example::

        try:
            train_step()
        except PeerIdleError as e:
            print(e)  # "rank 1 is alive but has issued no collective for 600 s; it is between
            #            steps, after step 2's last reduce-scatter ..."
            dist.destroy_process_group()
            raise SystemExit(1)
    """


class CollectiveMismatchError(FSDPConsistencyError):
    """Ranks issued (or were about to issue) collectives that do not match.

    Raised by the watchdog's stall diagnosis (on by default, see ``set_stall_timeout``) when a
    rank is at another collective or in another step than the one its peers wait in (it
    skipped a module, or ran another number of collectives in the step), and by the opt-in
    collective checks before a
    mismatched collective is issued at all (they cost one small all-gather per collective:
    turn them on to find why a job hangs, not for production runs). A subclass of
    ``FSDPConsistencyError``, so one ``except`` catches both.

    Example::

        model.set_collective_checks(True)  # or SHARDWEAVE_CHECK_COLLECTIVES=1
        try:
            model(batch).sum().backward()
        except CollectiveMismatchError as e:
            print(e)  # which rank is at which group, step and collective
            raise
    """


class Phase(Enum):
    """Where a rank is in the engine's step, as the watchdog reports it to its peers."""

    INIT = "before its first step"
    FORWARD = "in the forward"
    AFTER_FORWARD = "between the forward and the backward"
    BACKWARD = "in the backward"
    AFTER_BACKWARD = "between steps"


@dataclass(frozen=True)
class Progress:
    """A snapshot of this rank's progress in the current failure scope."""

    epoch: int
    step: int
    seq: int  # collectives issued in this step
    phase: Phase
    idle_s: float  # since the engine last did anything (issued, waited, changed phase)


@dataclass(frozen=True)
class Failure:
    """A published failure record (see Design note: the failure channel)."""

    epoch: int
    origin: int  # the rank that published it
    kind: str  # the error class a verdict raises; "" for a rank's own exception
    message: str


class _FaultState:
    """Process-wide: the failure scope, this rank's progress in it, and the check setting."""

    def __init__(self) -> None:
        self.epoch = 0  # agreed at each root lazy init; 0 = no root (or no peers) yet
        self.step = 0
        self.seq = 0
        self.phase = Phase.INIT
        self.active = time.monotonic()  # the engine's last activity
        self.checks = os.environ.get(CHECK_ENV) == "1"
        self.names: dict[int, str] = {}  # group hash -> group name, for peers' signatures
        self.published = False
        # This rank raised its own exception in the current epoch (published or not): a peer's
        # exception published in the same epoch is then not raised here, since every rank
        # that raised may catch its own and go on (whose record wins the publish is a race).
        self.raised_own = False
        self.failure: Failure | None = None  # adopted, for the current epoch


_STATE = _FaultState()


def _failure_key(epoch: int) -> str:
    return _channel.key(_SCOPE, epoch, "failure")


# --- lifecycle ----------------------------------------------------------------------------------
def new_epoch(nonce: int | None) -> None:
    """A root finished lazy init: start a fresh failure scope named by ``nonce``, which every
    rank of the mesh agreed on (None: no peers, nothing to tell)."""
    _STATE.epoch = 0 if nonce is None else nonce
    _STATE.step = 0
    _STATE.seq = 0
    _STATE.phase = Phase.INIT
    _STATE.active = time.monotonic()
    _STATE.published = False
    _STATE.raised_own = False
    _STATE.failure = None
    _install_excepthook()


def new_step() -> None:
    """The root's forward started a new iteration."""
    _STATE.step += 1
    _STATE.seq = 0
    enter_phase(Phase.FORWARD)


def enter_phase(phase: Phase) -> None:
    """The root's forward ended, its backward began, or the backward's final callback ran."""
    _STATE.phase = phase
    _STATE.active = time.monotonic()


def next_collective() -> tuple[int, int]:
    """The (step, sequence number) of the collective the seam is about to issue."""
    _STATE.seq += 1
    _STATE.active = time.monotonic()
    return _STATE.step, _STATE.seq


def touch() -> None:
    """The engine waited for a collective: it is working, not idle."""
    _STATE.active = time.monotonic()


def current_epoch() -> int:
    return _STATE.epoch


def current_phase() -> Phase:
    return _STATE.phase


def progress() -> Progress:
    return Progress(
        _STATE.epoch, _STATE.step, _STATE.seq, _STATE.phase, time.monotonic() - _STATE.active
    )


def set_checks(enabled: bool) -> None:
    _STATE.checks = enabled


def checks_enabled() -> bool:
    return _STATE.checks


# --- publishing -----------------------------------------------------------------------------
def _publish(epoch: int, kind: str, message: str, client: Store | None = None) -> bool:
    client = client if client is not None else _channel.store()
    if client is None or epoch == 0:
        return False
    record = {"origin": dist.get_rank(), "kind": kind, "message": message}
    with contextlib.suppress(Exception):  # never mask the original error
        _channel.publish_once(client, _failure_key(epoch), json.dumps(record))
        return True
    return False


def publish_failure(exc: BaseException, where: str = "") -> None:
    """Tell the peers that this rank failed with ``exc`` (first failure per epoch wins)."""
    if isinstance(exc, (PeerFailureError, KeyboardInterrupt)):
        return
    _STATE.raised_own = True
    if _STATE.published:
        return
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > 2000:
        text = text[:2000] + " ..."
    detail = f"rank {dist.get_rank()} raised {text}" if dist.is_initialized() else text
    detail += f" ({where})" if where else ""
    _STATE.published = _publish(_STATE.epoch, "", detail)


def publish_verdict(kind: str, message: str, epoch: int, client: Store | None = None) -> None:
    """Publish the watchdog's verdict (``kind`` names the error class) as ``epoch``'s
    failure, so every rank raises it (first failure wins). The epoch is the diagnosed
    collective's: a diagnosis that outlives its model must not fail the next. ``client``: the
    watchdog thread's own store client."""
    _publish(epoch, kind, message, client)


def poll_failure(client: Store | None = None) -> Failure | None:
    """Read the current scope's failure record through the channel and adopt it (the
    watchdog thread passes its own store client)."""
    epoch = _STATE.epoch
    if _STATE.failure is not None or epoch == 0:
        return _STATE.failure
    client = client if client is not None else _channel.store()
    raw = _channel.read(client, _failure_key(epoch)) if client is not None else None
    if not raw:
        return None
    try:
        record = json.loads(raw)
        found = Failure(epoch, int(record["origin"]), str(record["kind"]), str(record["message"]))
    except (ValueError, KeyError, TypeError):
        return None
    if _STATE.epoch == epoch:
        _STATE.failure = found
    return found


def raisable(failure: Failure | None) -> bool:
    """A verdict is raised everywhere; a rank's exception only on the ranks that raised none
    of their own in the same epoch (not back on its origin, nor on a rank whose own
    exception merely lost the race to publish)."""
    if failure is None or failure.epoch != _STATE.epoch:
        return False
    if failure.kind:
        return True
    return failure.origin != dist.get_rank() and not _STATE.raised_own


def raise_if_failed(what: str | Callable[[], str]) -> None:
    """Raise the adopted failure, if any, at an engine call (cheap: no store access)."""
    failure = _STATE.failure
    if failure is not None and raisable(failure):
        text = what if isinstance(what, str) else what()
        raise _failure_error(failure, f"about to issue {text}")


@contextlib.contextmanager
def failure_guard() -> Iterator[None]:
    """Publish any exception raised inside (then re-raise it), so peers waiting in a
    collective raise ``PeerFailureError`` within a second instead of hanging.

    Exceptions escaping the root's forward are published without it; wrap the rest of the
    step (loss, backward, data that differs per rank). It costs nothing unless something
    raises, and publishes nothing before the root's first forward or when the consistency
    check is skipped (``SHARDWEAVE_SKIP_CONSISTENCY_CHECK=1``): there is no failure scope.

    Example::

        for batch in loader:
            with failure_guard():
                loss = loss_fn(model(batch), batch["labels"])
                loss.backward()
            optim.step()
            optim.zero_grad()
    """
    try:
        yield
    except BaseException as exc:
        publish_failure(exc, "failure_guard")
        raise


_previous_hook: Callable[[type[BaseException], BaseException, TracebackType | None], object]
_previous_hook = sys.excepthook


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    publish_failure(exc, "uncaught")
    _channel.record_exit(f"exited with an uncaught {exc_type.__name__}: {exc}")
    _previous_hook(exc_type, exc, tb)


def _install_excepthook() -> None:
    global _previous_hook
    if sys.excepthook is not _excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def _at_exit() -> None:
    if _STATE.epoch != 0:  # a process that never trained has nobody waiting for it
        _channel.record_exit("exited (its Python process ended)")


atexit.register(_at_exit)


# --- waiting --------------------------------------------------------------------------------
def _timed_wait(work: dist.Work) -> bool:
    """One ``POLL_INTERVAL`` wait: True when the work finished, False when it timed out.

    A backend whose ``Work.wait`` takes no timeout (the threaded test group, some custom
    backends) is waited without one: no failure channel there, but no crash either.
    """
    try:
        work.wait(timeout=POLL_INTERVAL)
        return True
    except RuntimeError as e:
        text = str(e).lower()
        if "not implemented" in text and "timeout" in text:
            work.wait()
            return True
        if "timed out" not in text:
            raise
    try:
        failed = bool(work.is_completed())
    except Exception:  # not implemented (gloo's reduce-scatter): see _wait_on_thread
        failed = False
    if failed:
        # gloo's own collective timeout (the process group's) also says "timed out", and then
        # the Work is complete: waiting again raises its error for the seam to explain.
        work.wait()
        return True
    return False


class _Waiters:
    """Daemon threads that wait ``Work``s whose ``wait(timeout)`` ignores the timeout.

    gloo's reduce-scatter is one: its timed wait blocks until the collective completes (and
    its ``is_completed()`` and future are not implemented), so a training thread waiting on it
    could not look at the failure channel. Handing the wait to another thread lets the
    training thread keep polling. The threads are kept between waits (starting one costs
    0.1-0.4 ms on a busy 2-core machine, at every reduce-scatter of every step); a new one
    starts only when every kept one is still blocked, so after a failure a thread that stays
    blocked until the backend gives up (its error dropped) never holds up later waits. A
    forked child starts with none: its parent's threads did not survive the fork.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_WaitJob]] = []
        self.started = 0  # threads started in this process (tests read it)

    def submit(self, work: dist.Work) -> tuple[threading.Event, list[BaseException]]:
        job = _WaitJob(work)
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
            if jobs is None:
                self.started += 1
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(
                target=self._run, args=(jobs,), name="shardweave-wait", daemon=True
            ).start()
        jobs.put(job)
        return job.done, job.errors

    def _run(self, jobs: queue.SimpleQueue[_WaitJob]) -> None:
        while True:
            job = jobs.get()
            # Only this thread holds the Work from here: a finished Work keeps its tensors
            # alive, so it goes with this iteration.
            work, job.work = job.work, None
            try:
                if work is not None:
                    work.wait()
            except BaseException as e:  # reported to the waiting thread, if it still waits
                job.errors.append(e)
            finally:
                del work
                # Back in the pool before the waiter hears of it, so that its next wait
                # (the next reduce-scatter, moments later) finds this thread idle.
                with self._lock:
                    self._idle.append(jobs)
                job.done.set()


class _WaitJob:
    __slots__ = ("done", "errors", "work")

    def __init__(self, work: dist.Work) -> None:
        self.work: dist.Work | None = work
        self.done = threading.Event()
        self.errors: list[BaseException] = []


_WAITERS = _Waiters()


def _new_waiters_in_child() -> None:
    global _WAITERS
    _WAITERS = _Waiters()


if hasattr(os, "register_at_fork"):  # POSIX only; nothing forks elsewhere
    os.register_at_fork(after_in_child=_new_waiters_in_child)


def _wait_on_thread(work: dist.Work) -> tuple[threading.Event, list[BaseException]]:
    """Wait for ``work`` on a kept daemon thread (see ``_Waiters``): the event is set when it
    finished, the list holds its error."""
    return _WAITERS.submit(work)


# ``torch.device.type`` builds a new string on every read (about 1 us, as long as the rest of
# a wait's bookkeeping): ``wait`` runs for every collective, so it looks each device up once.
_DEVICE_IS_CPU: dict[torch.device, bool] = {}


def _is_cpu(device: torch.device) -> bool:
    found = _DEVICE_IS_CPU.get(device)
    if found is None:
        found = _DEVICE_IS_CPU[device] = device.type == "cpu"
    return found


def wait(
    work: dist.Work | None,
    what: str | Callable[[], str],
    device: torch.device | None = None,
    *,
    ignores_timeout: bool = False,
) -> None:
    """``work.wait()`` that gives up when a peer has published a failure.

    ``what`` names the collective in the error (a callable defers building the text).
    ``ignores_timeout``: the Work's timed wait blocks anyway (gloo's reduce-scatter); it is
    then waited on a thread of its own while this one polls (``_wait_on_thread``).

    Only on CPU (``device`` None or of type ``cpu``): there the backend runs the collective
    on its own threads and a timed wait merely wakes the host to look at the failure channel.
    On an accelerator the wait has no timeout: NCCL measures a ``Work.wait`` timeout from the
    collective's *issue* and aborts the communicator when it expires, so any collective still
    queued behind slow compute would end the job.
    """
    if work is None:
        return
    if (
        (device is not None and not _is_cpu(device))
        or _STATE.epoch == 0
        or _channel.store() is None
    ):
        work.wait()
        return
    if ignores_timeout:
        done, errors = _wait_on_thread(work)

        def finished() -> bool:
            if done.wait(POLL_INTERVAL.total_seconds()):
                if errors:
                    raise errors[0]
                return True
            return False

    else:

        def finished() -> bool:
            return _timed_wait(work)

    try:
        while not finished():
            failure = poll_failure()
            if raisable(failure):
                assert failure is not None
                text = what if isinstance(what, str) else what()
                raise _failure_error(failure, f"waiting in {text}")
    finally:
        touch()


_VERDICT_TYPES: dict[str, type[Exception]] = {}


def verdict_error(kind: str, message: str) -> Exception:
    """The exception a watchdog verdict of ``kind`` raises."""
    return _VERDICT_TYPES.get(kind, PeerFailureError)(message)


def _failure_error(failure: Failure, what: str) -> Exception:
    """The exception for a published failure: a watchdog verdict keeps its own type."""
    here = f"this rank ({dist.get_rank()}) was {what}"
    if failure.kind:
        return verdict_error(failure.kind, f"{failure.message} [{here}]")
    return PeerFailureError(
        f"{failure.message}; {here}. The process group cannot be reused after a collective "
        "was abandoned: destroy it (torch.distributed.destroy_process_group()) and restart"
    )


# --- collective checks ----------------------------------------------------------------------
def _hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


def _describe(sig: list[int]) -> str:
    step, seq, group, kind, numel, dtype = sig
    name = _STATE.names.get(group, f"<unknown group {group:#x}>")
    kinds = list(CollectiveKind)
    kind_name = kinds[kind].value if 0 <= kind < len(kinds) else f"kind {kind}"
    return (
        f"{kind_name} of group '{name}' (step {step}, collective #{seq}, {numel} elements of "
        f"{_DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else dtype})"
    )


_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
]


def check_collective(
    group: dist.ProcessGroup,
    kind: CollectiveKind,
    name: str,
    numel: int,
    dtype: torch.dtype,
    device: torch.device | None,
    seq: int,
    watch: Callable[[dist.Work], None] | None = None,
) -> None:
    """Refuse (on every rank of ``group``) a collective that peers would not issue identically.

    The signatures travel on ``device`` (the collective's own, so NCCL groups work). The
    signature all-gather is handed to ``watch`` (the seam registers it with the watchdog), so
    a peer that never arrives is judged like one missing from any collective; on CPU the wait
    polls the failure channel (see ``wait``).
    """
    gid = _hash(name)
    _STATE.names[gid] = name
    dtype_code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    sig = [_STATE.step, seq, gid, kind.code, numel, dtype_code]
    mine = _describe(sig)
    world = group.size()
    local = torch.tensor(sig, dtype=torch.int64, device=device)
    gathered = torch.empty(world * _SIG_LEN, dtype=torch.int64, device=device)
    work = all_gather_single(gathered, local, group=group, async_op=True)  # 2.11 lacks dist's
    assert work is not None  # async_op=True always hands back the Work
    if watch is not None:
        watch(work)
    wait(work, f"the collective check before the {mine}", device)
    rows = gathered.view(world, _SIG_LEN).tolist()
    ranks = dist.get_process_group_ranks(group)
    differ = [(r, row) for r, row in zip(ranks, rows, strict=True) if row != sig]
    if differ:
        lines = "\n".join(f"  rank {r}: {_describe(row)}" for r, row in differ)
        raise CollectiveMismatchError(
            f"collective check: rank {dist.get_rank()} is about to issue the {mine}, but\n"
            f"{lines}\nA rank skipped a module, ran a different number of steps or produced "
            "another shape; make every rank run the same modules in the same order (for "
            "modules some ranks skip, call them with empty inputs, and see "
            "set_reduce_scatter_unused_params)"
        )


_VERDICT_TYPES.update(
    {
        "CollectiveMismatchError": CollectiveMismatchError,
        "PeerExitedError": PeerExitedError,
        "PeerIdleError": PeerIdleError,
        "PeerFailureError": PeerFailureError,
    }
)
