"""Our modules pass ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` and torch's own components
find our state, while torch's engine is never constructed.

Oracles: *compatibility* (torch's ``fully_shard``/``replicate`` on the same model: the same
isinstance answers, ``torch's api.state(m)`` non-None exactly where torch's is, the same losses,
shards and grads bitwise over a training run) and *closed form* (the MRO order; every method
torch's class defines resolves to ours; torch's engine constructors, patched to raise, are never
called).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state

from shardweave.fsdp import FSDPModule, fully_shard
from shardweave.fsdp._torch_compat import STATE_EXPOSES_ONE_GROUP
from shardweave.fsdp._torch_interop import unimplemented_torch_methods
from shardweave.fsdp.core._state import get_fsdp_state
from shardweave.replicate import ReplicateModule, replicate
from tests._dist import WorkerPool
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import assert_same_as_torch

STEPS = 3


@contextmanager
def torch_engine_forbidden() -> Iterator[None]:
    """torch's FSDPState, FSDPParamGroup and FSDPParam constructors raise while inside."""
    targets = [
        (_fsdp_state.FSDPState, "FSDPState"),
        (_fsdp_param_group.FSDPParamGroup, "FSDPParamGroup"),
        (_fsdp_param.FSDPParam, "FSDPParam"),
    ]
    originals = [cls.__init__ for cls, _ in targets]

    def forbidden(name: str) -> Any:
        def init(*args: Any, **kwargs: Any) -> None:
            raise AssertionError(f"torch's {name} was constructed")

        return init

    for cls, name in targets:
        cls.__init__ = forbidden(name)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for (cls, _), init in zip(targets, originals, strict=True):
            cls.__init__ = init  # type: ignore[method-assign]


def marker_identity(rank: int, world: int) -> None:
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(seq[0])
    fully_shard(seq)
    rep = replicate(nn.Linear(4, 4))
    for m in (seq, seq[0], rep):
        assert isinstance(m, FSDPModule) and isinstance(m, TorchFSDPModule), type(m).__mro__
        mro = type(m).__mro__
        assert mro.index(FSDPModule) < mro.index(TorchFSDPModule), mro  # ours wins lookups
        assert not isinstance(seq[1], TorchFSDPModule)  # managed through the root, as torch
    assert isinstance(rep, ReplicateModule)
    # every method a caller can reach through torch's class is ours: none is left to the guard
    # (whose stand-ins raise), and none to torch's class
    for name, attr in vars(TorchFSDPModule).items():
        if not inspect.isfunction(attr) or name in ("__init__",):
            continue
        for m in (seq, rep):
            resolved = inspect.getattr_static(type(m), name)
            owner = next(c for c in type(m).__mro__ if name in vars(c))
            assert owner is not TorchFSDPModule, (name, owner)
            assert resolved is not attr, name
    for m in (seq, rep):
        assert unimplemented_torch_methods(type(m)) == [], type(m)
    # torch's composable accessors (PipelineStage reads fully_shard.state) find our states
    assert torch_fully_shard.state(seq) is get_fsdp_state(seq)  # type: ignore[attr-defined]
    assert torch_fully_shard.state(seq[0]) is get_fsdp_state(seq[0])  # type: ignore[attr-defined]
    assert torch_fully_shard.state(seq[1]) is None  # type: ignore[attr-defined]
    assert torch_replicate.state(rep) is get_fsdp_state(rep)  # type: ignore[attr-defined]
    assert torch_replicate.state(seq) is None  # type: ignore[attr-defined]
    assert fully_shard.state(seq) is get_fsdp_state(seq)
    # rebuilding through the class (Sequential slicing) gives a plain module, as torch's does
    sliced = seq[1:]
    assert type(sliced) is nn.Sequential and not isinstance(sliced, TorchFSDPModule)


def torch_managed_is_refused(rank: int, world: int) -> None:
    for theirs in (torch_fully_shard, torch_replicate):
        model = nn.Linear(4, 4)
        theirs(model)
        cls = type(model)
        for ours in (fully_shard, replicate):
            with pytest.raises(AssertionError, match="can only be applied to a module once") as e:
                ours(model)  # type: ignore[operator]
            assert "torch's own fully_shard or replicate" in str(e.value), e.value
            assert type(model) is cls  # left as it was
        model(torch.randn(2, 4)).sum().backward()  # still torch's, still trains


def train(
    model: nn.Module, kind: str, steps: int, rank: int
) -> tuple[list[torch.Tensor], nn.Module]:
    # SGD, not Adam: a missing accumulated micro-batch changes the step (Adam would normalize it)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        inp = make_batch(kind, seed=100 * step + rank)
        if isinstance(model, TorchFSDPModule):  # the switch torchtitan and Fabric make
            model.set_requires_gradient_sync(False)
            loss_fn(kind, model(inp), inp).backward()  # accumulate without reducing
            model.set_requires_gradient_sync(True)
        loss = loss_fn(kind, model(inp), inp)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, model


def no_torch_engine(rank: int, world: int, api: str) -> None:
    base = make_model("gpt")
    torch_model, model = copy.deepcopy(base), copy.deepcopy(base)
    policy = TorchMixedPrecisionPolicy(reduce_dtype=torch.float32)  # torch's object, to both
    if api == "fully_shard":
        shard_blocks(torch_model, torch_fully_shard, mp_policy=policy)
    else:
        torch_replicate(torch_model, mp_policy=policy)
    expected, torch_model = train(torch_model, "gpt", STEPS, rank)
    with torch_engine_forbidden():
        if api == "fully_shard":
            shard_blocks(model, fully_shard, mp_policy=policy)
        else:
            replicate(model, mp_policy=policy)
        got, model = train(model, "gpt", STEPS, rank)
        # what a checkpoint helper or a framework calls through torch's class, still ours
        state = torch_fully_shard.state(model)  # type: ignore[attr-defined]
        assert state is get_fsdp_state(model), state
    for step, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(ours, theirs), f"{api} step {step}: {ours} vs {theirs}"
    if api == "fully_shard":
        assert_same_as_torch(model, torch_model, api)


def private_internals_named(rank: int, world: int) -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    # Before 2.13 torch's PipelineStage reads a state's single `_fsdp_param_group`, so ours
    # exposes that one name there (STATE_EXPOSES_ONE_GROUP); otherwise it is missing, as any.
    state = fully_shard.state(model)
    assert hasattr(state, "_fsdp_param_group") is STATE_EXPOSES_ONE_GROUP
    opt = torch.optim.Adam(model.parameters())
    tracker = FSDPMemTracker(model, opt)  # passes torch's isinstance check, then reads internals
    with pytest.raises(AttributeError) as err:
        tracker.__enter__()
    message = str(err.value)
    if STATE_EXPOSES_ONE_GROUP:
        # Where our state answers `_fsdp_param_group` (torch < 2.13), the tracker goes on to
        # the state's `_pre_forward_hook_handle`, which ours does not name: a plain error.
        assert "_pre_forward_hook_handle" in message, message
    else:
        assert "private attribute of torch's engine" in message, message
        assert "shardweave.fsdp.trace" in message, message


def test_torch_private_internals_are_named(world2: WorkerPool) -> None:
    """Closed form: code reaching into torch's engine internals through the marker (torch's
    FSDPMemTracker) gets an AttributeError that says why and what to use instead."""
    world2.run(private_internals_named)


def test_marker_identity(world2: WorkerPool) -> None:
    """Closed form: isinstance of both classes, ours first in the MRO, every method torch's
    class defines resolved to ours; compatibility: torch's ``fully_shard.state`` and
    ``replicate.state`` return our state where torch's return theirs, None elsewhere."""
    world2.run(marker_identity)


def test_torch_managed_module_is_refused(world2: WorkerPool) -> None:
    """A module torch's engine manages gets torch's 'applied once' sentence, not an MRO error,
    and is left untouched."""
    world2.run(torch_managed_is_refused)


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_training_never_builds_torch_engine(world2: WorkerPool, api: str) -> None:
    """Compatibility: losses (and for fully_shard shards and grads) bitwise equal to torch's
    engine over 3 SGD steps, with gradient accumulation switched through torch's isinstance
    check, while torch's engine constructors raise."""
    world2.run(no_torch_engine, api)


def cast_after_init(rank: int, world: int) -> None:
    base = make_model("mlp")
    model, torch_model = copy.deepcopy(base), copy.deepcopy(base)
    for m, api in ((model, fully_shard), (torch_model, torch_fully_shard)):
        shard_blocks(m, api)
        m.to(torch.float64)  # through nn.Module._apply, past torch's marker base in our MRO
    for step in range(2):
        inp = make_batch("mlp", seed=10 * step + rank).double()
        for m in (model, torch_model):
            loss_fn("mlp", m(inp), inp).backward()
        assert_same_as_torch(model, torch_model, f"step {step}")
        for m in (model, torch_model):
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)  # type: ignore[operator]
            m.zero_grad(set_to_none=True)
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_cast_after_init(world2: WorkerPool) -> None:
    """Compatibility: ``.to(torch.float64)`` after fully_shard trains bitwise like torch's engine
    (our ``_apply`` reaches nn.Module's without running torch's marker ``_apply``)."""
    world2.run(cast_after_init)
