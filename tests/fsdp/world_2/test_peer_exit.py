"""A peer whose process exits (``os._exit``, the OOM killer, a node loss) or freezes between steps.

Runs in its own spawned processes, at world sizes 2 and 4 (the worker pool treats a dead worker
as a failed test, so this file lives beside the world-2 tests but spawns its own). Default
settings but the stall threshold, scaled down to 1 s. Oracle: the error contract. Every
surviving rank raises ``PeerExitedError`` naming the last rank, the collective and the module it
waited in, within the stall threshold + 5 s of the exit, where gloo alone reports "Connection
closed by peer" with an address, or waits out its 30 s timeout.

- ``exits``: the last rank exits right after a step (no exit record: as if killed).
- ``pauses_then_exits``: it pauses first (alive: the others warn that it is idle), then exits:
  the error comes at once, not at the idle timeout.
- ``freezes``: it stops (SIGSTOP) with its connections open, as a lost node on NCCL looks: only
  its heartbeat, standing still, tells; the error comes once it stood still for the threshold.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

STALL_S = 1.0
SLACK_S = 5.0
PAUSE_S = 2.5


def _rank(rank: int, world: int, store_path: str, case: str, results: Any) -> None:
    from shardweave.fsdp import PeerExitedError, set_stall_timeout
    from shardweave.fsdp.faults import _watchdog
    from tests.fsdp._faults import _build, _step
    from tests.fsdp._watchdog_cases import idle_warnings, watchdog_log

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    set_stall_timeout(STALL_S)
    net = _build(dist.device_mesh.DeviceMesh.from_group(dist.group.WORLD, "cpu"))  # type: ignore[arg-type]
    _step(net, rank, 0)
    dist.barrier()
    start = time.monotonic()
    if rank == world - 1:
        if case == "pauses_then_exits":
            time.sleep(PAUSE_S)  # alive and idle: a warning on the others
        if case == "freezes":
            # Its heartbeat stops and its sockets stay open. The watchdog thread is stopped
            # first so that it cannot be frozen inside a store write (holding the file lock).
            _watchdog.WATCHDOG.stop()
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(3)  # no cleanup, no exit record: as if killed
    exited_at = PAUSE_S if case == "pauses_then_exits" else 0.0
    with watchdog_log() as log:
        try:
            _step(net, rank, 1)
            results.put((rank, "no error", 0.0, exited_at, 0))
        except PeerExitedError as e:
            warned = len(idle_warnings(log, world - 1))
            results.put((rank, str(e), time.monotonic() - start, exited_at, warned))
        except BaseException as e:
            results.put((rank, f"{type(e).__name__}: {e}", -1.0, exited_at, 0))


@pytest.mark.parametrize(
    ("world", "case"),
    [(2, "exits"), (4, "exits"), (2, "pauses_then_exits"), (2, "freezes")],
)
def test_peer_process_exit_is_named(world: int, case: str) -> None:
    """Oracle: the error contract (type, rank, module, time) on every surviving rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, world, store, case, results)) for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            outcomes = [results.get(timeout=120) for _ in range(world - 1)]
        finally:
            for p in procs:
                if p.is_alive() and p is procs[-1] and case == "freezes":
                    p.kill()  # stopped: only SIGKILL ends it
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    for rank, message, elapsed, exited_at, warned in outcomes:
        assert elapsed > 0, (rank, message)
        assert f"rank {world - 1}" in message, message
        assert "blocks." in message and "step 2" in message, message
        if case == "freezes":
            assert "stopped answering" in message, message
        assert elapsed - exited_at < STALL_S + SLACK_S, (elapsed, message)
        if case == "pauses_then_exits":
            assert warned >= 1, (rank, message)  # idle first: a warning, not an error
