"""The engine's own host time per step, communication taken out, side by side with torch's FSDP2.

Run::

    python benchmarks/host_time.py [--steps 150] [--warmup 30] [--workloads mlp48,gpt,gpt-narrow]
        [--backend fake|nocomm] [--json bench-results/host_time.json]
        [--profile mlp48 [--profile-steps 100]]

One process, rank 0 of a world of 8 on torch's fake process group (``FakeStore`` and backend
``"fake"`` from ``torch.testing._internal.distributed.fake_pg``): every collective returns at
once and nothing leaves the process, so what is left of a step is the model's own compute plus
the engine's host work (hooks, views, copy-in/copy-out, bookkeeping). The fake group still
copies each all-gather input into every rank's slot of the output (a memcpy of the whole
parameter, the same bytes for both engines); ``--backend nocomm`` takes that out too (a
process group whose collectives touch no tensor). The values the collectives leave behind are
meaningless; only the time is. The fake store has no
``add``/``get``, so shardweave's first-forward consistency check is skipped
(``SHARDWEAVE_SKIP_CONSISTENCY_CHECK=1``) and its watchdog thread never starts (its cost:
``benchmarks/watchdog_overhead.py``); the per-collective bookkeeping still runs.

Engines, each on its own model built from the same seed: ``eager`` (the plain model, no FSDP:
the model's own compute), ``shardweave`` (``shardweave.fsdp.fully_shard``) and ``torch``
(``torch.distributed.fsdp.fully_shard``), both applied per unit as ``benchmarks/run.py``'s
workloads do (``mlp48``: every Linear+ReLU pair, then the root; ``gpt``: every block, then
the root; ``gpt-narrow``: the same at 1/8 of the width, where almost no memory work is left,
only the engines' bookkeeping). A step is forward + backward (``loss.backward()``); gradients
are set to ``None`` between steps outside the timed window, and there is no optimizer step
(its cost depends on the parameter type, not on the engine).

Pairing. The engines take turns step by step, the order rotating every step (E S T, S T E,
T E S, then reversed), so drift and other load on the machine hit all three alike. For each
step index the report takes the engine's time less the eager time of the same round
("overhead"), and gives the median over steps of the totals and of the overheads, plus the
ratios shardweave / torch of both medians. One intra-op thread (``torch.set_num_threads(1)``).

``--profile WORKLOAD`` runs ``cProfile`` over ``--profile-steps`` steps of shardweave's engine
on that workload (after warm-up) and prints the top functions by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import os
import platform
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _report import write_report
from _workloads import GPT_CONFIG, WORKLOADS, Workload  # puts demos/ on sys.path
from model import GPT
from torch import nn

_ROOT = Path(__file__).resolve().parents[1]
for _pkg in ("mesh", "fsdp", "replicate", "extensions"):
    _src = str(_ROOT / "packages" / _pkg / "src")
    if _src not in sys.path:
        sys.path.insert(1, _src)

ENGINES = ("eager", "shardweave", "torch")
WORLD_SIZE = 8
_FSDP = {w.name: w for w in WORKLOADS if w.mode == "fsdp"}
# The GPT's structure (its groups, parameters and hooks) at 1/8 of its width, 1/64 of its
# parameter bytes: what is left of each engine's overhead there is its bookkeeping, with almost
# none of the memory work (copy-out, the reduce-scatter input, allocations and first touches),
# which both engines do alike and which makes up most of the full GPT's overhead.
_NARROW_GPT = dataclasses.replace(
    _FSDP["gpt"],
    name="gpt-narrow",
    description=f"the gpt workload at n_embd {GPT_CONFIG.n_embd // 8}",
    build=lambda: GPT(dataclasses.replace(GPT_CONFIG, n_embd=GPT_CONFIG.n_embd // 8)),
)
FSDP_WORKLOADS = {**_FSDP, _NARROW_GPT.name: _NARROW_GPT}


class _NoCommGroup(dist.ProcessGroup):
    """``--backend nocomm``: every collective the engines issue returns a finished ``Work`` at
    once and touches no tensor (torch's fake group copies each all-gather input into every
    rank's slot of the output: a memory copy of the whole parameter, the same for both
    engines, which this takes out too). A Python process group, as torch's threaded test
    group is; its dispatch costs both engines alike."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._world_size = world_size

    @staticmethod
    def _done(result: Any = None) -> dist.Work:
        from torch._C._distributed_c10d import _create_work_from_future
        from torch.futures import Future

        future: Future[Any] = Future()
        future.set_result(result)
        return _create_work_from_future(future)  # type: ignore[no-any-return]

    def size(self) -> int:
        return self._world_size

    def getBackendName(self) -> str:
        return "nocomm"

    @property
    def group_name(self) -> str:  # DeviceMesh names its groups
        return str(dist.distributed_c10d._world.pg_names[self])

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        return self._done([output])

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        return self._done([output])

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._done(tensors)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        return self._done(outputs)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._done(tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._done()


def _init_fake_pg(backend: str = "fake") -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # The fake store has no add/get: the first forward's consistency check (the one use of the
    # store, besides the watchdog thread it starts) cannot run, so skip it. The watchdog's
    # thread then never starts; its per-collective bookkeeping still runs.
    os.environ["SHARDWEAVE_SKIP_CONSISTENCY_CHECK"] = "1"
    if backend == "nocomm" and "nocomm" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "nocomm", lambda store, rank, size, timeout: _NoCommGroup(rank, size), devices=["cpu"]
        )
    if not dist.is_initialized():
        dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=WORLD_SIZE)


def _build(w: Workload, engine: str) -> nn.Module:
    torch.manual_seed(0)
    model = w.build()
    if engine != "eager":
        w.wrap(engine, model)
    return model


def _make_step(w: Workload, model: nn.Module) -> Callable[[], float]:
    batch = w.make_batch(0)

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        t0 = time.perf_counter()
        w.loss(model, batch).backward()
        return time.perf_counter() - t0

    return step


def _orders(n: int) -> list[tuple[str, ...]]:
    """Rotations of the engines, then the same rotations reversed, repeated to ``n`` rounds."""
    rot = [ENGINES[i:] + ENGINES[:i] for i in range(len(ENGINES))]
    cycle = rot + [tuple(reversed(r)) for r in rot]
    return [cycle[i % len(cycle)] for i in range(n)]


def measure(w: Workload, steps: int, warmup: int) -> dict[str, Any]:
    models = {e: _build(w, e) for e in ENGINES}
    fns = {e: _make_step(w, m) for e, m in models.items()}
    for order in _orders(warmup):
        for e in order:
            fns[e]()
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    gc.collect()
    gc.disable()  # a collection inside one engine's step is noise charged to that engine
    try:
        for i, order in enumerate(_orders(steps)):
            for e in order:
                times[e].append(fns[e]())
            if i % 25 == 24:
                gc.collect()
    finally:
        gc.enable()
    med = {e: statistics.median(ts) for e, ts in times.items()}
    over = {
        e: [t - t_eager for t, t_eager in zip(times[e], times["eager"], strict=True)]
        for e in ("shardweave", "torch")
    }
    med_over = {e: statistics.median(v) for e, v in over.items()}
    ratio_each = [a / b for a, b in zip(over["shardweave"], over["torch"], strict=True) if b > 0]
    return {
        "description": w.description,
        "steps": steps,
        "warmup": warmup,
        "median_ms": {e: round(v * 1e3, 4) for e, v in med.items()},
        "overhead_median_ms": {e: round(v * 1e3, 4) for e, v in med_over.items()},
        "overhead_ratio": round(med_over["shardweave"] / med_over["torch"], 4),
        "overhead_ratio_paired_median": round(statistics.median(ratio_each), 4),
        "total_ratio": round(med["shardweave"] / med["torch"], 4),
    }


def profile(w: Workload, steps: int, warmup: int, top: int) -> None:
    model = _build(w, "shardweave")
    step = _make_step(w, model)
    for _ in range(warmup):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs()
    print(f"\n== cProfile, shardweave on {w.name}: {steps} steps, by cumulative time ==")
    stats.sort_stats("cumulative").print_stats(top)
    print(f"\n== cProfile, shardweave on {w.name}: {steps} steps, by own time ==")
    stats.sort_stats("tottime").print_stats(top)


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"host time per step (forward+backward), {report['meta']['backend']} process group, "
        f"rank 0 of {WORLD_SIZE}, "
        f"load at start {report['meta']['load_average_at_start']}",
        f"{'workload':10} {'eager ms':>9} {'sw ms':>8} {'torch ms':>9} {'sw over':>8} "
        f"{'torch over':>10} {'over sw/t':>9} {'total sw/t':>10}",
    ]
    for name, r in report["workloads"].items():
        m, o = r["median_ms"], r["overhead_median_ms"]
        lines.append(
            f"{name:10} {m['eager']:9.3f} {m['shardweave']:8.3f} {m['torch']:9.3f} "
            f"{o['shardweave']:8.3f} {o['torch']:10.3f} {r['overhead_ratio']:9.3f} "
            f"{r['total_ratio']:10.3f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="timed rounds (default %(default)s)")
    p.add_argument("--warmup", type=int, default=30, help="untimed rounds (default %(default)s)")
    p.add_argument(
        "--workloads",
        default=",".join(FSDP_WORKLOADS),
        help="comma-separated subset of: " + ",".join(FSDP_WORKLOADS),
    )
    p.add_argument(
        "--json",
        type=Path,
        default=Path("bench-results/host_time.json"),
        help="write the report here (default %(default)s; git-ignored)",
    )
    p.add_argument(
        "--backend",
        choices=("fake", "nocomm"),
        default="fake",
        help="fake: torch's fake process group (default); nocomm: a process group whose "
        "collectives touch no tensor (no all-gather copy either)",
    )
    p.add_argument("--profile", metavar="WORKLOAD", help="cProfile shardweave on this workload")
    p.add_argument("--profile-steps", type=int, default=100)
    p.add_argument("--profile-top", type=int, default=40)
    args = p.parse_args(argv)
    args.workloads = [s for s in args.workloads.split(",") if s]
    if unknown := set(args.workloads) - set(FSDP_WORKLOADS):
        p.error(f"--workloads: unknown {sorted(unknown)}")
    if args.profile is not None and args.profile not in FSDP_WORKLOADS:
        p.error(f"--profile: unknown workload {args.profile!r}")
    if min(args.steps, args.warmup) < 1:
        p.error("--steps and --warmup must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    _init_fake_pg(args.backend)
    try:
        if args.profile is not None:
            profile(FSDP_WORKLOADS[args.profile], args.profile_steps, args.warmup, args.profile_top)
            return 0
        load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        t0 = time.perf_counter()
        workloads = {
            name: measure(FSDP_WORKLOADS[name], args.steps, args.warmup) for name in args.workloads
        }
        report = {
            "meta": {
                "backend": args.backend,
                "world_size": WORLD_SIZE,
                "rank": 0,
                "device": "cpu",
                "threads": torch.get_num_threads(),
                "torch_version": torch.__version__,
                "python": platform.python_version(),
                "cpu_count": os.cpu_count(),
                "load_average_at_start": load,
                "wall_s": round(time.perf_counter() - t0, 2),
                "step": "forward + backward, grads set to None outside the window",
                "pairing": "engines take turns each step, order rotating and reversing",
                "overhead": "engine step time less the eager step of the same round",
            },
            "workloads": workloads,
        }
        print(format_report(report))
        if args.json is not None:
            write_report(report, args.json)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
