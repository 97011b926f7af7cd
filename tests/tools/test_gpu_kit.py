"""The GPU kit (``tools/gpu_kit.py``, ``nox -s gpu``) on a machine without CUDA: the one-line
dry path, and the sections that need no CUDA run on CPU, which checks the kit's own logic (its
comparisons, its threaded ranks, its ``DelayedCollectives`` plugin) before a GPU ever runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tools._load import REPO

KIT = REPO / "tools" / "gpu_kit.py"
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry path is CPU-only")


def _kit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(KIT), *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )


@needs_no_cuda
def test_without_cuda_one_line_and_exit_0(tmp_path: Path) -> None:
    proc = _kit("--out", str(tmp_path / "report.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stdout
    assert not (tmp_path / "report.json").exists()


def test_cpu_sections_pass_and_cuda_ones_are_skipped(tmp_path: Path) -> None:
    """plugin: closed forms at 4 threaded ranks; parity: bitwise vs torch's fully_shard at
    world 1 (gloo); delayed: 4 threaded ranks through the plugin, each case bitwise equal to
    the synchronized run. sync/csan/bench need CUDA and say so."""
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
    for case in ("fsdp", "bf16", "hsdp_2x2", "replicate"):
        assert delayed[case]["bitwise"] and len(delayed[case]["ranks"]) == 4, case
    assert sections["sync"] == {"skipped": "needs CUDA"}
