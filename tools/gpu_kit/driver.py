"""The kit's command line: each section in a subprocess of its own, one JSON report."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import __doc__ as OVERVIEW
from ._common import KIT_DIR, PACKAGE_SRCS, subprocess_env
from ._training import CASES
from .bench import bench_round, section_bench
from .csan import section_csan
from .delayed import section_delayed
from .llama import section_llama
from .mutants import mutant_rank, section_mutants
from .parity import section_parity
from .plugin import section_plugin
from .sync import section_sync

SECTIONS = ("plugin", "parity", "delayed", "mutants", "llama", "sync", "csan", "bench")
CUDA_ONLY = ("sync", "csan")

SECTION_FUNCS: dict[str, Callable[[str], dict[str, Any]]] = {
    "mutants": section_mutants,
    "llama": section_llama,
    "plugin": section_plugin,
    "parity": section_parity,
    "delayed": section_delayed,
    "sync": section_sync,
    "csan": section_csan,
    "bench": section_bench,
}


def _run_section_subprocess(name: str, device_type: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "section.json"
        cmd = [sys.executable, str(KIT_DIR), "--_section", name, "--device", device_type,
               "--out", str(out)]  # fmt: skip
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            return {
                "error": f"timed out after {timeout:.0f} s",
                "output_tail": str(exc.output)[-4000:],
            }
        seconds = round(time.monotonic() - start, 1)
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit {proc.returncode}", "seconds": seconds,
                    "output_tail": (proc.stdout + proc.stderr)[-4000:]}  # fmt: skip
        result: dict[str, Any] = json.loads(out.read_text())
        result["seconds"] = seconds
        return result


def _passed(name: str, result: dict[str, Any]) -> bool:
    if "error" in result or "skipped" in result:
        return False
    if name in ("parity", "delayed"):
        cases = [v for k, v in result.items() if k in CASES]
        return bool(cases) and all(v.get("bitwise") for v in cases)
    # bench passes when every round started from the same baseline (its ratios are reported,
    # never judged)
    return bool(result.get("ok"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(OVERVIEW or "").split("\n\n")[0])
    parser.add_argument("--out", default="gpu-report.json", help="where the JSON report goes")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per section")
    # How the kit starts its own subprocesses (a section, a bench round, a mutant's rank).
    parser.add_argument("--_section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_bench_round", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_mutant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--_store", default=None, help=argparse.SUPPRESS)
    return parser


def _inside_subprocess(args: argparse.Namespace) -> int:
    """One section, bench round or mutant rank, its result written to ``args.out``."""
    sys.path[:0] = PACKAGE_SRCS
    if args._mutant:
        mutant_rank(args._mutant, args._rank, args._world, args._store, args.out)
        return 0
    if args._bench_round:
        result = bench_round(args._bench_round, args.device)
    else:
        result = SECTION_FUNCS[args._section](args.device)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


def _run_sections(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    device_type: str,
    report: dict[str, Any],
) -> None:
    """Each section asked for, in a subprocess of its own, into ``report["sections"]``."""
    for name in [s for s in args.sections.split(",") if s]:
        if name not in SECTION_FUNCS:
            parser.error(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        if name in CUDA_ONLY and device_type != "cuda":
            report["sections"][name] = {"skipped": "needs CUDA"}
            continue
        result = _run_section_subprocess(name, device_type, args.timeout)
        if "skipped" in result:  # the section found nothing to run here (say, no transformers)
            report["sections"][name] = result
            print(f"gpu kit: {name}: skipped ({result['skipped']})", flush=True)
            continue
        result["passed"] = _passed(name, result)
        report["sections"][name] = result
        print(f"gpu kit: {name}: {'passed' if result['passed'] else 'FAILED'}"
              f" ({result.get('seconds', '?')} s)", flush=True)  # fmt: skip
        # Written after every section: a run cut short (a lent GPU's time is short) still
        # leaves the sections it finished.
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args._section or args._bench_round or args._mutant:  # inside a subprocess of the kit
        return _inside_subprocess(args)

    try:
        import torch
    except ModuleNotFoundError:  # the machine's own python (``nox -s gpu``) may have no torch
        print(
            f"gpu kit: no torch in this python ({sys.executable}); run the kit with a python"
            " that has torch 2.11 or newer: <that python> tools/gpu_kit"
        )
        return 0

    device_type = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device_type is None:
        print(f"gpu kit: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 0
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu",
        "sections": {},
    }
    _run_sections(parser, args, device_type, report)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu kit: report written to {args.out}")
    ran = [v for v in report["sections"].values() if "skipped" not in v]
    return 0 if all(v["passed"] for v in ran) else 1
