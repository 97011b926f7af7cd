"""``bench``: step time and per-phase allocated/peak memory against torch's FSDP2 at world 1,
each round in a fresh process; fails unless every round starts from the same bytes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._common import KIT_DIR, init_world1, subprocess_env
from ._training import apply_engine, make_model

# Rounds in this order, each in a fresh process: in one process a round's model is not freed
# at ``del`` (reference cycles), so each later round would carry the earlier ones' memory.
BENCH_ROUNDS = ("torch", "shardweave", "torch", "shardweave")
BENCH_PHASES = ("forward", "backward", "optimizer", "zero_grad")
# (width, blocks, batch, sequence, warm-up steps, measured steps): ~0.54 B parameters in bf16
# on CUDA; a tiny model on CPU, where only the kit's logic is checked.
BENCH_SIZES = {"cuda": (2048, 16, 8, 1024, 3, 10), "cpu": (32, 2, 2, 8, 1, 2)}


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach (DTensors by their
    local tensor): the CPU stand-in for ``torch.cuda.memory_allocated`` (no allocator stats
    on CPU). A model kept alive by a reference cycle is counted until it is collected."""
    import gc

    import torch

    storages: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        # issubclass(type(...)): isinstance would read ``__class__``, which some lazy module
        # attributes answer with a deprecation warning.
        if not issubclass(type(obj), torch.Tensor):
            continue
        local = getattr(obj, "_local_tensor", obj)
        if local.device.type == "meta" or not isinstance(local, torch.Tensor):
            continue
        with contextlib.suppress(Exception):  # wrapper subclasses without a storage
            storage = local.untyped_storage()
            if storage.data_ptr():
                storages[(local.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


class _Meter:
    """Allocated and peak bytes per phase: CUDA's allocator statistics; on CPU, live tensor
    bytes at the phase's end (the peak inside a phase is not seen there: it is the larger of
    its start and end)."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda"

    def allocated(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return int(torch.cuda.memory_allocated())
        return live_tensor_bytes()

    @contextlib.contextmanager
    def phase(self, into: dict[str, dict[str, int]], name: str) -> Iterator[None]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = self.allocated()
        yield
        end = self.allocated()
        peak = int(torch.cuda.max_memory_allocated()) if self.cuda else max(start, end)
        into[name] = {"allocated": end, "peak": peak}


def bench_round(engine: str, device_type: str) -> dict[str, Any]:
    """One round in this process: baseline (allocated before the model exists), median step
    time, per-phase allocated/peak of one more step after the timed ones, and what is left allocated
    after the round is deleted and collected (``leftover_bytes``, for information)."""
    import gc

    import torch
    import torch.distributed as dist

    dim, blocks, batch, seq, warmup, measured = BENCH_SIZES[device_type]
    init_world1(device_type)
    device = torch.device(device_type)
    meter = _Meter(device_type)
    try:
        gc.collect()
        baseline = meter.allocated()
        model = make_model(dim, blocks, device)
        apply_engine(engine, model, "bf16", device_type)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        x = torch.randn(batch, seq, dim, device=device)

        def step(model: Any, opt: Any, x: Any) -> None:
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step(model, opt, x)
        # Timed steps run back to back (no host wait inside a step, which would hide
        # overlap); the per-phase memory is measured on one more step after them.
        times: list[float] = []
        for _ in range(measured):
            if device_type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(model, opt, x)
            if device_type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        phases: dict[str, dict[str, int]] = {}
        with meter.phase(phases, "forward"):
            loss = model(x).float().pow(2).mean()
        with meter.phase(phases, "backward"):
            loss.backward()
            del loss
        with meter.phase(phases, "optimizer"):
            opt.step()
        with meter.phase(phases, "zero_grad"):  # between steps
            opt.zero_grad(set_to_none=True)
        del model, opt, x
        gc.collect()
        leftover = meter.allocated() - baseline
    finally:
        dist.destroy_process_group()
    return {"engine": engine, "baseline_bytes": baseline, "phases": phases,
            "step_ms": sorted(times)[len(times) // 2], "leftover_bytes": leftover}  # fmt: skip


def bench_verdict(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios of ours to torch's (best step time; largest per-phase peak) and the baseline
    check: every round must start from the same allocated bytes, or the comparison measures
    leftovers (``ok`` false)."""
    baselines = [r["baseline_bytes"] for r in rounds]
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        by_engine.setdefault(r["engine"], []).append(r)

    def peak(r: dict[str, Any]) -> int:
        return max(p["peak"] for p in r["phases"].values())

    result: dict[str, Any] = {"rounds": rounds, "baselines": baselines}
    result["same_baseline"] = len(set(baselines)) == 1
    if {"torch", "shardweave"} <= by_engine.keys():
        ours, theirs = by_engine["shardweave"], by_engine["torch"]
        result["step_time_ratio"] = min(r["step_ms"] for r in ours) / min(
            r["step_ms"] for r in theirs
        )
        result["peak_memory_ratio"] = max(map(peak, ours)) / max(max(map(peak, theirs)), 1)
    result["ok"] = result["same_baseline"] and len(rounds) == len(BENCH_ROUNDS)
    return result


def section_bench(device_type: str) -> dict[str, Any]:
    """Each round of ``BENCH_ROUNDS`` in a fresh process (``--_bench_round``)."""
    rounds: list[dict[str, Any]] = []
    errors: list[str] = []
    for engine in BENCH_ROUNDS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "round.json"
            cmd = [sys.executable, str(KIT_DIR), "--_bench_round", engine,
                   "--device", device_type, "--out", str(out)]  # fmt: skip
            proc = subprocess.run(
                cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600
            )
            if proc.returncode != 0 or not out.exists():
                errors.append(
                    f"{engine}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"
                )
                continue
            rounds.append(json.loads(out.read_text()))
    result = bench_verdict(rounds)
    if device_type == "cuda":
        result["params"] = sum(
            p.numel()
            for p in make_model(BENCH_SIZES["cuda"][0], BENCH_SIZES["cuda"][1], "meta").parameters()
        )
    if errors:
        result["errors"] = errors
        result["ok"] = False
    return result
