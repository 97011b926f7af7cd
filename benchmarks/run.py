"""Benchmark shardweave's ``fully_shard`` and ``replicate`` against torch's on the same models.

Run::

    python benchmarks/run.py [--world-size 2] [--steps N] [--json bench-results/fsdp.json]

Spawns ``--world-size`` CPU processes (gloo over a ``FileStore`` in a temporary directory, so
no port is ever bound) and, for each workload, builds one model per implementation from the
same seed and trains them side by side on the same per-rank batches:

* ``mlp16``: 16 x (Linear(64, 64) + ReLU), each pair ``fully_shard``-ed, then the root; SGD.
* ``gpt``: the demo's GPT (``demos/model.py``), each block ``fully_shard``-ed, then the root; AdamW.
* ``replicate``: the same GPT and AdamW under data parallelism, three ways: ``shardweave``
  (``shardweave.replicate.replicate`` per block, then the root), ``torch-replicate`` (torch's
  FSDP-engine ``replicate_with_fsdp.replicate``, the same way) and ``ddp``
  (``DistributedDataParallel`` on the plain model). Fewer timed steps by default (three
  implementations share the time budget); the minimum traffic is one all-reduce of every
  gradient byte per step.

Timed steps alternate A/B/B/A between the implementations so slow drift (thermal, other load)
hits both equally; a step's time is the slowest rank's. One extra step per implementation runs
under a dispatch mode that records every c10d collective, so the report also gives collectives
and bytes per step by kind, next to the theoretical minimum for the sharding layout.

If ``shardweave.fsdp`` or ``shardweave.replicate`` does not import (or fails while running),
the report says so and the torch numbers are still produced.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demos"))
from model import GPT, GPTConfig
from train_gpt import load_fully_shard

# Implementation names as reports and ``--impls`` spell them; a workload maps each of its
# implementations to an engine (``shardweave`` means ``fully_shard`` in the FSDP workloads and
# ``replicate`` in the replicate one).
FSDP_IMPLS: Final = {"shardweave": "shardweave", "torch": "torch"}
REPLICATE_IMPLS: Final = {
    "shardweave": "shardweave.replicate",
    "torch-replicate": "torch-replicate",
    "ddp": "ddp",
}
IMPLS: Final = ("shardweave", "torch", "torch-replicate", "ddp")
# Engines the crash fallback keeps (everything that is not shardweave's).
TORCH_ENGINES: Final = ("torch", "torch-replicate", "ddp")
KINDS: Final = ("all_gather", "reduce_scatter", "all_reduce", "other")
# A hung collective (say one rank raised mid-step) becomes an error instead of a hang; the
# parent then reruns with torch alone.
COLLECTIVE_TIMEOUT: Final = datetime.timedelta(seconds=120)

FullyShard = Callable[..., Any]


def load_engine(engine: str) -> FullyShard:
    """The per-module wrapper an engine applies (``ddp`` returns the DDP class itself)."""
    if engine in ("shardweave", "torch"):
        return load_fully_shard(engine)  # the demo's loader: the two are drop-in replacements
    if engine == "shardweave.replicate":
        from shardweave.replicate import replicate as sw_replicate

        return sw_replicate
    if engine == "torch-replicate":
        from torch.distributed._composable.replicate_with_fsdp import (
            replicate as torch_replicate,
        )

        return torch_replicate
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    raise ValueError(f"unknown engine {engine!r}")


def import_error(engine: str) -> str | None:
    try:
        load_engine(engine)
    except Exception as e:  # any failure, not just ImportError: a half-written package counts
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------------------
# Collective accounting


def collective_kind(op_name: str) -> str | None:
    """Map a dispatcher op name to a collective kind, or None if it is not a collective."""
    namespace = op_name.split(".", 1)[0]
    if namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
        return None
    name = op_name.replace("_", "")
    if "waittensor" in name or "barrier" in name or "monitored" in name:
        return None
    if "allgather" in name:
        return "all_gather"
    if "reducescatter" in name:
        return "reduce_scatter"
    if "allreduce" in name:
        return "all_reduce"
    return "other"


def tensor_bytes(obj: object) -> int:
    flat, _ = tree_flatten(obj)
    return sum(t.nbytes for t in flat if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives and their bytes as seen by the dispatcher.

    Works below whatever Python API an engine calls (``all_gather_into_tensor``,
    ``all_gather_single``, ``ProcessGroup`` methods, functional collectives), since all of
    them reach a ``c10d``/``_c10d_functional`` op. Bytes are counted the way the theoretical
    minimum is: an all-gather by its gathered (output) size, a reduce-scatter by its
    unreduced (input) size, an all-reduce by its tensor size. In-place c10d ops take
    ``(outputs, inputs, ...)`` while functional ones take the input and return the output,
    so the larger side of the first two arguments (and the result) is the full-size one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.bytes: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = collective_kind(str(func))
        if kind is not None:
            sides = [tensor_bytes(a) for a in args[:2]] + [tensor_bytes(out)]
            nbytes = sides[0] if kind == "all_reduce" else max(sides)
            self.counts[kind] += 1
            self.bytes[kind] += nbytes
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return out


# --------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    # Modules to fully_shard, in order (children before the root, which comes last).
    shard_units: Callable[[nn.Module], list[nn.Module]]
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    make_batch: Callable[[int], tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    # Implementation name -> engine (see ``load_engine``); the first is the one under test,
    # the others are the baselines its median step time is divided by.
    impls: dict[str, str] = field(default_factory=lambda: dict(FSDP_IMPLS))
    # Timed steps per implementation when ``--steps`` is not given.
    default_steps: int = 30
    # "fsdp": fully_shard every unit; "replicate": replicate every unit (``ddp``: wrap the root).
    mode: str = "fsdp"

    @property
    def baselines(self) -> list[str]:
        return [impl for impl in self.impls if impl != "shardweave"]

    def wrap(self, engine: str, model: nn.Module) -> nn.Module:
        apply = load_engine(engine)
        if engine == "ddp":
            return apply(model)  # type: ignore[no-any-return]
        for unit in self.shard_units(model):
            apply(unit)
        return model


def _mlp16() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(16)))


def _mlp16_batch(rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)


def _mlp16_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out: torch.Tensor = model(batch[0])
    return (out - batch[1]).square().mean()


GPT_CONFIG: Final = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _gpt_batch(rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(2000 + rank)
    tokens = torch.randint(GPT_CONFIG.vocab_size, (8, GPT_CONFIG.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    _, loss = model(batch[0], batch[1])
    assert loss is not None
    return loss  # type: ignore[no-any-return]


def _gpt_units(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, GPT)
    return [*model.blocks, model]


WORKLOADS: Final = (
    Workload(
        name="mlp16",
        description="16 x (Linear(64,64)+ReLU), each fully_shard-ed + root; SGD; batch 32x64",
        build=_mlp16,
        shard_units=lambda m: [*m.children(), m],
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        make_batch=_mlp16_batch,
        loss=_mlp16_loss,
    ),
    Workload(
        name="gpt",
        description=(
            f"GPT {GPT_CONFIG.n_layer} blocks, n_embd {GPT_CONFIG.n_embd}, vocab "
            f"{GPT_CONFIG.vocab_size}: per-block fully_shard + root; AdamW; batch 8x"
            f"{GPT_CONFIG.block_size} tokens"
        ),
        build=lambda: GPT(GPT_CONFIG),
        shard_units=_gpt_units,
        make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        make_batch=_gpt_batch,
        loss=_gpt_loss,
    ),
    Workload(
        name="replicate",
        description=(
            f"GPT {GPT_CONFIG.n_layer} blocks, n_embd {GPT_CONFIG.n_embd}, vocab "
            f"{GPT_CONFIG.vocab_size}: per-block replicate + root (ddp: DistributedDataParallel"
            f" on the plain model); AdamW; batch 8x{GPT_CONFIG.block_size} tokens"
        ),
        build=lambda: GPT(GPT_CONFIG),
        shard_units=_gpt_units,
        make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        make_batch=_gpt_batch,
        loss=_gpt_loss,
        impls=dict(REPLICATE_IMPLS),
        default_steps=12,
        mode="replicate",
    ),
)


def theoretical_min(model: nn.Module, units: list[nn.Module], world_size: int) -> dict[str, int]:
    """Bytes per training step that the sharding layout cannot avoid.

    Every group is all-gathered once in forward; groups that reshard after forward (all but
    the root, whose ``reshard_after_forward=None`` keeps it unsharded) are all-gathered again
    in backward; every group's gradients are reduce-scattered once. ``*_padded`` adds FSDP's
    padding of each parameter's dim 0 to a multiple of the world size.
    """
    claimed: set[nn.Parameter] = set()
    fwd = bwd = rs = fwd_pad = bwd_pad = rs_pad = groups_with_params = 0
    for unit in units:  # children first, so the root is left with what no child claimed
        params = [p for p in unit.parameters() if p not in claimed]
        claimed.update(params)
        groups_with_params += bool(params)
        full = sum(p.nbytes for p in params)
        padded = sum(
            math.ceil(p.shape[0] / world_size) * world_size * p[0].nbytes if p.dim() else p.nbytes
            for p in params
        )
        grad_full = sum(p.nbytes for p in params if p.requires_grad)
        grad_padded = sum(
            math.ceil(p.shape[0] / world_size) * world_size * p[0].nbytes if p.dim() else p.nbytes
            for p in params
            if p.requires_grad
        )
        is_root = unit is model
        fwd, fwd_pad = fwd + full, fwd_pad + padded
        if not is_root:
            bwd, bwd_pad = bwd + full, bwd_pad + padded
        rs, rs_pad = rs + grad_full, rs_pad + grad_padded
    return {
        "all_gather_bytes": fwd + bwd,
        "all_gather_bytes_padded": fwd_pad + bwd_pad,
        "reduce_scatter_bytes": rs,
        "reduce_scatter_bytes_padded": rs_pad,
        "all_reduce_bytes": 0,
        "groups": len(units),
        "groups_with_own_params": groups_with_params,
    }


def theoretical_min_replicate(model: nn.Module, units: list[nn.Module]) -> dict[str, int]:
    """Bytes per training step data parallelism cannot avoid: every gradient all-reduced once
    (the parameters are already whole on every rank, so nothing is gathered)."""
    claimed: set[nn.Parameter] = set()
    grads = groups_with_params = 0
    for unit in units:
        params = [p for p in unit.parameters() if p not in claimed]
        claimed.update(params)
        groups_with_params += bool(params)
        grads += sum(p.nbytes for p in params if p.requires_grad)
    return {
        "all_gather_bytes": 0,
        "all_gather_bytes_padded": 0,
        "reduce_scatter_bytes": 0,
        "reduce_scatter_bytes_padded": 0,
        "all_reduce_bytes": grads,
        "groups": len(units),
        "groups_with_own_params": groups_with_params,
    }


# --------------------------------------------------------------------------------------
# Worker


@dataclass
class ImplResult:
    error: str | None = None
    step_ms: list[float] = field(default_factory=list)  # slowest rank's time, per timed step
    comm_counts: dict[str, int] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_ops: dict[str, int] = field(default_factory=dict)
    loss_first: float | None = None
    loss_last: float | None = None


class _Runner:
    """One implementation's model + optimizer for one workload, on this rank."""

    def __init__(self, impl: str, workload: Workload, rank: int) -> None:
        torch.manual_seed(0)  # same init for every implementation and every rank
        self.model = workload.wrap(workload.impls[impl], workload.build())
        self.opt = workload.make_optimizer(self.model.parameters())
        self.batch = workload.make_batch(rank)
        self.loss_fn = workload.loss
        self.losses: list[float] = []

    def step(self) -> None:
        loss = self.loss_fn(self.model, self.batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.item())


def _all_agree(ok: bool) -> bool:
    # Every rank must take the same branch after a failure, or the next collective hangs.
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def _run_workload(
    workload: Workload, engines: list[str], args: argparse.Namespace, rank: int, world: int
) -> dict[str, Any]:
    steps = args.steps if args.steps is not None else workload.default_steps
    impls = [i for i, e in workload.impls.items() if i in args.impls and e in engines]
    results = {impl: ImplResult() for impl in impls}
    runners: dict[str, _Runner] = {}
    for impl in impls:
        err = None
        try:
            runner = _Runner(impl, workload, rank)
            for _ in range(args.warmup):
                runner.step()
            runners[impl] = runner
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            if rank == 0:
                traceback.print_exc()
        if not _all_agree(err is None):
            results[impl].error = err or "failed on another rank"
            runners.pop(impl, None)

    # A/B/B/A: each implementation runs first and last equally often, cancelling linear drift.
    active = list(runners)
    order: list[str] = []
    while len(order) < steps * len(active):
        order += active + active[::-1]
    order = order[: steps * len(active)]
    local_ms: dict[str, list[float]] = {impl: [] for impl in active}
    failed: dict[str, str] = {}
    for impl in order:
        if impl in failed:
            continue
        err = None
        dist.barrier()  # common start: a step's time then includes waiting for the slowest rank
        t0 = time.perf_counter()
        try:
            runners[impl].step()
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        local_ms[impl].append((time.perf_counter() - t0) * 1e3)
        if not _all_agree(err is None):
            failed[impl] = err or "failed on another rank"

    for impl in active:
        res = results[impl]
        if impl in failed:
            res.error = failed[impl]
            continue
        times = torch.tensor(local_ms[impl], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        res.step_ms = times.tolist()
        counter = CollectiveCounter()
        err = None
        try:
            with counter:
                runners[impl].step()
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        if not _all_agree(err is None):
            res.error = err or "failed on another rank"
            continue
        res.comm_counts, res.comm_bytes, res.comm_ops = counter.counts, counter.bytes, counter.ops
        losses = runners[impl].losses
        res.loss_first, res.loss_last = losses[0], losses[-1]

    medians = {impl: statistics.median(r.step_ms) for impl, r in results.items() if r.error is None}
    ratios = {
        f"median_ratio_shardweave_over_{base}": (
            medians["shardweave"] / medians[base]
            if "shardweave" in medians and base in medians
            else None
        )
        for base in workload.baselines
    }
    finals = {impl: r.loss_last for impl, r in results.items() if r.loss_last is not None}
    # Same init, same batches, same number of steps: a drop-in engine should land on (nearly)
    # the same loss; a large gap here means the timings compare different computations.
    names = list(workload.impls)
    loss_diffs = {
        f"{a} - {b}": abs(finals[a] - finals[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if a in finals and b in finals
    }
    reference = workload.build()
    units = workload.shard_units(reference)
    return {
        "description": workload.description,
        "num_params": sum(p.numel() for p in reference.parameters()),
        "timed_steps": steps,
        "theoretical_min": (
            theoretical_min_replicate(reference, units)
            if workload.mode == "replicate"
            else theoretical_min(reference, units, world)
        ),
        **ratios,
        # The largest gap between any two implementations (for two, just their gap).
        "loss_last_abs_diff": max(loss_diffs.values()) if loss_diffs else None,
        "loss_last_abs_diffs": loss_diffs,
        "results": {
            impl: {
                "error": r.error,
                "step_ms": {
                    "min": min(r.step_ms),
                    "median": statistics.median(r.step_ms),
                    "max": max(r.step_ms),
                    "samples": r.step_ms,
                }
                if r.step_ms
                else None,
                "comm_counts": r.comm_counts,
                "comm_bytes": r.comm_bytes,
                "comm_ops": r.comm_ops,
                "loss_first": r.loss_first,
                "loss_last": r.loss_last,
            }
            for impl, r in results.items()
        },
    }


def _worker(
    rank: int, world: int, store_path: str, engines: list[str], args: argparse.Namespace, out: str
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        selected = [w for w in WORKLOADS if w.name in args.workloads]
        report = {w.name: _run_workload(w, engines, args, rank, world) for w in selected}
        if rank == 0:
            Path(out).write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _spawn(engines: list[str], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="shardweave-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(
            _worker,
            args=(args.world_size, os.path.join(tmp, "store"), engines, args, out),
            nprocs=args.world_size,
            join=True,
        )
        result: dict[str, Any] = json.loads(Path(out).read_text())
        return result


# --------------------------------------------------------------------------------------
# Report


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
        f"{meta['torch_version']}, {meta['timed_steps']} timed steps per impl (A/B/B/A), "
        f"{meta['warmup_steps']} warm-up",
    ]
    for impl, info in report["impls"].items():
        status = "ok" if info["error"] is None else f"UNAVAILABLE ({info['error']})"
        lines.append(f"  {impl:<20} {status}")
    for name, w in report["workloads"].items():
        steps = w.get("timed_steps", meta["timed_steps"])
        steps_note = f"; {steps} timed steps per impl" if steps != meta["timed_steps"] else ""
        lines += [
            "",
            f"[{name}] {w['description']}; {w['num_params']:,} parameters{steps_note}",
        ]
        width = max([11, *(len(impl) for impl in w["results"])])
        lines.append(
            f"  {'impl':<{width}} {'min ms':>8} {'median':>8} {'max ms':>8}   "
            f"{'all-gather':>19} {'reduce-scatter':>19} {'all-reduce':>14}  "
            f"{'loss first->last':>17}"
        )
        for impl, r in w["results"].items():
            if r["error"] is not None:
                lines.append(f"  {impl:<{width}} FAILED: {r['error']}")
                continue
            t, c, b = r["step_ms"], r["comm_counts"], r["comm_bytes"]
            lines.append(
                f"  {impl:<{width}} {t['min']:>8.2f} {t['median']:>8.2f} {t['max']:>8.2f}   "
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
            f"  {'minimum':<{width}} {'':>8} {'':>8} {'':>8}   "
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
                lines.append(f"  {impl} bytes / minimum: " + ", ".join(parts))
        for pair, diff in w.get("loss_last_abs_diffs", {}).items():
            lines.append(f"  last loss |{pair}|: {diff:.3g}")
        for key, ratio in w.items():
            if key.startswith("median_ratio_shardweave_over_"):
                base = key.removeprefix("median_ratio_shardweave_over_")
                lines.append(
                    f"  median step time shardweave / {base}: "
                    + (f"{ratio:.3f}" if ratio is not None else "n/a (needs both implementations)")
                )
    return "\n".join(lines)


def _ratio(actual: int, minimum: int) -> str:
    return f"{actual / minimum:.4f}" if minimum else "n/a"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per implementation (default: "
        + ", ".join(f"{w.name} {w.default_steps}" for w in WORKLOADS)
        + ")",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation")
    p.add_argument(
        "--json",
        type=Path,
        default=Path("bench-results/fsdp.json"),
        help="write the full report here (default %(default)s; git-ignored)",
    )
    p.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help="comma-separated subset of: " + ",".join(IMPLS) + " (default all; shardweave is "
        "fully_shard in the FSDP workloads and replicate in the replicate one)",
    )
    p.add_argument(
        "--workloads",
        default=",".join(w.name for w in WORKLOADS),
        help="comma-separated subset of: " + ",".join(w.name for w in WORKLOADS),
    )
    args = p.parse_args(argv)
    args.impls = [s for s in args.impls.split(",") if s]
    args.workloads = [s for s in args.workloads.split(",") if s]
    if unknown := set(args.impls) - set(IMPLS):
        p.error(f"--impls: unknown {sorted(unknown)}; choose from {list(IMPLS)}")
    if unknown := set(args.workloads) - {w.name for w in WORKLOADS}:
        p.error(f"--workloads: unknown {sorted(unknown)}")
    if (args.steps is not None and args.steps < 1) or args.warmup < 1 or args.world_size < 1:
        p.error("--steps, --warmup and --world-size must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Engines the selected workloads and implementations need, in first-use order.
    engines = list(
        dict.fromkeys(
            engine
            for w in WORKLOADS
            if w.name in args.workloads
            for impl, engine in w.impls.items()
            if impl in args.impls
        )
    )
    impl_info: dict[str, dict[str, Any]] = {
        engine: {"error": import_error(engine)} for engine in engines
    }
    runnable = [engine for engine in engines if impl_info[engine]["error"] is None]
    for engine, info in impl_info.items():
        if info["error"] is not None:
            print(f"benchmark: {engine} unavailable: {info['error']}", file=sys.stderr)
    if not runnable:
        print("benchmark: no implementation to run", file=sys.stderr)
        return 1

    t0 = time.perf_counter()
    try:
        workloads = _spawn(runnable, args)
    except Exception as e:
        fallback = [engine for engine in runnable if engine in TORCH_ENGINES]
        if not fallback or fallback == runnable:
            raise
        # A crash or hang in one implementation must not cost the others' numbers.
        print(
            f"benchmark: run with {runnable} failed ({type(e).__name__}: {e}); "
            f"rerunning with {fallback} only",
            file=sys.stderr,
        )
        for engine in runnable:
            if engine not in fallback:
                impl_info[engine]["error"] = f"crashed the benchmark: {type(e).__name__}: {e}"
        workloads = _spawn(fallback, args)

    report = {
        "meta": {
            "world_size": args.world_size,
            # Per workload under workloads.<name>.timed_steps; this is --steps, or the default
            # of the FSDP workloads.
            "timed_steps": args.steps if args.steps is not None else Workload.default_steps,
            "warmup_steps": args.warmup,
            "backend": "gloo",
            "device": "cpu",
            "torch_version": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "wall_s": round(time.perf_counter() - t0, 2),
            "step_time": "slowest rank, barrier before each step; order A/B/B/A",
            "bytes": "all-gather: gathered output; reduce-scatter: unreduced input; "
            "all-reduce: tensor size",
        },
        "impls": impl_info,
        "workloads": workloads,
    }
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nreport written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
