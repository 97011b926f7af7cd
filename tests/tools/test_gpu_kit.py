"""The GPU kit (``tools/gpu_kit``, ``nox -s gpu``) on a machine without CUDA: the one-line
dry paths (no CUDA, no torch), the sections that need no CUDA run on CPU, which checks the
kit's own logic (its comparisons, its threaded ranks, its ``DelayedCollectives`` plugin, its
consumer-side delays, its bench rounds, its mutants) before a GPU ever runs it, and the kit's
pure functions (sync counting, removed waits, the bench verdict) on planted inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.tools._load import REPO, load_tool_module

KIT = REPO / "tools" / "gpu_kit"  # a package run as a folder: python tools/gpu_kit
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry path is CPU-only")


def _kit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(KIT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )


def _kit_module(name: str) -> ModuleType:
    """One module of the kit (``tools/gpu_kit/<name>.py``): bench, driver, sync, ..."""
    return load_tool_module("gpu_kit", name)


@needs_no_cuda
def test_without_cuda_one_line_and_exit_0(tmp_path: Path) -> None:
    proc = _kit("--out", str(tmp_path / "report.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stdout
    assert not (tmp_path / "report.json").exists()


def test_without_torch_one_line_and_exit_0(tmp_path: Path) -> None:
    """``nox -s gpu`` runs the machine's own python, which may have no torch. ``-I -S``: no
    site-packages and no PYTHONPATH, so this interpreter cannot import torch."""
    no_torch = subprocess.run([sys.executable, "-I", "-S", "-c", "import torch"], cwd=tmp_path)
    assert no_torch.returncode != 0, "torch importable without site-packages: the test is moot"
    proc = subprocess.run(
        [sys.executable, "-I", "-S", str(KIT), "--out", str(tmp_path / "report.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "no torch in this python" in lines[0], proc.stdout + proc.stderr
    assert proc.stderr == "" and not (tmp_path / "report.json").exists()


def test_cpu_sections_pass_and_cuda_ones_are_skipped(tmp_path: Path) -> None:
    """plugin: closed forms at 4 threaded ranks; parity: bitwise vs torch's fully_shard at
    world 1 (gloo); delayed: 4 threaded ranks through the plugin, with every consumer-side
    delay point reached, each case bitwise equal to the synchronized run. sync/csan need CUDA
    and say so."""
    out = tmp_path / "report.json"
    proc = _kit("--device", "cpu", "--out", str(out), "--sections", "plugin,parity,delayed,sync")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sections = json.loads(out.read_text())["sections"]
    assert sections["plugin"]["passed"] and sections["plugin"]["calls"] == 16, sections["plugin"]
    parity = sections["parity"]
    assert parity["passed"], parity
    for case in ("fsdp", "cpu_batch", "bf16", "offload_hooks", "replicate", "hsdp_1x1"):
        assert parity[case]["bitwise"] and len(parity[case]["losses"]["oracle"]) == 3, case
    # 3 blocks x (norm, up, down) x (weight, bias) + out's weight and bias
    assert parity["offload_hooks"]["state_dict_entries"] == 20, parity["offload_hooks"]
    delayed = sections["delayed"]
    assert delayed["passed"] and delayed["collectives_issued"] > 100, delayed
    cases = ("fsdp", "bf16", "hsdp_2x2", "hsdp_2x2_bf16_reduce", "replicate")
    for case in (*cases, "replicate_bf16_reduce", "offload", "offload_hooks"):
        assert delayed[case]["bitwise"] and len(delayed[case]["ranks"]) == 4, case
    points = delayed["delay_points"]
    assert set(points) == {
        "before_copy_out",
        "before_copy_in",
        "before_reduce_scatter_copy_in",
        "before_divide",
        "before_optimizer",
    }, points
    assert all(n > 0 for n in points.values()), points
    assert sections["sync"] == {"skipped": "needs CUDA"}


def test_bench_rounds_start_from_the_same_baseline(tmp_path: Path) -> None:
    """bench on CPU at a tiny size: four rounds, each in a fresh process, each starting from
    the same live tensor bytes, with allocated/peak per phase for both engines."""
    out = tmp_path / "report.json"
    proc = _kit("--device", "cpu", "--out", str(out), "--sections", "bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bench = json.loads(out.read_text())["sections"]["bench"]
    assert bench["passed"] and bench["same_baseline"], bench
    rounds = bench["rounds"]
    assert [r["engine"] for r in rounds] == ["torch", "shardweave", "torch", "shardweave"]
    for r in rounds:
        assert set(r["phases"]) == {"forward", "backward", "optimizer", "zero_grad"}, r
        assert all(p["peak"] >= p["allocated"] > 0 for p in r["phases"].values()), r
    assert bench["peak_memory_ratio"] > 0 and bench["step_time_ratio"] > 0


def test_bench_fails_when_a_round_starts_from_leftovers() -> None:
    """What the old in-process bench did: each round on top of the previous rounds' memory."""
    bench, driver = _kit_module("bench"), _kit_module("driver")

    def round_(engine: str, baseline: int) -> dict[str, Any]:
        phases = {
            p: {"allocated": baseline + 10, "peak": baseline + 20} for p in bench.BENCH_PHASES
        }
        return {"engine": engine, "baseline_bytes": baseline, "phases": phases, "step_ms": 1.0}

    engines = bench.BENCH_ROUNDS
    same = bench.bench_verdict([round_(e, 100) for e in engines])
    assert same["ok"] and same["peak_memory_ratio"] == 1.0, same
    growing = bench.bench_verdict([round_(e, 100 * (i + 1)) for i, e in enumerate(engines)])
    assert not growing["ok"] and growing["baselines"] == [100, 200, 300, 400], growing
    assert not driver._passed("bench", growing)


def test_sync_counts_only_synchronization_warnings() -> None:
    """A planted non-sync warning (the pre-backward hook's "returned a view tensor") is listed
    apart; a planted warning with torch's sync-debug text is counted."""
    sync = _kit_module("sync")
    with sync.recording_syncs() as found:
        warnings.warn(
            "fully_shard-wrapped module (Net) returned a view tensor; an in-place op ...",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    assert len(found["syncs"]) == 2, found
    assert len(found["other"]) == 1 and "returned a view tensor" in found["other"][0], found
    assert sync.sync_verdict(found["syncs"], found["syncs"])["ok"]
    assert sync.sync_verdict(found["syncs"], found["syncs"][:1])["ok"] is False
    verdict = sync.sync_verdict([], found["syncs"])
    assert verdict["ok"] and verdict["counts"] == {"shardweave": 0, "torch": 2}, verdict


class _Stream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)

    def wait_stream(self, stream: object) -> None:
        self.waited.append(stream)


class _Engine:
    def ordered(self, stream: _Stream) -> None:
        stream.wait_event("event")

    def kept(self, stream: _Stream) -> None:
        stream.wait_stream("other")


def test_dropping_waits_removes_only_the_named_functions_waits() -> None:
    delayed = _kit_module("delayed")
    stream, dropped = _Stream(), []
    original = _Stream.wait_event
    with delayed.dropping_waits(_Stream, lambda: {"_Engine.ordered"}, dropped):
        _Engine().ordered(stream)
        _Engine().kept(stream)
    assert stream.waited == ["other"] and dropped == ["_Engine.ordered"]
    assert _Stream.wait_event is original  # restored
    _Engine().ordered(stream)
    assert stream.waited == ["other", "event"]


def test_mutants_on_cpu_are_reported_by_the_sanitizer(tmp_path: Path) -> None:
    """The mutants section on CPU: the tests' own mutation list (a removed wait and a removed
    keep-alive here), each at two gloo ranks on the test accelerator, reported."""
    out = tmp_path / "report.json"
    names = "compute-waits-for-all-gather,keep-all-gather-output"
    proc = _kit("--device", "cpu", "--out", str(out), "--sections", "mutants",
                env={"KIT_MUTANTS": names})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mutants = json.loads(out.read_text())["sections"]["mutants"]
    assert mutants["passed"], mutants
    for name in names.split(","):
        assert mutants[name]["caught"] and all(mutants[name]["dropped"]), mutants[name]


def test_device_mutant_path_runs_on_cpu(tmp_path: Path) -> None:
    """The device path of ``mutants`` on CPU threads: the waits are found by name and removed,
    the control and the mutant agree with the synchronized run (CPU streams run in order, so
    nothing is caught here; on a GPU the mutant must differ)."""
    names = ["reduce-scatter-waits-for-compute", "all-gather-waits-for-copy-in"]
    code = (
        "import json, sys; sys.path[:0] = sys.argv[1:]\n"
        "from gpu_kit.mutants import mutants_threaded\n"
        f"print(json.dumps(mutants_threaded('cpu', 2, {names!r})))\n"
    )
    paths = [str(REPO / "tools"), *(str(REPO / "packages" / p / "src") for p in
             ("mesh", "fsdp", "replicate", "extensions"))]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, *paths], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    gpu_kit_trials = 2  # MUTANT_TRIALS
    for name in names:
        result = report[name]
        assert result["waits_dropped"] > 0 and not result["caught"], result
        # poisoned buffers (the layout's output, the copy-in's slot) are all overwritten in
        # program order: both runs agree with the synchronized one
        assert all(result["control_bitwise"]) and all(result["mutant_bitwise"]), result
        assert len(result["mutant_bitwise"]) == gpu_kit_trials, result
    # each mutant reached its own producer's delay point
    assert report["delay_points"]["before_reduce_scatter_copy_in"] > 0, report
    assert report["delay_points"]["before_copy_in"] > 0, report


def test_every_mutant_has_a_producer_delay() -> None:
    """``MUTANT_DELAYS`` names, for each mutation of the tests, the late producer the device
    run delays (a mutation added to the tests without one would fail the kit with a KeyError
    on the GPU)."""
    mutants, delayed = _kit_module("mutants"), _kit_module("delayed")
    assert set(mutants.MUTANT_DELAYS) == set(mutants.mutations())
    for delays in mutants.MUTANT_DELAYS.values():
        assert len(delays) == 1 and delays <= delayed.ALL_DELAYS, delays


def test_llama_section_passes_or_skips_without_transformers(tmp_path: Path) -> None:
    """A transformers Llama (tied/untied x bf16/fp32 x offload) at world 1: bitwise against
    torch's engine where torch's engine agrees with itself; skipped (exit 0) without
    transformers."""
    out = tmp_path / "report.json"
    proc = _kit("--device", "cpu", "--out", str(out), "--sections", "llama")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    llama = json.loads(out.read_text())["sections"]["llama"]
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        assert llama["skipped"] == "transformers is not installed", llama
        return
    assert llama["passed"] and llama["differs"] == [] and llama["not_judged"] == [], llama
    assert len([k for k in llama if k.startswith(("tied", "untied"))]) == 8, llama


def test_llama_verdict_judges_only_where_torch_agrees_with_itself() -> None:
    llama = _kit_module("llama")

    def run(loss: float) -> dict[str, Any]:
        return {"losses": [loss], "params": [("w", torch.ones(2), torch.ones(2))], "state": []}

    agree = llama.llama_verdict(run(1.0), run(1.0), run(1.0))
    assert agree["ok"] and agree["judged"]
    differs = llama.llama_verdict(run(1.0), run(1.0), run(2.0))
    assert not differs["ok"] and differs["judged"]
    noisy = llama.llama_verdict(run(1.0), run(3.0), run(2.0))  # torch differs from itself
    assert noisy["ok"] and not noisy["judged"] and not noisy["torch_agrees_with_itself"]
