"""demos/train_gpt.py, the README's main job: a short run on the world-2 pool.

Oracles: the planner (its prediction for the demo's setup must equal what the tracer measures
in the demo's own traced step) and *closed form* (the loss goes down; every rank writes its
trace and plot; a notice every rank gives is printed once). tests/demos/test_readme_demo.py
runs the script itself, as ``nox -s demo`` does.
"""

from __future__ import annotations

import contextlib
import io
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
    assert "peak with activations" in text, text
    return {
        "plan_vs_trace": report.plan_vs_trace,
        "evals": report.evals,
        "peak_vs_plan": report.peak_vs_plan,
    }


def test_demo_plans_traces_and_trains(world2: WorkerPool, tmp_path: Path) -> None:
    results = world2.run(body, str(tmp_path))
    assert results[1] is None
    r0 = results[0]
    assert r0 is not None
    comparison = r0["plan_vs_trace"]
    assert isinstance(comparison, dict) and len(comparison) == 2, comparison
    for label, v in comparison.items():
        assert v["plan"] == v["trace"] > 0, (label, v)
    # the planner's peak with activations against the measured forward-and-backward peak
    peak = r0["peak_vs_plan"]
    assert isinstance(peak, dict)
    assert abs(peak["plan"] - peak["measured"]) <= 0.05 * peak["measured"], peak
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


def body_without_matplotlib(rank: int, world: int, out_dir: str) -> tuple[str, list[str]]:
    """The demo where matplotlib cannot be imported: returns this rank's stderr and files."""
    sys.path.insert(0, str(DEMOS))
    import train_gpt

    args = train_gpt.parse_args(
        ["--steps", "3", "--eval-interval", "3", "--eval-iters", "1", "--sample-chars", "4",
         "--no-progress", "--no-track-live-bytes", "--trace-steps", "1", "--trace-dir", out_dir]
    )  # fmt: skip
    saved = sys.modules.get("matplotlib.figure")
    sys.modules["matplotlib.figure"] = None  # type: ignore[assignment]  # import raises
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            train_gpt.train(args)
    finally:
        if saved is None:
            del sys.modules["matplotlib.figure"]
        else:
            sys.modules["matplotlib.figure"] = saved
    return err.getvalue(), sorted(p.name for p in Path(out_dir).iterdir())


def test_same_notice_on_every_rank_is_printed_once(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracle: closed form: both ranks miss the plot, rank 0 says so once, nobody else does;
    the traces are still written."""
    (err0, files), (err1, _) = world2.run(body_without_matplotlib, str(tmp_path))
    assert err0.count("no memory plot") == 1, err0
    assert "train_gpt.py: no memory plot (" in err0, err0  # every rank: no rank list
    assert "no memory plot" not in err1, err1
    assert files == ["trace-rank0.json", "trace-rank1.json"], files


def test_merge_notices() -> None:
    sys.path.insert(0, str(DEMOS))
    import train_gpt

    assert train_gpt.merge_notices([["a", "b"], ["a"], ["a", "b"]]) == [
        "train_gpt.py: a",
        "train_gpt.py: ranks 0, 2: b",
    ]
    assert train_gpt.merge_notices([[], ["c"]]) == ["train_gpt.py: rank 1: c"]
    assert train_gpt.merge_notices([[], []]) == []
