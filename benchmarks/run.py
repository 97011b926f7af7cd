"""Benchmark shardweave's ``fully_shard`` and ``replicate`` against torch's on the same models.

Run::

    python benchmarks/run.py [--world-size 2] [--steps N] [--json bench-results/fsdp.json]

Workloads (each builds one model per implementation from the same seed, trained on the same
per-rank batches with the same optimizer):

* ``mlp48``: 48 x (Linear(64, 64) + ReLU), each pair ``fully_shard``-ed, then the root; SGD
  (issue #8's "many small modules"; it replaced the earlier 16-module ``mlp16``).
* ``gpt``: the demo's GPT (``demos/model.py``), each block ``fully_shard``-ed, then the root; AdamW.
* ``replicate``: the same GPT and AdamW under data parallelism, three ways: ``shardweave``
  (``shardweave.replicate.replicate`` per block, then the root), ``torch-replicate`` (torch's
  FSDP-engine ``replicate_with_fsdp.replicate``, the same way) and ``ddp``
  (``DistributedDataParallel`` on the plain model). The minimum traffic is one all-reduce of
  every gradient byte per step.

Process layout. Every implementation of a workload runs in its own set of ``--world-size``
spawned CPU processes with its own gloo process group (its own ``FileStore`` in a temporary
directory, so no port is ever bound and no implementation can disturb another's collectives).
The parent drives the sets in turns over pipes: round 1 runs A, B, C; round 2 runs C, B, A;
and so on, each turn being ``--steps-per-turn`` timed steps. Only one set computes at a time;
the others sit blocked in a pipe read (one intra-op thread per rank, so no OpenMP spin-wait),
so the implementations never share the CPU cores, and alternating the order cancels slow drift
(thermal, other load on the machine) to first order. A step's time is the slowest rank's, with
a barrier before each step. Every pipe read has a timeout (``--timeout``): an implementation
that raises, dies or hangs is reported with its error, its processes are killed, and the
others still produce numbers.

Optimizer time. Each timed step also records the slowest rank's ``opt.step()`` + ``zero_grad``
("opt ms"); the report gives the median step-time ratio with and without it. The optimizer runs
no collective, and its cost depends on the parameters' type rather than on the engine: on CPU,
torch's AdamW takes its per-tensor path for every parameter, and each operation on a DTensor
parameter (``replicate``'s, like torch's ``replicate``'s) goes through DTensor dispatch, several
times the cost of the same operation on the plain tensors DDP trains.

``--foreach`` passes ``foreach=True`` (or, as ``--no-foreach``, ``False``) to every
implementation's optimizer: on accelerators torch's optimizers default to their ``foreach``
path, DTensor parameters included, so this is the closer model of a GPU run's optimizer.

``--implicit-forward-prefetch`` turns on shardweave's ``set_implicit_forward_prefetch()`` in
the ``fully_shard`` workloads (off by default, as torch's FSDP2 has no such prefetch).

Collectives. One extra step per implementation runs under a dispatch mode that records every
c10d collective, so the report gives collectives and bytes per step by kind, next to the
theoretical minimum for the sharding layout.

Peak live tensor bytes. Each rank runs ``torch.profiler.profile(profile_memory=True)`` from
before the model is built until after one measured training step (forward, backward, optimizer
step, ``zero_grad``) that follows the warm-up steps, so optimizer state exists. With memory
profiling on, c10's CPU allocator reports every allocation and free on the threads the
profiler instruments (the training thread, and gloo's worker threads, which carry its state)
as an allocation event carrying a signed size and the allocator's running total of the bytes
it tracks, updated under its lock (so exact whatever the order of equal timestamps). That
total, less its value when the profiler started, is the bytes live in tensor storages
allocated since then: the model, its sharded/unsharded parameters, gradients, optimizer state,
activations, the engines' collective buffers, and anything an engine keeps in C++ (DDP's
gradient buckets) that a Python-side walk would miss. Left out, for every implementation
alike: what the process group allocates inside a collective call (gloo's reduce-scatter clones
its input to all-reduce it; its all-gather stages the input on its worker thread, under
``gloo:all_gather``, at a moment only that thread's schedule decides, which moved either
engine's peak by one block's all-gather input from run to run until 2026-11-27), which is
freed by whichever thread finishes the collective, and
a free on a thread the profiler does not instrument (shardweave waits for gloo's
reduce-scatter on a thread of its own) would leave it counted for the rest of the run (see
``_memory._engine_totals``); and tensors made before the profiler started. CPU has no
allocator cache, so freed bytes never count. The peak is the largest total inside the
measured step's ``record_function`` window, and the report takes the max over ranks.
``live_before`` is the total when the step starts (steady-state memory) and ``state_bytes``
the part of it that is parameters, gradients, optimizer state and buffers (distinct
storages), so ``live_before - state_bytes`` is what an engine keeps besides them.
Validation: every rank first measures a small step with a real all-reduce twice, once also
holding a 1 MiB tensor through the window; the two peaks must differ by exactly 1 MiB (the
report's ``memory_self_check``), else the peak figures are marked unvalidated.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _engines import IMPLS, import_error
from _report import format_report, write_report
from _sets import run_sets
from _workloads import WORKLOADS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per implementation (default: "
        + ", ".join(f"{w.name} {w.default_steps}" for w in WORKLOADS)
        + ")",
    )
    p.add_argument(
        "--steps-per-turn",
        type=int,
        default=1,
        help="timed steps a set runs before handing over to the next (default %(default)s)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation")
    p.add_argument(
        "--foreach",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pass foreach=True/False to every implementation's optimizer (default: the "
        "optimizer's own choice, which on CPU is its per-tensor path)",
    )
    p.add_argument(
        "--implicit-forward-prefetch",
        action="store_true",
        help="shardweave's fully_shard workloads call set_implicit_forward_prefetch() on the "
        "root (not in torch's FSDP2; default off there and here)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a set's reply before declaring it hung (default %(default)s)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=Path("bench-results/fsdp.json"),
        help="write the full report here (default %(default)s; git-ignored)",
    )
    p.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help="comma-separated subset of: " + ",".join(IMPLS) + " (default all; shardweave is "
        "fully_shard in the FSDP workloads and replicate in the replicate one)",
    )
    p.add_argument(
        "--workloads",
        default=",".join(w.name for w in WORKLOADS),
        help="comma-separated subset of: " + ",".join(w.name for w in WORKLOADS),
    )
    args = p.parse_args(argv)
    args.impls = [s for s in args.impls.split(",") if s]
    args.workloads = [s for s in args.workloads.split(",") if s]
    if unknown := set(args.impls) - set(IMPLS):
        p.error(f"--impls: unknown {sorted(unknown)}; choose from {list(IMPLS)}")
    if unknown := set(args.workloads) - {w.name for w in WORKLOADS}:
        p.error(f"--workloads: unknown {sorted(unknown)}")
    if min(args.steps or 1, args.steps_per_turn, args.warmup, args.world_size) < 1:
        p.error("--steps, --steps-per-turn, --warmup and --world-size must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Engines the selected workloads and implementations need, in first-use order.
    engines = list(
        dict.fromkeys(
            engine
            for w in WORKLOADS
            if w.name in args.workloads
            for impl, engine in w.impls.items()
            if impl in args.impls
        )
    )
    impl_info: dict[str, dict[str, Any]] = {
        engine: {"error": import_error(engine)} for engine in engines
    }
    for engine, info in impl_info.items():
        if info["error"] is not None:
            print(f"benchmark: {engine} unavailable: {info['error']}", file=sys.stderr)
    if all(info["error"] is not None for info in impl_info.values()):
        print("benchmark: no implementation to run", file=sys.stderr)
        return 1

    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    workloads: dict[str, Any] = {}
    for w in WORKLOADS:
        if w.name in args.workloads:
            impls = [
                impl
                for impl, engine in w.impls.items()
                if impl in args.impls and impl_info[engine]["error"] is None
            ]
            workloads[w.name] = run_sets(w, impls, args)

    checks = [
        r["memory"]["self_check_ok"]
        for w in workloads.values()
        for r in w["results"].values()
        if r["memory"]
    ]
    report = {
        "meta": {
            "world_size": args.world_size,
            "warmup_steps": args.warmup,
            "steps_per_turn": args.steps_per_turn,
            "backend": "gloo",
            "device": "cpu",
            "torch_version": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "wall_s": round(time.perf_counter() - t0, 2),
            "step_time": "slowest rank, barrier before each step; one process set per "
            "implementation, driven in turns, order alternating A B C / C B A",
            "opt_ms": "slowest rank's opt.step() + zero_grad within each timed step",
            "optimizer_foreach": args.foreach,
            "shardweave_implicit_forward_prefetch": args.implicit_forward_prefetch,
            "bytes": "all-gather: gathered output; reduce-scatter: unreduced input; "
            "all-reduce: tensor size",
            "peak_bytes": "max over ranks of the peak bytes in live CPU tensor storages during "
            "one training step after warm-up (torch.profiler allocation events)",
            "memory_self_check": (
                "ok (exactly +1 MiB on every rank of every set)"
                if checks and all(checks)
                else "FAILED: peak figures unvalidated"
                if checks
                else "not run"
            ),
        },
        "impls": impl_info,
        "workloads": workloads,
    }
    print(format_report(report))
    if args.json is not None:
        write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
