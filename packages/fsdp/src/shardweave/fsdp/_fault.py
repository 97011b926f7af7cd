"""Never hang: a failed rank tells its peers, and collectives that would not match are refused.

Design note: the failure channel
    Collectives cannot carry "I failed": a rank that raised mid-step simply never joins the
    next one, and its peers wait out the process-group timeout (or, on a size mismatch, gloo
    aborts the process). So a rank that raises publishes the error in the c10d store, which
    every rank already shares, and a rank waiting on a collective wakes every
    ``POLL_INTERVAL`` seconds to look there. A collective that finishes in time costs nothing
    extra: the first timed wait simply returns. The key is scoped to the current root lazy
    init (``epoch``), so a failure in one job does not leak into a model built later.

    The watchdog's stall diagnosis (``_watchdog``) publishes its verdict through the same key,
    tagged with the error class (``verdict:<class>:<message>``), so a waiting rank raises
    ``CollectiveMismatchError`` or ``PeerExitedError`` rather than ``PeerFailureError``. This
    timed poll runs on CPU only; on accelerators a ``Work.wait(timeout)`` would abort the
    communicator, and the watchdog aborts the group instead.

Design note: collective checks (opt-in)
    With checks on (``FSDPModule.set_collective_checks`` or ``SHARDWEAVE_CHECK_COLLECTIVES=1``)
    every engine collective is preceded by an all-gather of its signature (step, sequence
    number, group, kind, element count, dtype) over the same process group, so a rank that
    skipped a module, reached another step or computed another shape is named on every rank
    before any mismatched collective can abort or silently mix data. Each rank also writes its
    position to the store, so a rank stuck waiting for a peer that never arrives can say which
    peer is missing and where it was last seen.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType

import torch
import torch.distributed as dist

from shardweave.fsdp._consistency import FSDPConsistencyError
from shardweave.fsdp._fsdp_common import COLLECTIVE_KINDS

__all__ = [
    "CHECK_ENV",
    "CollectiveMismatchError",
    "PeerExitedError",
    "PeerFailureError",
    "PeerIdleError",
    "checks_enabled",
    "failure_guard",
    "publish_failure",
    "set_checks",
    "wait",
]

CHECK_ENV = "SHARDWEAVE_CHECK_COLLECTIVES"
POLL_INTERVAL = datetime.timedelta(seconds=0.5)
_PREFIX = "shardweave/fault"
# Signature layout: step, sequence number, group hash, kind (index in COLLECTIVE_KINDS), numel,
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

    Raised on every rank still in the step when the watchdog's stall diagnosis (see
    ``set_stall_timeout``) finds a rank of the stalled collective's group that no longer
    answers. The message names the rank, and the collective, group and step this rank
    waited in. The process group cannot be used again.

    Example::

        try:
            train_step()
        except PeerExitedError as e:
            print(e)  # "... rank 3 did not answer within 3 s (its process exited ...)"
            dist.destroy_process_group()
            raise SystemExit(1)
    """


class PeerIdleError(PeerFailureError):
    """A peer has issued no collective for the idle timeout while this rank waited for it.

    The peer is alive (it answers the watchdog) but stays outside the engine: it left the
    training loop, or waits on something that never comes. Until the idle timeout (by default
    the process group's own timeout, see ``set_idle_timeout``) such a pause is a warning,
    never an error: a checkpoint write, an evaluation, a slow data loader or a first compile
    on one rank are ordinary. The message names the idle rank and where it last was. The
    process group cannot be used again.

    Example::

        try:
            train_step()
        except PeerIdleError as e:
            print(e)  # "... rank 1 has issued no collective for 1800 s and is past ..."
            dist.destroy_process_group()
            raise SystemExit(1)
    """


class CollectiveMismatchError(FSDPConsistencyError):
    """Ranks issued (or were about to issue) collectives that do not match.

    Raised by the watchdog's stall diagnosis (on by default, see ``set_stall_timeout``) when a
    rank is at another collective or in another step than the one its peers wait in (it
    skipped a module or left the step), and by the opt-in collective checks before a
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


class _FaultState:
    """Process-wide: the current epoch, step and sequence number, and the check settings."""

    def __init__(self) -> None:
        self.epoch = 0  # agreed at each root lazy init; 0 = no root (or no peers) yet
        self.step = 0
        self.seq = 0
        self.checks = os.environ.get(CHECK_ENV) == "1"
        self.stall_timeout = 5.0
        self.names: dict[int, str] = {}  # group hash -> group name, for peers' signatures
        self.lock = threading.Lock()
        self.published = False


_STATE = _FaultState()


def _store() -> dist.distributed_c10d.Store | None:
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _key(*parts: object, epoch: int | None = None) -> str:
    scope = _STATE.epoch if epoch is None else epoch
    return "/".join((_PREFIX, str(scope), *(str(p) for p in parts)))


# --- lifecycle ----------------------------------------------------------------------------------
def new_epoch(nonce: int | None) -> None:
    """A root finished lazy init: start a fresh failure scope named by ``nonce``, which every
    rank of the mesh agreed on (None: no peers, nothing to tell)."""
    _STATE.epoch = 0 if nonce is None else nonce
    _STATE.step = 0
    _STATE.seq = 0
    _STATE.published = False
    _install_excepthook()


def new_step() -> None:
    """The root's forward started a new iteration."""
    _STATE.step += 1
    _STATE.seq = 0


def next_collective() -> tuple[int, int]:
    """The (step, sequence number) of the collective the seam is about to issue."""
    _STATE.seq += 1
    return _STATE.step, _STATE.seq


def set_checks(enabled: bool, stall_timeout: float | None = None) -> None:
    _STATE.checks = enabled
    if stall_timeout is not None:
        if stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be positive seconds, got {stall_timeout!r}")
        _STATE.stall_timeout = stall_timeout


def checks_enabled() -> bool:
    return _STATE.checks


# --- publishing -----------------------------------------------------------------------------
def publish_failure(exc: BaseException, where: str = "") -> None:
    """Tell the peers that this rank failed with ``exc`` (first failure per epoch wins)."""
    if isinstance(exc, (PeerFailureError, KeyboardInterrupt)) or _STATE.epoch == 0:
        return
    store = _store()
    if store is None or _STATE.published:
        return
    rank = dist.get_rank()
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > 2000:
        text = text[:2000] + " ..."
    detail = f"rank {rank} raised {text}" + (f" ({where})" if where else "")
    with contextlib.suppress(Exception):  # never mask the original error
        store.compare_set(_key("failure"), "", detail)
        _STATE.published = True


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


def publish_verdict(kind: str, message: str, epoch: int) -> None:
    """Publish the watchdog's diagnosis (``kind`` names the error class) as ``epoch``'s
    failure, so every rank waiting in the engine raises it (first failure wins). The epoch is
    the diagnosed collective's: a diagnosis that outlives its model must not fail the next."""
    store = _store()
    if store is None or epoch == 0:
        return
    with contextlib.suppress(Exception):
        store.compare_set(_key("failure", epoch=epoch), "", f"{_VERDICT}{kind}:{message}")


def exit_record(rank: int) -> str | None:
    """What ``rank`` wrote when its process ended (None: nothing, e.g. killed)."""
    store = _store()
    key = _key("exit", rank)
    try:
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:
        return None


def _record_exit(reason: str) -> None:
    store = _store()
    if store is None or _STATE.epoch == 0:
        return
    with contextlib.suppress(Exception):
        store.set(_key("exit", dist.get_rank()), reason)


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    publish_failure(exc, "uncaught")
    _record_exit(f"exited with an uncaught {exc_type.__name__}: {exc}")
    _previous_hook(exc_type, exc, tb)


def _install_excepthook() -> None:
    global _previous_hook
    if sys.excepthook is not _excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


atexit.register(lambda: _record_exit("exited (its Python process ended)"))


def _peer_failure() -> str | None:
    store = _store()
    if store is None:
        return None
    key = _key("failure")
    try:
        if not store.check([key]):
            return None
        value = store.get(key).decode()
    except Exception:
        return None
    return value or None


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
    if _completed(work):
        # It finished meanwhile, or failed on its own: gloo's own collective timeout (the
        # process group's) also says "timed out", and then the Work is complete. Waiting
        # again returns at once, or raises the collective's error for the seam to explain.
        work.wait()
        return True
    return False


def _completed(work: dist.Work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # not implemented (gloo's reduce-scatter): handled by _wait_on_thread
        return False


def _wait_on_thread(work: dist.Work) -> tuple[threading.Event, list[BaseException]]:
    """Wait for ``work`` on a daemon thread of its own; for Works whose ``wait(timeout)``
    ignores the timeout.

    gloo's reduce-scatter is one: its timed wait blocks until the collective completes (and
    its ``is_completed()`` and future are not implemented), so a training thread waiting on it
    could not look at the failure channel. Handing the wait to another thread lets the
    training thread keep polling. One thread per wait: after a failure the thread stays
    blocked until the backend gives up (its error is dropped), and must not hold up later
    waits.
    """
    done, errors = threading.Event(), list[BaseException]()

    def run() -> None:
        try:
            work.wait()
        except BaseException as e:  # reported to the waiting thread, if it still waits
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="shardweave-wait", daemon=True).start()
    return done, errors


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
    if (device is not None and device.type != "cpu") or _STATE.epoch == 0 or _store() is None:
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

    while not finished():
        failure = _peer_failure()
        if failure is not None:
            raise _failure_error(failure, what if isinstance(what, str) else what())


_VERDICT = "verdict:"
_VERDICT_TYPES: dict[str, type[Exception]] = {}


def verdict_error(kind: str, message: str) -> Exception:
    """The exception a watchdog verdict of ``kind`` raises."""
    return _VERDICT_TYPES.get(kind, PeerFailureError)(message)


def _failure_error(failure: str, what: str) -> Exception:
    """The exception for a published failure: a watchdog verdict keeps its own type."""
    here = f"this rank ({dist.get_rank()}) was waiting in {what}"
    if failure.startswith(_VERDICT):
        kind, _, message = failure[len(_VERDICT) :].partition(":")
        return verdict_error(kind, f"{message} [{here}]")
    return PeerFailureError(
        f"{failure}; {here}. The process group cannot be reused after a collective was "
        "abandoned: destroy it (torch.distributed.destroy_process_group()) and restart"
    )


# --- collective checks ----------------------------------------------------------------------
def _hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


def _describe(sig: list[int]) -> str:
    step, seq, group, kind, numel, dtype = sig
    name = _STATE.names.get(group, f"<unknown group {group:#x}>")
    kind_name = COLLECTIVE_KINDS[kind] if 0 <= kind < len(COLLECTIVE_KINDS) else f"kind {kind}"
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
    kind: str,
    name: str,
    numel: int,
    dtype: torch.dtype,
    device: torch.device | None,
    seq: int,
) -> None:
    """Refuse (on every rank of ``group``) a collective that peers would not issue identically.

    The signatures travel on ``device`` (the collective's own, so NCCL groups work); off CPU
    they are waited without a timeout (see ``wait``), so a missing peer is found by the stall
    diagnosis there, not by this check.
    """
    gid = _hash(name)
    _STATE.names[gid] = name
    dtype_code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    sig = [_STATE.step, seq, gid, COLLECTIVE_KINDS.index(kind), numel, dtype_code]
    mine = _describe(sig)
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_key("position", dist.get_rank()), mine)
    world = group.size()
    local = torch.tensor(sig, dtype=torch.int64, device=device)
    gathered = torch.empty(world * _SIG_LEN, dtype=torch.int64, device=device)
    work = dist.all_gather_single(gathered, local, group=group, async_op=True)
    if device is not None and device.type != "cpu":
        work.wait()
    else:
        _wait_or_name_missing(work, group, mine)
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


def _wait_or_name_missing(work: dist.Work, group: dist.ProcessGroup, mine: str) -> None:
    start = time.monotonic()
    while not _timed_wait(work):
        failure = _peer_failure()
        if failure is not None:
            raise _failure_error(failure, f"the collective check before the {mine}")
        if time.monotonic() - start < _STATE.stall_timeout:
            continue
        missing = _missing_peers(group, mine)
        if missing:
            raise CollectiveMismatchError(
                f"collective check: rank {dist.get_rank()} waited {_STATE.stall_timeout:.0f} s "
                f"for its peers before the {mine}; "
                + "; ".join(missing)
                + ". A rank left the step early or skipped this group; make every rank run the "
                "same modules (or raise set_collective_checks(stall_timeout=...) for slow steps)"
            )


def _missing_peers(group: dist.ProcessGroup, mine: str) -> list[str]:
    store = _store()
    if store is None:
        return []
    out: list[str] = []
    for rank in dist.get_process_group_ranks(group):
        if rank == dist.get_rank():
            continue
        key = _key("position", rank)
        try:
            seen = store.get(key).decode() if store.check([key]) else None
        except Exception:
            seen = None
        if seen != mine:
            out.append(
                f"rank {rank} did not join (last seen before the "
                f"{seen if seen is not None else 'start of this model'})"
            )
    return out


_VERDICT_TYPES.update(
    {
        "CollectiveMismatchError": CollectiveMismatchError,
        "PeerExitedError": PeerExitedError,
        "PeerIdleError": PeerIdleError,
    }
)
