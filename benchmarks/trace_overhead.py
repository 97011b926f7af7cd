"""Step time with and without ``shardweave.fsdp.trace()`` on a small many-module model.

Run::

    python benchmarks/trace_overhead.py [--world-size 2] [--layers 32] [--steps 30] [--rounds 5]
        [--chrome out/trace-{rank}.json] [--json out/trace_overhead.json]

Spawns ``--world-size`` CPU processes (gloo over a ``FileStore`` in a temporary directory).
The model is ``--layers`` x ``Linear(64, 64)`` + ReLU, each pair ``fully_shard``-ed, then the
root. Rounds alternate untraced / traced / traced / untraced so drift hits both equally; a
step's time is the slowest rank's, and each configuration reports its median step. It also
times the disabled instrumentation check itself (``_recorder.ACTIVE is not None``) and counts how
many checks one step executes, which bounds the disabled overhead from above.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "fsdp" / "src"))


def _model(layers: int) -> nn.Module:
    from shardweave.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(layers)]
    model = nn.Sequential(*blocks, nn.Linear(64, 1))
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
    return float(elapsed.item())


def _worker(rank: int, world: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from shardweave.fsdp import trace
    from shardweave.fsdp.tracing import _recorder

    model = _model(args.layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        _step(model, x, opt)  # warm-up, lazy init
    times: dict[str, list[float]] = {"off": [], "on": []}
    last = None
    for mode in ["off", "on", "on", "off"] * args.rounds:
        if mode == "off":
            times[mode].extend(_step(model, x, opt) for _ in range(args.steps))
        else:
            with trace() as tracer:
                for _ in range(args.steps):
                    times[mode].append(_step(model, x, opt))
                    tracer.step()
            last = tracer
    assert last is not None
    # The disabled check, and how many a step executes (the engine's instrumentation points).
    check_ns = (
        min(
            timeit.repeat(
                "_recorder.ACTIVE is not None", globals={"_recorder": _recorder}, number=10**6
            )
        )
        * 1e9
        / 10**6
    )
    records = sum(len(getattr(last, a)) for a in ("collectives", "spans", "memory"))
    if rank == 0:
        if args.chrome:
            last.export_chrome_trace(args.chrome)
        print(last.summary_table(step=0))
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        result = {
            "world_size": world,
            "layers": args.layers,
            "steps_per_config": len(times["off"]),
            "median_step_ms_untraced": off * 1e3,
            "median_step_ms_traced": on * 1e3,
            "traced_overhead_pct": (on / off - 1) * 100,
            "records_per_step": records / last.num_steps,
            "disabled_check_ns": check_ns,
        }
        out.put(result)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chrome", default="")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _worker,
            args=(args.world_size, store, args, queue),
            nprocs=args.world_size,
            start_method="spawn",
        )
    result = queue.get()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
