"""``fit()``: search the ``fully_shard`` configurations a user would try by hand, keep those whose
predicted peak (activations and communication buffers included) fits a per-rank budget, and
rank them by a stated step-time estimate (``python -m shardweave.fsdp.plan --fit 24GiB``).

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

Design note: the step-time estimate (docs/framework_guide.md, "Make it fit", defines each term)
    compute   = FLOPs of the fake step (forward + backward, a checkpoint's recompute counted,
                from torch's ``flop_registry``) / device FLOP/s for the compute dtype
    comm      = sum over collectives of bus bytes / link bandwidth + latency, a ring's bus
                bytes being ``(n-1)/n`` of the all-gather output or reduce-scatter input
                (``2(n-1)/n`` of an all-reduce's buffer); the shard dimension uses
                ``shard_link`` bandwidth, the HSDP replicate dimension ``replicate_link``; the
                latency is NCCL's ring model (``Device.ring_latency``: a fixed cost plus one
                per ring step, NVLink within a node, the network between nodes)
    exposed   = what the engine's schedule cannot hide behind compute: the root's forward
                all-gather (nothing runs before it) and the last reduction (nothing runs after
                it), plus whatever of the rest exceeds compute (``max(0, comm - compute)``)
    offload   = host<->device bytes (the shards copied to the device for every all-gather,
                sharded gradients copied back) / host link bandwidth, not overlapped
    optimizer = bytes the optimizer step streams (sharded parameters read and written,
                gradients read, states read and written) / device memory bandwidth, or host
                memory bandwidth with offload (the step runs on the CPU); after backward, not
                overlapped
    step      = compute + exposed + offload + optimizer; the term that dominates is named.
    It is an estimate: peak numbers, no kernel efficiency, no contention between links.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy
from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE
from shardweave.fsdp.plan._activations import SampleInput, fake_mode, run_fake_step
from shardweave.fsdp.plan._apply import checkpoint_blocks
from shardweave.fsdp.plan._fold import (
    Fold,
    FoldMismatch,
    cut,
    find_fold,
    install_markers,
    kept_specs,
    unfold,
)
from shardweave.fsdp.plan._model import (
    ROOT_KEY,
    GroupSpec,
    PlanError,
    discover_groups,
    module_wrap_predicate,
)
from shardweave.fsdp.plan._plan import (
    BACKENDS,
    OPTIMIZER_STATES,
    group_plans,
    parse_mesh,
)
from shardweave.fsdp.plan._report import format_bytes
from shardweave.fsdp.plan._schedule import GroupTraffic, Replay
from shardweave.fsdp.plan._sharding import grad_made_in

__all__ = ["DEVICES", "FitConfig", "FitResult", "Fitted", "fit", "parse_budget"]


@dataclass(frozen=True)
class Device:
    """Throughput numbers for the time estimate (each default's source is in ``source``)."""

    bf16_flops: float  # dense, tensor cores (also used for fp16)
    fp32_flops: float  # plain FP32 (no TF32): torch's default for float32 matmuls
    intra_node_bytes_per_s: float  # per GPU, one direction
    inter_node_bytes_per_s: float  # per GPU, one direction
    host_bytes_per_s: float  # host <-> device, one direction
    gpus_per_node: int
    source: str
    hbm_bytes_per_s: float = 3.35e12  # device memory: the optimizer step reads and writes it
    host_memory_bytes_per_s: float = 76.8e9  # per GPU: the offloaded optimizer step's
    # NCCL's ring/Simple latency model: a fixed cost per collective plus one per ring step,
    # over NVLink within a node or over the network between nodes (see ``ring_latency``)
    collective_latency_s: float = 8.4e-6
    nvlink_step_latency_s: float = 3.4e-6
    network_step_latency_s: float = 9.6e-6

    def ring_latency(self, ranks: int, nodes: int, all_reduce: bool = False) -> float:
        """Seconds of latency of one ring collective over ``ranks`` on ``nodes`` nodes:
        ``ranks - 1`` steps (twice that for an all-reduce), ``nodes - 1`` of them (twice)
        crossing the network."""
        if ranks <= 1:
            return 0.0
        k = 2 if all_reduce else 1
        steps, network = k * (ranks - 1), k * (max(nodes, 1) - 1)
        return (
            self.collective_latency_s
            + (steps - network) * self.nvlink_step_latency_s
            + network * self.network_step_latency_s
        )


# Vendor datasheet numbers (peak, not achieved): NVIDIA H100 SXM5 datasheet (bf16 dense
# 989.4 TFLOP/s, FP32 66.9 TFLOP/s, NVLink 4 900 GB/s bidirectional = 450 GB/s per direction),
# one ConnectX-7 NDR 400 Gb/s (50 GB/s) per GPU between nodes, PCIe gen5 x16 (64 GB/s per
# direction, 128 GT/s raw). A100 SXM4 datasheet: bf16 dense 312 TFLOP/s, FP32 19.5 TFLOP/s,
# NVLink 3 600 GB/s bidirectional, HDR 200 Gb/s IB, PCIe gen4 x16 32 GB/s. Device memory:
# H100 SXM5 HBM3 3.35 TB/s, A100 SXM4 80 GB HBM2e 2.039 TB/s (datasheets). Host memory per
# GPU: the DGX system's CPU sockets' peak DRAM bandwidth shared by its 8 GPUs (DGX H100: two
# Xeon 8480C, 8 channels of DDR5-4800 each, 614 GB/s; DGX A100: two EPYC 7742, 8 channels of
# DDR4-3200 each, 410 GB/s). Collective latencies: NCCL's tuning model (src/graph/tuning.cc,
# ring with the Simple protocol, which large FSDP collectives use): 8.4 us per collective,
# 3.4 us per ring step over NVLink, 9.6 us per step over the network.
DEVICES: Final[dict[str, Device]] = {
    "h100": Device(
        989.4e12,
        66.9e12,
        450e9,
        50e9,
        64e9,
        8,
        "NVIDIA H100 SXM5 datasheet (bf16 dense, FP32, HBM3), NVLink 4 per direction, "
        "InfiniBand NDR 400 Gb/s per GPU, PCIe gen5 x16, DGX H100 host DRAM per GPU, "
        "NCCL's ring latency model",
        hbm_bytes_per_s=3.35e12,
        host_memory_bytes_per_s=76.8e9,
    ),
    "a100": Device(
        312e12,
        19.5e12,
        300e9,
        25e9,
        32e9,
        8,
        "NVIDIA A100 SXM4 80 GB datasheet (bf16 dense, FP32, HBM2e), NVLink 3 per direction, "
        "InfiniBand HDR 200 Gb/s per GPU, PCIe gen4 x16, DGX A100 host DRAM per GPU, "
        "NCCL's ring latency model",
        hbm_bytes_per_s=2.039e12,
        host_memory_bytes_per_s=51.2e9,
    ),
}

# What a step's estimated time adds up (seconds each; see _time_terms).
STEP_TERMS: Final = ("compute", "exposed_comm", "offload", "optimizer")

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
class FitConfig:
    """One configuration: everything ``apply`` needs to reproduce it."""

    wrap: str | None  # module class name wrapped with fully_shard (None: the root only)
    reshard_after_forward: bool | int
    root_reshard_after_forward: bool
    param_dtype: str | None
    reduce_dtype: str | None
    checkpoint_every: int  # 0: none, 1: every wrapped block, k: every k-th (the 1st, k+1th, ...)
    offload: bool
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    reduce_scatter_max_input_buffers: int = 1

    def describe(self) -> str:
        ac = _every(self.checkpoint_every)
        return (
            f"wrap={self.wrap or '-'} reshard={self.reshard_after_forward} "
            f"root_reshard={self.root_reshard_after_forward} "
            f"mp={self.param_dtype or 'fp32'}/{_reduce_label(self.param_dtype, self.reduce_dtype)} "
            f"checkpoint={ac} offload={self.offload}"
        )


def _reduce_label(param: str | None, reduce: str | None, model: str = "fp32") -> str:
    """The dtype gradients are reduced in: ``reduce``, or without it the parameters' own
    dtype from torch 2.15 (``REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE``) and ``param`` before."""
    if reduce is not None:
        return reduce
    if param is None or REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE:
        return model
    return param


def _every(k: int) -> str:
    if k <= 1:
        return "none" if k == 0 else "every block"
    suffix = {2: "nd", 3: "rd"}.get(k % 10 if k % 100 not in (12, 13) else 0, "th")
    return f"every {k}{suffix} block"


@dataclass(frozen=True)
class Fitted:
    config: FitConfig
    peak_bytes: int
    step_seconds: float
    terms: dict[str, float]  # STEP_TERMS and comm (seconds), flops
    dominant: str

    def margin(self, budget: int) -> int:
        return budget - self.peak_bytes


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

    @property
    def best(self) -> Fitted | None:
        return self.kept[0] if self.kept else None

    def to_dict(self) -> dict[str, object]:
        def row(f: Fitted) -> dict[str, object]:
            return {
                "config": dataclasses.asdict(f.config),
                "peak_bytes": f.peak_bytes,
                "step_seconds": f.step_seconds,
                "margin_bytes": self.budget_bytes - f.peak_bytes,
                "terms_seconds": f.terms,
                "dominant": f.dominant,
            }

        return {
            "budget_bytes": self.budget_bytes,
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


# --- recording the fake step's calls into the replay -------------------------------------------


class _Bytes(dict[str, int]):
    """The replay's counters; records writes made from outside the replay (a gradient moved
    from "activations" to "unsharded gradients" by the fake step's tracker)."""

    owner: _RecordingReplay

    def __setitem__(self, key: str, value: int) -> None:
        rec = getattr(self, "owner", None)
        if rec is not None and rec.depth == 0:
            rec.events.append(("bytes", key, value - self.get(key, 0)))
        super().__setitem__(key, value)


class _RecordingReplay(Replay):
    """A ``Replay`` that also records every call made into it by the fake step."""

    def __init__(self, groups: list[GroupTraffic], **kwargs: Any) -> None:
        self.depth = 1
        self.events: list[tuple[Any, ...]] = []
        super().__init__(groups, **kwargs)
        b = _Bytes(self.bytes)
        b.owner = self
        self.bytes = b
        self.depth = 0

    def _call(self, name: str, *args: Any) -> None:
        if self.depth == 0:
            self.events.append((name, *args))
        self.depth += 1
        try:
            getattr(Replay, name)(self, *args)
        finally:
            self.depth -= 1

    def add(self, category: str, delta: int, group: str, event: str) -> None:
        self._call("add", category, delta, group, event)

    def mark(self, kind: str, block: int) -> None:
        """A fold marker (``_fold``): not a call into the replay."""
        if self.depth == 0:
            self.events.append(("mark", kind, block))

    def pre_forward(self, key: str) -> None:
        self._call("pre_forward", key)

    def post_forward(self, key: str) -> None:
        self._call("post_forward", key)

    def start_backward(self) -> None:
        self._call("start_backward")

    def pre_backward(self, key: str) -> None:
        self._call("pre_backward", key)

    def final_callback(self) -> None:
        self._call("final_callback")

    def post_backward(self, key: str, free_grads: Callable[[], None] | None = None) -> None:
        nested: list[tuple[Any, ...]] = []
        if self.depth == 0:
            self.events.append(("post_backward", key, nested))

        def recorded_free() -> None:
            outer, saved = self.events, self.depth
            self.events, self.depth = nested, 0
            try:
                if free_grads is not None:
                    free_grads()
            finally:
                self.events, self.depth = outer, saved

        self.depth += 1
        try:
            Replay.post_backward(self, key, free_grads=recorded_free)
        finally:
            self.depth -= 1


def _play(replay: Replay, events: Sequence[tuple[Any, ...]]) -> None:
    for ev in events:
        name = ev[0]
        if name == "flops":
            continue
        if name == "bytes":
            replay.bytes[ev[1]] += ev[2]
        elif name == "post_backward":
            replay.post_backward(ev[1], free_grads=functools.partial(_play, replay, ev[2]))
        else:
            getattr(replay, name)(*ev[1:])


# --- the search --------------------------------------------------------------------------------


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


def _checkpoint_forwards(model: nn.Module, wrap: str, every: int) -> None:
    """Activation checkpointing as ``apply`` installs it (see ``_apply``)."""
    checkpoint_blocks(model, wrap, every)


def _flops_and_trace(
    factory: Callable[[], nn.Module],
    specs_of: Callable[[nn.Module], list[GroupSpec]],
    traffic: list[GroupTraffic],
    sample: SampleInput,
    loss_fn: Any,
    param_dtype: torch.dtype | None,
    wrap: str | None,
    every: int,
    fold: bool = True,
    reduce_dtype: torch.dtype | None = None,
) -> tuple[list[tuple[Any, ...]], float, Fold | None]:
    """One recorded fake step (its events, FLOPs included) for a wrapping, precision and
    checkpointing choice; over a few blocks of a stack of alike blocks when ``fold``
    (``_fold``), else, or when the kept blocks do not repeat, over the whole model."""

    def build() -> tuple[Any, nn.Module, list[GroupSpec]]:
        mode = fake_mode()
        with mode:
            model = factory()
        specs = specs_of(model)
        if wrap is not None and every:
            _checkpoint_forwards(model, wrap, every)
        return mode, model, specs

    mode, model, specs = build()
    stack = find_fold(model, period=max(every, 1)) if fold else None
    if stack is not None:
        try:
            events = _trace(
                model, mode, specs, stack, traffic, sample, loss_fn, param_dtype, reduce_dtype
            )
            return events, float(sum(_flops(events))), stack
        except FoldMismatch:
            mode, model, specs = build()  # the cut was made in place: a whole model again
    events = _trace(model, mode, specs, None, traffic, sample, loss_fn, param_dtype, reduce_dtype)
    return events, float(sum(_flops(events))), None


def _trace(
    model: nn.Module,
    mode: Any,
    specs: list[GroupSpec],
    stack: Fold | None,
    traffic: list[GroupTraffic],
    sample: SampleInput,
    loss_fn: Any,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> list[tuple[Any, ...]]:
    run_specs = specs
    if stack is not None:
        cut(model, stack)
        run_specs = kept_specs(model, specs)
    rec = _RecordingReplay(traffic, keep_timeline=False)
    markers = (lambda m: install_markers(m, stack, rec)) if stack is not None else None
    try:
        with _FlopCounter(rec):
            run_fake_step(
                model,
                mode,
                run_specs,
                rec,
                sample,
                loss_fn,
                param_dtype,
                markers,
                reduce_dtype=reduce_dtype,
            )
    except PlanError as exc:
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
        )

        if isinstance(exc.__cause__, (DynamicOutputShapeException, DataDependentOutputException)):
            raise PlanError(
                f"fit: the model's forward has an operator whose output shape depends on the "
                f"data ({exc.__cause__}; e.g. mixture-of-experts routing with nonzero), which a "
                "fake-tensor step cannot run; the sample input is not at fault. A transformers "
                "MoE model can route without it: build it with "
                "experts_implementation='batched_mm' in its config"
            ) from exc.__cause__
        if stack is not None:  # e.g. a forward indexing blocks the cut stack lacks
            raise FoldMismatch(str(exc)) from exc
        raise
    if stack is None:
        return rec.events
    return unfold(rec.events, stack, _grad_bytes(specs, stack, param_dtype, reduce_dtype))


def _grad_bytes(
    specs: list[GroupSpec],
    stack: Fold,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> Callable[[str], tuple[int, int]]:
    """For ``_fold.unfold``: a group's gradient bytes in one block of the stack (the blocks
    are alike: the first), and in everything the cut model kept."""
    by_key = {s.key: s for s in specs}
    head = f"{stack.fqn}."

    def block_of(fqn: str) -> int | None:
        return int(fqn[len(head) :].split(".", 1)[0]) if fqn.startswith(head) else None

    def nbytes(p: Any) -> int:
        dtype = param_dtype if param_dtype is not None and p.dtype.is_floating_point else p.dtype
        made_in = grad_made_in(p.dtype, dtype, reduce_dtype)  # as the fake step (_activations)
        return int(math.prod(p.shape)) * int(made_in.itemsize)

    def grad_bytes(key: str) -> tuple[int, int]:
        spec = by_key.get(key)
        if spec is None or key.startswith(head):  # a block's own group: copied with it
            return 0, 0
        grads = [p for p in spec.params if p.requires_grad]
        per_block = sum(nbytes(p) for p in grads if block_of(p.fqn) == 0)
        kept = sum(nbytes(p) for p in grads if (b := block_of(p.fqn)) is None or b < stack.keep)
        return per_block, kept

    return grad_bytes


def _flops(events: Sequence[tuple[Any, ...]]) -> Iterator[int]:
    for ev in events:
        if ev[0] == "flops":
            yield ev[1]
        elif ev[0] == "post_backward":
            yield from _flops(ev[2])


class _FlopCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """FLOPs of every operator with a formula in torch's ``flop_registry`` (matmuls,
    convolutions, attention; a checkpoint's recompute included, as it runs operators again).
    Not ``FlopCounterMode`` itself: its module tracker keeps autograd hooks on every module's
    outputs, which holds tensors alive and would change the fake step's measured peak."""

    def __init__(self, rec: _RecordingReplay) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rec = rec

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:  # recorded as an event, so a folded stack's copies count
            self.rec.events.append(("flops", int(formula(*args, **kwargs, out_val=out))))
        return out


_DTYPES: Final[dict[str | None, torch.dtype | None]] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


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
    backend: str = "nccl",
    loss_fn: Any = None,
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
    ``budget``, fastest (by the step-time estimate in this module's design note) first.

    Args:
        model_factory: zero-argument callable building the model (built under fake tensors).
        mesh: shard size (``1024``) or ``(replicate, shard)`` / ``"8x128"`` for HSDP.
        sample_input: one step's input per rank, ``(shape, dtype)``, a tensor or a factory.
        budget: bytes per rank, or a string such as ``"24GiB"`` (see ``parse_budget``).
        wrap: class names to try wrapping (each alone); default: the model's repeated classes
            with parameters, plus wrapping nothing but the root. A name not in the model is
            an error listing the candidates.
        allow_lower_precision: also try ``param_dtype=lower_dtype`` with fp32 and with
            ``lower_dtype`` reductions (off: the model trains in its own dtype).
        device: ``"h100"`` or ``"a100"`` (datasheet numbers, see ``DEVICES``) or a ``Device``;
            ``device_flops`` and the ``*_bytes_per_s`` arguments override single numbers.
        checkpoint_choices: activation checkpointing per wrapped block: 0 none, 1 every block,
            k every k-th block.
        offload_choices: CPU offload off/on.
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
    budget_bytes = parse_budget(budget)
    dims = parse_mesh(mesh)
    shard_size, replicate_size = dims[-1], (dims[0] if len(dims) == 2 else 1)
    if backend not in BACKENDS:
        raise PlanError(f"fit: backend must be one of {BACKENDS}, got {backend!r}")
    states = OPTIMIZER_STATES[optimizer.lower().replace("-", "_")]
    dev = DEVICES[device] if isinstance(device, str) else device
    shard_bw = shard_link_bytes_per_s or (
        dev.intra_node_bytes_per_s
        if shard_size <= dev.gpus_per_node
        else dev.inter_node_bytes_per_s
    )
    repl_bw = replicate_link_bytes_per_s or dev.inter_node_bytes_per_s
    host_bw = host_link_bytes_per_s or dev.host_bytes_per_s
    links = _Links(
        dev,
        shard_size,
        replicate_size,
        shard_bw,
        repl_bw,
        shard_link_bytes_per_s or dev.intra_node_bytes_per_s,
        host_bw,
    )
    if not callable(model_factory) or isinstance(model_factory, nn.Module):
        raise PlanError("fit: pass the model as a zero-argument factory (built on meta/fake)")
    try:
        with torch.device("meta"):
            meta_model = model_factory()
    except Exception as exc:
        raise PlanError(
            f"fit: the model factory cannot build on the meta device "
            f"({type(exc).__name__}: {exc}); build parameters from shapes only"
        ) from exc
    if not isinstance(meta_model, nn.Module):
        raise PlanError(f"fit: the factory returned {type(meta_model).__name__}")
    candidates = _repeated_classes(meta_model)
    present = {type(m).__name__ for m in meta_model.modules()}
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
    reshards: list[bool | int] = [True, False]
    for n in (8, 4, 2):  # reshard to a node-sized group, where it divides the shard size
        if 1 < n < shard_size and shard_size % n == 0:
            reshards.append(n)
            break
    precisions: list[tuple[str | None, str | None]] = [(None, None)]
    if allow_lower_precision:
        precisions += [(lower_dtype, "fp32"), (lower_dtype, None)]
    search_space: dict[str, object] = {
        "wrap": [w or "(root only)" for w in wraps],
        "reshard_after_forward": reshards,
        "root_reshard_after_forward": [False, True],
        "mixed_precision (param, reduce)": [
            [p or "model dtype", _reduce_label(p, r, "model dtype")] for p, r in precisions
        ],
        "activation_checkpointing": [_every(k) for k in checkpoint_choices],
        "cpu_offload": list(offload_choices),
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
                "low precision": device_flops or dev.bf16_flops,
                "fp32": device_flops or dev.fp32_flops,
            },
            "shard_link_bytes_per_s": shard_bw,
            "replicate_link_bytes_per_s": repl_bw,
            "host_link_bytes_per_s": host_bw,
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
    results: list[Fitted] = []
    searched = 0
    fake_steps = 0
    folded: list[str] = []
    for w in wraps:
        pred = module_wrap_predicate(w)

        def specs_of(model: nn.Module, pred: Any = pred) -> list[GroupSpec]:
            return discover_groups(model, pred, shard_size=shard_size)

        specs = specs_of(meta_model)
        n_blocks = sum(1 for s in specs if s.key != ROOT_KEY)
        acs = [k for k in checkpoint_choices if k == 0 or (w is not None and k <= max(n_blocks, 1))]
        for (pd, rd), every in itertools.product(precisions, acs):
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[pd], reduce_dtype=_DTYPES[rd])
            base_traffic = group_plans(
                specs, True, False, shard_size, mp, states, replicate_size, backend, False
            )[1]
            events, flops, folded_stack = _flops_and_trace(
                model_factory,
                specs_of,
                base_traffic,
                sample_input,
                loss_fn,
                mp.param_dtype,
                w,
                every,
                fold,
                mp.reduce_dtype,
            )
            fake_steps += 1
            if folded_stack is not None:
                folded.append(
                    f"{folded_stack.fqn}: {folded_stack.blocks} blocks run as {folded_stack.keep}"
                )
            low = mp.param_dtype in (torch.bfloat16, torch.float16) or (
                mp.param_dtype is None
                and any(p.dtype in (torch.bfloat16, torch.float16) for s in specs for p in s.params)
            )
            flops_per_s = device_flops or (dev.bf16_flops if low else dev.fp32_flops)
            # With no wrapped blocks the blocks' reshard is moot: one value.
            block_reshards = reshards if w is not None else [True]
            for reshard, root_reshard, offload in itertools.product(
                block_reshards, (False, True), offload_choices
            ):
                plans, traffic = group_plans(
                    specs,
                    reshard,
                    root_reshard,
                    shard_size,
                    mp,
                    states,
                    replicate_size,
                    backend,
                    offload,
                )
                replay = Replay(traffic, keep_timeline=False, stream_ordered=backend == "nccl")
                _play(replay, events)
                sharded = sum(g.sharded_param_bytes for g in plans)
                opt = sum(g.optimizer_state_bytes for g in plans)
                held = 0 if offload else sharded + opt
                peak = held + replay.result.peak_dynamic_bytes
                cfg = FitConfig(
                    wrap=w,
                    reshard_after_forward=reshard,
                    root_reshard_after_forward=root_reshard,
                    param_dtype=pd,
                    reduce_dtype=rd,
                    checkpoint_every=every,
                    offload=offload,
                )
                searched += 1
                terms = _time_terms(
                    plans, replay.result.all_gathers, flops, flops_per_s, links, offload
                )
                step = sum(terms[k] for k in STEP_TERMS)
                dominant = max(STEP_TERMS, key=lambda k: terms[k])
                results.append(Fitted(cfg, peak, step, terms, dominant))
            del events
    kept = sorted(
        (f for f in results if f.peak_bytes <= budget_bytes),
        key=lambda f: (f.step_seconds, f.peak_bytes),
    )
    smallest = min(results, key=lambda f: f.peak_bytes) if results else None
    advice: list[str] = []
    if not kept and smallest is not None:
        advice = _advice(smallest, budget_bytes, shard_size, offload_choices, allow_lower_precision)
    return FitResult(
        budget_bytes=budget_bytes,
        kept=tuple(kept),
        searched=searched,
        search_seconds=round(time.perf_counter() - started, 3),
        search_space=search_space,
        smallest=smallest,
        advice=tuple(advice),
        fake_steps=fake_steps,
        folded=tuple(folded),
        mesh=dims,
        device=dev.source,
    )


@dataclass(frozen=True)
class _Links:
    """The time model's numbers for one mesh (see ``Device``)."""

    device: Device
    shard_size: int
    replicate_size: int
    shard_bw: float
    repl_bw: float
    intra_bw: float
    host_bw: float

    @property
    def shard_nodes(self) -> int:  # a shard group's ranks are consecutive, a node at a time
        return -(-self.shard_size // self.device.gpus_per_node)

    @property
    def repl_nodes(self) -> int:  # replicas on one node: as many as fit beside the shards
        per_node = max(1, self.device.gpus_per_node // self.shard_size)
        return -(-self.replicate_size // per_node)

    def all_gather(self, nbytes: int) -> float:
        """One all-gather (or reduce-scatter) of ``nbytes`` (output, or input) over the shard
        dimension: a ring's ``(n-1)/n`` of the bytes over its link, plus its latency."""
        n = self.shard_size
        if n <= 1:
            return 0.0
        return nbytes * (n - 1) / n / self.shard_bw + self.device.ring_latency(n, self.shard_nodes)

    def all_reduce(self, nbytes: int) -> float:
        n = self.replicate_size
        if n <= 1:
            return 0.0
        lat = self.device.ring_latency(n, self.repl_nodes, all_reduce=True)
        return nbytes * 2 * (n - 1) / n / self.repl_bw + lat

    def node_all_gather(self, nbytes: int, ranks: int) -> float:
        """An int ``reshard_after_forward``'s backward all-gather within groups of ``ranks``."""
        lat = self.device.ring_latency(ranks, 1)
        return nbytes * (ranks - 1) / ranks / self.intra_bw + lat


def _time_terms(
    plans: Sequence[Any],
    all_gathers: dict[str, int],
    flops: float,
    flops_per_s: float,
    links: _Links,
    offload: bool,
) -> dict[str, float]:
    comm = first = last = host = 0.0
    trainable = [g for g in plans if g.trainable_numel > 0]
    for g in plans:
        n_ag = all_gathers.get(g.key, 0)
        ag = n_ag * links.all_gather(g.gathered_bytes)
        mode = g.reshard_after_forward
        if n_ag >= 2 and not isinstance(mode, bool) and mode > 1:
            # The backward all-gather of an int reshard_after_forward N gathers the post-forward
            # shards within groups of N ranks (a node when N is the node size): its own link.
            ag += links.node_all_gather(g.gathered_bytes, mode) - links.all_gather(g.gathered_bytes)
        rs = links.all_gather(g.reduce_scatter_bytes) if g.trainable_numel else 0.0
        ar = links.all_reduce(g.all_reduce_bytes) if g.trainable_numel else 0.0
        comm += ag + rs + ar
        if g.key == ROOT_KEY and n_ag:
            first = links.all_gather(g.gathered_bytes)
        if offload:
            host += n_ag * g.sharded_param_bytes / links.host_bw + g.grad_bytes / links.host_bw
    if trainable:
        g = trainable[0]  # the root reduces last (in the final callback)
        last = links.all_gather(g.reduce_scatter_bytes) + links.all_reduce(g.all_reduce_bytes)
    compute = flops / flops_per_s
    exposed = first + last + max(0.0, comm - first - last - compute)
    # The optimizer step streams the sharded parameters (read and written; the sharded
    # gradients share their dtype), the gradients (read) and its states (read and written)
    # through memory: the device's, or with offload the host's (it runs on the CPU).
    streamed = sum(3 * g.grad_bytes + 2 * g.optimizer_state_bytes for g in plans)
    dev = links.device
    optimizer = streamed / (dev.host_memory_bytes_per_s if offload else dev.hbm_bytes_per_s)
    return {
        "compute": compute,
        "comm": comm,
        "exposed_comm": exposed,
        "offload": host,
        "optimizer": optimizer,
        "flops": flops,
    }


def _advice(
    smallest: Fitted,
    budget: int,
    shard_size: int,
    offload_choices: Sequence[bool],
    lower: bool,
) -> list[str]:
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
    if True not in offload_choices:
        out.append("allow CPU offload (params, grads and optimizer state in host memory)")
    if not lower:
        out.append("allow lower precision (--allow-lower-precision: bf16 parameters)")
    return out


def _folded_note(folded: Sequence[str]) -> str:
    if not folded:
        return ""
    return f", {len(folded)} folded ({', '.join(sorted(set(folded)))})"


def format_fit(result: FitResult, top: int = 5) -> str:
    lines = [
        f"make it fit: budget {format_bytes(result.budget_bytes)} per rank, mesh "
        f"{'x'.join(map(str, result.mesh))}; searched {result.searched} configurations "
        f"({result.fake_steps} fake steps{_folded_note(result.folded)}) in "
        f"{result.search_seconds:.2f} s",
        "search space:",
    ]
    for k, v in result.search_space.items():
        lines.append(f"  {k}: {v}")
    if not result.kept:
        lines += ["", *result.advice]
        return "\n".join(lines)
    lines += ["", f"{len(result.kept)} fit; fastest first (step time is an estimate):"]
    for i, f in enumerate(result.kept[:top]):
        t = f.terms
        lines.append(
            f"  {i + 1}. peak {format_bytes(f.peak_bytes)} (margin "
            f"{format_bytes(result.budget_bytes - f.peak_bytes)}), step ~{f.step_seconds:.3g} s "
            f"[compute {t['compute']:.3g}, exposed comm {t['exposed_comm']:.3g} "
            f"of {t['comm']:.3g}, offload {t['offload']:.3g}, optimizer {t['optimizer']:.3g} s; "
            f"{f.dominant} dominates]"
        )
        lines.append(f"     {f.config.describe()}")
    best = result.kept[0]
    lines += ["", "the winner as code:", snippet(best.config)]
    return "\n".join(lines)


def snippet(cfg: FitConfig) -> str:
    return "\n".join(
        [
            "from shardweave.fsdp.plan import FitConfig, apply",
            f"apply(model, {cfg!r})",
            "# which is:",
            *("# " + line for line in _explain(cfg)),
        ]
    )


def _explain(cfg: FitConfig) -> list[str]:
    out = []
    mp = (
        f"MixedPrecisionPolicy(param_dtype=torch.{_long(cfg.param_dtype)}, "
        f"reduce_dtype={'torch.' + _long(cfg.reduce_dtype) if cfg.reduce_dtype else None})"
        if cfg.param_dtype
        else "MixedPrecisionPolicy()"
    )
    off = "CPUOffloadPolicy()" if cfg.offload else "OffloadPolicy()"
    if cfg.wrap:
        if cfg.checkpoint_every:
            out.append(
                f"checkpoint the forward of {_every(cfg.checkpoint_every)} of class {cfg.wrap} "
                "(torch.utils.checkpoint, use_reentrant=False)"
            )
        out.append(f"for m in model.modules(): if type(m).__name__ == {cfg.wrap!r}:")
        out.append(
            f"    fully_shard(m, reshard_after_forward={cfg.reshard_after_forward!r}, "
            f"mp_policy={mp}, offload_policy={off})"
        )
    out.append(
        f"fully_shard(model, reshard_after_forward={cfg.root_reshard_after_forward!r}, "
        f"mp_policy={mp}, offload_policy={off})"
    )
    return out


def _long(name: str | None) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name or "", str(name))
