"""demos/train_gpt.py, the README's main job: a short run on the world-2 pool.

Oracles: the planner (its prediction for the demo's setup must equal what the tracer measures
in the demo's own traced step) and *closed form* (the loss goes down; every rank writes its
trace and plot).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests._dist import WorkerPool

DEMOS = Path(__file__).resolve().parents[2] / "demos"


def body(rank: int, world: int, out_dir: str) -> dict[str, object] | None:
    sys.path.insert(0, str(DEMOS))
    import train_gpt

    args = train_gpt.parse_args(
        ["--steps", "6", "--eval-interval", "3", "--eval-iters", "1", "--sample-chars", "8",
         "--no-progress", "--no-track-live-bytes", "--trace-steps", "2", "--trace-dir", out_dir]
    )  # fmt: skip
    report = train_gpt.train(args)
    if report is None:
        return None
    text = train_gpt.format_report(report)
    assert "plan vs trace" in text, text
    return {"plan_vs_trace": report.plan_vs_trace, "evals": report.evals}


def test_demo_plans_traces_and_trains(world2: WorkerPool, tmp_path: Path) -> None:
    results = world2.run(body, str(tmp_path))
    assert results[1] is None
    r0 = results[0]
    assert r0 is not None
    comparison = r0["plan_vs_trace"]
    assert isinstance(comparison, dict) and len(comparison) == 3, comparison
    for label, v in comparison.items():
        assert v["plan"] == v["trace"] > 0, (label, v)
    evals = r0["evals"]
    assert isinstance(evals, list)
    assert evals[-1]["train"] < evals[0]["train"], evals
    for rank in range(2):
        trace = json.loads((tmp_path / f"trace-rank{rank}.json").read_text())
        assert any(
            e.get("cat") == "all_gather" or "all_gather" in str(e.get("name"))
            for e in trace["traceEvents"]
        )
        assert (tmp_path / f"memory-rank{rank}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
