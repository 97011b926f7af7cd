"""No timed host wait on accelerators: NCCL measures a ``Work.wait(timeout)`` from the
collective's issue and aborts the communicator when it expires, so one would end a job whose
collective merely queued behind slow compute.

Oracles: *closed form*. The package sources contain one timed wait, inside the CPU-only poll;
driven with fake ``Work`` objects, the fault wait, the seam's ``InFlight.wait`` and ``issue``
never pass a timeout for a non-CPU device, while the same calls for CPU do (so the fakes do
reach the timed path).
"""

from __future__ import annotations

import ast
import datetime
import os
import threading
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from tests._dist import WorkerPool

ROOT = Path(__file__).resolve().parents[3]


def _timed_waits() -> list[tuple[str, str]]:
    """(file, innermost enclosing function) of every ``<x>.wait(...)`` given a timeout."""
    found = []
    for path in sorted((ROOT / "packages").glob("*/src/shardweave/**/*.py")):
        tree = ast.parse(path.read_text(), str(path))
        funcs = [
            f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "wait"
                # a class's own wait (the planner's simulated schedule) is no Work
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self")
                # Work.wait(timeout) / wait(timeout=...); the seam's InFlight.wait takes
                # (streams, stream) and is not a host wait on its own
                and (len(node.args) == 1 or any(k.arg == "timeout" for k in node.keywords))
            ):
                continue
            enclosing = [f for f in funcs if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
            innermost = max(enclosing, key=lambda f: f.lineno)
            found.append((path.name, innermost.name))
    return sorted(set(found))


# Every timed ``.wait(...)`` in package code, and why it is allowed. A new one fails the test
# until it is reviewed here: on an accelerator a timed Work.wait aborts the communicator.
ALLOWED_TIMED_WAITS = {
    ("_failures.py", "_timed_wait"): "Work.wait, reached only for CPU devices (see _failures.wait)",
    ("_failures.py", "finished"): "threading.Event.wait: the hand-off for gloo's reduce-scatter",
    ("_watchdog.py", "_run"): "threading.Event.wait: the watchdog thread's poll interval",
}


def test_only_the_cpu_poll_waits_with_a_timeout() -> None:
    """Closed form: the one timed ``Work.wait`` in package code is ``_failures._timed_wait``;
    the other timed waits are host-side events, listed with their reasons."""
    assert _timed_waits() == sorted(ALLOWED_TIMED_WAITS)


class FakeWork:
    """Records the timeout of every ``wait`` (None: untimed)."""

    def __init__(self) -> None:
        self.timeouts: list[datetime.timedelta | None] = []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.timeouts.append(timeout)
        return True


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def record_event(self) -> object:
        return object()

    def wait_event(self, event: object) -> None:
        self.waited.append(event)

    def wait_stream(self, stream: object) -> None:
        self.waited.append(stream)


class FakeDeviceModule:
    """Just enough of a device module for ``CommStreams``."""

    def __init__(self) -> None:
        self._current = FakeStream()

    def Stream(self, priority: int = 0) -> FakeStream:
        return FakeStream()

    def current_stream(self) -> FakeStream:
        return self._current

    def stream(self, stream: Any) -> Any:
        import contextlib

        return contextlib.nullcontext(stream)


def waits_by_device(rank: int, world: int) -> dict[str, list[Any]]:
    from shardweave.fsdp._fsdp_common import CollectiveKind
    from shardweave.fsdp.comm._seam import issue
    from shardweave.fsdp.comm._streams import CommStreams, use_device_module
    from shardweave.fsdp.faults import _failures

    saved = _failures._STATE.epoch
    _failures._STATE.epoch = 1  # a root lazy init happened: the failure channel is live
    try:
        seen: dict[str, list[Any]] = {}
        for device in ("cpu", "cuda"):
            work = FakeWork()
            _failures.wait(work, "a test collective", torch.device(device))
            seen[f"fault.wait {device}"] = work.timeouts
        with use_device_module(FakeDeviceModule()):
            for device, host_wait in (("cpu", False), ("meta", False), ("meta", True)):
                streams = CommStreams(torch.device(device))
                tensor = torch.empty(4, device=device)
                work = FakeWork()
                asked: list[bool] = []

                def launch(async_op: bool, work: FakeWork = work, asked: list[bool] = asked) -> Any:
                    asked.append(async_op)
                    return work

                in_flight = issue(
                    CollectiveKind.ALL_REDUCE,
                    launch,
                    group=dist.group.WORLD,  # type: ignore[arg-type]
                    tensor=tensor,
                    name="test",
                    trace_key="test",
                    streams=streams,
                    stream=streams.all_reduce,
                    what="a test collective",
                    host_wait=host_wait,
                )
                consumer = streams.current()
                in_flight.wait(streams, consumer)
                key = f"issue {device} host_wait={host_wait}"
                seen[key] = [asked, work.timeouts, in_flight.event in consumer.waited]
        return seen
    finally:
        _failures._STATE.epoch = saved


def test_no_timed_wait_off_cpu(world1: WorkerPool) -> None:
    """Closed form: off CPU every wait is untimed (the collective is ordered on its stream at
    issue unless a ``Work`` is asked for); on CPU the same calls poll with a timeout, so the
    fakes reach the timed path. The consumer stream always waits the event."""
    poll = datetime.timedelta(seconds=0.5)
    [seen] = world1.run(waits_by_device)
    assert seen["fault.wait cpu"] == [poll]
    assert seen["fault.wait cuda"] == [None]
    assert seen["issue cpu host_wait=False"] == [[True], [poll], True]
    # Stream-ordered: the Work is waited once, untimed, inside the stream context at issue
    # (what async_op=False does on NCCL); the watchdog polls it, nothing waits on it later.
    assert seen["issue meta host_wait=False"] == [[True], [None], True]
    assert seen["issue meta host_wait=True"] == [[True], [None], True]


class BlockingWork:
    """A Work whose ``wait`` ignores any timeout and blocks until released (gloo's
    reduce-scatter), or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.release = threading.Event()
        self.error = error
        self.waited_on: list[int] = []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waited_on.append(threading.get_ident())
        self.release.wait()
        if self.error is not None:
            raise self.error
        return True


def test_hand_off_waits_keep_their_threads() -> None:
    """Closed form: the hand-off for Works that ignore a wait's timeout keeps its threads
    between waits (one thread for a run of waits, each finished before the next), starts
    another only while every kept one is blocked (a stuck wait never holds up a later one),
    and hands a wait's error to the waiting thread."""
    from shardweave.fsdp.faults import _failures

    waiters = _failures._Waiters()
    for _ in range(5):
        work = BlockingWork()
        work.release.set()
        done, errors = waiters.submit(cast(dist.Work, work))
        assert done.wait(10) and errors == []
    assert waiters.started == 1

    stuck = BlockingWork()
    stuck_done, _ = waiters.submit(cast(dist.Work, stuck))
    failing = BlockingWork(error=RuntimeError("peer closed the connection"))
    failing.release.set()
    done, errors = waiters.submit(cast(dist.Work, failing))
    assert done.wait(10), "a blocked hand-off held up the next one"
    assert [str(e) for e in errors] == ["peer closed the connection"]
    assert waiters.started == 2 and not stuck_done.is_set()
    stuck.release.set()
    assert stuck_done.wait(10)
    assert stuck.waited_on[0] != failing.waited_on[0]


def test_a_forked_child_starts_with_no_waiter_threads() -> None:
    """Closed form: the parent's kept waiter threads did not survive a fork, so a child (a
    data loader worker that trains, say) must not queue its waits to them."""
    from shardweave.fsdp.faults import _failures

    work = BlockingWork()
    work.release.set()
    done, _ = _failures._WAITERS.submit(cast(dist.Work, work))
    assert done.wait(10)
    parent = _failures._WAITERS
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether it got a pool of its own, then leave at once
        os.close(read)
        fresh = _failures._WAITERS is not parent and not _failures._WAITERS._idle
        os.write(write, b"1" if fresh else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"
