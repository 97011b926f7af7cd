"""Exposed communication per step: how long the host waits for collectives, by kind.

Run::

    python benchmarks/exposed_comm.py [--workload gpt] [--world-size 2] [--steps 30]
        [--rounds 3] [--implicit-forward-prefetch] [--json out/exposed.json]

Trains one workload of ``run.py`` (default ``gpt``) with shardweave's ``fully_shard`` in
``--world-size`` spawned CPU processes (gloo over a ``FileStore``), traced by
``shardweave.fsdp.trace()``. For every traced step it sums, per collective kind, the
tracer's *exposed* time (from the moment the host began waiting for a collective until the
wait returned; see Design note: traced quantities in ``shardweave.fsdp.tracing._recorder``), takes the
slowest rank, and reports the median over steps. The sources on ``PYTHONPATH`` decide which
engine is measured, so the same script compares two commits::

    PYTHONPATH=<old checkout>/packages/fsdp/src:<old checkout>/packages/mesh/src \\
        python benchmarks/exposed_comm.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _spawn import run_ranks, shardweave_step


def _worker(rank: int, world: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    step = shardweave_step(rank, world, store_path, args.workload, args.implicit_forward_prefetch)
    from shardweave.fsdp import trace

    for _ in range(args.warmup):
        step()
    rows: list[dict[str, float]] = []
    for _ in range(args.rounds):
        dist.barrier()
        with trace() as tracer:
            for i in range(args.steps):
                if i:
                    tracer.step()
                step()
        summary = tracer.summary()
        for s, record in zip(summary["steps"], tracer.steps, strict=True):
            kinds = list(summary["collectives"])  # the tracer's collective kinds
            row = {k: 0.0 for k in kinds}
            for group in s["groups"].values():
                for kind in kinds:
                    row[kind] += group[kind]["exposed_ms"]
            row["step_ms"] = (record.end_ns - record.begin_ns) / 1e6
            rows.append(row)
    out.put((rank, rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="traced steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--implicit-forward-prefetch",
        action="store_true",
        help="FSDPModule.set_implicit_forward_prefetch() on the root (and every child)",
    )
    args = parser.parse_args()
    per_rank = run_ranks(_worker, args.world_size, args)
    steps = len(per_rank[0])
    kinds = [k for k in per_rank[0][0] if k != "step_ms"]
    slowest = [
        {k: max(per_rank[r][i][k] for r in per_rank) for k in (*kinds, "step_ms")}
        for i in range(steps)
    ]
    result = {k: statistics.median(row[k] for row in slowest) for k in (*kinds, "step_ms")}
    result["exposed_ms"] = sum(result[k] for k in kinds)
    result["steps"] = steps
    print(f"{args.workload}, world {args.world_size}, {steps} traced steps, median ms per step:")
    for k, v in result.items():
        print(f"  {k:>15}: {v:.3f}" if isinstance(v, float) else f"  {k:>15}: {v}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
