"""The FSDP tracer at 2 ranks: counts and bytes, the Chrome export, the gathered-bytes timeline,
numerics and the disabled path.

Oracles: *independent counter* (``count_collectives`` wraps the c10d entry points the engine
dispatches to, so it sees every collective without the tracer's help); *closed form* (peak
gathered bytes of a known model, worked out by hand below); *reference* (the same training
untraced, losses compared bitwise).
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardweave.fsdp import FSDPTracer, fully_shard, trace
from shardweave.fsdp.tracing import _recorder as trace_module
from tests._dist import WorkerPool
from tests.fsdp._counting import count_collectives
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks


class Chain(nn.Module):
    """Four Linear blocks then a Linear head on the root; sizes chosen so that every group's
    gathered bytes differ and the peak is neither the forward's nor the sum of all groups."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(4, 6), nn.Linear(6, 10), nn.Linear(10, 3), nn.Linear(3, 5)]
        )
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _chain(reshard_after_forward: bool | None) -> Chain:
    torch.manual_seed(0)
    model = Chain()
    kwargs: dict[str, Any] = {}
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


# Gathered bytes at world 2, fp32: Linear(i, o) keeps ceil(o / 2) rows of the weight and of the
# bias per rank, and the all-gather output holds 2 such shards.
#   layers.0 Linear(4, 6):  2 * (3 * 4 + 3)  = 30 floats = 120 B
#   layers.1 Linear(6, 10): 2 * (5 * 6 + 5)  = 70 floats = 280 B
#   layers.2 Linear(10, 3): 2 * (2 * 10 + 2) = 44 floats = 176 B
#   layers.3 Linear(3, 5):  2 * (3 * 3 + 3)  = 24 floats =  96 B
#   <root>   Linear(5, 1):  2 * (1 * 5 + 1)  = 12 floats =  48 B
CHAIN_GATHERED = {
    "layers.0": 120,
    "layers.1": 280,
    "layers.2": 176,
    "layers.3": 96,
    "<root>": 48,
}
# reshard_after_forward=True everywhere and an input that requires grad (so every group's
# post-backward runs during backward). Forward holds the root plus one layer: at most
# 48 + 280 = 328. Backward: the root is gathered until the input's gradient (the end); each
# layer's pre-backward prefetches the layer before it, and a layer reshards at its
# post-backward, which runs before the previous layer's pre-backward. So while layers.2
# computes, the root, layers.2 and the prefetched layers.1 are alive: 48 + 176 + 280 = 504.
CHAIN_PEAK = 504
# Unsharded gradients are released right after being copied into the reduce-scatter input,
# so at most one group's (unpadded) gradients are alive: layers.1, (6 * 10 + 10) * 4 = 280 B.
CHAIN_PEAK_GRADS = 280


def _traced_counts(tracer: FSDPTracer) -> Counter[str]:
    out: Counter[str] = Counter()
    for c in tracer.collectives:
        out[c.kind] += 1
        out[f"{c.kind}_bytes"] += c.nbytes
    return out


# --- counts and bytes against the independent counter ---------------------------------------
def counts_match_counter(rank: int, world: int, reshard: bool | None) -> None:
    model = make_model("gpt")
    shard_blocks(
        model, fully_shard, **({} if reshard is None else {"reshard_after_forward": reshard})
    )
    batch = make_batch("gpt", rank)
    loss_fn("gpt", model(batch), batch).backward()  # warm-up: lazy init's own collectives
    model.zero_grad()
    with count_collectives() as counts, trace() as tracer:
        for _ in range(2):
            loss_fn("gpt", model(batch), batch).backward()
            model.zero_grad()
            tracer.step()
    traced = _traced_counts(tracer)
    assert traced["all_gather"] == counts["all_gather_single"] > 0, (traced, counts)
    assert traced["reduce_scatter"] == counts["reduce_scatter_single"] > 0, (traced, counts)
    assert traced["all_reduce"] == counts["all_reduce"] == 0
    # The counter sees each all-gather's per-rank input; the tracer reports the gathered output.
    assert traced["all_gather_bytes"] == world * counts["all_gather_single_bytes"]
    assert traced["reduce_scatter_bytes"] == counts["reduce_scatter_single_bytes"]
    assert all(c.ranks == (0, 1) and c.complete_ns is not None for c in tracer.collectives)
    summary = tracer.summary()
    assert summary["num_steps"] == 2
    for s in summary["steps"]:  # both steps do the same work
        assert s["collectives"] == summary["steps"][0]["collectives"]
        assert s["end_gathered_bytes"] == 0 and s["end_grad_bytes"] == 0
    total = summary["total"]["collectives"]
    assert total["all_gather"]["count"] == traced["all_gather"]
    assert total["reduce_scatter"]["bytes"] == traced["reduce_scatter_bytes"]
    groups = summary["total"]["groups"]
    assert set(groups) == {"layers.0", "layers.1", "<root>"}
    for key, g in groups.items():
        assert g["reduce_scatter"]["count"] == 2, key
        # layers regather in backward unless reshard is False; the root only when True
        regather = reshard is True or (reshard is None and key != "<root>")
        assert g["all_gather"]["count"] == 2 * (2 if regather else 1), key
        assert g["unshard"] == g["all_gather"]["count"], key
        assert {"pre_forward", "post_forward", "pre_backward", "post_backward"} <= set(g["hooks"])
    table = tracer.summary_table()
    assert "layers.1" in table and "peak gathered" in table
    json.dumps(summary)  # JSON-serializable


@pytest.mark.parametrize("reshard", [None, True, False])
def test_counts_and_bytes_match_counter(world2: WorkerPool, reshard: bool | None) -> None:
    """Oracle: independent counter (``count_collectives``)."""
    world2.run(counts_match_counter, reshard)


# --- gathered-bytes timeline ----------------------------------------------------------------
def chain_timeline(rank: int, world: int) -> None:
    model = _chain(reshard_after_forward=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    model(x).sum().backward()  # warm-up
    with trace() as tracer:
        model(x).sum().backward()
        tracer.step()
    summary = tracer.summary()
    step = summary["steps"][0]
    assert step["peak_gathered_bytes"] == CHAIN_PEAK, step["peak_gathered_bytes"]
    assert step["peak_grad_bytes"] == CHAIN_PEAK_GRADS, step["peak_grad_bytes"]
    assert step["end_gathered_bytes"] == 0 and step["end_grad_bytes"] == 0
    assert tracer.gathered_bytes_timeline()[-1][1] == 0
    for key, nbytes in CHAIN_GATHERED.items():
        g = step["groups"][key]
        assert g["peak_gathered_bytes"] == nbytes, (key, g)
        assert g["all_gather"] == {**g["all_gather"], "count": 2, "bytes": 2 * nbytes}, key
        assert g["unshard"] == 2 and g["reshard"] == 2, (key, g)
    times = [t for t, _ in tracer.gathered_bytes_timeline()]
    assert times == sorted(times)


def chain_timeline_root_kept(rank: int, world: int) -> None:
    """Default root policy: the root stays gathered from forward into backward."""
    model = _chain(reshard_after_forward=None)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    with trace() as tracer:
        model(x).sum().backward()
    step = tracer.summary()["steps"][0]
    assert step["end_gathered_bytes"] == 0
    assert step["groups"]["<root>"]["all_gather"]["count"] == 1
    assert step["peak_gathered_bytes"] == CHAIN_PEAK


def test_gathered_timeline(world2: WorkerPool) -> None:
    """Oracle: closed form (CHAIN_PEAK and CHAIN_GATHERED, worked out above)."""
    world2.run(chain_timeline)
    world2.run(chain_timeline_root_kept)


# --- Chrome / Perfetto export -----------------------------------------------------------------
def chrome_export(rank: int, world: int) -> None:
    model = make_model("gpt")
    shard_blocks(model, fully_shard)
    batch = make_batch("gpt", rank)
    with trace() as tracer:
        for _ in range(2):
            loss_fn("gpt", model(batch), batch).backward()
            tracer.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = tracer.export_chrome_trace(Path(tmp) / "trace-{rank}.json")
        assert path.name == f"trace-{rank}.json"
        data = json.loads(path.read_text())
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    by_ph: Counter[str] = Counter(e["ph"] for e in events)
    assert set(by_ph) <= {"X", "C", "M", "i"}, by_ph
    for e in events:
        assert e["pid"] == rank and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] in ("X", "i"):
            assert isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values()), e
    complete = [e for e in events if e["ph"] == "X"]
    cats = Counter(e["cat"] for e in complete)
    assert cats["all_gather"] == sum(1 for c in tracer.collectives if c.kind == "all_gather")
    assert cats["reduce_scatter"] == 2 * 3  # one per group per step
    assert cats["step"] == 2
    for cat in ("hook", "copy_in", "copy_out", "wait", "unshard"):
        assert cats[cat] > 0, (cat, cats)
    ag = next(e for e in complete if e["cat"] == "all_gather")
    assert ag["args"]["ranks"] == [0, 1] and ag["args"]["bytes"] > 0
    # Complete events on one thread must not overlap (the format nests them by time).
    by_tid: dict[int, list[tuple[float, float]]] = {}
    for e in complete:
        by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_tid.values():
        spans.sort()
        for (_, end), (begin, _) in itertools.pairwise(spans):
            assert begin >= end - 1e-6, spans
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"hook", "all_gather", "reduce_scatter"} <= names, names
    counters = [
        e for e in events if e["ph"] == "C" and e["name"] == "all-gathered (issue to reshard)"
    ]
    assert counters[-1]["args"]["bytes"] == 0
    assert (
        max(e["args"]["bytes"] for e in counters)
        == tracer.summary()["total"]["peak_gathered_bytes"]
    )


def test_chrome_trace(world2: WorkerPool) -> None:
    """Oracle: the Trace Event Format's rules, and the tracer's own records."""
    world2.run(chrome_export)


# --- numerics and the disabled path ---------------------------------------------------------
def _train(rank: int, traced: bool) -> list[float]:
    model = make_model("gpt")
    shard_blocks(model, fully_shard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = trace().start() if traced else None
    losses = []
    for step in range(3):
        batch = make_batch("gpt", 100 * step + rank)
        loss = loss_fn("gpt", model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if tracer is not None:
            tracer.step()
    if tracer is not None:
        tracer.stop()
        assert tracer.num_steps == 3
    return losses


def numerics_unchanged(rank: int, world: int) -> None:
    assert _train(rank, traced=True) == _train(rank, traced=False)  # bitwise


def test_tracing_keeps_numerics(world2: WorkerPool) -> None:
    """Oracle: reference (the same training untraced; losses bitwise equal)."""
    world2.run(numerics_unchanged)


def disabled_records_nothing(rank: int, world: int) -> None:
    model = _chain(reshard_after_forward=True)
    x = torch.randn(3, 4)
    idle = FSDPTracer()  # created, never started
    assert trace_module.ACTIVE is None
    model(x).sum().backward()
    assert not idle.collectives and not idle.spans and not idle.memory
    with trace() as tracer:
        with pytest.raises(RuntimeError, match="already active"):
            FSDPTracer().start()
        model(x).sum().backward()
    assert trace_module.ACTIVE is None
    n = (len(tracer.collectives), len(tracer.spans), len(tracer.memory))
    assert all(n)
    model(x).sum().backward()  # after stop: nothing more is recorded
    assert (len(tracer.collectives), len(tracer.spans), len(tracer.memory)) == n


def test_disabled_tracer_records_nothing(world2: WorkerPool) -> None:
    """Oracle: closed form (no records outside the traced block)."""
    world2.run(disabled_records_nothing)


# --- memory plot (no process group needed) ----------------------------------------------------
def _small_trace() -> FSDPTracer:
    tracer = FSDPTracer()
    tracer.memory.append(trace_module.MemoryRecord(10, 0, "a", "unshard", 8, 8, 0))
    tracer.memory.append(trace_module.MemoryRecord(20, 0, "a", "reshard", -8, 0, 0))
    return tracer


def test_plot_memory_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = _small_trace().plot_memory(tmp_path / "mem-{rank}.png")
    assert out.name == "mem-0.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_memory_names_extra_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(ImportError, match=r"shardweave-fsdp\[plot\]"):
        _small_trace().plot_memory(tmp_path / "mem.png")
