"""``fit()``: search the ``fully_shard`` configurations a user would try by hand, keep those whose
predicted peak (activations and communication buffers included) fits a per-rank budget, and
rank them by a stated step-time estimate (``python -m shardweave.fsdp.plan --fit 24GiB``).

``fit`` reads as its four steps: the search space (``_search_space``), the fake steps
(``_fake_steps``: one per activation trace, ``_recording``), every configuration replayed and
timed (``_replays``, the time model of ``_time_model``), and the answer (``_answer``: what
fits, fastest first, or the advice when nothing does).

Design note: one fake step per activation trace
    What a configuration changes splits in two. The wrapping, the compute dtype
    (``param_dtype``) and the activation checkpointing change which tensors the model makes:
    each such choice runs one fake-tensor forward and backward (``_activations``) whose calls
    into the ``Replay`` are recorded (hook calls, activation allocations and frees, gradients
    moved to "unsharded gradients"). Everything else (``reshard_after_forward`` of the blocks
    and of the root, the reduce dtype, CPU offload) only changes the replay's per-group bytes
    and rules, not the hooks' order or the activations: those configurations replay the
    recorded calls into a fresh ``Replay`` built from their own traffic, with no tensors. So a
    search of ``W`` wrappings costs ``W x checkpointing choices x compute dtypes`` fake steps
    and one cheap replay per configuration.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, astuple, dataclass, field, replace
from typing import Any, Final

import torch
from torch import nn

from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy
from shardweave.fsdp.plan._activations import LossFn, SampleInput, Step, StepFn, resolve_step
from shardweave.fsdp.plan._fit_config import (
    DTYPES,
    FitConfig,
    Target,
    every_label,
    parse_target,
    reduce_label,
)
from shardweave.fsdp.plan._layouts import (
    ACCUMULATION_CHOICES,
    Layout,
    layouts,
    microbatches,
    sample_of,
)
from shardweave.fsdp.plan._model import (
    ROOT_KEY,
    GroupSpec,
    PlanError,
    discover_groups,
    module_wrap_predicate,
)
from shardweave.fsdp.plan._plan import OPTIMIZER_STATES, group_plans, parse_mesh
from shardweave.fsdp.plan._recording import compress, flops_and_trace, play
from shardweave.fsdp.plan._report import format_bytes
from shardweave.fsdp.plan._schedule import Replay
from shardweave.fsdp.plan._sharding import grad_made_in
from shardweave.fsdp.plan._time_model import DEVICES, STEP_TERMS, Device, time_terms

__all__ = ["FitResult", "Fitted", "fit", "parse_budget"]

_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_budget(budget: int | float | str) -> int:
    """Bytes per rank: a number of bytes, or a number with a unit. ``GiB``/``G`` are powers of
    two; ``GB`` is 10^9 (as SI and disk vendors define it; note a GPU sold as "80GB" holds
    about 80 GiB): ``24GiB`` = 25,769,803,776 bytes, ``24GB`` = 24,000,000,000."""
    if isinstance(budget, bool):
        raise PlanError(f"fit: budget must be bytes or e.g. '24GiB', got {budget!r}")
    if isinstance(budget, (int, float)):
        value, unit = float(budget), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", budget)
        if m is None or m.group(2).lower() not in _UNITS:
            raise PlanError(
                f"fit: cannot read the budget {budget!r}; pass bytes or a number with a unit: "
                "B, KiB, MiB, GiB, TiB (powers of 2; K/M/G/T too) or KB, MB, GB, TB (powers of 10)"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"fit: the budget must be a positive size, got {budget!r}")
    return int(value * _UNITS[unit])


@dataclass(frozen=True)
class Fitted:
    config: FitConfig
    peak_bytes: int
    step_seconds: float
    terms: dict[str, float]  # STEP_TERMS and comm (seconds), flops
    dominant: str
    # Twins: configurations with this peak and step time that differ from ``config`` in one
    # setting only (which then changes neither): one row, these its alternatives.
    alternatives: tuple[FitConfig, ...] = ()

    def margin(self, budget: int) -> int:
        return budget - self.peak_bytes

    def alternative_settings(self) -> list[dict[str, object]]:
        """Each alternative as the settings it changes, e.g. ``{"root_reshard_after_forward":
        True}``."""
        mine = asdict(self.config)
        return [{k: v for k, v in asdict(alt).items() if mine[k] != v} for alt in self.alternatives]


@dataclass(frozen=True)
class FitResult:
    budget_bytes: int
    kept: tuple[Fitted, ...]  # fitting configurations, fastest first
    searched: int
    search_seconds: float
    search_space: dict[str, object]
    smallest: Fitted | None  # the smallest peak found (the answer when nothing fits)
    advice: tuple[str, ...] = ()
    fake_steps: int = 0
    mesh: tuple[int, ...] = ()
    folded: tuple[str, ...] = ()  # per folded fake step, what ran (``_fold``)
    device: str = ""
    step: str = ""  # the step planned, up to its loss (``_activations.resolve_step``)
    target: str = ""  # the device type and backend planned for (``Target``)
    global_batch: int | None = None  # with it, layouts and microbatches were searched
    ruled_out: int = 0  # searched but not replayed: shards and optimizer state over budget

    @property
    def best(self) -> Fitted | None:
        return self.kept[0] if self.kept else None

    def to_dict(self) -> dict[str, object]:
        def row(f: Fitted) -> dict[str, object]:
            return {
                "config": asdict(f.config),
                "peak_bytes": f.peak_bytes,
                "step_seconds": f.step_seconds,
                "margin_bytes": self.budget_bytes - f.peak_bytes,
                "terms_seconds": f.terms,
                "dominant": f.dominant,
                "alternatives": f.alternative_settings(),
            }

        return {
            "target": self.target,
            "budget_bytes": self.budget_bytes,
            "step": self.step,
            "kept": [row(f) for f in self.kept],
            "searched": self.searched,
            "ruled_out_before_replay": self.ruled_out,
            "global_batch": self.global_batch,
            "search_seconds": self.search_seconds,
            "search_space": self.search_space,
            "fake_steps": self.fake_steps,
            "folded": list(self.folded),
            "smallest": None if self.smallest is None else row(self.smallest),
            "advice": list(self.advice),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str) + "\n"


# --- step 1: the problem and the search space --------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """What every step of the search reads: the model, the step it trains, the mesh, the
    optimizer, the backend and the time model's numbers."""

    factory: Callable[[], nn.Module]
    meta_model: nn.Module
    sample: SampleInput
    step: Step
    budget_bytes: int
    dims: tuple[int, ...]  # the mesh fit was given
    states: int
    target: Target
    device: Device
    device_flops: float | None
    layouts: tuple[Layout, ...]  # the first: FSDP over all ranks, or the mesh given
    microbatches: tuple[tuple[int, int], ...]  # (local batch, accumulation steps)
    global_batch: int | None
    fold: bool
    specs_cache: dict[tuple[str | None, int], list[GroupSpec]] = field(default_factory=dict)
    # group_plans per configuration: traces of other checkpointing and local batches share it
    plans_cache: dict[tuple[Any, ...], tuple[Any, Any]] = field(default_factory=dict)

    @property
    def shard_size(self) -> int:  # the first layout's: what the fake steps' groups assume
        return self.layouts[0].shard


@dataclass(frozen=True)
class _Space:
    """The choices ``fit`` combines (see ``describe`` for what the answer prints of them)."""

    wraps: tuple[str | None, ...]
    reshards: tuple[bool | int, ...]
    root_reshards: tuple[bool, ...]
    precisions: tuple[tuple[str | None, str | None], ...]
    checkpoints: tuple[int, ...]
    offloads: tuple[bool, ...]
    lower_allowed: bool

    def describe(self, problem: _Problem) -> dict[str, object]:
        links, dev = problem.layouts[0].links, problem.device
        shapes: dict[str, object] = {}
        if problem.global_batch is not None:
            shapes = {
                "layout (replicate x shard)": [x.label for x in problem.layouts],
                "microbatch (local batch x accumulation)": [
                    f"{b}x{a}" for b, a in problem.microbatches
                ],
            }
        return {
            **shapes,
            "wrap": [w or "(root only)" for w in self.wraps],
            "reshard_after_forward": list(self.reshards)
            + ([f"{_NODE_RESHARDS} where it divides the shard size"] if shapes else []),
            "root_reshard_after_forward": list(self.root_reshards),
            "mixed_precision (param, reduce)": [
                [p or "model dtype", reduce_label(p, r, "model dtype")] for p, r in self.precisions
            ],
            "activation_checkpointing": [every_label(k) for k in self.checkpoints],
            "cpu_offload": list(self.offloads)
            if problem.target.accelerator
            else "not searched: on a CPU target the host is the device, offload moves nothing off it",
            "not searched (fixed)": {
                "forward_prefetch": 0,
                "backward_prefetch": 1,
                "reduce_scatter_max_input_buffers": 1,
                "why": "the planner models them, but their memory effect is small and a time "
                "model of deeper prefetch is not built yet",
            },
            "time model": {
                "device": dev.source,
                "compute_flops_per_s": {
                    "low precision": problem.device_flops or dev.bf16_flops,
                    "fp32": problem.device_flops or dev.fp32_flops,
                },
                "shard_link_bytes_per_s": links.shard_bw
                if not shapes
                else "NVLink within a node, the network across nodes",
                "replicate_link_bytes_per_s": links.repl_bw
                if not shapes
                else "NVLink when the whole mesh is one node, else the network",
                "devices_per_node": dev.gpus_per_node,
                "host_link_bytes_per_s": links.host_bw,
                "device_memory_bytes_per_s": dev.hbm_bytes_per_s,
                "host_memory_bytes_per_s": dev.host_memory_bytes_per_s,
                "collective_latency_s": {
                    "base": dev.collective_latency_s,
                    "per_ring_step_nvlink": dev.nvlink_step_latency_s,
                    "per_ring_step_network": dev.network_step_latency_s,
                },
                "step": " + ".join(STEP_TERMS),
            },
        }


def _problem(
    factory: Callable[[], nn.Module],
    sample: SampleInput,
    step: tuple[StepFn | str | None, LossFn | None],
    budget: int | float | str,
    mesh: int | Sequence[int] | str,
    optimizer: str,
    target: Target,
    device: tuple[str | Device, float | None, int | None],
    links: dict[str, float | None],
    batch: tuple[int | None, Sequence[int]],
    fold: bool,
) -> _Problem:
    """The inputs checked and read: the meta model, the layouts and microbatches searched
    (one of each without a global batch), the time model's device."""
    budget_bytes = parse_budget(budget)
    dims = parse_mesh(mesh)
    states = OPTIMIZER_STATES[optimizer.lower().replace("-", "_")]
    name, device_flops, per_node = device
    dev = DEVICES[name] if isinstance(name, str) else name
    if per_node is not None:
        dev = replace(dev, gpus_per_node=per_node)
    global_batch, accumulation = batch
    meta_model = _meta_model(factory)
    return _Problem(
        factory,
        meta_model,
        sample,
        resolve_step(*step, meta_model),
        budget_bytes,
        dims,
        states,
        target,
        dev,
        device_flops,
        layouts(dims, dev, global_batch is not None, links),
        microbatches(global_batch, math.prod(dims), sample, accumulation),
        global_batch,
        fold,
    )


def _meta_model(factory: Callable[[], nn.Module]) -> nn.Module:
    if not callable(factory) or isinstance(factory, nn.Module):
        raise PlanError("fit: pass the model as a zero-argument factory (built on meta/fake)")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:
        raise PlanError(
            f"fit: the model factory cannot build on the meta device "
            f"({type(exc).__name__}: {exc}); build parameters from shapes only"
        ) from exc
    if not isinstance(model, nn.Module):
        raise PlanError(f"fit: the factory returned {type(model).__name__}")
    return model


def _search_space(
    problem: _Problem,
    wrap: Sequence[str] | str | None,
    allow_lower_precision: bool,
    lower_dtype: str,
    checkpoint_choices: Sequence[int],
    offload_choices: Sequence[bool],
) -> _Space:
    candidates = _repeated_classes(problem.meta_model)
    present = {type(m).__name__ for m in problem.meta_model.modules()}
    if wrap is None:
        wraps: list[str | None] = [*candidates[:3], None]
    else:
        names = [w.strip() for w in (wrap.split(",") if isinstance(wrap, str) else wrap)]
        missing = [n for n in names if n not in present]
        if missing:
            raise PlanError(
                f"fit: wrap class(es) {missing} are not in the model; candidates (repeated "
                f"blocks): {candidates or sorted(present)}"
            )
        wraps = list(names)
    reshards = _reshards(problem.shard_size) if problem.global_batch is None else [True, False]
    precisions: list[tuple[str | None, str | None]] = [(None, None)]
    if allow_lower_precision:
        precisions += [(lower_dtype, "fp32"), (lower_dtype, None)]
    # Offload moves bytes off the device only where the device is not the host.
    offloads = tuple(offload_choices) if problem.target.accelerator else (False,)
    return _Space(
        wraps=tuple(wraps),
        reshards=tuple(reshards),
        root_reshards=(False, True),
        precisions=tuple(precisions),
        checkpoints=tuple(checkpoint_choices),
        offloads=offloads,
        lower_allowed=allow_lower_precision,
    )


_NODE_RESHARDS: Final = (8, 4, 2)


def _reshards(shard_size: int) -> list[bool | int]:
    """``True``, ``False``, and resharding to a node-sized group where it divides the shard
    size (the first of ``_NODE_RESHARDS``)."""
    found: list[bool | int] = [True, False]
    for n in _NODE_RESHARDS:
        if 1 < n < shard_size and shard_size % n == 0:
            found.append(n)
            break
    return found


def _repeated_classes(model: nn.Module) -> list[str]:
    """Classes with parameters that occur at least twice, most parameters first: the blocks."""
    counts: Counter[str] = Counter()
    numel: dict[str, int] = {}
    for m in model.modules():
        if m is model:
            continue
        n = sum(p.numel() for p in m.parameters())
        if n == 0:
            continue
        name = type(m).__name__
        counts[name] += 1
        numel[name] = numel.get(name, 0) + n
    repeated = sorted((c for c, k in counts.items() if k >= 2), key=lambda c: -numel[c])
    # Prefer the model's own block classes over torch's leaf layers (nn.Linear, nn.LayerNorm):
    # wrapping every Linear is rarely what a user tries first; leaves are kept when nothing else
    # repeats (a plain nn.Sequential MLP stack).
    own = [c for c in repeated if c not in _TORCH_NN]
    return own or repeated


_TORCH_NN: Final = frozenset(n for n in dir(nn) if isinstance(getattr(nn, n), type))


# --- step 2: one fake step per activation trace ------------------------------------------------


@dataclass
class _Trace:
    """One recorded fake step: what it ran (wrapping, compute dtype, checkpointing) and what
    every configuration sharing it replays."""

    wrap: str | None
    specs: list[GroupSpec]
    precision: tuple[str | None, str | None]
    mp: MixedPrecisionPolicy
    checkpoint_every: int
    microbatch: tuple[int, int]  # (local batch, accumulation steps)
    events: list[tuple[Any, ...]]
    flops: float
    flops_per_s: float
    folded: str | None
    ran: bool = True  # False: it shares the fake step of an earlier trace


def _fake_steps(problem: _Problem, space: _Space) -> Iterator[_Trace]:
    """Each wrapping x compute dtype x checkpointing x local batch choice's fake step,
    recorded (one at a time: a trace's events are dropped once its configurations are
    replayed). Precisions that differ only in a reduce dtype that leaves the gradients' dtype
    as it is share one fake step (its recorded calls are the same)."""
    for w in space.wraps:
        pred = module_wrap_predicate(w)

        def specs_of(model: nn.Module, pred: Any = pred) -> list[GroupSpec]:
            return discover_groups(model, pred, shard_size=problem.shard_size)

        specs = specs_of(problem.meta_model)
        n_blocks = sum(1 for s in specs if s.key != ROOT_KEY)
        acs = [k for k in space.checkpoints if k == 0 or (w is not None and k <= max(n_blocks, 1))]
        for every, micro in itertools.product(acs, problem.microbatches):
            ran: dict[tuple[Any, ...], tuple[list[tuple[Any, ...]], float, str | None]] = {}
            for pd, rd in space.precisions:
                mp = MixedPrecisionPolicy(param_dtype=DTYPES[pd], reduce_dtype=DTYPES[rd])
                key = (mp.param_dtype, _grad_dtypes(specs, mp))
                shared = key in ran
                if not shared:
                    ran[key] = _record(problem, specs, specs_of, mp, w, every, micro[0])
                events, flops, folded = ran[key]
                yield _Trace(
                    w,
                    specs,
                    (pd, rd),
                    mp,
                    every,
                    micro,
                    events,
                    flops,
                    _flops_per_s(problem, specs, mp),
                    None if shared else folded,
                    ran=not shared,
                )


def _grad_dtypes(specs: list[GroupSpec], mp: MixedPrecisionPolicy) -> tuple[str, ...]:
    """The dtypes the fake step's gradients are made in (``grad_made_in``)."""
    found = set()
    for s in specs:
        for p in s.params:
            if p.requires_grad:
                compute = mp.param_dtype if p.dtype.is_floating_point else None
                made = grad_made_in(p.dtype, compute or p.dtype, mp.reduce_dtype)
                found.add(str(made))
    return tuple(sorted(found))


def _record(
    problem: _Problem,
    specs: list[GroupSpec],
    specs_of: Callable[[nn.Module], list[GroupSpec]],
    mp: MixedPrecisionPolicy,
    wrap: str | None,
    every: int,
    local_batch: int,
) -> tuple[list[tuple[Any, ...]], float, str | None]:
    """One fake step, recorded and compressed (``_recording.compress``): its events, FLOPs and
    what a fold ran."""
    base_traffic = group_plans(
        specs,
        True,
        False,
        problem.shard_size,
        mp,
        problem.states,
        problem.layouts[0].replicate,
        problem.target.backend,
        False,
    )[1]
    events, flops, stack = flops_and_trace(
        problem.factory,
        specs_of,
        base_traffic,
        sample_of(problem.sample, local_batch),
        problem.step.run,
        mp.param_dtype,
        wrap,
        every,
        problem.fold,
        mp.reduce_dtype,
    )
    folded = None if stack is None else f"{stack.fqn}: {stack.blocks} blocks run as {stack.keep}"
    return compress(events), flops, folded


def _flops_per_s(problem: _Problem, specs: list[GroupSpec], mp: MixedPrecisionPolicy) -> float:
    low = mp.param_dtype in (torch.bfloat16, torch.float16) or (
        mp.param_dtype is None
        and any(p.dtype in (torch.bfloat16, torch.float16) for s in specs for p in s.params)
    )
    dev = problem.device
    return problem.device_flops or (dev.bf16_flops if low else dev.fp32_flops)


# --- step 3: every configuration sharing a trace, replayed and timed ---------------------------


@dataclass
class _Pruned:
    """Configurations not replayed: their shards and optimizer state alone are over the budget
    and above a peak already found (so none of them is kept, nor the smallest)."""

    smallest_peak: int | None = None
    count: int = 0


def _replays(problem: _Problem, space: _Space, trace: _Trace, pruned: _Pruned) -> Iterator[Fitted]:
    """Every configuration sharing ``trace``: each layout, the blocks' and the root's
    resharding, offload."""
    local_batch, accumulation = trace.microbatch
    for layout in problem.layouts:
        specs = _specs(problem, trace.wrap, layout.shard)
        # With no wrapped blocks the blocks' reshard is moot: one value.
        reshards = _reshards(layout.shard) if trace.wrap is not None else [True]
        if problem.global_batch is None and trace.wrap is not None:
            reshards = list(space.reshards)
        for reshard, root_reshard, offload in itertools.product(
            reshards, space.root_reshards, space.offloads
        ):
            cfg = FitConfig(
                wrap=trace.wrap,
                reshard_after_forward=reshard,
                root_reshard_after_forward=root_reshard,
                param_dtype=trace.precision[0],
                reduce_dtype=trace.precision[1],
                checkpoint_every=trace.checkpoint_every,
                offload=offload,
                target=str(problem.target),
                mesh=layout.dims,
                local_batch=local_batch,
                grad_accumulation=accumulation,
            )
            fitted = _replay(problem, trace, cfg, layout, specs, pruned)
            if fitted is not None:
                yield fitted


def _specs(problem: _Problem, wrap: str | None, shard_size: int) -> list[GroupSpec]:
    key = (wrap, shard_size)
    if key not in problem.specs_cache:
        pred = module_wrap_predicate(wrap)
        problem.specs_cache[key] = discover_groups(problem.meta_model, pred, shard_size=shard_size)
    return problem.specs_cache[key]


def _replay(
    problem: _Problem,
    trace: _Trace,
    cfg: FitConfig,
    layout: Layout,
    specs: list[GroupSpec],
    pruned: _Pruned,
) -> Fitted | None:
    """One configuration's peak (the trace replayed into its own bytes: the last microbatch's,
    see ``_layouts``) and step time; None when pruned (``_Pruned``)."""
    reshard = cfg.reshard_after_forward
    key: tuple[Any, ...] = (cfg.wrap, layout.dims, type(reshard), reshard)
    key += (cfg.root_reshard_after_forward, trace.precision, cfg.offload)
    if key not in problem.plans_cache:
        problem.plans_cache[key] = group_plans(
            specs,
            reshard,
            cfg.root_reshard_after_forward,
            layout.shard,
            trace.mp,
            problem.states,
            layout.replicate,
            problem.target.backend,
            cfg.offload,
        )
    plans, traffic = problem.plans_cache[key]
    held = 0
    if not cfg.offload:
        held = sum(g.sharded_param_bytes + g.optimizer_state_bytes for g in plans)
    floor = pruned.smallest_peak
    if held > problem.budget_bytes and floor is not None and held >= floor:
        pruned.count += 1
        return None
    accumulation = cfg.grad_accumulation
    replay = Replay(
        traffic,
        keep_timeline=False,
        stream_ordered=problem.target.accelerator,
        set_to_none=accumulation == 1,
    )
    play(replay, trace.events)
    peak = held + replay.result.peak_dynamic_bytes
    pruned.smallest_peak = peak if floor is None else min(floor, peak)
    terms = _step_terms(trace, plans, replay.result.all_gathers, layout, cfg)
    step = sum(terms[k] for k in STEP_TERMS)
    dominant = max(STEP_TERMS, key=lambda k: terms[k])
    return Fitted(cfg, peak, step, terms, dominant)


def _step_terms(
    trace: _Trace, plans: Any, all_gathers: dict[str, int], layout: Layout, cfg: FitConfig
) -> dict[str, float]:
    """One optimizer step's terms: ``a`` microbatches (the HSDP all-reduce on the last only)
    and one optimizer step."""
    args = (plans, all_gathers, trace.flops, trace.flops_per_s, layout.links, cfg.offload)
    last = time_terms(*args)
    a = cfg.grad_accumulation
    if a == 1:
        return last
    other = time_terms(*args, all_reduce=False)
    terms = {k: last[k] + (a - 1) * other[k] for k in last}
    terms["optimizer"] = last["optimizer"]
    return terms


# --- step 4: the answer ------------------------------------------------------------------------


def _answer(
    problem: _Problem,
    space: _Space,
    rows: list[Fitted],
    traces: list[_Trace],
    pruned: _Pruned,
    started: float,
) -> FitResult:
    """What fits, fastest first (ties: the smaller peak), or the smallest peak and advice."""
    budget = problem.budget_bytes
    kept = _fold_twins(
        sorted(
            (f for f in rows if f.peak_bytes <= budget),
            key=lambda f: (f.step_seconds, f.peak_bytes),
        )
    )
    smallest = min(rows, key=lambda f: f.peak_bytes) if rows else None
    advice: list[str] = []
    if not kept and smallest is not None:
        advice = _advice(smallest, budget, problem, space)
    return FitResult(
        budget_bytes=budget,
        kept=tuple(kept),
        searched=len(rows) + pruned.count,
        search_seconds=round(time.perf_counter() - started, 3),
        search_space=space.describe(problem),
        smallest=smallest,
        advice=tuple(advice),
        fake_steps=sum(t.ran for t in traces),
        folded=tuple(t.folded for t in traces if t.folded is not None),
        mesh=problem.dims,
        device=problem.device.source,
        step=problem.step.description,
        target=str(problem.target),
        global_batch=problem.global_batch,
        ruled_out=pruned.count,
    )


def _fold_twins(ranked: list[Fitted]) -> list[Fitted]:
    """Rows with the same peak and step time whose configurations differ in one setting only
    are one row (the first in the search's order), the others listed as its alternatives;
    twins of an alternative join its row too (several settings may each change nothing)."""
    rows: list[Fitted] = []
    by_cost: dict[tuple[int, float], list[int]] = {}
    for f in ranked:
        cost = (f.peak_bytes, f.step_seconds)
        twin = next((i for i in by_cost.get(cost, []) if _one_apart(rows[i], f.config)), None)
        if twin is None:
            by_cost.setdefault(cost, []).append(len(rows))
            rows.append(f)
        else:
            first = rows[twin]
            rows[twin] = replace(first, alternatives=(*first.alternatives, f.config))
    return rows


def _one_apart(row: Fitted, cfg: FitConfig) -> bool:
    """``cfg`` differs from the row's configuration, or from one of its alternatives, in one
    setting only."""
    return any(
        sum(a != b for a, b in zip(astuple(c), astuple(cfg), strict=True)) == 1
        for c in (row.config, *row.alternatives)
    )


def _advice(smallest: Fitted, budget: int, problem: _Problem, space: _Space) -> list[str]:
    """What would make it fit; each item applies on the target (no offload on a CPU one)."""
    shard_size = problem.shard_size
    over = smallest.peak_bytes - budget
    out = [
        f"nothing fits {format_bytes(budget)}: the smallest peak found is "
        f"{format_bytes(smallest.peak_bytes)} ({format_bytes(over)} over) with "
        f"{smallest.config.describe()}"
    ]
    out.append(
        f"more ranks: {2 * shard_size} ranks halve the sharded parameters, gradients and "
        "optimizer state (activations per rank stay)"
    )
    if problem.global_batch is None:
        out.append(
            "a smaller sample input (fewer sequences or tokens per rank) shrinks activations; "
            "with --global-batch fit also searches accumulation steps and HSDP layouts"
        )
    else:
        out.append("more accumulation steps (--accumulation) shrink the local batch's activations")
    if True not in space.offloads and problem.target.accelerator:
        out.append("allow CPU offload (params, grads and optimizer state in host memory)")
    if not space.lower_allowed:
        out.append("allow lower precision (--allow-lower-precision: bf16 parameters)")
    return out


def fit(
    model_factory: Callable[[], nn.Module],
    *,
    mesh: int | Sequence[int] | str,
    sample_input: SampleInput,
    budget: int | float | str,
    wrap: Sequence[str] | str | None = None,
    allow_lower_precision: bool = False,
    lower_dtype: str = "bf16",
    optimizer: str = "adamw",
    backend: str | None = None,
    target: str | Target | None = None,
    loss_fn: LossFn | None = None,
    step: StepFn | str | None = None,
    device: str | Device = "h100",
    device_flops: float | None = None,
    shard_link_bytes_per_s: float | None = None,
    replicate_link_bytes_per_s: float | None = None,
    host_link_bytes_per_s: float | None = None,
    checkpoint_choices: Sequence[int] = (0, 1, 2),
    offload_choices: Sequence[bool] = (False, True),
    fold: bool = True,
    global_batch: int | None = None,
    devices_per_node: int | None = None,
    accumulation_choices: Sequence[int] = ACCUMULATION_CHOICES,
) -> FitResult:
    """Search configurations of ``fully_shard`` for the ones whose predicted per-rank peak fits
    ``budget``, fastest (by the step-time estimate of ``_time_model``) first.

    Args:
        model_factory: zero-argument callable building the model (built under fake tensors).
        mesh: shard size (``1024``) or ``(replicate, shard)`` / ``"8x128"`` for HSDP.
        sample_input: one step's input per rank, ``(shape, dtype)``, a tensor or a factory.
        target: the device type and backend planned for (``Target``): ``"cuda/nccl"`` (the
            default), ``"cpu/gloo"``, ``"cuda/gloo"``; ``backend="gloo"`` alone is
            ``"cpu/gloo"``. Named in the answer's first line and in every kept
            ``FitConfig``, which ``apply`` applies on that target only. CPU offload is
            searched only on an accelerator (on the CPU it moves nothing off the device).
        budget: bytes per rank, or a string such as ``"24GiB"`` (see ``parse_budget``).
        step: the step trained, up to its loss: ``step(model, batch) -> loss``, ``"labels"``
            (transformers' models: ``model(input_ids=batch, labels=batch).loss``) or ``"sum"``
            (the first floating output summed). Default: ``"labels"`` where the model's
            forward takes ``labels``, else ``"sum"``; ``loss_fn(output, batch)`` instead
            plans ``model(batch)`` then that loss. ``FitResult.step`` says which was planned.
        wrap: class names to try wrapping (each alone); default: the model's repeated classes
            with parameters, plus wrapping nothing but the root. A name not in the model is
            an error listing the candidates.
        allow_lower_precision: also try ``param_dtype=lower_dtype`` with fp32 and with
            ``lower_dtype`` reductions (off: the model trains in its own dtype).
        device: ``"h100"`` or ``"a100"`` (datasheet numbers, see ``DEVICES``) or a ``Device``;
            ``device_flops`` and the ``*_bytes_per_s`` arguments override single numbers.
        checkpoint_choices: activation checkpointing per wrapped block: 0 none, 1 every block,
            k every k-th block.
        offload_choices: CPU offload off/on (an accelerator target only).
        global_batch: samples per optimizer step over all ranks. With it (and ``mesh`` one
            size ``N``) fit also chooses the layout, FSDP over the ``N`` ranks or HSDP
            ``R x S`` (shard groups within a node first), and the microbatch: a local batch
            ``b`` (the sample input's first dimension) and ``a`` accumulation steps
            (``accumulation_choices`` dividing ``global_batch / N``), see ``_layouts``. Each
            kept ``FitConfig`` says its ``mesh``, ``local_batch`` and ``grad_accumulation``;
            ``apply`` builds the mesh, ``FitConfig.how_to_run()`` gives the loop.
        devices_per_node: the node size the layouts and links assume (default: the
            device's, 8 for ``h100``/``a100``).
        fold: run each fake step over a few blocks of the model's largest stack of alike
            blocks and repeat their recorded events for the rest (``_fold``: exact, checked,
            and undone when the kept blocks do not repeat); False runs every block.

    Returns:
        A ``FitResult``: ``kept`` (fitting, fastest first), ``smallest`` (the smallest peak
        found) and ``advice`` (what would make it fit when nothing does).

    Example::

        r = fit(build, mesh=8, sample_input=((4, 2048), torch.long), budget="24GiB")
        print(r.best.config, r.best.peak_bytes, r.best.step_seconds)
        apply(model, r.best)  # fully_shard, mixed precision, offload, checkpointing
    """
    # Past 80 lines for its docstring (every argument's trade-off); the body is its four steps.
    started = time.perf_counter()
    links = {
        "shard": shard_link_bytes_per_s,
        "replicate": replicate_link_bytes_per_s,
        "host": host_link_bytes_per_s,
    }
    problem = _problem(
        model_factory,
        sample_input,
        (step, loss_fn),
        budget,
        mesh,
        optimizer,
        parse_target(target, backend),
        (device, device_flops, devices_per_node),
        links,
        (global_batch, accumulation_choices),
        fold,
    )
    space = _search_space(
        problem, wrap, allow_lower_precision, lower_dtype, checkpoint_choices, offload_choices
    )
    rows: list[Fitted] = []
    traces: list[_Trace] = []
    pruned = _Pruned()
    for trace in _fake_steps(problem, space):
        rows += _replays(problem, space, trace, pruned)
        trace.events = []  # replayed: dropped here (a trace sharing them holds its own)
        traces.append(trace)
    return _answer(problem, space, rows, traces, pruned, started)
