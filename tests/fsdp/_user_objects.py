"""The user-objects catalogue: what users hold of a sharded model, times what they do with it.

Users save, copy and ship what the model hands them: ``model.state_dict()``, the DCP state
dicts, the optimizer's, one parameter, its local shard, its gradient, an optimizer state
tensor. Whatever layout the engine keeps inside, those objects must behave as torch's own
(ARCHITECTURE.md, "What users hold is torch's"). Each *line* of the catalogue is one
(holder, operation) pair, run with torch's ``fully_shard`` (the oracle) and ours on
identically seeded models in the same processes:

* torch's outcome is pinned per line (``torch_raises``; a configuration may override it):
  works, or raises a named exception type. A change there is reported, since the line then
  no longer says what it was written to say;
* ours must have the same outcome; where torch raises and the line is ``beyond_torch``, ours
  must work instead (the decision is pinned here: flip the flag to go back to "raise like
  torch");
* where it works, the line's own check holds on both engines (a round trip gives back the
  same tensors: type, placements, shapes, dtype, device, local bits; a load gives back the
  original values) and ours gives bitwise what torch gives (the line's snapshot).

``run_catalogue`` runs every line on both engines inside one spawned body, never stops at a
failing line, and returns rows; ``assert_catalogue`` (in the pytest process) fails once with
the whole table, naming each broken line. Where torch's engine cannot run a kind at all, a
configuration's subject for torch is None and ours must work and pass the lines' own checks.

Configurations (policies, meshes, parameter kinds) only change how the models are built: see
``Config`` and ``fsdp_subject``; TP and tensor-subclass subjects live with the extensions tests.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests._dist.sync import barrier
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks

# ------------------------------------------------------------------------------ engines


@dataclass(frozen=True)
class Engine:
    """One engine's entry points: its ``fully_shard`` and its policy classes."""

    name: str
    fully_shard: Callable[..., Any]
    mixed_precision: Callable[..., Any]
    cpu_offload: Callable[..., Any]


TORCH: Final = Engine("torch", torch_fully_shard, TorchMixedPrecisionPolicy, TorchCPUOffloadPolicy)
OURS: Final = Engine("shardweave", fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy)


@dataclass(frozen=True)
class Subject:
    """One engine's models for a configuration.

    ``build(seed)`` returns a sharded model (``seed`` picks the initial values: the catalogue
    loads into models built with another seed, so a load that does nothing shows);
    ``loss(model, i)`` runs the forward on this rank's batch of step ``i``;
    ``param`` names the single parameter the tensor lines hold; ``prepare`` runs before every
    line that holds the whole model's state (e.g. an eval forward that leaves the parameters
    unsharded, so the state-dict hooks must reshard first)."""

    build: Callable[[int], nn.Module]
    loss: Callable[[nn.Module, int], torch.Tensor]
    param: str
    prepare: Callable[[nn.Module], None] | None = None


@dataclass(frozen=True)
class Config:
    """A parametrization of the catalogue.

    ``subject(engine)`` builds that engine's models, or returns None where the engine cannot
    run the kind (then ours must work and pass each line's own checks). ``torch_raises``
    overrides lines' expected torch outcome for this configuration, by line label (None:
    torch works)."""

    name: str
    subject: Callable[[Engine], Subject | None]
    torch_raises: Mapping[str, type[BaseException] | None] = field(default_factory=dict)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # AdamW: state tensors (exp_avg, exp_avg_sq) shaped like the shards, and a scalar step.
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp_subject(
    engine: Engine,
    kind: str,
    param: str,
    *,
    apply: Callable[..., Any] | None = None,
    make: Callable[[int], nn.Module] | None = None,
    mesh: object | None = None,
    mp: bool = False,
    offload: bool = False,
    reshard_after_forward: bool | int | None = None,
    eval_forward: bool = False,
) -> Subject:
    """A ``tests.fsdp._models`` kind (built by ``make(seed)``, default ``make_model``) under
    ``shard_blocks`` with ``apply`` (default: the engine's ``fully_shard``) and the given
    policies."""
    kwargs: dict[str, object] = {}
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    if mesh is not None:
        kwargs["mesh"] = mesh
    if mp:
        kwargs["mp_policy"] = engine.mixed_precision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if offload:
        # Pinned memory needs an accelerator.
        kwargs["offload_policy"] = engine.cpu_offload(pin_memory=False)
    rank = dist.get_rank()

    def build(seed: int) -> nn.Module:
        model = make(seed) if make is not None else make_model(kind, seed=seed)
        shard_blocks(model, apply or engine.fully_shard, **kwargs)
        return model

    def loss(model: nn.Module, i: int) -> torch.Tensor:
        batch = make_batch(kind, 100 * i + rank)
        return loss_fn(kind, model(batch), batch).float()

    def prepare(model: nn.Module) -> None:
        with torch.no_grad():
            model(make_batch(kind, 999))

    return Subject(build, loss, param, prepare if eval_forward else None)


# ------------------------------------------------------------------------------ snapshots


@dataclass(frozen=True)
class TensorFacts:
    """What a user can see of a tensor, with its (local) values cloned."""

    cls: str
    is_param: bool
    placements: tuple[object, ...] | None
    mesh: tuple[object, ...] | None  # shape, ranks, dim names
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool
    local_shape: tuple[int, ...]
    local_stride: tuple[int, ...] | None  # None for empty locals, whose strides mean nothing
    parts: tuple[torch.Tensor, ...]  # the local values (a wrapper subclass: its inner tensors)
    grad: object = None  # the gradient's facts, when asked for (deepcopy copies ``.grad``)


def inner_tensors(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The plain tensors holding ``t``'s values: ``t`` itself, or a wrapper subclass's inner
    tensors (``__tensor_flatten__``)."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return (t,)
    names, _ = t.__tensor_flatten__()
    return tuple(p for n in names for p in inner_tensors(getattr(t, n)))


def _parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(p.detach().clone() for p in inner_tensors(t))


def snapshot(obj: object, grads: bool = False) -> object:
    """``obj`` with every tensor replaced by its ``TensorFacts`` (containers kept); ``grads``:
    with each tensor's ``.grad`` too."""
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            dm = obj.device_mesh if isinstance(obj, DTensor) else None
            mesh = (
                (tuple(dm.shape), tuple(dm.mesh.flatten().tolist()), dm.mesh_dim_names)
                if dm is not None
                else None
            )
            return TensorFacts(
                cls=type(obj).__name__,
                is_param=isinstance(obj, nn.Parameter),
                placements=tuple(obj.placements) if isinstance(obj, DTensor) else None,
                mesh=mesh,
                shape=tuple(obj.shape),
                dtype=obj.dtype,
                device=str(obj.device),
                requires_grad=obj.requires_grad,
                local_shape=tuple(local.shape),
                local_stride=tuple(local.stride()) if local.numel() else None,
                parts=_parts(local.detach()),
                grad=snapshot(obj.grad) if grads and obj.grad is not None else None,
            )
    if isinstance(obj, Mapping):
        return {k: snapshot(v, grads) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v, grads) for v in obj)
    return obj


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(got: object, want: object, path: str = "") -> list[str]:
    """Where two snapshots differ (bitwise for tensor values), as readable lines."""
    where = path or "<top>"
    if isinstance(want, AtMost) and isinstance(got, AtMost):
        return [] if got.n <= want.n else [f"{where}: {got.n} bytes, more than torch's {want.n}"]
    if isinstance(want, TensorFacts) or isinstance(got, TensorFacts):
        if not (isinstance(want, TensorFacts) and isinstance(got, TensorFacts)):
            return [f"{where}: {type(got).__name__} vs {type(want).__name__}"]
        out = [
            f"{where}.{name}: {getattr(got, name)} vs {getattr(want, name)}"
            for name in TensorFacts.__dataclass_fields__
            if name not in ("parts", "grad") and getattr(got, name) != getattr(want, name)
        ]
        out += differences(got.grad, want.grad, f"{where}.grad")
        if len(got.parts) != len(want.parts):
            out.append(f"{where}: {len(got.parts)} vs {len(want.parts)} inner tensors")
        elif not out:
            for i, (a, b) in enumerate(zip(got.parts, want.parts, strict=True)):
                same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
                if not same:
                    out.append(f"{where}: local values differ (inner tensor {i})")
        return out
    if isinstance(want, Mapping):
        if not isinstance(got, Mapping) or list(got) != list(want):
            keys = list(got) if isinstance(got, Mapping) else type(got).__name__
            return [f"{where}: keys {keys} vs {list(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}[{k!r}]")]
    if isinstance(want, (list, tuple)):
        if (
            not isinstance(got, (list, tuple))
            or type(got) is not type(want)
            or len(got) != len(want)
        ):
            return [f"{where}: {got!r} vs {want!r}"]
        return [
            d
            for i, (a, b) in enumerate(zip(got, want, strict=True))
            for d in differences(a, b, f"{path}[{i}]")
        ]
    return [] if got == want else [f"{where}: {got!r} vs {want!r}"]


class WrongResult(AssertionError):
    """A line ran but gave back something else than it should (not an exception it raised)."""


def expect_same(got: object, want: object, what: str, grads: bool = False) -> None:
    diffs = differences(snapshot(got, grads), snapshot(want, grads))
    if diffs:
        more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise WrongResult(f"{what}: " + "; ".join(diffs[:3]) + more)


# ------------------------------------------------------------------------------ one engine's side


@dataclass
class Side:
    """One engine's trained model and optimizer (the originals every line reads)."""

    engine: Engine
    subject: Subject
    model: nn.Module
    opt: torch.optim.Optimizer
    output: torch.Tensor  # the model's loss on the batch of step 3 (forward only)

    @property
    def param(self) -> torch.Tensor:
        return self.model.get_parameter(self.subject.param)

    def fresh(self, seed: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = self.subject.build(seed)
        return model, make_optimizer(model)


def reshard(model: nn.Module) -> None:
    """Every FSDP module of ``model`` back to sharded parameters (a forward without backward,
    e.g. under no_grad, may leave some unsharded, on either engine)."""
    for module in model.modules():
        resharding = getattr(module, "reshard", None)  # FSDPModule of either engine
        if resharding is not None:
            resharding()


def train(subject: Subject, model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        subject.loss(model, i).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()


def make_side(engine: Engine, subject: Subject) -> Side:
    """Two AdamW steps, then one more backward: parameters, gradients and optimizer state."""
    model = subject.build(0)
    opt = make_optimizer(model)
    train(subject, model, opt, range(2))
    subject.loss(model, 2).backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        output = subject.loss(model, 3)
    reshard(model)
    return Side(engine, subject, model, opt, output)


def local_state(model: nn.Module) -> dict[str, object]:
    """The model's parameters and buffers as snapshots (every value a copy)."""
    # remove_duplicate=False: tied weights keep both names (``load_state_dict(assign=True)``
    # unties them, on torch's engine too).
    named = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    return {k: snapshot(v) for k, v in named.items()}


# ------------------------------------------------------------------------------ holders


@dataclass(frozen=True)
class Holder:
    """What the user holds: a label and how it is taken from a side. ``whole_model`` holders
    are taken after the subject's ``prepare`` (e.g. an eval forward)."""

    label: str
    take: Callable[[Side], Any]
    whole_model: bool = False


FULL: Final = StateDictOptions(full_state_dict=True)
FULL_CPU: Final = StateDictOptions(full_state_dict=True, cpu_offload=True)

MODEL_SD: Final = Holder("model.state_dict()", lambda s: s.model.state_dict(), True)
DCP_SD: Final = Holder("get_model_state_dict", lambda s: get_model_state_dict(s.model), True)


def _waited(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A full state dict whose wrapper-subclass values hold their gathered data, not a pending
    collective. DTensor's ``full_tensor`` of a wrapper subclass (the all-gather protocol's
    ``BF16Gather``) hands back the subclass around an ``AsyncCollectiveTensor`` on either engine,
    and pickling flattens the subclass without a dispatch, so nothing waits: ``torch.save`` can
    read the output buffer before gloo has written it (torch warns that the collective's output
    was never waited on; one CI run saved other values on one rank). A user of such a subclass
    waits first, as here; plain tensors are left as they come."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for value in state_dict.values():
        if is_traceable_wrapper_subclass(value) and not isinstance(value, AsyncCollectiveTensor):
            for name in value.__tensor_flatten__()[0]:
                inner = getattr(value, name)
                if isinstance(inner, AsyncCollectiveTensor):
                    setattr(value, name, inner.wait())
    return state_dict


DCP_FULL: Final = Holder(
    "get_model_state_dict(full)",
    lambda s: _waited(get_model_state_dict(s.model, options=FULL)),
    True,
)
DCP_FULL_CPU: Final = Holder(
    "get_model_state_dict(full, cpu_offload)",
    lambda s: _waited(get_model_state_dict(s.model, options=FULL_CPU)),
    True,
)
# Not after an eval forward: with the parameters left unsharded, get_optimizer_state_dict cannot
# map the optimizer's (sharded) parameters to names, on torch's engine too (KeyError).
DCP_OSD: Final = Holder(
    "get_optimizer_state_dict", lambda s: get_optimizer_state_dict(s.model, s.opt)
)
OPT_SD: Final = Holder("opt.state_dict()", lambda s: s.opt.state_dict())
PARAM: Final = Holder("parameter", lambda s: s.param)


def _no_grad_local(t: torch.Tensor) -> torch.Tensor:
    # Taken outside autograd, as checkpointing code does: with grad mode on, ``to_local()`` of a
    # parameter is a non-leaf that deepcopy refuses on either engine, whatever the storage.
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined, no-any-return]


LOCAL: Final = Holder("parameter.to_local()", lambda s: _no_grad_local(s.param))
GRAD: Final = Holder("parameter.grad", lambda s: s.param.grad)
GRAD_LOCAL: Final = Holder(
    "parameter.grad.to_local()",
    lambda s: _no_grad_local(s.param.grad),  # type: ignore[arg-type]
)
OPT_TENSOR: Final = Holder(
    "opt.state[parameter]['exp_avg']", lambda s: s.opt.state[s.param]["exp_avg"]
)


# ------------------------------------------------------------------------------ operations


def _roundtrip_file(obj: object, weights_only: bool) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


def op_save_load(weights_only: bool) -> Callable[[Side, Any], object]:
    def run(side: Side, obj: Any) -> object:
        loaded = _roundtrip_file(obj, weights_only)
        expect_same(loaded, obj, "loaded vs saved")
        return snapshot(loaded)

    return run


def op_deepcopy(side: Side, obj: Any) -> object:
    copied = copy.deepcopy(obj)
    # A deep copy of a parameter copies its gradient too (torch.save and pickle do not).
    expect_same(copied, obj, "copy vs original", grads=True)
    return snapshot(copied, grads=True)


def op_pickle(side: Side, obj: Any) -> object:
    copied = pickle.loads(pickle.dumps(obj))
    expect_same(copied, obj, "unpickled vs original")
    return snapshot(copied)


def _after_load(side: Side, model: nn.Module) -> object:
    """The loaded model's forward (which reads whatever the engine all-gathers from, not only
    what the registered parameters show) gives bitwise the original's output, and the model
    holds the original's values. The forward comes first: checks that fail on one rank only
    must not keep it from a collective the others run."""
    with torch.no_grad():
        output = side.subject.loss(model, 3)
    reshard(model)
    expect_same(local_state(model), local_state(side.model), "loaded model vs original")
    expect_same(output, side.output, "loaded model's output vs original's")
    return local_state(model)


class RankFailure(Exception):
    """A rank-local step failed on another rank (``synced``): this rank reports that error."""

    def __init__(self, rank: int, type_name: str, message: str) -> None:
        super().__init__(f"{type_name} on rank {rank}: {message}")
        self.type_name = type_name


def _first_line(e: BaseException) -> str:
    """The line of an error message that says what went wrong (for a weights-only load, the
    unpickler's own line, not the advice above it), without terminal colours."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines()]
    lines = [line for line in lines if line] or [""]
    said = next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0])
    return said[:200]


def synced(fn: Callable[[], Any]) -> Any:
    """Run a rank-local step that a collective follows: where it fails on some rank, it fails on
    every rank (the others raise ``RankFailure`` naming that error), so no rank waits in a
    collective the others skip (e.g. a full state dict that only rank 0 holds)."""
    error: BaseException | None = None
    try:
        result = fn()
    except (Exception, CheckpointException) as e:
        result, error = None, e
    report = None if error is None else (type(error).__name__, _first_line(error))
    reports: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if error is not None:
        raise error
    for rank, other in enumerate(reports):
        if other is not None:
            raise RankFailure(rank, *other)  # type: ignore[misc]
    return result


def op_load_state_dict(assign: bool) -> Callable[[Side, Any], object]:
    def run(side: Side, obj: Any) -> object:
        loaded = synced(lambda: _roundtrip_file(obj, weights_only=True))
        model, _ = side.fresh()
        synced(lambda: model.load_state_dict(loaded, assign=assign))
        return _after_load(side, model)

    return run


def op_load_into_trained(assign: bool) -> Callable[[Side, Any], object]:
    """Load into a model that already took a step (its engine initialized, its shards
    adopted): the next forward must read the loaded values (torch re-adopts assigned
    parameters in a ``load_state_dict`` post-hook)."""

    def run(side: Side, obj: Any) -> object:
        loaded = synced(lambda: _roundtrip_file(obj, weights_only=True))
        model, opt = side.fresh()
        train(side.subject, model, opt, range(1))
        synced(lambda: model.load_state_dict(loaded, assign=assign))
        return _after_load(side, model)

    return run


def op_set_model_state_dict(options: StateDictOptions) -> Callable[[Side, Any], object]:
    def run(side: Side, obj: Any) -> object:
        loaded = synced(lambda: _roundtrip_file(obj, weights_only=True))
        model, _ = side.fresh()
        set_model_state_dict(model, loaded, options=options)
        return _after_load(side, model)

    return run


def shared_tmpdir() -> str:
    box = [tempfile.mkdtemp(prefix="sw-userobj-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _remove(path: str) -> None:
    barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def op_dcp_model(side: Side, obj: Any) -> object:
    path = shared_tmpdir()
    try:
        dcp.save({"model": obj}, checkpoint_id=path)  # type: ignore[attr-defined]
        model, _ = side.fresh()
        target = {"model": get_model_state_dict(model)}
        dcp.load(target, checkpoint_id=path)  # type: ignore[attr-defined]
        set_model_state_dict(model, target["model"])
        return _after_load(side, model)
    finally:
        _remove(path)


def _fresh_with_weights(side: Side) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model holding the original's weights, copied shard by shard (not through any
    state-dict path under test), and its fresh optimizer."""
    model, opt = side.fresh()
    with torch.no_grad():
        for p, q in zip(side.model.parameters(), model.parameters(), strict=True):
            src = p.to_local() if isinstance(p, DTensor) else p
            dst = q.to_local() if isinstance(q, DTensor) else q
            dst.copy_(src)
    return model, opt


def _after_optimizer_load(side: Side, opt: torch.optim.Optimizer) -> object:
    expect_same(opt.state_dict(), side.opt.state_dict(), "loaded optimizer vs original")
    return snapshot(opt.state_dict())


def op_opt_load_state_dict(side: Side, obj: Any) -> object:
    loaded = synced(lambda: _roundtrip_file(obj, weights_only=True))
    _, opt = _fresh_with_weights(side)
    opt.load_state_dict(loaded)
    return _after_optimizer_load(side, opt)


def op_set_optimizer_state_dict(side: Side, obj: Any) -> object:
    loaded = synced(lambda: _roundtrip_file(obj, weights_only=True))
    model, opt = _fresh_with_weights(side)
    set_optimizer_state_dict(model, opt, loaded)
    return _after_optimizer_load(side, opt)


def op_dcp_optimizer(side: Side, obj: Any) -> object:
    path = shared_tmpdir()
    try:
        dcp.save({"model": get_model_state_dict(side.model), "optim": obj}, checkpoint_id=path)  # type: ignore[attr-defined]
        model, opt = side.fresh()
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)  # type: ignore[attr-defined]
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        _after_load(side, model)
        return _after_optimizer_load(side, opt)
    finally:
        _remove(path)


@dataclass(frozen=True)
class AtMost:
    """A size that ours must not exceed torch's (``differences`` compares it so)."""

    n: int


def saved_storage_bytes(obj: object) -> int:
    """The bytes of the storage records ``torch.save`` writes for ``obj`` (not the pickle)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as archive:
        return sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)


def op_saved_storage_bytes(exact: bool) -> Callable[[Side, Any], object]:
    """``torch.save`` of one tensor writes that tensor's storage, nothing of its neighbours:
    equal to torch's (``exact``), or at most torch's (gradients: torch's are views into its
    reduce-scatter output and write all of it; ours may write less). A DTensor writes its local
    tensor and its mesh's record, nothing more (the check that stands where torch raises)."""

    def run(side: Side, obj: Any) -> object:
        n = saved_storage_bytes(obj)
        if isinstance(obj, DTensor):
            with torch.no_grad():
                parts = saved_storage_bytes(obj.to_local()) + saved_storage_bytes(obj.device_mesh)
            if n > parts:
                raise WrongResult(f"writes {n} bytes, its local tensor and mesh {parts}")
        return n if exact else AtMost(n)

    return run


def op_storage_nbytes(exact: bool) -> Callable[[Side, Any], object]:
    def run(side: Side, obj: Any) -> object:
        n = obj.untyped_storage().nbytes()
        return n if exact else AtMost(n)

    return run


def _local_storages(side: Side) -> object:
    """Each parameter's local shard in a storage of its own, as torch allocates them, and of
    torch's size (its padded shard: what ``torch.save`` of the shard writes)."""
    with torch.no_grad():
        inner = {
            name: inner_tensors(p.to_local() if isinstance(p, DTensor) else p)
            for name, p in side.model.named_parameters()
        }
    ptrs = [t.untyped_storage().data_ptr() for ts in inner.values() for t in ts]
    return {
        "storage bytes": {
            name: [t.untyped_storage().nbytes() for t in ts] for name, ts in inner.items()
        },
        "local tensors": len(ptrs),
        "distinct storages": len(set(ptrs)),
    }


def _resume(side: Side) -> object:
    """4 steps; after the first 2, ``torch.save`` of both state dicts (per rank), loaded into a
    fresh sharded model and optimizer that take the last 2: bitwise the same as the
    uninterrupted run (saving does not perturb it)."""
    subject = side.subject
    straight = subject.build(0)
    straight_opt = make_optimizer(straight)
    train(subject, straight, straight_opt, range(2))
    state = {"model": straight.state_dict(), "optim": straight_opt.state_dict()}
    saved = synced(lambda: _roundtrip_file(state, weights_only=True))
    train(subject, straight, straight_opt, range(2, 4))
    resumed, resumed_opt = side.fresh(seed=5)

    def load() -> None:
        resumed.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["optim"])

    synced(load)
    train(subject, resumed, resumed_opt, range(2, 4))
    want = {"model": local_state(straight), "optim": snapshot(straight_opt.state_dict())}
    got = {"model": local_state(resumed), "optim": snapshot(resumed_opt.state_dict())}
    diffs = differences(got, want)
    if diffs:
        raise WrongResult("resumed vs uninterrupted: " + "; ".join(diffs[:3]))
    return want


# ------------------------------------------------------------------------------ the catalogue


@dataclass(frozen=True)
class Line:
    """One (holder, operation) line. ``run(side)`` returns the snapshot compared with torch's
    and raises ``WrongResult`` when its own check fails.

    ``torch_raises``: the exception type torch's engine raises on this line (None: it works);
    ``beyond_torch``: where torch raises, ours must work anyway (and pass the line's check)."""

    holds: str
    does: str
    run: Callable[[Side], object]
    torch_raises: type[BaseException] | None = None
    beyond_torch: bool = False

    @property
    def label(self) -> str:
        return f"{self.holds} / {self.does}"


def _line(
    holder: Holder,
    does: str,
    op: Callable[[Side, Any], object],
    *,
    torch_raises: type[BaseException] | None = None,
    beyond_torch: bool = False,
) -> Line:
    def run(side: Side) -> object:
        if not (holder.whole_model and side.subject.prepare is not None):
            return op(side, holder.take(side))
        side.subject.prepare(side.model)
        try:
            return op(side, holder.take(side))
        finally:
            # Back to the sharded state every other line starts from (lines are independent).
            reshard(side.model)

    return Line(holder.label, does, run, torch_raises, beyond_torch)


SAVE_LOAD_WO: Final = "torch.save+load(weights_only=True)"
SAVE_LOAD: Final = "torch.save+load(weights_only=False)"
DEEPCOPY: Final = "copy.deepcopy"
PICKLE: Final = "pickle.dumps+loads"
SAVED_BYTES: Final = "torch.save storage bytes"
NBYTES: Final = "untyped_storage().nbytes()"


def _copies(holder: Holder, **kwargs: Any) -> list[Line]:
    """The four ways to copy or ship an object."""
    return [
        _line(holder, SAVE_LOAD_WO, op_save_load(True), **kwargs),
        _line(holder, SAVE_LOAD, op_save_load(False), **kwargs),
        _line(holder, DEEPCOPY, op_deepcopy, **kwargs),
        _line(holder, PICKLE, op_pickle, **kwargs),
    ]


# torch 2.13's sharded gradients are views into its reduce-scatter output; for a parameter that
# is not first in its group the view has a nonzero offset, which DTensor's detach carries onto a
# wrapper without storage: pickling, copying or saving the gradient raises, and so does
# deep-copying the parameter (deepcopy copies ``.grad``). The subjects' single parameter is such
# a one. Decision (issue 42): ours hands out gradients that do all of that. Set
# GRADS_BEYOND_TORCH to False to require torch's outcome (raise the same type) instead.
GRADS_BEYOND_TORCH: Final = True
_GRAD: Final[dict[str, Any]] = {"torch_raises": RuntimeError, "beyond_torch": GRADS_BEYOND_TORCH}

CATALOGUE: Final[list[Line]] = [
    *_copies(MODEL_SD),
    _line(MODEL_SD, "load_state_dict into a fresh model", op_load_state_dict(False)),
    _line(MODEL_SD, "load_state_dict(assign=True)", op_load_state_dict(True)),
    _line(MODEL_SD, "load_state_dict into a trained model", op_load_into_trained(False)),
    _line(
        MODEL_SD, "load_state_dict(assign=True) into a trained model", op_load_into_trained(True)
    ),
    _line(MODEL_SD, "set_model_state_dict", op_set_model_state_dict(StateDictOptions())),
    _line(MODEL_SD, "dcp.save+load into a fresh model", op_dcp_model),
    *_copies(DCP_SD),
    _line(DCP_SD, "load_state_dict into a fresh model", op_load_state_dict(False)),
    _line(DCP_SD, "set_model_state_dict", op_set_model_state_dict(StateDictOptions())),
    *_copies(DCP_FULL),
    _line(DCP_FULL, "set_model_state_dict(full)", op_set_model_state_dict(FULL)),
    *_copies(DCP_FULL_CPU),
    _line(
        DCP_FULL_CPU,
        "set_model_state_dict(full, broadcast_from_rank0)",
        op_set_model_state_dict(StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)),
    ),
    *_copies(DCP_OSD),
    _line(DCP_OSD, "set_optimizer_state_dict", op_set_optimizer_state_dict),
    _line(DCP_OSD, "dcp.save+load into a fresh model and optimizer", op_dcp_optimizer),
    *_copies(OPT_SD),
    _line(OPT_SD, "opt.load_state_dict into a fresh optimizer", op_opt_load_state_dict),
    _line(PARAM, SAVE_LOAD_WO, op_save_load(True)),
    _line(PARAM, SAVE_LOAD, op_save_load(False)),
    _line(PARAM, DEEPCOPY, op_deepcopy, **_GRAD),
    _line(PARAM, PICKLE, op_pickle),
    _line(PARAM, SAVED_BYTES, op_saved_storage_bytes(exact=True)),
    *_copies(LOCAL),
    _line(LOCAL, SAVED_BYTES, op_saved_storage_bytes(exact=True)),
    _line(LOCAL, NBYTES, op_storage_nbytes(exact=True)),
    *_copies(GRAD, **_GRAD),
    _line(GRAD, SAVED_BYTES, op_saved_storage_bytes(exact=False), **_GRAD),
    *_copies(GRAD_LOCAL),
    _line(GRAD_LOCAL, SAVED_BYTES, op_saved_storage_bytes(exact=False)),
    _line(GRAD_LOCAL, NBYTES, op_storage_nbytes(exact=False)),
    *_copies(OPT_TENSOR),
    _line(OPT_TENSOR, SAVED_BYTES, op_saved_storage_bytes(exact=True)),
    Line("model.parameters()", "local shards: own storages, torch's sizes", _local_storages),
    Line("model + optimizer", "resume: 2 steps, torch.save, load, 2 steps == 4 steps", _resume),
]


# ------------------------------------------------------------------------------ running


@dataclass(frozen=True)
class Outcome:
    ok: bool
    error: str = ""  # "TypeName: first line of the message" when not ok
    error_type: str = ""
    wrong: bool = False  # the line ran but its own check failed
    value: object = None

    def __str__(self) -> str:
        if self.ok:
            return "works"
        return f"wrong result ({self.error})" if self.wrong else f"raised {self.error}"


def _attempt(line: Line, side: Side) -> Outcome:
    try:
        return Outcome(True, value=line.run(side))
    except WrongResult as e:
        return Outcome(False, error=str(e)[:300], error_type="WrongResult", wrong=True)
    except RankFailure as e:
        return Outcome(
            False, error=str(e), error_type=e.type_name, wrong=e.type_name == "WrongResult"
        )
    # Every failure is a row of the table, not the end of the body (DCP's CheckpointException
    # is a BaseException).
    except (Exception, CheckpointException) as e:
        return Outcome(
            False, error=f"{type(e).__name__}: {_first_line(e)}", error_type=type(e).__name__
        )


@dataclass(frozen=True)
class Row:
    """One line's result on one rank: both engines' outcomes and what is wrong, if anything."""

    label: str
    torch: str
    ours: str
    problem: str  # empty when the line holds
    seconds: float


def verdict(line: Line, config: Config, t: Outcome | None, o: Outcome) -> str:
    """What is wrong with the two outcomes against the line's pinned expectation ('' if none)."""
    expected = config.torch_raises.get(line.label, line.torch_raises)
    problems: list[str] = []
    if t is not None:
        if expected is None and not t.ok:
            problems.append(f"torch {t}, the catalogue expects it to work")
        elif expected is not None and t.error_type != expected.__name__:
            problems.append(f"torch {t}, the catalogue expects it to raise {expected.__name__}")
    must_work = t is None or expected is None or line.beyond_torch
    if must_work:
        if not o.ok:
            problems.append(f"shardweave {o}")
        elif t is not None and t.ok:
            diffs = differences(o.value, t.value)
            if diffs:
                problems.append("shardweave differs from torch: " + "; ".join(diffs[:3]))
    elif o.ok or o.error_type != (expected.__name__ if expected else ""):
        problems.append(f"shardweave {o}, torch raises {expected.__name__ if expected else ''}")
    return "; ".join(problems)


def _across_ranks(t: Outcome | None, o: Outcome) -> tuple[Outcome | None, Outcome]:
    """A line fails where it fails on any rank (a checkpoint that one rank cannot write is not
    written): every rank reports the first failing rank's error; values stay each rank's."""
    mine = [(x.ok, x.error, x.error_type, x.wrong) if x is not None else None for x in (t, o)]
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: list[Outcome | None] = []
    for i, own in enumerate((t, o)):
        failed = [
            (rank, r[i])  # type: ignore[index]
            for rank, r in enumerate(everyone)
            if r[i] is not None and not r[i][0]  # type: ignore[index]
        ]
        if own is None or own.ok is False or not failed:
            merged.append(own)
            continue
        rank, (_, error, error_type, wrong) = failed[0]
        merged.append(Outcome(False, f"{error} (on rank {rank})", error_type, wrong))
    return merged[0], merged[1]  # type: ignore[return-value]


def run_catalogue(config: Config, lines: list[Line] | None = None) -> list[Row]:
    """Every line on torch's engine and ours (both built and trained first); one row each."""
    subjects = {e.name: config.subject(e) for e in (TORCH, OURS)}
    ours_subject = subjects[OURS.name]
    assert ours_subject is not None, f"{config.name}: shardweave must run every kind"
    torch_subject = subjects[TORCH.name]
    torch_side = make_side(TORCH, torch_subject) if torch_subject is not None else None
    ours_side = make_side(OURS, ours_subject)
    rows = []
    for line in lines if lines is not None else CATALOGUE:
        start = time.perf_counter()
        t = _attempt(line, torch_side) if torch_side is not None else None
        o = _attempt(line, ours_side)
        t, o = _across_ranks(t, o)
        rows.append(
            Row(
                line.label,
                str(t) if t is not None else "n/a (cannot run this kind)",
                str(o),
                verdict(line, config, t, o),
                time.perf_counter() - start,
            )
        )
    return rows


def assert_catalogue(config: str, per_rank: list[object]) -> None:
    """Fail once with every broken line (with the ranks it broke on) and the whole table."""
    __tracebackhide__ = True
    tables: list[list[Row]] = [list(rows) for rows in per_rank]  # type: ignore[call-overload]
    broken: dict[tuple[str, str], list[int]] = {}
    for rank, rows in enumerate(tables):
        for r in rows:
            if r.problem:
                broken.setdefault((r.label, r.problem), []).append(rank)
    if not broken:
        return
    lines = [f"  {label}: {problem} (rank {ranks})" for (label, problem), ranks in broken.items()]
    table = []
    for rank_rows in zip(*tables, strict=True):
        outcomes = {(r.torch, r.ours) for r in rank_rows}
        where = "" if len(outcomes) == 1 else " (rank 0; ranks differ)"
        mark = "FAIL" if any(r.problem for r in rank_rows) else "ok  "
        r = rank_rows[0]
        table.append(f"  {mark} {r.label}: torch {r.torch} | shardweave {r.ours}{where}")
    raise AssertionError(
        f"{config}: {len(lines)} broken line(s) of {len(tables[0])} (what users hold must behave "
        "as with torch's fully_shard; tests/fsdp/_user_objects.py)\n"
        + "\n".join(lines)
        + "\nall lines:\n"
        + "\n".join(table)
    )
