"""Report formatting: the human-readable summary printed from the JSON report, and the
JSON report itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write ``report`` as JSON to ``path`` (its folder made if need be) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nreport written to {path}")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_report(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"fully_shard/replicate benchmark: world_size {meta['world_size']}, gloo on CPU, torch "
        f"{meta['torch_version']}, one process set per implementation, turns of "
        f"{meta['steps_per_turn']} step(s) in alternating order, {meta['warmup_steps']} warm-up",
        f"peak memory self-check (1 MiB held through the window): {meta['memory_self_check']}",
    ]
    for impl, info in report["impls"].items():
        status = "ok" if info["error"] is None else f"UNAVAILABLE ({info['error']})"
        lines.append(f"  {impl:<20} {status}")
    for name, w in report["workloads"].items():
        lines += [
            "",
            f"[{name}] {w['description']}; {w['num_params']:,} parameters; "
            f"{w['timed_steps']} timed steps per impl",
        ]
        width = max([11, *(len(impl) for impl in w["results"])])
        lines.append(
            f"  {'impl':<{width}} {'min ms':>8} {'median':>8} {'max ms':>8} {'opt ms':>7} "
            f"{'peak live':>10}   "
            f"{'all-gather':>19} {'reduce-scatter':>19} {'all-reduce':>14}  "
            f"{'loss first->last':>17}"
        )
        for impl, r in w["results"].items():
            if r["error"] is not None:
                # The last line of a traceback; the JSON keeps all of it.
                lines.append(f"  {impl:<{width}} FAILED: {r['error'].strip().splitlines()[-1]}")
                continue
            t, c, b = r["step_ms"], r["comm_counts"], r["comm_bytes"]
            lines.append(
                f"  {impl:<{width}} {t['min']:>8.2f} {t['median']:>8.2f} {t['max']:>8.2f} "
                f"{r['opt_ms']['median']:>7.2f} {_fmt_bytes(r['memory']['peak_bytes']):>10}   "
                f"{c['all_gather']:>4} x {_fmt_bytes(b['all_gather']):>10}    "
                f"{c['reduce_scatter']:>4} x {_fmt_bytes(b['reduce_scatter']):>10}    "
                f"{c['all_reduce']:>3} x {_fmt_bytes(b['all_reduce']):>7}  "
                f"{r['loss_first']:>8.4f}->{r['loss_last']:.4f}"
                + (f"   (+{c['other']} other collectives)" if c["other"] else "")
            )
        tm = w["theoretical_min"]
        if tm["all_reduce_bytes"]:  # replicate: one all-reduce of every gradient byte
            note = f"({tm['groups_with_own_params']} groups with parameters)"
        else:
            note = (
                f"({tm['groups_with_own_params']} groups with parameters; with dim-0 padding: "
                f"AG {_fmt_bytes(tm['all_gather_bytes_padded'])}, "
                f"RS {_fmt_bytes(tm['reduce_scatter_bytes_padded'])})"
            )
        lines.append(
            f"  {'minimum':<{width}} {'':>8} {'':>8} {'':>8} {'':>7} {'':>10}   "
            f"{'':>4}   {_fmt_bytes(tm['all_gather_bytes']):>10}    "
            f"{'':>4}   {_fmt_bytes(tm['reduce_scatter_bytes']):>10}    "
            f"{'':>3}   {_fmt_bytes(tm['all_reduce_bytes']):>7}  {note}"
        )
        for impl, r in w["results"].items():
            if r["error"] is None:
                b = r["comm_bytes"]
                parts = [
                    f"{label} {_ratio(b[kind], tm[f'{kind}_bytes'])}"
                    for kind, label in (
                        ("all_gather", "all-gather"),
                        ("reduce_scatter", "reduce-scatter"),
                        ("all_reduce", "all-reduce"),
                    )
                    if tm[f"{kind}_bytes"]
                ]
                m = r["memory"]
                lines.append(
                    f"  {impl}: bytes / minimum: " + ", ".join(parts) + "; live before step "
                    f"{_fmt_bytes(m['live_before_bytes'])} (params/grads/optimizer/buffers "
                    f"{_fmt_bytes(m['state_bytes'])}), peak {_fmt_bytes(m['peak_bytes'])}"
                )
        for pair, diff in w.get("loss_last_abs_diffs", {}).items():
            lines.append(f"  last loss |{pair}|: {diff:.3g}")
        for key, ratio in w.items():
            for prefix, what in (
                ("median_ratio_shardweave_over_", "median step time"),
                (
                    "median_ratio_without_optimizer_shardweave_over_",
                    "median step time less the optimizer's",
                ),
                ("peak_bytes_ratio_shardweave_over_", "peak live bytes"),
            ):
                if key.startswith(prefix):
                    lines.append(
                        f"  {what} shardweave / {key.removeprefix(prefix)}: "
                        + (f"{ratio:.3f}" if ratio is not None else "n/a (needs both)")
                    )
    return "\n".join(lines)


def _ratio(actual: int, minimum: int) -> str:
    return f"{actual / minimum:.4f}" if minimum else "n/a"
