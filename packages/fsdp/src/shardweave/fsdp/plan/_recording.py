"""One fake step per activation trace, recorded: the calls a fake-tensor forward and backward
makes into the ``Replay``, so that ``fit`` replays them for every configuration that changes
only bytes (see ``_fit``'s Design note: one fake step per activation trace), and the step's
FLOPs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from shardweave.fsdp.plan._activations import SampleInput, StepFn, fake_mode, run_fake_step
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
from shardweave.fsdp.plan._model import GroupSpec, PlanError
from shardweave.fsdp.plan._schedule import GroupTraffic, Replay
from shardweave.fsdp.plan._sharding import grad_made_in

__all__ = ["RecordingReplay", "compress", "flops_and_trace", "play"]


class _Bytes(dict[str, int]):
    """The replay's counters; records writes made from outside the replay (a gradient moved
    from "activations" to "unsharded gradients" by the fake step's tracker)."""

    owner: RecordingReplay

    def __setitem__(self, key: str, value: int) -> None:
        rec = getattr(self, "owner", None)
        if rec is not None and rec.depth == 0:
            rec.events.append(("bytes", key, value - self.get(key, 0)))
        super().__setitem__(key, value)


class RecordingReplay(Replay):
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


def play(replay: Replay, events: Sequence[tuple[Any, ...]]) -> None:
    add = replay.add  # most events: bound once (fit replays thousands of configurations)
    for ev in events:
        name = ev[0]
        if name == "add":
            add(ev[1], ev[2], ev[3], ev[4])
        elif name == "flops":
            continue
        elif name == "bytes":
            replay.bytes[ev[1]] += ev[2]
        elif name == "post_backward":
            replay.post_backward(ev[1], free_grads=functools.partial(play, replay, ev[2]))
        else:
            getattr(replay, name)(*ev[1:])


def compress(events: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The events with each run of byte changes to one category (the operators' allocations
    and frees between two calls into the replay) folded to two: up to the run's highest point,
    then down to its end; FLOPs dropped. Any replay of the result reaches the same peaks (the
    other categories do not move inside a run), in a tenth of the events or fewer; only the
    peak's label (which operator) is lost, which ``fit`` does not report."""
    out: list[tuple[Any, ...]] = []
    category: str | None = None
    total = high = 0

    def flush() -> None:
        if category is not None:
            out.append(("add", category, high, "", "operators"))
            out.append(("add", category, total - high, "", "operators"))

    for ev in events:
        name = ev[0]
        if name == "flops":
            continue
        if name == "add" and ev[1] == category:
            total += ev[2]
            high = max(high, total)
            continue
        flush()
        category, total, high = None, 0, 0
        if name == "add":
            category, total, high = ev[1], ev[2], max(0, ev[2])
        elif name == "post_backward":
            out.append((name, ev[1], compress(ev[2])))
        else:
            out.append(ev)
    flush()
    return out


def _checkpoint_forwards(model: nn.Module, wrap: str, every: int) -> None:
    """Activation checkpointing as ``apply`` installs it (see ``_apply``)."""
    checkpoint_blocks(model, wrap, every)


def flops_and_trace(
    factory: Callable[[], nn.Module],
    specs_of: Callable[[nn.Module], list[GroupSpec]],
    traffic: list[GroupTraffic],
    sample: SampleInput,
    step: StepFn,
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
                model, mode, specs, stack, traffic, sample, step, param_dtype, reduce_dtype
            )
            return events, float(sum(_flops(events))), stack
        except FoldMismatch:
            mode, model, specs = build()  # the cut was made in place: a whole model again
    events = _trace(model, mode, specs, None, traffic, sample, step, param_dtype, reduce_dtype)
    return events, float(sum(_flops(events))), None


def _trace(
    model: nn.Module,
    mode: Any,
    specs: list[GroupSpec],
    stack: Fold | None,
    traffic: list[GroupTraffic],
    sample: SampleInput,
    step: StepFn,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> list[tuple[Any, ...]]:
    run_specs = specs
    if stack is not None:
        cut(model, stack)
        run_specs = kept_specs(model, specs)
    rec = RecordingReplay(traffic, keep_timeline=False)
    markers = (lambda m: install_markers(m, stack, rec)) if stack is not None else None
    try:
        with _FlopCounter(rec):
            run_fake_step(
                model,
                mode,
                run_specs,
                rec,
                sample,
                step,
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

    def __init__(self, rec: RecordingReplay) -> None:
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
