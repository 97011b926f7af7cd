"""``plan()``: per-rank memory and per-step communication of a ``fully_shard`` setup, predicted
from parameter shapes alone (a meta-device model; no process group, no parameter memory)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import torch
from torch import nn

from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy
from shardweave.fsdp._fsdp_common import CollectiveKind
from shardweave.fsdp.plan._activations import (
    LossFn,
    SampleInput,
    Step,
    StepFn,
    describe_sample,
    fake_mode,
    resolve_step,
    run_fake_step,
)
from shardweave.fsdp.plan._fit_config import BACKENDS, Target, parse_target
from shardweave.fsdp.plan._model import (
    ROOT_KEY,
    GroupSpec,
    ParamSpec,
    PlanError,
    WrapPredicate,
    discover_groups,
    module_wrap_predicate,
)
from shardweave.fsdp.plan._report import suggestions as make_suggestions
from shardweave.fsdp.plan._result import ActivationPlan, GroupPlan, ParamPlan, Plan
from shardweave.fsdp.plan._schedule import GroupTraffic, Replay, simulate_step
from shardweave.fsdp.plan._sharding import grad_made_in, layout, reduce_dtype, unsharded_dtype

__all__ = ["plan"]

# Optimizer state tensors per trainable parameter, each the size of the rank's (unpadded) shard
# in the parameter's original dtype. Adam's per-parameter ``step`` scalars are not counted (one
# 4-byte tensor per parameter, kept on the CPU unless capturable/fused).
OPTIMIZER_STATES: Final[dict[str, int]] = {
    "adamw": 2,
    "adam": 2,
    "sgd": 0,
    "sgd_momentum": 1,
    "none": 0,
}

DTYPE_NAMES: Final[dict[str, torch.dtype]] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}

_SHORT: Final[dict[torch.dtype, str]] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}

ModelOrFactory = nn.Module | Callable[[], nn.Module]


def parse_mesh(mesh: int | Sequence[int] | str) -> tuple[int, ...]:
    """``1024`` / ``"1024"`` (shard) or ``(8, 128)`` / ``"8x128"`` (replicate x shard)."""
    if isinstance(mesh, str):
        try:
            dims = tuple(int(d) for d in mesh.lower().replace("*", "x").split("x"))
        except ValueError:
            raise PlanError(
                f"plan: mesh {mesh!r} is not a shape; pass e.g. '1024' or '8x128' "
                "(replicate x shard)"
            ) from None
    elif isinstance(mesh, int):
        dims = (mesh,)
    else:
        dims = tuple(int(d) for d in mesh)
    if not 1 <= len(dims) <= 2 or any(d < 1 for d in dims):
        raise PlanError(
            f"plan: mesh must be one positive size (FSDP) or two (replicate, shard) for HSDP, "
            f"got {mesh!r}"
        )
    return dims


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value.lower() in ("none", ""):
        return None
    if value.lower() not in DTYPE_NAMES:
        raise PlanError(f"plan: unknown dtype {value!r}; use one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[value.lower()]


def parse_mp(
    mp_policy: MixedPrecisionPolicy | str | torch.dtype | None,
    reduce: str | torch.dtype | None = None,
) -> MixedPrecisionPolicy:
    if isinstance(mp_policy, MixedPrecisionPolicy):
        if reduce is not None:
            raise PlanError("plan: pass reduce_dtype inside the MixedPrecisionPolicy, not both")
        return mp_policy
    return MixedPrecisionPolicy(
        param_dtype=parse_dtype(mp_policy), reduce_dtype=parse_dtype(reduce)
    )


def parse_reshard(value: bool | int | str | None) -> bool | int | None:
    if value is None or isinstance(value, (bool, int)):
        return value
    lowered = value.lower()
    if lowered in ("true", "yes"):
        return True
    if lowered in ("false", "no"):
        return False
    if lowered == "none":
        return None
    try:
        return int(lowered)
    except ValueError:
        raise PlanError(
            f"plan: reshard_after_forward must be true, false or an int, got {value!r}"
        ) from None


def _resolve_reshard(value: bool | int | None, shard_size: int, is_root: bool) -> bool | int:
    if value is None:
        return not is_root  # the root's default keeps it gathered after forward
    if isinstance(value, bool):
        return value
    if value < 1 or value > shard_size or shard_size % value:
        factors = tuple(d for d in range(1, shard_size + 1) if shard_size % d == 0)
        raise PlanError(
            f"plan: reshard_after_forward={value} must divide the shard size {shard_size}; "
            f"pass one of {factors[:12]}{' ...' if len(factors) > 12 else ''}, or True/False"
        )
    if value == 1:
        return False
    if value == shard_size:
        return True
    return value


def _build_model(model_or_factory: ModelOrFactory) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    if not callable(model_or_factory):
        raise PlanError(
            f"plan: expected an nn.Module or a zero-argument factory, got "
            f"{type(model_or_factory).__name__}"
        )
    with torch.device("meta"):
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise PlanError(f"plan: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def default_tp_shard_dim(fqn: str, param: nn.Parameter) -> int | None:
    """Approximate tensor parallelism: matrices sharded on dim 0, vectors replicated."""
    return 0 if param.ndim >= 2 else None


def plan(
    model_or_factory: ModelOrFactory,
    *,
    mesh: int | Sequence[int] | str,
    tp: int = 1,
    tp_shard_dim: Callable[[str, nn.Parameter], int | None] | None = None,
    wrap: type | str | Sequence[str] | WrapPredicate | None = None,
    mp_policy: MixedPrecisionPolicy | str | torch.dtype | None = None,
    reduce_dtype: str | torch.dtype | None = None,
    reshard_after_forward: bool | int | str = True,
    root_reshard_after_forward: bool | int | str | None = None,
    optimizer: str = "adamw",
    ignored_params: set[nn.Parameter] | None = None,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
    set_to_none: bool = True,
    sample_input: SampleInput | None = None,
    loss_fn: LossFn | None = None,
    step: StepFn | str | None = None,
    backend: str | None = None,
    target: str | Target | None = None,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    offload: bool = False,
    reduce_scatter_max_input_buffers: int = 1,
) -> Plan:
    """Predict per-rank memory and per-step communication of ``fully_shard`` on ``mesh``.

    The model is built on the meta device (pass a zero-argument factory; a module you built
    yourself is only read). ``fully_shard`` is modeled on every module ``wrap`` selects (inner
    first) and then on the root; no parameter memory is allocated and no process group is
    needed, so any mesh size is cheap: per-rank numbers are closed forms.

    Args:
        model_or_factory: a zero-argument callable returning the model, or the model.
        mesh: shard size (``1024`` or ``"1024"``), or ``(replicate, shard)`` for HSDP
            (``(8, 128)`` or ``"8x128"``): HSDP all-reduces the reduce-scatter output over the
            replicate dim (more traffic, and each rank gathers from fewer peers).
        tp: tensor-parallel degree (the data-parallel mesh is per TP rank): parameters are
            first chunked by ``tp_shard_dim(fqn, param)`` (default: matrices on dim 0, vectors
            replicated; an approximation of a real TP plan).
        tp_shard_dim: the tensor-parallel dim of each parameter, or ``None`` for replicated.
        wrap: which modules get their own ``fully_shard``: a class, a class name (several
            comma-separated), or a predicate. Smaller groups lower peak gathered memory; more
            groups cost more collectives.
        mp_policy: a ``MixedPrecisionPolicy`` or a ``param_dtype`` name (``"bf16"``).
        reduce_dtype: with a dtype name for ``mp_policy``: the reduce dtype (e.g. ``"fp32"``).
        reshard_after_forward: for the wrapped modules: ``True`` (least memory, a second
            all-gather in backward), ``False`` (no second all-gather, every group stays
            gathered), or an int ``N`` dividing the shard size (keeps ``1/N`` after forward;
            the backward all-gather runs within ``N`` ranks).
        root_reshard_after_forward: the root's; ``None`` (the engine's default) keeps the root
            gathered after forward.
        optimizer: ``"adamw"``/``"adam"`` (2 states), ``"sgd_momentum"`` (1), ``"sgd"`` (0).
        ignored_params: parameters ``fully_shard`` leaves alone (not counted).
        forward_prefetch: each wrapped module prefetches the next ``k`` in forward (as
            ``set_modules_to_forward_prefetch``); 0 is the engine's default.
        backward_prefetch: previous groups prefetched in backward: 1 is the engine's implicit
            prefetch, ``k > 1`` models explicit ``set_modules_to_backward_prefetch`` lists.
        set_to_none: whether ``optimizer.zero_grad()`` frees the sharded gradients between
            steps (its default): then they appear during backward instead of being held.
        sample_input: one step's input: a tensor, a zero-argument factory of the input(s) (run
            under fake tensors), or ``(shape, dtype)``. With it the model (a factory) runs one
            forward and backward under fake tensors and ``Plan.activations`` gives the step's
            peak with activations and when it is reached (see ``_activations``).
        loss_fn: ``loss_fn(output, input)`` for that step, after ``model(input)``.
        step: the step trained, up to its loss: ``step(model, batch) -> loss``, or
            ``"labels"`` (transformers: ``model(input_ids=batch, labels=batch).loss``) or
            ``"sum"`` (the first floating output summed). Default (with no ``loss_fn``):
            ``"labels"`` where the model's forward takes ``labels``, else ``"sum"``.
            ``activations.step`` says which was planned.
        backend: without ``target``, ``"nccl"`` (GPUs) or ``"gloo"`` (CPU processes).
        target: the device type and backend planned for (``Target``): ``"cuda/nccl"`` (the
            default), ``"cpu/gloo"``, ``"cuda/gloo"``; the report's first line names it. An
            accelerator replays the engine's accelerator schedule (each gradient reduction
            runs to its end when started, ordered by events), the CPU its CPU one (waits at
            later post-backwards); gloo stages collectives in copies of its own, counted as
            communication buffers while the collective is in flight.
        shard_placement_fn: as ``fully_shard``'s: ``Shard(dim)`` or ``None`` (dim 0) per
            parameter; a dim other than 0 must be divisible by the shard size, and costs a
            scratch copy at each copy-out and a re-laid-out gradient at each reduce-scatter.
        offload: ``CPUOffloadPolicy``: sharded parameters, sharded gradients and optimizer
            state live in host memory (``Plan.host_bytes``) and leave the device peaks; each
            all-gather first copies the shards to the device (a communication buffer).
        reduce_scatter_max_input_buffers: ``FSDPModule.set_reduce_scatter_max_input_buffers``:
            how many reduce-scatter inputs stay alive in backward (the engine's retirement
            rule, ``_reduction.reduce_scatters_to_retire``, read by the replay).

    Returns:
        A ``Plan``: totals (``sharded_param_bytes``, ``grad_bytes``, ``optimizer_state_bytes``,
        ``peak_gathered_param_bytes``, ``unsharded_grad_bytes``, ``peak_tensor_bytes``,
        ``comm_bytes``), per-group rows and suggestions; ``activations`` with a sample input.

    Example::

        from shardweave.fsdp.plan import plan
        p = plan(lambda: MyModel(cfg), mesh="8x128", wrap="Block", mp_policy="bf16")
        print(p.peak_tensor_bytes / 2**30, "GiB per rank")
    """
    # Past 80 lines: its docstring (every argument's trade-off) and the Plan it fills field by
    # field; the work is in group_plans, simulate_step and the helpers below.
    started = time.perf_counter()
    dims = parse_mesh(mesh)
    replicate_size, shard_size = (1, dims[0]) if len(dims) == 1 else dims
    if not isinstance(tp, int) or tp < 1:
        raise PlanError(f"plan: tp must be a positive int, got {tp!r}")
    if optimizer.lower().replace("-", "_") not in OPTIMIZER_STATES:
        raise PlanError(
            f"plan: unknown optimizer {optimizer!r}; use one of {list(OPTIMIZER_STATES)}"
        )
    if forward_prefetch < 0 or backward_prefetch < 1:
        raise PlanError("plan: forward_prefetch must be >= 0 and backward_prefetch >= 1")
    states = OPTIMIZER_STATES[optimizer.lower().replace("-", "_")]
    if backend is not None and backend not in BACKENDS:
        raise PlanError(f"plan: backend must be one of {BACKENDS}, got {backend!r}")
    planned_for = parse_target(target, backend)
    backend = planned_for.backend
    mp = parse_mp(mp_policy, reduce_dtype)
    block_reshard = parse_reshard(reshard_after_forward)
    root_reshard = parse_reshard(root_reshard_after_forward)
    model, fake_tensors = _model_for(model_or_factory, sample_input, tp)
    specs = discover_groups(
        model,
        module_wrap_predicate(wrap),
        ignored_params=ignored_params,
        tp=tp,
        tp_shard_dim=(tp_shard_dim or default_tp_shard_dim) if tp > 1 else None,
        shard_placement_fn=shard_placement_fn,
        shard_size=shard_size,
    )
    param_dtypes = resolved_param_dtypes(model, mp)
    groups, traffic = group_plans(
        specs,
        block_reshard,
        root_reshard,
        shard_size,
        mp,
        states,
        replicate_size,
        backend,
        offload,
        param_dtypes,
    )
    sched = simulate_step(
        traffic,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        set_to_none=set_to_none,
        reduce_scatter_max_input_buffers=reduce_scatter_max_input_buffers,
        stream_ordered=planned_for.accelerator,
    )
    final = _with_counts(groups, sched.all_gathers, shard_size, replicate_size)
    sharded = sum(g.sharded_param_bytes for g in final)
    grads = sum(g.grad_bytes for g in final)
    opt0 = sum(g.optimizer_state_bytes for g in final)
    # Per kind, from GroupPlan's fields named after it ("<kind>_bytes", "<kind>s_per_step");
    # a kind the planner does not model (no such fields) is predicted as 0.
    comm: dict[str, int] = {
        kind.value: sum(getattr(g, f"{kind.value}_bytes", 0) for g in final)
        for kind in CollectiveKind
    }
    comm["total"] = sum(comm.values())
    collectives = {
        kind.value: sum(getattr(g, f"{kind.value}s_per_step", 0) for g in final)
        for kind in CollectiveKind
    }
    opt_last = sum(g.last_rank_optimizer_state_bytes for g in final)
    host = sharded + grads + opt0 if offload else 0
    # Device bytes held all step: the shards and optimizer state, unless offloaded.
    held0, held_last = (0, 0) if offload else (sharded + opt0, sharded + opt_last)
    peak = held0 + sched.peak_dynamic_bytes
    activations = None
    if fake_tensors is not None and sample_input is not None:
        replay = Replay(
            traffic,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
            set_to_none=set_to_none,
            keep_timeline=False,
            reduce_scatter_max_input_buffers=reduce_scatter_max_input_buffers,
            stream_ordered=planned_for.accelerator,
        )
        held = {"sharded_params": sharded, "optimizer_state": opt0, "last": held_last}
        activations = _activation_plan(
            model,
            (fake_tensors, specs, replay),
            sample_input,
            resolve_step(step, loss_fn, model),
            (mp, param_dtypes),
            held if not offload else dict.fromkeys(held, 0),
        )
    ranks = _rank_rows(final, peak - opt0, offload)
    largest = max(final, key=lambda g: g.gathered_bytes).key if final else ""
    inputs = _inputs(
        dims, tp, wrap, mp, (block_reshard, root_reshard), optimizer, planned_for, sample_input
    )
    inputs |= {
        "forward_prefetch": forward_prefetch,
        "backward_prefetch": backward_prefetch,
        "set_to_none": set_to_none,
        "offload": offload,
    }
    result = Plan(
        inputs=inputs,
        world_size=math.prod(dims) * tp,
        shard_size=shard_size,
        replicate_size=replicate_size,
        total_numel=sum(g.numel for g in final),
        sharded_param_bytes=sharded,
        grad_bytes=grads,
        optimizer_state_bytes=opt0,
        peak_gathered_param_bytes=sched.peaks["gathered_params"],
        peak_comm_buffer_bytes=sched.peaks["comm_buffers"],
        unsharded_grad_bytes=sched.peaks["unsharded_grads"],
        peak_post_forward_shard_bytes=sched.peaks["post_forward_shards"],
        peak_tensor_bytes=peak,
        peak_at=sched.peak_dynamic_at,
        lines_at_peak={
            "sharded_params": 0 if offload else sharded,
            "optimizer_state": 0 if offload else opt0,
            **sched.at_peak,
        },
        host_bytes=host,
        comm_bytes=comm,
        collectives=collectives,
        ranks=ranks,
        groups=tuple(final),
        largest_group=largest,
        suggestions=(),
        schedule={
            "peaks_at": dict(sched.peaks_at),
            "peak_dynamic_bytes": sched.peak_dynamic_bytes,
            "peak_dynamic_at": sched.peak_dynamic_at,
            "model": (
                "forward: root unshards, wrapped modules unshard/run/reshard in order; "
                f"forward prefetch {forward_prefetch}; backward: each group re-gathers if "
                f"resharded and prefetches {backward_prefetch} previous group(s); root and "
                "wrapped nn.Embedding reduce in the final callback; sharded grads "
                + ("appear as reductions finish" if set_to_none else "held between steps")
                + "; activations only in 'activations', from a fake step on a sample input"
            ),
        },
        timeline=tuple(sched.timeline),
        activations=activations,
    )
    result = dataclasses.replace(result, suggestions=tuple(make_suggestions(result, specs)))
    return dataclasses.replace(result, planner_seconds=round(time.perf_counter() - started, 4))


def _activation_plan(
    model: nn.Module,
    run: tuple[Any, Sequence[GroupSpec], Replay],
    sample_input: SampleInput,
    planned_step: Step,
    dtypes: tuple[MixedPrecisionPolicy, Mapping[str, torch.dtype | None] | None],
    held: dict[str, int],
) -> ActivationPlan:
    """The fake step's peak with activations (``run``: the fake mode, the groups and the
    replay it drives), on top of the bytes ``held`` all step (the shards and optimizer state,
    none with offload; ``last``: the last shard rank's)."""
    mode, specs, replay = run
    mp, param_dtypes = dtypes
    fake = run_fake_step(
        model,
        mode,
        specs,
        replay,
        sample_input,
        planned_step.run,
        mp.param_dtype,
        param_dtypes=param_dtypes,
        reduce_dtype=mp.reduce_dtype,
    )
    fs = fake.schedule
    phase, group, event = fs.peak_moment
    held0 = held["sharded_params"] + held["optimizer_state"]
    return ActivationPlan(
        sample_input=describe_sample(sample_input),
        peak_bytes=held0 + fs.peak_dynamic_bytes,
        last_shard_rank_peak_bytes=held["last"] + fs.peak_dynamic_bytes,
        peak_phase=phase,
        peak_group=group,
        peak_event=event,
        peak_activation_bytes=fake.peak_activation_bytes,
        lines_at_peak={
            "sharded_params": held["sharded_params"],
            "optimizer_state": held["optimizer_state"],
            **fs.at_peak,
        },
        peaks=dict(fs.peaks),
        seconds=round(fake.seconds, 4),
        step=planned_step.description,
    )


def _with_counts(
    groups: Sequence[GroupPlan],
    all_gathers: Mapping[str, int],
    shard_size: int,
    replicate_size: int,
) -> list[GroupPlan]:
    """Each group's collectives per step (all-gathers as the replay counted them; one
    reduce-scatter, and under HSDP one all-reduce, per trained group) and their bytes."""
    final: list[GroupPlan] = []
    for gp in groups:
        ag_count = all_gathers.get(gp.key, 0) if shard_size > 1 else 0
        trains = gp.trainable_numel > 0
        rs_count = 1 if trains and shard_size > 1 else 0
        ar_count = 1 if trains and replicate_size > 1 else 0
        final.append(
            dataclasses.replace(
                gp,
                all_gathers_per_step=ag_count,
                all_gather_bytes=ag_count * gp.gathered_bytes,
                reduce_scatters_per_step=rs_count,
                reduce_scatter_bytes=rs_count * gp.reduce_scatter_bytes,
                all_reduces_per_step=ar_count,
                all_reduce_bytes=ar_count * gp.all_reduce_bytes,
            )
        )
    return final


def _model_for(
    model_or_factory: ModelOrFactory, sample_input: SampleInput | None, tp: int
) -> tuple[nn.Module, Any]:
    """The model to read: built under fake tensors (and that mode) for a fake step with a
    sample input, else on the meta device (or the module given)."""
    if sample_input is None:
        return _build_model(model_or_factory), None
    if isinstance(model_or_factory, nn.Module) or not callable(model_or_factory):
        raise PlanError(
            "plan: sample_input needs the model as a zero-argument factory (it is built "
            "again under fake tensors), not a built module"
        )
    if tp > 1:
        raise PlanError("plan: sample_input with tp > 1 is not modeled; plan without it")
    fake_tensors = fake_mode()
    with fake_tensors:
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise PlanError(f"plan: the factory returned {type(model).__name__}, not an nn.Module")
    return model, fake_tensors


def _inputs(
    dims: tuple[int, ...],
    tp: int,
    wrap: object,
    mp: MixedPrecisionPolicy,
    reshards: tuple[bool | int | None, bool | int | None],
    optimizer: str,
    planned_for: Target,
    sample_input: SampleInput | None,
) -> dict[str, object]:
    """``Plan.inputs``: what was planned, as the report and the JSON name it."""
    return {
        "mesh": list(dims),
        "tp": tp,
        "wrap": wrap
        if isinstance(wrap, str) or wrap is None
        else getattr(wrap, "__name__", repr(wrap)),
        "mp_policy": {
            "param_dtype": _name(mp.param_dtype),
            "reduce_dtype": _name(mp.reduce_dtype),
        },
        "reshard_after_forward": reshards[0],
        "root_reshard_after_forward": reshards[1],
        "optimizer": optimizer,
        "backend": planned_for.backend,
        "target": str(planned_for),
        "sample_input": None if sample_input is None else describe_sample(sample_input),
    }


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _group_plan(
    spec: GroupSpec,
    mode: bool | int,
    world: int,
    mp: MixedPrecisionPolicy,
    states: int,
    all_reduce: bool,
    gloo: bool,
    offload: bool,
    param_dtypes: Mapping[str, torch.dtype | None],
) -> tuple[GroupPlan, GroupTraffic]:
    # Past 80 lines: one pass over the group's parameters sums a dozen per-rank quantities
    # that the engine's rules then combine; split, they would travel as a dozen arguments.
    params: list[ParamPlan] = []
    numel = trainable = padded = 0
    sharded = grad = opt = opt_last = gathered = ugrad = post = rs = ar = 0
    rank0 = last = cast_input = ar_staging = scratch = relayout = 0
    orig_dtypes = {p.dtype for p in spec.params}
    casts = False
    # One reduction per group, in the promoted dtype of what its gradients are reduced in
    # (group_reduce_dtype): mixed only where param_dtype_override_fn or explicit grad_dtypes
    # make them differ.
    trained = [p for p in spec.params if p.requires_grad]
    rds = {_reduced_in(p, param_dtypes.get(p.fqn, mp.param_dtype), mp) for p in trained}
    rd = functools.reduce(torch.promote_types, rds) if rds else torch.float32
    out_dtype_differs = False
    for p in spec.params:
        lay = layout(p.shape, world, p.shard_dim)
        pd = param_dtypes.get(p.fqn, mp.param_dtype)
        ud = unsharded_dtype(p.dtype, pd)
        gd = p.grad_dtype or p.dtype  # the sharded gradient's
        casts |= ud != p.dtype
        orig = p.dtype.itemsize
        numel += lay.numel
        padded += lay.padded_shard_numel
        rank0 += lay.rank0_numel
        last += lay.last_numel
        sharded += lay.padded_shard_numel * orig
        gathered += world * lay.padded_shard_numel * ud.itemsize
        cast_input += lay.padded_shard_numel * ud.itemsize
        if p.shard_dim and world > 1:
            # Gathered rows are chunks along the dim: copied out into scratch, then concatenated
            # into place; gradients are re-laid out as dim-0 chunks before the reduce-scatter.
            scratch += lay.numel * ud.itemsize
            relayout += lay.numel * ud.itemsize if p.requires_grad else 0
        if not isinstance(mode, bool):
            post += world * lay.padded_shard_numel // mode * ud.itemsize
        if p.requires_grad:
            trainable += lay.numel
            grad += lay.padded_shard_numel * gd.itemsize
            out_dtype_differs |= rd != gd
            # Adam's moments are made like the parameter, with a 4-byte ``step`` tensor beside
            # them; SGD's momentum is a clone of the first gradient (its dtype).
            size = orig if states == 2 else gd.itemsize
            opt += states * lay.rank0_numel * size + (4 if states == 2 else 0)
            opt_last += states * lay.last_numel * size + (4 if states == 2 else 0)
            ugrad += lay.numel * grad_made_in(p.dtype, ud, mp.reduce_dtype, p.grad_dtype).itemsize
            rs += world * lay.padded_shard_numel * rd.itemsize
            ar += lay.padded_shard_numel * rd.itemsize
            if rd.itemsize < 4:
                ar_staging += lay.padded_shard_numel * 4  # gloo reduces in fp32
        params.append(
            ParamPlan(
                p.fqn,
                p.shape,
                _name(p.dtype) or "",
                p.requires_grad,
                lay.padded_shard_numel,
                lay.rank0_numel,
                lay.last_numel,
            )
        )
    # The engine's rules (FSDPParamGroup.unshard): one flat shard buffer per group when the
    # dtypes agree; with one rank per shard group and no cast the parameters view it.
    uniform = len(orig_dtypes) <= 1
    aliases = world == 1 and uniform and not casts and isinstance(mode, bool) and not offload
    if aliases:
        gathered = 0
    # The all-gather input (all_gather_copy_in): with a collective, a built input (a cast, a
    # copy to the device, a concatenation) is written into this rank's slot of the output;
    # only what it is built from may be transient (offloaded shards copied to the device
    # before the cast; each parameter's cast before the concatenation). With one rank per
    # shard the copy-out casts, so only a copy to the device or a concatenation is kept.
    ag_input = ag_transient = 0
    if world > 1:
        if offload and casts:
            ag_transient = sharded
        elif not uniform and casts:
            ag_transient = cast_input
    elif not uniform:
        ag_input = cast_input
    elif offload:
        ag_input = sharded
    gp = GroupPlan(
        key=spec.key,
        module_type=spec.module_type,
        reshard_after_forward=mode,
        num_params=len(spec.params),
        numel=numel,
        trainable_numel=trainable,
        padded_shard_numel=padded,
        sharded_param_bytes=sharded,
        grad_bytes=grad,
        optimizer_state_bytes=opt,
        last_rank_optimizer_state_bytes=opt_last,
        rank0_numel=rank0,
        last_rank_numel=last,
        gathered_bytes=gathered,
        unsharded_grad_bytes=ugrad,
        post_forward_shard_bytes=post,
        all_gathers_per_step=0,
        all_gather_bytes=0,
        reduce_scatters_per_step=0,
        reduce_scatter_bytes=rs,  # one collective's bytes until scaled by the count
        all_reduces_per_step=0,
        all_reduce_bytes=ar,
        children=spec.children,
        params=tuple(params),
        aliases_shards=aliases,
    )
    tr = GroupTraffic(
        key=spec.key,
        parent=spec.parent,
        gathered_bytes=gathered,
        all_gather_output_bytes=gathered if world > 1 else 0,
        all_gather_input_bytes=0 if aliases else ag_input,
        all_gather_input_transient_bytes=ag_transient,
        post_forward_bytes=post,
        # Concatenated post-forward shards go into the output's slot when gathered.
        post_forward_input_bytes=post if len(spec.params) > 1 and mode == 1 else 0,
        unsharded_grad_bytes=ugrad,
        reduce_scatter_input_bytes=rs,
        reduce_scatter_output_bytes=ar,
        reduce_scatter_issued=world > 1,
        sharded_grad_bytes=0 if offload else grad,  # offloaded: copied to the host
        reduce_output_cast=out_dtype_differs or offload,
        all_reduce=all_reduce and trainable > 0,
        reshard_after_forward=mode,
        deferred_post_backward=spec.key == ROOT_KEY or spec.input_is_integer,
        copy_out_scratch_bytes=0 if aliases else scratch,
        reduce_scatter_layout_bytes=relayout,
        backend_all_gather_bytes=gathered if gloo and world > 1 else 0,
        backend_reduce_scatter_bytes=rs if gloo and world > 1 else 0,
        backend_all_reduce_bytes=ar_staging if gloo and all_reduce else 0,
    )
    return gp, tr


def _rank_rows(
    groups: Sequence[GroupPlan], peak_less_opt: int, offload: bool
) -> dict[str, dict[str, int]]:
    """Shard rank 0 and the last shard rank: they differ only in optimizer state (which is
    host memory, out of the device peak, when offloaded)."""
    opt0 = sum(g.optimizer_state_bytes for g in groups)
    opt_last = sum(g.last_rank_optimizer_state_bytes for g in groups)
    if offload:
        peak_less_opt += opt0  # the device peak holds no optimizer state
        return {
            "rank0": {
                "real_shard_numel": sum(g.rank0_numel for g in groups),
                "optimizer_state_bytes": opt0,
                "peak_tensor_bytes": peak_less_opt,
            },
            "last_shard_rank": {
                "real_shard_numel": sum(g.last_rank_numel for g in groups),
                "optimizer_state_bytes": opt_last,
                "peak_tensor_bytes": peak_less_opt,
            },
        }
    return {
        "rank0": {
            "real_shard_numel": sum(g.rank0_numel for g in groups),
            "optimizer_state_bytes": opt0,
            "peak_tensor_bytes": peak_less_opt + opt0,
        },
        "last_shard_rank": {
            "real_shard_numel": sum(g.last_rank_numel for g in groups),
            "optimizer_state_bytes": opt_last,
            "peak_tensor_bytes": peak_less_opt + opt_last,
        },
    }


def _reduced_in(
    p: ParamSpec, param_dtype: torch.dtype | None, mp: MixedPrecisionPolicy
) -> torch.dtype:
    """The dtype one parameter's gradient is reduced in (``FSDPParam.init_dtype_attrs``): the
    policy's ``reduce_dtype``, else an explicit ``grad_dtype``, else the release's rule."""
    policy_reduce = mp.reduce_dtype if mp.reduce_dtype is not None else p.grad_dtype
    return reduce_dtype(p.dtype, param_dtype, policy_reduce)


def resolved_param_dtypes(
    model: nn.Module, mp: MixedPrecisionPolicy
) -> dict[str, torch.dtype | None] | None:
    """Each parameter's ``param_dtype`` as ``mp.param_dtype_override_fn`` decides it (None
    without the callable); its bad answers are ``fully_shard``'s ``ValueError``, as a
    ``PlanError``."""
    if mp.param_dtype_override_fn is None:
        return None
    try:
        return {fqn: mp.resolve_param_dtype(p) for fqn, p in model.named_parameters()}
    except ValueError as exc:
        raise PlanError(f"plan: {exc}") from exc


def group_plans(
    specs: Sequence[GroupSpec],
    reshard: bool | int | None,
    root_reshard: bool | int | None,
    shard_size: int,
    mp: MixedPrecisionPolicy,
    states: int,
    replicate_size: int,
    backend: str,
    offload: bool,
    param_dtypes: Mapping[str, torch.dtype | None] | None = None,
) -> tuple[list[GroupPlan], list[GroupTraffic]]:
    """Every group's plan and the traffic its replay needs, under one configuration: for
    ``plan`` and for each configuration ``fit`` searches. ``param_dtypes``: per parameter FQN,
    its ``param_dtype`` where ``mp.param_dtype_override_fn`` decides it
    (``resolved_param_dtypes``)."""
    groups: list[GroupPlan] = []
    traffic: list[GroupTraffic] = []
    for spec in specs:
        is_root = spec.key == ROOT_KEY
        mode = _resolve_reshard(root_reshard if is_root else reshard, shard_size, is_root)
        gp, tr = _group_plan(
            spec,
            mode,
            shard_size,
            mp,
            states,
            replicate_size > 1,
            backend == "gloo",
            offload,
            param_dtypes or {},
        )
        groups.append(gp)
        traffic.append(tr)
    return groups, traffic
