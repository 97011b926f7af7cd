"""How long the planner takes: a 70B model on 1,024 ranks without a sample input (the budget is
5 s), the make-it-fit search for it with a sample input (the budget is 30 s), the same with a
global batch on 8 and on 1,024 devices (layouts and microbatches searched too; 30 s each), and
a 1.1B model with a sample input (one fake-tensor forward and backward; the budget is a minute
on a 2-core machine).

Run::

    python benchmarks/plan_speed.py [--repeats 3] [--json out/plan_speed.json]

Each plan runs ``--repeats`` times in this process; the report gives every time and the
slowest (the first run pays for imports and the meta-device build's first calls).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from demos.llama70b import llama_1b, llama_70b
    from shardweave.fsdp.plan import FitResult, fit, plan

    cases = {
        "llama_70b_1024_ranks": lambda: plan(
            llama_70b, mesh=1024, wrap="TransformerBlock", mp_policy="bf16"
        ),
        # make it fit: the default search (wrap candidates x checkpointing, 10 fake steps,
        # folded to 4 blocks each) with a sample input; the budget is 30 s
        "llama_70b_1024_ranks_fit_sample_1x4096": lambda: fit(
            llama_70b, mesh=1024, sample_input=((1, 4096), torch.long), budget="80GiB"
        ),
        # make it fit with a global batch: FSDP and HSDP layouts, local batch x accumulation
        "llama_70b_1024_ranks_fit_global_batch_2048": lambda: fit(
            llama_70b,
            mesh=1024,
            sample_input=((1, 4096), torch.long),
            budget="80GiB",
            wrap="TransformerBlock",
            global_batch=2048,
        ),
        "llama_70b_8_ranks_fit_global_batch_16": lambda: fit(
            llama_70b,
            mesh=8,
            sample_input=((1, 4096), torch.long),
            budget="80GiB",
            wrap="TransformerBlock",
            global_batch=16,
        ),
        "llama_1b_8_ranks_sample_4x2048": lambda: plan(
            llama_1b,
            mesh=8,
            wrap="TransformerBlock",
            mp_policy="bf16",
            sample_input=((4, 2048), torch.long),
        ),
    }
    result: dict[str, dict[str, object]] = {}
    for name, run in cases.items():
        seconds = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            p = run()
            seconds.append(round(time.perf_counter() - t0, 3))
        if isinstance(p, FitResult):
            peak = p.best.peak_bytes if p.best is not None else 0
        else:
            peak = p.activations.peak_bytes if p.activations is not None else p.peak_tensor_bytes
        result[name] = {"seconds": seconds, "max_s": max(seconds), "peak_bytes": peak}
        print(f"{name}: {max(seconds):.2f} s at most ({seconds}); peak {peak / 2**30:.2f} GiB")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
