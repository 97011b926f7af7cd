"""Run one function on ``world`` spawned CPU ranks (gloo over a ``FileStore`` in a temporary
directory) and collect what each rank puts on the queue: for the small single-purpose scripts
(``exposed_comm.py``, ``watchdog_overhead.py``); ``run.py`` has its own process sets."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
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


def shardweave_step(
    rank: int, world: int, store_path: str, workload_name: str, forward_prefetch: bool = False
) -> Callable[[], None]:
    """Join the gloo group, build ``workload_name`` under shardweave's ``fully_shard`` (same
    seed on every rank) and return one training step (loss, backward, the optimizer step,
    zero_grad) on this rank's batch."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    from _workloads import WORKLOADS

    workload = next(w for w in WORKLOADS if w.name == workload_name)
    torch.manual_seed(0)
    model = workload.wrap("shardweave", workload.build())
    if forward_prefetch:
        model.set_implicit_forward_prefetch()  # type: ignore[operator]
    opt = workload.make_optimizer(model.parameters())
    batch = workload.make_batch(rank)

    def step() -> None:
        workload.loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

    return step
