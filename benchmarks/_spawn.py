"""Run one function on ``world`` spawned CPU ranks (gloo over a ``FileStore`` in a temporary
directory) and collect what each rank puts on the queue: for the small single-purpose scripts
(``exposed_comm.py``, ``watchdog_overhead.py``); ``run.py`` has its own process sets."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(
    worker: Callable[..., None], world: int, *args: Any, timeout: float = 900
) -> dict[int, Any]:
    """``worker(rank, world, store_path, *args, out)`` on every rank; returns rank -> result
    (each rank calls ``out.put((rank, result))`` once)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=worker, args=(r, world, store_path, *args, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join()
    return results
