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
from dataclasses import asdict, astuple, dataclass, replace
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
from shardweave.fsdp.plan._model import (
    ROOT_KEY,
    GroupSpec,
    PlanError,
    discover_groups,
    module_wrap_predicate,
)
from shardweave.fsdp.plan._plan import OPTIMIZER_STATES, group_plans, parse_mesh
from shardweave.fsdp.plan._recording import flops_and_trace, play
from shardweave.fsdp.plan._report import format_bytes
from shardweave.fsdp.plan._schedule import Replay
from shardweave.fsdp.plan._time_model import DEVICES, STEP_TERMS, Device, Links, time_terms

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
    dims: tuple[int, ...]
    shard_size: int
    replicate_size: int
    states: int
    target: Target
    device: Device
    device_flops: float | None
    links: Links
    fold: bool


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
        links, dev = problem.links, problem.device
        return {
            "wrap": [w or "(root only)" for w in self.wraps],
            "reshard_after_forward": list(self.reshards),
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
                "shard_link_bytes_per_s": links.shard_bw,
                "replicate_link_bytes_per_s": links.repl_bw,
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
    device: str | Device,
    device_flops: float | None,
    links: dict[str, float | None],
    fold: bool,
) -> _Problem:
    """The inputs checked and read: the meta model, the mesh and the time model's links."""
    budget_bytes = parse_budget(budget)
    dims = parse_mesh(mesh)
    shard_size, replicate_size = dims[-1], (dims[0] if len(dims) == 2 else 1)
    states = OPTIMIZER_STATES[optimizer.lower().replace("-", "_")]
    dev = DEVICES[device] if isinstance(device, str) else device
    shard_link = links["shard"]
    link_numbers = Links(
        dev,
        shard_size,
        replicate_size,
        shard_link
        or (
            dev.intra_node_bytes_per_s
            if shard_size <= dev.gpus_per_node
            else dev.inter_node_bytes_per_s
        ),
        links["replicate"] or dev.inter_node_bytes_per_s,
        shard_link or dev.intra_node_bytes_per_s,
        links["host"] or dev.host_bytes_per_s,
    )
    meta_model = _meta_model(factory)
    return _Problem(
        factory,
        meta_model,
        sample,
        resolve_step(*step, meta_model),
        budget_bytes,
        dims,
        shard_size,
        replicate_size,
        states,
        target,
        dev,
        device_flops,
        link_numbers,
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
    shard_size = problem.shard_size
    reshards: list[bool | int] = [True, False]
    for n in (8, 4, 2):  # reshard to a node-sized group, where it divides the shard size
        if 1 < n < shard_size and shard_size % n == 0:
            reshards.append(n)
            break
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
    events: list[tuple[Any, ...]]
    flops: float
    flops_per_s: float
    folded: str | None


def _fake_steps(problem: _Problem, space: _Space) -> Iterator[_Trace]:
    """Each wrapping x compute dtype x checkpointing choice's fake step, recorded (one at a
    time: a trace's events are dropped once its configurations are replayed)."""
    for w in space.wraps:
        pred = module_wrap_predicate(w)

        def specs_of(model: nn.Module, pred: Any = pred) -> list[GroupSpec]:
            return discover_groups(model, pred, shard_size=problem.shard_size)

        specs = specs_of(problem.meta_model)
        n_blocks = sum(1 for s in specs if s.key != ROOT_KEY)
        acs = [k for k in space.checkpoints if k == 0 or (w is not None and k <= max(n_blocks, 1))]
        for (pd, rd), every in itertools.product(space.precisions, acs):
            mp = MixedPrecisionPolicy(param_dtype=DTYPES[pd], reduce_dtype=DTYPES[rd])
            base_traffic = group_plans(
                specs,
                True,
                False,
                problem.shard_size,
                mp,
                problem.states,
                problem.replicate_size,
                problem.target.backend,
                False,
            )[1]
            events, flops, stack = flops_and_trace(
                problem.factory,
                specs_of,
                base_traffic,
                problem.sample,
                problem.step.run,
                mp.param_dtype,
                w,
                every,
                problem.fold,
                mp.reduce_dtype,
            )
            folded = (
                None if stack is None else f"{stack.fqn}: {stack.blocks} blocks run as {stack.keep}"
            )
            yield _Trace(
                w,
                specs,
                (pd, rd),
                mp,
                every,
                events,
                flops,
                _flops_per_s(problem, specs, mp),
                folded,
            )


def _flops_per_s(problem: _Problem, specs: list[GroupSpec], mp: MixedPrecisionPolicy) -> float:
    low = mp.param_dtype in (torch.bfloat16, torch.float16) or (
        mp.param_dtype is None
        and any(p.dtype in (torch.bfloat16, torch.float16) for s in specs for p in s.params)
    )
    dev = problem.device
    return problem.device_flops or (dev.bf16_flops if low else dev.fp32_flops)


# --- step 3: every configuration sharing a trace, replayed and timed ---------------------------


def _replays(problem: _Problem, space: _Space, trace: _Trace) -> Iterator[Fitted]:
    # With no wrapped blocks the blocks' reshard is moot: one value.
    block_reshards = space.reshards if trace.wrap is not None else (True,)
    for reshard, root_reshard, offload in itertools.product(
        block_reshards, space.root_reshards, space.offloads
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
        )
        yield _replay(problem, trace, cfg)


def _replay(problem: _Problem, trace: _Trace, cfg: FitConfig) -> Fitted:
    """One configuration's peak (the trace replayed into its own bytes) and step time."""
    plans, traffic = group_plans(
        trace.specs,
        cfg.reshard_after_forward,
        cfg.root_reshard_after_forward,
        problem.shard_size,
        trace.mp,
        problem.states,
        problem.replicate_size,
        problem.target.backend,
        cfg.offload,
    )
    replay = Replay(traffic, keep_timeline=False, stream_ordered=problem.target.accelerator)
    play(replay, trace.events)
    held = 0
    if not cfg.offload:
        held = sum(g.sharded_param_bytes + g.optimizer_state_bytes for g in plans)
    terms = time_terms(
        plans,
        replay.result.all_gathers,
        trace.flops,
        trace.flops_per_s,
        problem.links,
        cfg.offload,
    )
    step = sum(terms[k] for k in STEP_TERMS)
    dominant = max(STEP_TERMS, key=lambda k: terms[k])
    return Fitted(cfg, held + replay.result.peak_dynamic_bytes, step, terms, dominant)


# --- step 4: the answer ------------------------------------------------------------------------


def _answer(
    problem: _Problem,
    space: _Space,
    rows: list[Fitted],
    traces: list[_Trace],
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
        searched=len(rows),
        search_seconds=round(time.perf_counter() - started, 3),
        search_space=space.describe(problem),
        smallest=smallest,
        advice=tuple(advice),
        fake_steps=len(traces),
        folded=tuple(t.folded for t in traces if t.folded is not None),
        mesh=problem.dims,
        device=problem.device.source,
        step=problem.step.description,
        target=str(problem.target),
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
    out.append("a smaller sample input (fewer sequences or tokens per rank) shrinks activations")
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
        device,
        device_flops,
        links,
        fold,
    )
    space = _search_space(
        problem, wrap, allow_lower_precision, lower_dtype, checkpoint_choices, offload_choices
    )
    rows: list[Fitted] = []
    traces: list[_Trace] = []
    for trace in _fake_steps(problem, space):
        rows += _replays(problem, space, trace)
        trace.events = []  # recorded calls can be large (a 70 B model's): replayed, dropped
        traces.append(trace)
    return _answer(problem, space, rows, traces, started)
