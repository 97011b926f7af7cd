"""``mutants``: the tests' own stream-order mutations (every wait and keep-alive), each of
which must be caught: on CUDA by a number that differs under its producer's delay, on CPU by
the tests' stream sanitizer at two gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ._common import KIT_DIR, ROOT, subprocess_env
from .delayed import compare_ranks, run_plans
from .plugin import SLEEP_CYCLES

# Each mutant's late producer: the one place that sleeps while the waiter runs on at once. A
# sleep anywhere else can hide the race (a sleep before the copy-in delays the all-gather as
# much as one before the optimizer delays the shards it reads; a late all-gather holds back
# the compute stream that would reuse a reduce-scatter's input), so each mutant runs with its
# producer's delay only. tests/tools/test_gpu_kit.py checks that every mutation of the tests
# has one.
MUTANT_DELAYS: dict[str, frozenset[str]] = {
    # the all-gather writes late (and poisoned first); the copy-out runs at once
    "compute-waits-for-all-gather": frozenset({"all_gather"}),
    # the gradients are laid out late (into a poisoned buffer); the reduce-scatter reads at once
    "reduce-scatter-waits-for-compute": frozenset({"before_reduce_scatter_copy_in"}),
    # the optimizer updates the shards late; the next all-gather reads them at once
    "all-gather-waits-for-optimizer": frozenset({"before_optimizer"}),
    # the cast into the all-gather output's slot is late (the slot poisoned first)
    "all-gather-waits-for-copy-in": frozenset({"before_copy_in"}),
    # the casts into the gradients are late (the current stream waited for the reduce-scatter
    # itself, to release its input); the optimizer reads the gradients at once
    "optimizer-waits-for-post-reduce": frozenset({"before_divide"}),
    # a late reduce-scatter still reads its input when the next layout reuses the block
    "keep-reduce-scatter-input": frozenset({"reduce_scatter"}),
    # a late one-rank "reduce-scatter" (a copy, no collective) still reads the bucket input
    "keep-bucket-input": frozenset({"before_divide"}),
    # a late all-reduce still uses its buffer when the next reduce-scatter reuses it
    "keep-all-reduce-buffer": frozenset({"all_reduce"}),
    # a late copy-out still reads the gathered buffer when the next all-gather reuses it
    "keep-all-gather-output": frozenset({"before_copy_out"}),
}
# About 50 ms on an H200 (1.98 GHz): longer than the host needs to issue the next use of a
# buffer from two rank threads (an optimizer step over DTensors alone took more than the
# 10 ms tried first, so the optimizer's late writes were done before the next all-gather
# was issued).
MUTANT_SLEEP_CYCLES = 50 * SLEEP_CYCLES
# A keep-alive mutant is caught only if the block is handed out again while its late user is
# still at it, which the host's timing decides: each mutant runs this many times (each run's
# buffers at other addresses), and one run that differs catches it.
MUTANT_TRIALS = 2


def mutations() -> dict[str, tuple[dict[str, Any], str, tuple[str, ...]]]:
    """The tests' own mutation list (every stream wait and every keep-alive of the engine's
    stream-ordering design note), imported from the checkout's tests/."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.fsdp._stream_order import KEEP_ALIVE_MUTATIONS, WAIT_MUTATIONS

    return {**WAIT_MUTATIONS, **KEEP_ALIVE_MUTATIONS}


def _cfg_for_kit(cfg: dict[str, Any]) -> dict[str, Any]:
    """A test scenario as the kit's model runs it (the bucket cap is applied apart)."""
    return {k: v for k, v in cfg.items() if k != "bucket_bytes"}


def section_mutants(device_type: str, world: int = 2) -> dict[str, Any]:
    """Every mutant must be caught. On CUDA: threads as ranks, the mutant's waits removed with
    every delay on, against the synchronized run of the same scenario (an unmutated delayed
    run is the control, which must agree); caught = a number differs. On CPU: the tests' own
    check, each mutant at two gloo ranks on the test accelerator under the stream sanitizer;
    caught = the report names the race or unsafe reuse (``KIT_MUTANTS`` narrows the list)."""
    muts = mutations()
    only = [m for m in os.environ.get("KIT_MUTANTS", "").split(",") if m]
    names = [m for m in muts if not only or m in only]
    if device_type != "cuda":
        results: dict[str, Any] = {name: _mutant_sanitized(name, world) for name in names}
        results["ok"] = all(results[n]["caught"] for n in names) and bool(names)
        return results
    return mutants_threaded(device_type, world, names)


def mutants_threaded(
    device_type: str, world: int, names: list[str], trials: int = MUTANT_TRIALS
) -> dict[str, Any]:
    """The device check of ``section_mutants``: each mutant with its producer's delay only
    (``MUTANT_DELAYS``), poisoned, beside a control run the same way without the mutation,
    ``trials`` times; caught = every control agrees with the synchronized run and a mutant run
    does not (on CPU it runs, but catches nothing: the CPU streams run in program order)."""
    muts = mutations()
    plans: list[dict[str, Any]] = []
    for name in names:
        cfg, drop, _ = muts[name]
        base = {"case": _cfg_for_kit(cfg), "bucket_bytes": cfg.get("bucket_bytes")}
        plans.append({**base, "label": f"{name}/synchronized", "synchronize": True})
        delayed = {**base, "delays": MUTANT_DELAYS[name], "cycles": MUTANT_SLEEP_CYCLES}
        for trial in range(trials):
            plans.append({**delayed, "label": f"{name}/control/{trial}"})
            plans.append({**delayed, "label": f"{name}/mutant/{trial}", "drop": (drop,)})
    runs, seen = run_plans(device_type, world, plans)
    results: dict[str, Any] = {}
    for name in names:
        ref = runs[f"{name}/synchronized"]
        result: dict[str, Any] = {"delays": sorted(MUTANT_DELAYS[name])}
        for kind in ("control", "mutant"):
            result[f"{kind}_bitwise"] = [
                compare_ranks(runs[f"{name}/{kind}/{t}"], ref, world)["bitwise"]
                for t in range(trials)
            ]
        result["waits_dropped"] = seen["dropped"].count(muts[name][1])
        # A mutant whose waits were never asked for (0 dropped) tested nothing.
        result["caught"] = (
            all(result["control_bitwise"])
            and not all(result["mutant_bitwise"])
            and result["waits_dropped"] > 0
        )
        results[name] = result
    results["delay_points"] = seen["delay_points"]
    results["sleep_cycles"] = MUTANT_SLEEP_CYCLES if device_type == "cuda" else 0
    results["ok"] = all(results[n]["caught"] for n in names) and bool(names)
    return results


def _mutant_sanitized(name: str, world: int, timeout: float = 300.0) -> dict[str, Any]:
    """One mutant through the tests' ``mutated`` body at ``world`` gloo ranks (processes)."""
    _, _, must_name = mutations()[name]
    with tempfile.TemporaryDirectory() as tmp:
        env = subprocess_env(str(ROOT))  # the ranks import the tests' mutated body
        procs = [
            subprocess.Popen(_rank_command(name, rank, world, Path(tmp)), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(world)
        ]  # fmt: skip
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0] + f"\n(timed out after {timeout:.0f} s)")
        reports = []
        for rank, proc in enumerate(procs):
            out = Path(tmp) / f"rank{rank}.json"
            if proc.returncode != 0 or not out.exists():
                return {"caught": False, "error": f"rank {rank} exit {proc.returncode}",
                        "output_tail": outputs[rank][-3000:]}  # fmt: skip
            reports.append(json.loads(out.read_text()))
    caught = all(
        r["dropped"] and any(all(n in race for n in must_name) for race in r["races"])
        for r in reports
    )
    return {"caught": caught, "dropped": [len(r["dropped"]) for r in reports],
            "races": [r["races"][:3] for r in reports]}  # fmt: skip


def _rank_command(name: str, rank: int, world: int, tmp: Path) -> list[str]:
    """The kit's command line that runs ``mutant_rank`` in a process of its own (rendezvous
    through a file store in ``tmp``, the rank's report written there)."""
    return [sys.executable, str(KIT_DIR), "--_mutant", name, "--_rank", str(rank),
            "--_world", str(world), "--_store", str(tmp / "store"),
            "--out", str(tmp / f"rank{rank}.json")]  # fmt: skip


def mutant_rank(name: str, rank: int, world: int, store: str, out: str) -> None:
    """One rank of ``_mutant_sanitized`` (a process of its own)."""
    import torch.distributed as dist

    cfg, drop, _ = mutations()[name]
    from tests.fsdp._stream_order import mutated

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        result = mutated(rank, world, cfg, drop, accelerator=True)
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(result, default=str))
