"""A pool of spawned gloo workers that runs distributed test bodies (STYLE.md section 7).

One pool per world size lives for the whole pytest session (see ``tests/conftest.py``): spawning
a process and importing torch costs seconds, a collective costs microseconds.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Final

from tests._dist import _worker

__all__ = ["GRACE_PERIOD_S", "WorkerError", "WorkerPool"]

REPO_ROOT: Final[str] = str(Path(__file__).resolve().parents[2])
# After one rank fails, how long the others get to finish before the pool is killed: they are
# usually blocked in a collective the failed rank will never join.
GRACE_PERIOD_S: Final[float] = 5.0
# Spawning, importing torch and joining the process group; not counted in run()'s timeout.
START_TIMEOUT_S: Final[float] = 180.0
_MODULE_HINT: Final[str] = (
    "hint: bodies must be module-level functions in an importable module such as "
    "tests.<pkg>.world_<N>.test_<x>; every directory under tests/ needs an __init__.py"
)


class WorkerError(AssertionError):
    """A body failed or timed out on at least one rank; the message has every rank's report."""


class WorkerPool:
    """``world_size`` spawned processes in one gloo process group, reused across test bodies.

    Each worker joins the default process group through a ``FileStore`` in a private temporary
    directory (no TCP ports), puts the repository root on ``sys.path`` and runs with one torch
    thread. Before every body it calls ``seed_everything(0)`` and syncs the ranks; after it, it
    restores the default dtype, deterministic-algorithms flag, grad mode and the plugin
    registries, and destroys the process groups the body made (``keep_process_group`` keeps
    one a fault test may leave with a collective that never completes). A body failing or
    timing out kills the workers and starts fresh ones (new store file), so the next test
    starts clean.

    Example::

        def _sum(rank: int, world_size: int) -> float:  # module level, so workers can import it
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            return t.item()

        def test_sum(world2: WorkerPool) -> None:
            assert world2.run(_sum) == [1.0, 1.0]
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"WorkerPool: world_size must be >= 1, got {world_size}")
        self.world_size: Final[int] = world_size
        self._tmpdir = tempfile.mkdtemp(prefix=f"shardweave-world{world_size}-")
        self._generation = 0
        # Mutated in place so the finalizer below always sees the live processes.
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._ready = False
        self._closed = False
        # Kills the workers if the pool is dropped or the interpreter exits without close().
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns, self._tmpdir)
        self._start()

    # ----------------------------------------------------------------------------------- public

    def run(self, fn: Callable[..., object], *args: object, timeout: float = 120.0) -> list[object]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

        Args:
            fn: a module-level function (pickled by reference; the workers import its module).
            *args: extra arguments, pickled and sent to every rank.
            timeout: seconds for the whole body on all ranks (startup not included). When it
                runs out the ranks still running are named, with their Python stacks.

        Raises:
            WorkerError: a rank raised (every failing rank's traceback is in the message; the
                others get ``GRACE_PERIOD_S`` to finish), a worker died, or the timeout passed.
                The pool is restarted before this is raised.
            TypeError: ``fn`` or ``args`` cannot be pickled.
        """
        __tracebackhide__ = True  # pytest: the report is the message, not the pool's frames
        if self._closed:
            raise RuntimeError("WorkerPool.run: the pool is closed")
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        try:
            payload = pickle.dumps((fn, args))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise TypeError(
                f"WorkerPool.run: cannot send {name} to the workers: {exc}. {_MODULE_HINT}"
            ) from exc
        self._wait_ready()
        return self._run_payload(name, payload, timeout)

    def close(self) -> None:
        """Stop the workers and remove the temporary directory; the pool cannot be used after."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"generation {self._generation}"
        return f"WorkerPool(world_size={self.world_size}, {state})"

    # ---------------------------------------------------------------------------------- private

    def _start(self) -> None:
        """Spawn a fresh generation of workers; does not wait for them (see ``_wait_ready``)."""
        self._generation += 1
        ctx = get_context("spawn")
        store_path = os.path.join(self._tmpdir, f"store-{self._generation}")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            dump_path = os.path.join(self._tmpdir, f"stacks-{self._generation}-rank{rank}.txt")
            proc = ctx.Process(
                target=_worker.worker_main,
                args=(rank, self.world_size, store_path, dump_path, REPO_ROOT, child_conn),
                name=f"shardweave-world{self.world_size}-rank{rank}",
                # Not a daemon, so bodies may start their own processes (DataLoader workers);
                # the finalizer kills the workers at exit instead.
                daemon=False,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._ready = False

    def _restart(self) -> None:
        _kill(self._procs, self._conns)
        self._start()

    def _wait_ready(self) -> None:
        __tracebackhide__ = True
        if self._ready:
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(self.world_size))
        failures: dict[int, str] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for rank in self._wait(pending, remaining):
                pending.discard(rank)
                try:
                    kind, payload = self._conns[rank].recv()
                except (EOFError, OSError):
                    failures[rank] = self._death_note(rank)
                    continue
                if kind != _worker.READY:
                    failures[rank] = str(payload)
        if failures or pending:
            lines = [f"WorkerPool(world_size={self.world_size}) failed to start:"]
            lines += [f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures)]
            if pending:
                lines.append(f"ranks {sorted(pending)} did not join within {START_TIMEOUT_S} s")
            self._restart()
            raise WorkerError("\n".join(lines))
        self._ready = True

    def _run_payload(self, name: str, payload: bytes, timeout: float) -> list[object]:
        __tracebackhide__ = True
        start = time.monotonic()
        deadline = start + timeout
        pending = set(range(self.world_size))
        results: dict[int, object] = {}
        failures: dict[int, str] = {}
        first_failure: float | None = None
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                failures[rank] = self._death_note(rank)
                pending.discard(rank)
        if failures:
            deadline = min(deadline, time.monotonic() + GRACE_PERIOD_S)
            first_failure = time.monotonic()
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for rank in self._wait(pending, remaining):
                pending.discard(rank)
                try:
                    kind, value = self._conns[rank].recv()
                except (EOFError, OSError):
                    kind, value = _worker.ERROR, self._death_note(rank)
                if kind == _worker.OK:
                    results[rank] = value
                    continue
                failures[rank] = str(value)
                if first_failure is None:
                    first_failure = time.monotonic()
                    deadline = min(deadline, first_failure + GRACE_PERIOD_S)
        if not failures and not pending:
            return [results[r] for r in range(self.world_size)]

        stacks = self._stacks(sorted(pending))
        lines: list[str] = []
        if failures:
            lines.append(f"{name} failed on rank(s) {sorted(failures)} of {self.world_size}")
        else:
            lines.append(
                f"{name} timed out after {timeout:g} s on world size {self.world_size}: "
                f"rank(s) {sorted(pending)} did not finish"
                + (f" (rank(s) {sorted(results)} did)" if results else "")
            )
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} raised ---\n{failures[rank].rstrip()}")
        if failures and pending:
            lines.append(
                f"rank(s) {sorted(pending)} did not finish within {GRACE_PERIOD_S:g} s of the "
                "first failure (probably blocked in a collective the failed rank never joined)"
            )
        for rank in sorted(pending):
            lines.append(f"--- rank {rank} stack when stopped ---\n{stacks[rank].rstrip()}")
        if any(
            "ModuleNotFoundError" in text or "AttributeError: Can't get" in text
            for text in failures.values()
        ):
            lines.append(_MODULE_HINT)
        lines.append(f"The pool was restarted ({time.monotonic() - start:.1f} s after submit).")
        self._restart()
        raise WorkerError("\n".join(lines))

    def _wait(self, ranks: set[int], timeout: float) -> list[int]:
        """The ranks among ``ranks`` with a message (or a closed pipe) waiting, in rank order."""
        ready = wait([self._conns[r] for r in ranks], timeout=timeout)
        return [r for r in sorted(ranks) if self._conns[r] in ready]

    def _death_note(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return f"worker process for rank {rank} died (exit code {proc.exitcode})"

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each still-running worker for its Python stacks (faulthandler on SIGUSR1)."""
        paths = {
            r: os.path.join(self._tmpdir, f"stacks-{self._generation}-rank{r}.txt") for r in ranks
        }
        sizes = {r: _size(p) for r, p in paths.items()}
        for r in ranks:
            pid = self._procs[r].pid
            if pid is not None and self._procs[r].is_alive():
                os.kill(pid, signal.SIGUSR1)
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 2.0
        for r, path in paths.items():
            # faulthandler writes from the signal handler; poll until the file grows and settles.
            last = -1
            while time.monotonic() < deadline:
                size = _size(path)
                if size > sizes[r] and size == last:
                    break
                last = size
                time.sleep(0.05)
            try:
                with open(path, errors="replace") as f:
                    f.seek(sizes[r])
                    text = f.read()
            except OSError:
                text = ""
            stacks[r] = _trim_stack(text) or "(no stack written)"
        return stacks


def _trim_stack(text: str) -> str:
    # faulthandler lists the innermost frame first; the frames below the harness's are noise.
    kept: list[str] = []
    for line in text.splitlines():
        kept.append(line)
        if f"{os.sep}_dist{os.sep}_worker.py" in line:
            break
    return "\n".join(kept)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _kill(procs: list[BaseProcess], conns: list[Connection]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()


def _shutdown(procs: list[BaseProcess], conns: list[Connection], tmpdir: str) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # already dead
            conn.send_bytes(_worker.SHUTDOWN)
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    _kill(procs, conns)
    shutil.rmtree(tmpdir, ignore_errors=True)
