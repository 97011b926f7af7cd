"""The FSDP tracer's reporting half: ``FSDPTracer`` renders what ``TraceRecorder`` (``_recorder``)
recorded as a summary dict, a table, a Chrome trace and a memory plot. The engine never imports
this module; see Design note: traced quantities (``_recorder``) for what every number means.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from shardweave.fsdp._fsdp_common import CollectiveKind
from shardweave.fsdp.tracing._recorder import TraceRecorder

__all__ = ["GATHERED_LABEL", "FSDPTracer", "trace"]

_PLOT_INSTALL: Final = "pip install 'shardweave-fsdp[plot]'"
# The memory plot's and the Chrome trace's name for the gathered bytes alive: each all-gather's
# output from its issue to its group's reshard, a prefetch still in flight included. Not the
# planner's "gathered params", which start at the copy-out (it files the output in flight under
# communication buffers); see Design note: traced quantities (``_recorder``).
GATHERED_LABEL: Final = "all-gathered (issue to reshard)"


def _group_stats() -> dict[str, Any]:
    """A group's entry of the summary, before anything is counted."""
    return {
        "unshard": 0,
        "reshard": 0,
        **{
            k: {"count": 0, "bytes": 0, "time_ms": 0.0, "exposed_ms": 0.0, "unwaited": 0}
            for k in (kind.value for kind in CollectiveKind)
        },
        "copy_in_ms": 0.0,
        "copy_out_ms": 0.0,
        "unshard_ms": 0.0,
        "hooks": {},
        "peak_gathered_bytes": 0,
    }


class FSDPTracer(TraceRecorder):
    """Records what ``fully_shard`` modules communicate, copy and keep gathered.

    Use it as a context manager (or ``start()`` / ``stop()``) around training steps, and call
    ``step()`` after each optimizer step to delimit steps. Only this process is traced: each
    rank records its own trace (``pid`` = rank in the Chrome export). See Design note: traced
    quantities (``_recorder``) for what every number means.

    Example::

        with trace() as tracer:
            for batch in batches:
                model(batch).sum().backward()
                optim.step()
                optim.zero_grad()
                tracer.step()
        tracer.export_chrome_trace("trace-rank{rank}.json")
        print(tracer.summary_table())
    """

    # --- analysis -----------------------------------------------------------------------------
    def gathered_bytes_timeline(self) -> list[tuple[int, int]]:
        """``(t_ns, gathered bytes alive)`` after each change, starting at ``(0, 0)``."""
        return [(0, 0), *((r.t_ns, r.gathered_bytes) for r in self.memory)]

    def grad_bytes_timeline(self) -> list[tuple[int, int]]:
        """``(t_ns, unsharded gradient bytes alive)`` after each change, starting at ``(0, 0)``."""
        return [(0, 0), *((r.t_ns, r.grad_bytes) for r in self.memory)]

    def summary(self) -> dict[str, Any]:
        """Per-group counts, bytes and times, over all steps (``total``) and per step.

        Returns a JSON-serializable dict::

            {"rank", "world_size", "num_steps",
             "total": {...}, "steps": [{...}, ...]}   # each {...} as below
            {"groups": {key: {"unshard": n, "reshard": n,
                              "all_gather" | "reduce_scatter" | "all_reduce":
                                  {"count", "bytes", "time_ms", "exposed_ms", "unwaited"},
                              "copy_in_ms", "copy_out_ms", "unshard_ms",
                              "hooks": {name: {"count", "wall_ms", "cpu_ms"}},
                              "peak_gathered_bytes"}},
             "collectives": {kind: {"count", "bytes"}},
             "peak_gathered_bytes", "peak_grad_bytes",
             "end_gathered_bytes", "end_grad_bytes"}

        Times are summed over records; a collective never waited counts in ``count`` and
        ``bytes`` and in ``unwaited``, not in the times.
        """
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "num_steps": self.num_steps,
            "total": self._summarize(None),
            "steps": [self._summarize(s.index) for s in self.steps],
        }

    def _summarize(self, step: int | None) -> dict[str, Any]:
        """The summary over all steps (``step`` None) or of one step: per group, then totals
        and the memory peaks."""
        groups: dict[str, dict[str, Any]] = {}

        def entry(key: str) -> dict[str, Any]:
            if key not in groups:
                groups[key] = _group_stats()
            return groups[key]

        totals = self._count_collectives(step, entry)
        self._count_spans(step, entry)
        return {"groups": groups, "collectives": totals, **self._replay_memory(step, entry)}

    def _count_collectives(
        self, step: int | None, entry: Callable[[str], dict[str, Any]]
    ) -> dict[str, dict[str, int]]:
        """Count each collective of ``step`` into its group's entry; the totals per kind."""
        totals = {k.value: {"count": 0, "bytes": 0} for k in CollectiveKind}
        for c in self.collectives:
            if step is not None and c.step != step:
                continue
            stats = entry(c.group)[c.kind]
            stats["count"] += 1
            stats["bytes"] += c.nbytes
            totals[c.kind]["count"] += 1
            totals[c.kind]["bytes"] += c.nbytes
            if c.duration_ns is None:
                stats["unwaited"] += 1
            else:
                stats["time_ms"] += c.duration_ns / 1e6
                stats["exposed_ms"] += (c.exposed_ns or 0) / 1e6
        return totals

    def _count_spans(self, step: int | None, entry: Callable[[str], dict[str, Any]]) -> None:
        """Add each span of ``step`` (hooks, copy-in, copy-out, unshard) to its group's entry."""
        for s in self.spans:
            if step is not None and s.step != step:
                continue
            g = entry(s.group)
            ms = (s.end_ns - s.begin_ns) / 1e6
            if s.category == "hook":
                hook = g["hooks"].setdefault(s.name, {"count": 0, "wall_ms": 0.0, "cpu_ms": 0.0})
                hook["count"] += 1
                hook["wall_ms"] += ms
                hook["cpu_ms"] += (s.cpu_ns or 0) / 1e6
            elif s.category in ("copy_in", "copy_out", "unshard"):
                g[f"{s.category}_ms"] += ms

    def _replay_memory(
        self, step: int | None, entry: Callable[[str], dict[str, Any]]
    ) -> dict[str, int]:
        """Replay the memory counters up to the end of ``step``: the unshard / reshard counts
        and peak gathered bytes of each group, and the step's peaks and end levels. The level
        carried into the step counts toward its peaks."""
        live: dict[str, int] = {}
        gathered = grads = peak_gathered = peak_grads = 0
        carried = step is None

        def carry_in() -> None:
            nonlocal peak_gathered, peak_grads
            peak_gathered, peak_grads = gathered, grads
            for key, nbytes in live.items():
                if nbytes:
                    entry(key)["peak_gathered_bytes"] = nbytes

        for r in self.memory:
            if step is not None and r.step > step:
                break
            in_step = step is None or r.step == step
            if in_step and not carried:
                carry_in()
                carried = True
            if r.event in ("unshard", "reshard", "discard"):
                live[r.group] = live.get(r.group, 0) + r.delta
            gathered, grads = r.gathered_bytes, r.grad_bytes
            if in_step:
                g = entry(r.group)
                if r.event in ("unshard", "reshard"):
                    g[r.event] += 1
                g["peak_gathered_bytes"] = max(g["peak_gathered_bytes"], live.get(r.group, 0))
                peak_gathered = max(peak_gathered, gathered)
                peak_grads = max(peak_grads, grads)
        if not carried:
            carry_in()
        return {
            "peak_gathered_bytes": peak_gathered,
            "peak_grad_bytes": peak_grads,
            "end_gathered_bytes": gathered,
            "end_grad_bytes": grads,
        }

    def summary_table(self, step: int | None = None) -> str:
        """``summary()`` as a text table, over all steps or for one."""
        data = self._summarize(step)
        header: tuple[str, ...] = ("group", "unshard")
        for kind in CollectiveKind:
            ms = "ms (exposed)" if kind == CollectiveKind.ALL_GATHER else "ms"
            header += (f"{kind.abbrev} n", f"{kind.abbrev} bytes", f"{kind.abbrev} {ms}")
        header += ("copy-in ms", "copy-out ms", "hooks ms", "peak gathered")
        rows: list[tuple[str, ...]] = [header]
        for key, g in data["groups"].items():
            hooks = sum(h["wall_ms"] for h in g["hooks"].values())
            row: tuple[str, ...] = (key, str(g["unshard"]))
            for kind in CollectiveKind:
                c = g[kind]
                ms = f"{c['time_ms']:.3f}"
                if kind == CollectiveKind.ALL_GATHER:
                    ms += f" ({c['exposed_ms']:.3f})"
                row += (str(c["count"]), str(c["bytes"]), ms)
            rows.append(
                (
                    *row,
                    f"{g['copy_in_ms']:.3f}",
                    f"{g['copy_out_ms']:.3f}",
                    f"{hooks:.3f}",
                    str(g["peak_gathered_bytes"]),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        which = "all steps" if step is None else f"step {step}"
        lines.insert(
            0, f"FSDP trace, rank {self.rank}/{self.world_size}, {which} of {self.num_steps}"
        )
        lines.append(
            f"peak gathered bytes {data['peak_gathered_bytes']}, peak unsharded grad bytes "
            f"{data['peak_grad_bytes']}, gathered at end {data['end_gathered_bytes']}"
        )
        return "\n".join(lines)

    # --- exports ------------------------------------------------------------------------------
    def chrome_trace(self) -> dict[str, Any]:
        """The trace as a Trace Event Format object (``traceEvents``; times in microseconds)."""
        pid = self.rank
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
        ]
        lanes = _Lanes(events, pid)
        for s in self.steps:
            end = s.end_ns if s.end_ns is not None else self.now()
            lanes.complete("step", f"step {s.index}", "step", s.begin_ns, end, {"step": s.index})
        for sp in self.spans:
            name = sp.name if sp.category == "hook" else sp.category
            args: dict[str, Any] = {"group": sp.group, "step": sp.step}
            if sp.cpu_ns is not None:
                args["cpu_us"] = sp.cpu_ns / 1e3
            category = "copy" if sp.category.startswith("copy") else sp.category
            lanes.complete(
                category, f"{name} {sp.group}", sp.category, sp.begin_ns, sp.end_ns, args
            )
        for c in self.collectives:
            if c.complete_ns is None:
                continue
            args = {
                "group": c.group,
                "step": c.step,
                "bytes": c.nbytes,
                "ranks": list(c.ranks),
                "group_size": len(c.ranks),
            }
            if c.exposed_ns is not None:
                args["exposed_us"] = c.exposed_ns / 1e3
            lanes.complete(c.kind, f"{c.kind} {c.group}", c.kind, c.issue_ns, c.complete_ns, args)
        for name in (GATHERED_LABEL, "unsharded grads"):
            events.append({"name": name, "ph": "C", "ts": 0.0, "pid": pid, "args": {"bytes": 0}})
        for r in self.memory:
            ts = r.t_ns / 1e3
            if r.event in ("reshard", "discard"):
                events.append(
                    {
                        "name": f"{r.event} {r.group}",
                        "cat": r.event,
                        "ph": "i",
                        "s": "t",
                        "ts": ts,
                        "pid": pid,
                        "tid": lanes.tid("reshard", 0),
                        "args": {"group": r.group, "freed_bytes": -r.delta, "step": r.step},
                    }
                )
            gathered = r.event in ("unshard", "reshard", "discard")
            events.append(
                {
                    "name": GATHERED_LABEL if gathered else "unsharded grads",
                    "ph": "C",
                    "ts": ts,
                    "pid": pid,
                    "args": {"bytes": r.gathered_bytes if gathered else r.grad_bytes},
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"rank": self.rank, "world_size": self.world_size, "source": "shardweave"},
        }

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write this rank's trace as Chrome / Perfetto JSON (load it in ui.perfetto.dev or
        chrome://tracing). ``{rank}`` in ``path`` is replaced by the rank. Returns the path."""
        out = Path(str(path).replace("{rank}", str(self.rank)))
        out.write_text(json.dumps(self.chrome_trace()))
        return out

    def plot_memory(self, path: str | Path) -> Path:
        """Draw the gathered bytes alive (labelled ``GATHERED_LABEL``: each all-gather from its
        issue to its reshard) and the unsharded-gradient bytes alive over time as a PNG.

        Needs matplotlib: ``pip install 'shardweave-fsdp[plot]'``. ``{rank}`` in ``path`` is
        replaced by the rank. Returns the path.
        """
        try:
            # No pyplot: a bare Figure draws with Agg and leaves the user's backend alone.
            figure: Any = importlib.import_module("matplotlib.figure")
        except ImportError as e:
            raise ImportError(
                f"FSDPTracer.plot_memory needs matplotlib, which is not installed; install the "
                f"plot extra: {_PLOT_INSTALL}"
            ) from e
        out = Path(str(path).replace("{rank}", str(self.rank)))
        fig = figure.Figure(figsize=(10, 4))
        ax = fig.add_subplot()
        for label, series in (
            (GATHERED_LABEL, self.gathered_bytes_timeline()),
            ("unsharded grads", self.grad_bytes_timeline()),
        ):
            ax.step(
                [t / 1e6 for t, _ in series],
                [b / 2**20 for _, b in series],
                where="post",
                label=label,
            )
        for s in self.steps[1:]:
            ax.axvline(s.begin_ns / 1e6, color="grey", linewidth=0.5, linestyle="--")
        ax.set_xlabel("time since trace start (ms)")
        ax.set_ylabel("MiB alive")
        ax.set_title(f"FSDP memory, rank {self.rank} ({self.num_steps} steps)")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        return out


class _Lanes:
    """Puts complete events on threads (``tid``) so none overlaps another on the same thread,
    as the Trace Event Format requires: one base tid per category, extra lanes for overlaps."""

    _ORDER: Final = (
        "step",
        "hook",
        "copy",
        "wait",
        "unshard",
        "reshard",
        *CollectiveKind,
    )

    def __init__(self, events: list[dict[str, Any]], pid: int) -> None:
        self._events = events
        self._pid = pid
        self._ends: dict[str, list[int]] = {}
        self._named: set[int] = set()

    def tid(self, category: str, lane: int) -> int:
        tid = (self._ORDER.index(category) + 1) * 100 + lane
        if tid not in self._named:
            self._named.add(tid)
            label = category if lane == 0 else f"{category} ({lane + 1})"
            self._events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": tid,
                    "args": {"name": label},
                }
            )
            self._events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        return tid

    def complete(
        self, category: str, name: str, cat: str, begin_ns: int, end_ns: int, args: dict[str, Any]
    ) -> None:
        ends = self._ends.setdefault(category, [])
        lane = next((i for i, end in enumerate(ends) if end <= begin_ns), len(ends))
        if lane == len(ends):
            ends.append(end_ns)
        else:
            ends[lane] = end_ns
        self._events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": begin_ns / 1e3,
                "dur": (end_ns - begin_ns) / 1e3,
                "pid": self._pid,
                "tid": self.tid(category, lane),
                "args": args,
            }
        )


def trace() -> FSDPTracer:
    """A tracer for the ``fully_shard`` modules of this process; use it as a context manager.

    While it is active the engine records every unshard, reshard and collective (kind, bytes,
    process group, issue and completion times), the copy-in/copy-out and hook times, and the
    gathered-parameter and unsharded-gradient bytes alive. Disabled (no active tracer), the
    engine pays one ``is None`` test per instrumentation point.

    Example::

        from shardweave.fsdp import trace

        with trace() as tracer:
            loss = model(batch).sum()
            loss.backward()
            tracer.step()
        print(tracer.summary_table())
        tracer.export_chrome_trace("fsdp-rank{rank}.json")
    """
    return FSDPTracer()
