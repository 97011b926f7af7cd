"""A peer whose process exits (``os._exit``, the OOM killer, a node loss) between steps.

Runs in its own spawned processes, at world sizes 2 and 4 (the worker pool treats a dead worker
as a failed test, so this file lives beside the world-2 tests but spawns its own).
Oracle: the error contract. The surviving rank raises ``PeerExitedError`` naming the last rank, the
collective and the module it waited in, within the stall threshold + 5 s, where gloo alone
reports "Connection closed by peer" with an address, or waits out its 30 s timeout.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

THRESHOLD_S = 2.0


def _rank(rank: int, world: int, store_path: str, results: Any) -> None:
    from shardweave.fsdp import PeerExitedError, set_stall_timeout
    from tests.fsdp._faults import _build, _step

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    set_stall_timeout(THRESHOLD_S)
    net = _build(dist.device_mesh.DeviceMesh.from_group(dist.group.WORLD, "cpu"))  # type: ignore[arg-type]
    _step(net, rank, 0)
    if rank == world - 1:
        os._exit(3)  # no cleanup, no exit record: as if killed
    start = time.monotonic()
    try:
        _step(net, rank, 1)
        results.put(("no error", 0.0))
    except PeerExitedError as e:
        results.put((str(e), time.monotonic() - start))
    except BaseException as e:
        results.put((f"{type(e).__name__}: {e}", -1.0))


@pytest.mark.parametrize("world", [2, 4])
def test_peer_process_exit_is_named(world: int) -> None:
    """Oracle: the error contract (type, rank, module, time) on every surviving rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, results)) for r in range(world)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=90) for _ in range(world - 1)]
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for message, elapsed in outcomes:
        assert elapsed > 0, message
        assert f"rank {world - 1}" in message, message
        assert "blocks." in message and "step 2" in message, message
        assert elapsed < THRESHOLD_S + 5.0, (elapsed, message)
