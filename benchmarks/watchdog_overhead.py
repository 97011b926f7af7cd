"""Step time with the watchdog on (the default) and off, on the same ranks, in alternating rounds.

Run::

    python benchmarks/watchdog_overhead.py [--workload gpt] [--world-size 2] [--steps 20]
        [--rounds 6] [--json out/watchdog_overhead.json]

Trains one workload of ``run.py`` (default ``gpt``) with shardweave's ``fully_shard`` in
``--world-size`` spawned CPU processes. Rounds alternate on / off / off / on (so drift hits both
equally); "off" is ``set_stall_timeout(None)`` (the watchdog thread stopped), "on" the default
(thread running, every collective registered and polled for completion each 0.5 s, a heartbeat
written and the failure record read each second). A step's time is the slowest rank's; the
report is the ratio of the median step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _spawn import run_ranks, shardweave_step


def _worker(rank: int, world: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    train_step = shardweave_step(rank, world, store_path, args.workload)
    from shardweave.fsdp import set_stall_timeout
    from shardweave.fsdp.faults import _watchdog

    def step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        train_step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    for _ in range(3):
        step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        mode = "on" if r % 4 in (0, 3) else "off"
        set_stall_timeout(_watchdog.DEFAULT_STALL_S if mode == "on" else None)
        assert _watchdog.WATCHDOG.running() == (mode == "on")
        times[mode] += [step() for _ in range(args.steps)]
    out.put((rank, times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    times = run_ranks(_worker, args.world_size, args)[0]  # already the slowest rank's
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    result = {"median_ms_on": on * 1e3, "median_ms_off": off * 1e3, "ratio_on_over_off": on / off}
    print(
        f"{args.workload}, world {args.world_size}: watchdog on {on * 1e3:.2f} ms, off "
        f"{off * 1e3:.2f} ms, ratio {on / off:.3f} ({len(times['on'])} steps each)"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
