"""Activations: one forward and backward of a sample input under fake tensors, with the
engine's schedule replayed from the model's own hooks.

Design note: the fake step
    The model is built under ``FakeTensorMode`` (shapes and dtypes only: no memory, no
    kernels), with each group's parameters replaced by unsharded ones in the compute dtype
    (``param_dtype``): what modules compute with during the real step. Hooks on each wrapped
    module (and the root) call the ``Replay`` where the engine's hooks run: pre-forward (which
    also casts floating inputs to ``param_dtype``, as every ``fully_shard`` state does),
    post-forward, pre-backward (a hook on the module's outputs' gradients), post-backward
    (an identity autograd function on the module's inputs, whose backward runs once the
    module's gradients are ready; modules whose inputs need no grad are reduced in the final
    callback). A checkpoint's recompute runs the forward hooks again inside backward, as it
    does in the engine. So gathered parameters, communication buffers, post-forward shards and
    sharded gradients follow the replay, in the order the real step meets them.

    A ``TorchDispatchMode`` counts the bytes of every storage an operator creates (a view of a
    known storage adds nothing) and a weak reference to the storage removes them when it dies:
    those are the activations (and the loss, the autograd intermediates of backward). The
    parameters' gradients are moved to *unsharded gradients* once autograd stores them, and
    freed when the group's post-backward takes them (the replay's reduce-scatter input is
    allocated first, as in the engine). The sample input is live from the start. A
    checkpoint's saved RNG state (``torch.get_rng_state``, made outside the dispatcher) is
    counted by wrapping that function for the step.

    Not modeled: scratch memory a kernel allocates and frees inside one operator (CPU bf16/fp16
    matmuls convert to fp32 in scratch buffers: a shallow bf16 model on CPU peaks up to ~20%
    above the prediction; GPU kernels use preallocated workspaces), the optimizer step (the
    peak is taken over forward and backward), and the CUDA RNG states a checkpoint saves.
"""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardweave.fsdp.plan._model import ROOT_KEY, GroupSpec, PlanError
from shardweave.fsdp.plan._schedule import Replay, ScheduleResult
from shardweave.fsdp.plan._sharding import grad_made_in

__all__ = [
    "FakeStepResult",
    "SampleInput",
    "Step",
    "describe_sample",
    "fake_mode",
    "resolve_step",
    "run_fake_step",
]

# A tensor (real or fake), a zero-argument factory of the input(s), or (shape, dtype).
SampleInput = torch.Tensor | Callable[[], Any] | tuple[Sequence[int], torch.dtype]
LossFn = Callable[[Any, Any], torch.Tensor]
# One training step up to its loss: ``step(model, batch) -> loss`` (backward is the planner's).
StepFn = Callable[[nn.Module, Any], torch.Tensor]


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def describe_sample(sample: SampleInput) -> str:
    if isinstance(sample, torch.Tensor):
        return f"tensor {tuple(sample.shape)} {str(sample.dtype).removeprefix('torch.')}"
    if isinstance(sample, tuple):
        shape, dtype = sample
        return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
    return getattr(sample, "__name__", "factory")


@dataclass(frozen=True)
class FakeStepResult:
    schedule: ScheduleResult
    peak_activation_bytes: int
    seconds: float


class _LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Bytes of the storages operators create, by category, reported to the replay."""

    def __init__(self, replay: Replay) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.replay = replay
        self.category: dict[int, str] = {}
        self.nbytes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref[Any]] = {}
        self.known: set[int] = set()  # storages made before the step (parameters): not counted
        self.op = ""
        self.closed = False  # after the step: later frees are not part of it

    def know(self, t: torch.Tensor) -> None:
        self.known.add(t.untyped_storage()._cdata)

    def track(self, t: torch.Tensor, category: str = "activations") -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.known or key in self.category:
            return
        n = storage.nbytes()
        self.category[key] = category
        self.nbytes[key] = n
        self.refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
        self.replay.add(category, n, "", self.op)

    def _freed(self, key: int, _ref: object = None) -> None:
        category = self.category.pop(key, None)
        if category is None or self.closed:
            return
        self.refs.pop(key, None)
        self.replay.add(category, -self.nbytes.pop(key), "", "freed")

    def reclassify(self, t: torch.Tensor, category: str) -> None:
        key = t.untyped_storage()._cdata
        old = self.category.get(key)
        if old is None or old == category:
            return
        n = self.nbytes[key]
        self.category[key] = category
        self.replay.bytes[old] -= n
        self.replay.add(category, n, "", "gradient stored")

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.op = f"op {func.overloadpacket.__name__}"
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward is the group's post-backward."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.hook()
        return (None, *grads)


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    return [
        t
        for t in pytree.tree_leaves(tree)
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled()
    ]


def _cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, tree)


def _install_hooks(
    model: nn.Module,
    specs: Sequence[GroupSpec],
    replay: Replay,
    tracker: _LiveBytes,
    params_of: dict[str, list[nn.Parameter]],
    param_dtype: torch.dtype | None,
) -> list[Any]:
    modules = dict(model.named_modules())
    handles: list[Any] = []
    for spec in specs:
        key = spec.key
        module = model if key == ROOT_KEY else modules[key]

        def free_grads(key: str = key) -> None:
            for p in params_of[key]:
                p.grad = None

        def post_backward(key: str = key) -> None:
            replay.post_backward(key, free_grads=lambda: free_grads(key))

        def pre_hook(mod: nn.Module, args: Any, kwargs: Any, key: str = key) -> tuple[Any, Any]:
            replay.pre_forward(key)
            args, kwargs = _cast_floating((args, kwargs), param_dtype)
            if replay.phase != "forward":
                return args, kwargs
            flat, spec_tree = pytree.tree_flatten((args, kwargs))
            idx = [
                i
                for i, t in enumerate(flat)
                if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled()
            ]
            if idx:
                outs = _PostBackward.apply(  # type: ignore[no-untyped-call]
                    lambda: post_backward(key), *(flat[i] for i in idx)
                )
                for i, o in zip(idx, outs, strict=True):
                    flat[i] = o
            # else: the engine registers nothing either; the final callback reduces the group
            new_args, new_kwargs = pytree.tree_unflatten(flat, spec_tree)
            return new_args, new_kwargs

        def post_hook(mod: nn.Module, args: Any, output: Any, key: str = key) -> Any:
            forward = replay.phase == "forward"
            replay.post_forward(key)
            if forward:
                for t in _grad_tensors(output):
                    t.register_hook(  # type: ignore[no-untyped-call]
                        lambda g, key=key: _pre_backward(replay, key, g)
                    )
            return output

        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook))
    for params in params_of.values():
        for p in params:
            if p.requires_grad:
                handles.append(
                    p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        lambda p: (
                            tracker.reclassify(p.grad, "unsharded_grads")
                            if p.grad is not None
                            else None
                        )
                    )
                )
    return handles


def _pre_backward(replay: Replay, key: str, grad: torch.Tensor) -> torch.Tensor:
    replay.start_backward()
    replay.pre_backward(key)
    return grad


def _swap_to_compute_dtype(
    model: nn.Module,
    specs: Sequence[GroupSpec],
    mode: Any,
    param_dtype: torch.dtype | None,
    param_dtypes: Mapping[str, torch.dtype | None],
    reduce_dtype: torch.dtype | None = None,
) -> dict[str, list[nn.Parameter]]:
    """Replace each managed parameter by an unsharded one in its compute dtype (tied
    parameters stay tied; ``param_dtypes`` overrides ``param_dtype`` per FQN), its gradient
    made in the dtype the engine has autograd make it in (``grad_made_in``); returns each
    group's new parameters."""
    by_fqn = {s.key: {p.fqn for p in s.params} for s in specs}
    new: dict[int, nn.Parameter] = {}
    params_of: dict[str, list[nn.Parameter]] = {s.key: [] for s in specs}
    owner = {fqn: key for key, fqns in by_fqn.items() for fqn in fqns}
    fqn_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:
                dtype = p.dtype
                compute = param_dtypes.get(fqn_of.get(id(p), ""), param_dtype)
                if compute is not None and p.dtype.is_floating_point:
                    dtype = compute
                with mode:
                    q = nn.Parameter(
                        torch.empty(p.shape, dtype=dtype, device=p.device),
                        requires_grad=p.requires_grad,
                    )
                # An explicit grad_dtype is left out: it makes a group's gradients differ in
                # dtype, and such a group's copy-in casts each to the reduce dtype first (as
                # torch's does on CPU), what the fake step's compute-dtype gradients stand for.
                made_in = grad_made_in(p.dtype, dtype, reduce_dtype)
                if p.requires_grad and made_in != dtype:
                    q.grad_dtype = made_in
                new[id(p)] = q
                key = owner.get(fqn_of.get(id(p), ""))
                if key is not None:
                    params_of[key].append(q)
            module._parameters[name] = new[id(p)]
    return params_of


def _make_input(sample: SampleInput, mode: Any) -> Any:
    with mode:
        if isinstance(sample, torch.Tensor):
            return mode.from_tensor(sample) if not _is_fake(sample) else sample
        if isinstance(sample, tuple):
            shape, dtype = sample
            if dtype.is_floating_point:
                return torch.empty(tuple(shape), dtype=dtype)
            return torch.zeros(tuple(shape), dtype=dtype)
        if callable(sample):
            return sample()
    raise PlanError(
        f"plan: sample_input must be a tensor, a zero-argument factory or (shape, dtype), got "
        f"{type(sample).__name__}"
    )


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def default_loss(output: Any, _input: Any) -> torch.Tensor:
    """The sum of the output's first floating-point tensor."""
    for t in pytree.tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.sum()
    raise PlanError("plan: the model's output has no floating-point tensor to take a loss of")


@dataclass(frozen=True)
class Step:
    """The training step the fake step runs up to its loss, and what the report calls it."""

    run: StepFn
    description: str


def _call(model: nn.Module, batch: Any) -> Any:
    return model(*(batch if isinstance(batch, tuple) else (batch,)))


def _loss_step(loss_fn: LossFn) -> StepFn:
    def run(model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_fn(_call(model, batch), batch)

    return run


def labels_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """transformers' training step for a model that takes ``labels``: the batch's token ids
    are the input and the labels (the model shifts them for a causal LM), the loss is the
    model's own (``output.loss``); the logits are dropped before backward, as in
    ``model(input_ids=x, labels=x).loss.backward()``."""
    if not isinstance(batch, torch.Tensor):
        raise PlanError(
            "plan: the 'labels' step needs the sample input as one tensor of token ids, got "
            f"{type(batch).__name__}; pass step=fn(model, batch) -> loss for other inputs"
        )
    out = model(input_ids=batch, labels=batch)
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise PlanError(
            f"plan: the 'labels' step: {type(model).__name__}(input_ids=x, labels=x) returned "
            "no loss; pass step=fn(model, batch) -> loss"
        )
    return loss


def takes_labels(model: nn.Module) -> bool:
    """Whether the model's ``forward`` names a ``labels`` argument (transformers' heads)."""
    try:
        return "labels" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


def resolve_step(
    step: StepFn | str | None, loss_fn: LossFn | None, model: nn.Module | None
) -> Step:
    """The step to plan: ``step`` (a callable ``step(model, batch) -> loss``, ``"labels"``
    or ``"sum"``), else ``loss_fn(output, batch)`` after ``model(batch)``, else (``None`` or
    ``"auto"``) the ``labels`` built-in for a model whose forward takes ``labels``, and the
    sum of the first floating output for any other."""
    if step is not None and loss_fn is not None:
        raise PlanError("plan: pass step= or loss_fn=, not both (a step computes its own loss)")
    if callable(step):
        name = getattr(step, "__qualname__", None) or type(step).__name__
        return Step(step, f"{getattr(step, '__module__', '')}:{name}(model, batch)")
    if loss_fn is not None:
        name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
        return Step(_loss_step(loss_fn), f"model(batch), then loss_fn {name}(output, batch)")
    if step not in (None, "auto", "labels", "sum"):
        raise PlanError(
            f"plan: step must be a callable step(model, batch) -> loss, 'labels', 'sum' or "
            f"'auto', got {step!r}"
        )
    auto = step in (None, "auto")
    if step == "labels" or (auto and model is not None and takes_labels(model)):
        how = " (auto: its forward takes labels)" if auto else ""
        return Step(labels_step, f"labels: model(input_ids=batch, labels=batch).loss{how}")
    how = " (auto: pass step= for your loss)" if auto else ""
    return Step(_loss_step(default_loss), f"sum: model(batch), first floating output summed{how}")


def run_fake_step(
    model: nn.Module,
    mode: Any,
    specs: Sequence[GroupSpec],
    replay: Replay,
    sample: SampleInput,
    step: StepFn,
    param_dtype: torch.dtype | None,
    extra_hooks: Callable[[nn.Module], list[Any]] | None = None,
    param_dtypes: Mapping[str, torch.dtype | None] | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> FakeStepResult:
    """One forward and backward of ``model`` (built under ``mode``) on ``sample``: ``step``
    runs the forward up to the loss (``resolve_step``). ``extra_hooks``: installs more hooks after the engine's (``fit``'s fold markers) and
    returns their handles."""
    started = time.perf_counter()
    params_of = _swap_to_compute_dtype(
        model, specs, mode, param_dtype, param_dtypes or {}, reduce_dtype
    )
    tracker = _LiveBytes(replay)
    for t in (*model.parameters(), *model.buffers()):
        tracker.know(t)
    inp = _make_input(sample, mode)
    for t in pytree.tree_leaves(inp):
        if isinstance(t, torch.Tensor):
            tracker.track(t)  # the input is live through the step
    handles = _install_hooks(model, specs, replay, tracker, params_of, param_dtype)
    if extra_hooks is not None:
        handles += extra_hooks(model)
    get_rng_state = torch.get_rng_state

    def tracked_rng_state() -> torch.Tensor:
        # A checkpoint saves the RNG state for its recompute: a real tensor made outside the
        # dispatcher (so invisible to the mode), live until the recompute.
        state = get_rng_state()
        tracker.track(state)
        return state

    try:
        torch.get_rng_state = tracked_rng_state
        with mode, tracker:
            loss = step(model, inp)  # what else the forward returned is dropped on return
            replay.start_backward()
            loss.backward()  # type: ignore[no-untyped-call]
            del loss
            replay.final_callback()
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(
            f"plan: the model's fake-tensor forward/backward on the sample input failed "
            f"({type(exc).__name__}: {exc}); check sample_input's shape and dtype"
        ) from exc
    finally:
        torch.get_rng_state = get_rng_state
        tracker.closed = True
        for h in handles:
            h.remove()
    return FakeStepResult(
        schedule=replay.result,
        peak_activation_bytes=replay.result.peaks["activations"],
        seconds=time.perf_counter() - started,
    )
