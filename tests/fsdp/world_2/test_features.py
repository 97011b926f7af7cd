"""Engine features beyond plain training: prefetch, async unshard, forward methods, unused
modules, meta init, buffers, ignored params, mixed dtypes, recovery, collective counts.

Oracles are named per test: *reference* (unsharded copy on the global batch), *compatibility*
(torch's fully_shard on a copy), *closed form* (a count or value known in advance).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from tests._dist import WorkerPool, assert_close
from tests.fsdp._counting import count_collectives
from tests.fsdp._models import TinyGPT, loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import (
    assert_matches_reference,
    assert_same_as_torch,
    local_chunk,
    sgd_step,
)


def _step_both(
    model: nn.Module, ref: nn.Module, kind: str, step: int, rank: int, world: int
) -> None:
    batches = [make_batch(kind, 1000 * step + r) for r in range(world)]
    loss_fn(kind, model(batches[rank]), batches[rank]).backward()
    (sum(loss_fn(kind, ref(b), b) for b in batches) / world).backward()  # type: ignore[union-attr]


# --- explicit prefetch and async unshard ------------------------------------------------------
def explicit_prefetch_and_async_unshard(rank: int, world: int) -> None:
    model = make_model("gpt")
    ref = copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    layers = [layer for layer in model.layers]  # type: ignore[union-attr]
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[i - 1 : i] if i > 0 else [])
    for step in range(3):
        handle = model.unshard(async_op=True)  # type: ignore[operator]
        assert isinstance(handle, UnshardHandle)
        if step == 0:
            handle.wait()
            handle.wait()  # idempotent
            assert not isinstance(model.tok.weight, DTensor), "root should be unsharded"  # type: ignore[union-attr]
        _step_both(model, ref, "gpt", step, rank, world)
        assert_matches_reference(model, ref, "grad", rank, world, f"step {step}")
        sgd_step(model, ref)
        assert_matches_reference(model, ref, "param", rank, world, f"step {step}")


def test_explicit_prefetch_and_async_unshard(world2: WorkerPool) -> None:
    """Oracle: reference. Prefetch lists and unshard(async_op=True) keep results exact."""
    world2.run(explicit_prefetch_and_async_unshard)


# --- methods other than forward ---------------------------------------------------------------
class WithScore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).square().sum()


def forward_method(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = WithScore()
    ref = copy.deepcopy(model)
    fully_shard(model)
    x = torch.randn(2, 5)
    with pytest.raises(Exception, match="DTensor"):  # unregistered: sharded params leak in
        model.score(x)
    register_fsdp_forward_method(model, "score")
    register_fsdp_forward_method(nn.Linear(1, 1), "forward")  # not an FSDPModule: no-op
    with pytest.raises(ValueError, match="does not have a method"):
        register_fsdp_forward_method(model, "nope")
    out = model.score(x)
    assert_close(out, ref.score(x))
    out.backward()
    ref.score(x).backward()
    # every rank fed the same x, so the averaged grad equals the reference grad
    assert_matches_reference(model, ref, "grad", rank, world)


def test_forward_method(world2: WorkerPool) -> None:
    """Oracle: reference; a registered method runs the FSDP hooks, an unregistered one fails."""
    world2.run(forward_method)


# --- a module whose forward is not called -----------------------------------------------------
class SometimesUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = self.a(x)
        return self.b(x) if use_b else x


def unused_module(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = SometimesUnused()
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    for m, api in ((model, fully_shard), (tmodel, torch_fully_shard)):
        api(m.a)
        api(m.b)
        api(m)
    for step, use_b in enumerate((False, True, False)):
        xs = [
            torch.randn(2, 4, generator=torch.Generator().manual_seed(step * 10 + r))
            for r in range(world)
        ]
        model(xs[rank], use_b).sum().backward()
        tmodel(xs[rank], use_b).sum().backward()
        (sum(ref(x, use_b).sum() for x in xs) / world).backward()  # type: ignore[union-attr]
        assert_same_as_torch(model, tmodel, f"step {step}")
        assert_matches_reference(model, ref, "grad", rank, world, f"step {step}")
        for m in (model, tmodel, ref):
            m.zero_grad(set_to_none=True)
        assert isinstance(model.b.weight, DTensor), "unused group must be resharded"


def test_unused_module(world2: WorkerPool) -> None:
    """Oracles: reference and compatibility; an unused group gets no grad and is resharded."""
    world2.run(unused_module)


# --- meta-device init, to_empty, reset_parameters ---------------------------------------------
def meta_init(rank: int, world: int) -> None:
    ref = make_model("gpt")
    with torch.device("meta"):
        model = TinyGPT()
    shard_blocks(model, fully_shard)
    assert all(p.device.type == "meta" for p in model.parameters())
    batch = make_batch("gpt", 0)
    with pytest.raises(RuntimeError, match="meta device"):
        model(batch)
    model.reset_iter_state()  # type: ignore[operator]
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()  # DTensor random init: runs, values differ from ref
    with torch.no_grad():  # load the reference's values shard by shard
        for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
            assert isinstance(p, DTensor)
            p.to_local().copy_(local_chunk(rp, p.placements[0].dim, world, rank))  # type: ignore[attr-defined]
    for step in range(2):
        _step_both(model, ref, "gpt", step, rank, world)
        assert_matches_reference(model, ref, "grad", rank, world, f"step {step}")
        sgd_step(model, ref)
        assert_matches_reference(model, ref, "param", rank, world, f"step {step}")


def test_meta_init(world2: WorkerPool) -> None:
    """Oracle: reference. Meta construction, to_empty, reset_parameters, then exact training."""
    world2.run(meta_init)


# --- buffers, ignored params, mixed dtypes ----------------------------------------------------
class WithBufferAndFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.frozen = nn.Parameter(torch.randn(6, 6).to(torch.bfloat16), requires_grad=False)
        self.extra = nn.Parameter(torch.randn(6))
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) @ self.frozen.float()) * self.scale + self.extra


def buffers_ignored_mixed_dtypes(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = WithBufferAndFrozen()
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    fully_shard(model, ignored_params={model.extra})
    torch_fully_shard(tmodel, ignored_params={tmodel.extra})
    assert not isinstance(model.scale, DTensor) and torch.equal(model.scale, ref.scale)
    assert not isinstance(model.extra, DTensor), "ignored params stay plain"
    assert isinstance(model.frozen, DTensor) and model.frozen.dtype == torch.bfloat16
    xs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    model(xs[rank]).sum().backward()  # the group all-gathers fp32 and bf16 shards together
    tmodel(xs[rank]).sum().backward()
    (sum(ref(x).sum() for x in xs) / world).backward()  # type: ignore[union-attr]
    assert model.frozen.grad is None
    # ignored: a local, unreduced grad (the user syncs it), identical to torch's
    assert model.extra.grad is not None and torch.equal(model.extra.grad, tmodel.extra.grad)  # type: ignore[arg-type]
    for name in ("lin.weight", "lin.bias"):
        ours, theirs = model.get_parameter(name), tmodel.get_parameter(name)
        assert torch.equal(ours.grad.to_local(), theirs.grad.to_local()), name  # type: ignore[union-attr]
        expected = local_chunk(ref.get_parameter(name).grad, 0, world, rank)  # type: ignore[arg-type]
        assert_close(ours.grad.to_local(), expected, msg=name)  # type: ignore[union-attr]


def test_buffers_ignored_params_mixed_dtypes(world2: WorkerPool) -> None:
    """Oracles: reference and compatibility. Buffers moved not sharded; ignored params left
    alone; a frozen bf16 param shares a group (byte all-gather) with fp32 params."""
    world2.run(buffers_ignored_mixed_dtypes)


# --- an exception mid-step, then reset_iter_state ---------------------------------------------
class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("injected failure")
        return x


def exception_recovery(rank: int, world: int, where: str) -> None:
    model = make_model("gpt")
    ref = copy.deepcopy(model)
    flaky = Flaky()
    model.layers[1].register_forward_pre_hook(lambda m, a: flaky(a[0]))  # type: ignore[index, union-attr]
    shard_blocks(model, fully_shard)
    _step_both(model, ref, "gpt", 0, rank, world)
    sgd_step(model, ref)
    batch = make_batch("gpt", 99)
    if where == "forward":
        flaky.fail = True
        with pytest.raises(RuntimeError, match="injected"):
            model(batch)
        flaky.fail = False
    else:
        out = model(batch)
        with pytest.raises(RuntimeError, match="injected"):
            loss = loss_fn("gpt", out, batch)
            loss.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected")))
            loss.backward()
    model.reset_iter_state()  # type: ignore[operator]
    model.zero_grad(set_to_none=True)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "everything resharded"
    for step in (1, 2):
        _step_both(model, ref, "gpt", step, rank, world)
        assert_matches_reference(model, ref, "grad", rank, world, f"after {where} failure")
        sgd_step(model, ref)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_exception_then_reset_iter_state(world2: WorkerPool, where: str) -> None:
    """Oracle: reference that skipped the failed step; training continues exactly."""
    world2.run(exception_recovery, where)


def reset_iter_state_drops_grads(rank: int, world: int) -> None:
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    shard_blocks(tmodel, torch_fully_shard)
    batch = make_batch("gpt", rank)
    for m in (model, tmodel):
        loss_fn("gpt", m(batch), batch).backward()
        m.reset_iter_state()  # type: ignore[operator]
    kept = [(n, p.grad is not None) for n, p in model.named_parameters()]
    assert kept == [(n, p.grad is not None) for n, p in tmodel.named_parameters()], kept
    assert_same_as_torch(model, tmodel, "after reset_iter_state")


def test_reset_iter_state_keeps_or_drops_grads_as_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility: torch 2.15's reset_iter_state also drops the sharded gradients
    (the same on every release that has it, checked against that release's engine)."""
    if not hasattr(TorchFSDPModule, "reset_iter_state"):
        pytest.skip("torch's FSDPModule has no reset_iter_state on this release")
    world2.run(reset_iter_state_drops_grads)


def inference_first(rank: int, world: int, mp: bool) -> None:
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    kwargs = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16)} if mp else {}
    tkwargs = {"mp_policy": TorchMixedPrecisionPolicy(torch.bfloat16)} if mp else {}
    shard_blocks(model, fully_shard, **kwargs)
    shard_blocks(tmodel, torch_fully_shard, **tkwargs)
    for seed in (rank, 10 + rank):  # the first forward allocates the buffers, the next reuses
        batch = make_batch("gpt", seed)
        with torch.inference_mode():
            out, tout = model(batch), tmodel(batch)
        assert torch.equal(out, tout), f"seed {seed}"


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
def test_first_forward_under_inference_mode(world2: WorkerPool, mp: bool) -> None:
    """Oracle: compatibility: a model whose first forward runs under torch.inference_mode()
    (an evaluation before any training) gives torch's outputs, bitwise; the gathered buffers
    made there have no version counter to preserve (it raised before)."""
    world2.run(inference_first, mp)


def reset_iter_state_non_root(rank: int, world: int) -> None:
    model = make_model("gpt")
    shard_blocks(model, fully_shard)
    model(make_batch("gpt", 0))
    with pytest.raises(RuntimeError, match="root"):
        model.layers[0].reset_iter_state()  # type: ignore[index, union-attr]


def test_reset_iter_state_on_non_root_raises(world2: WorkerPool) -> None:
    """Oracle: closed form (torch raises RuntimeError on a non-root)."""
    world2.run(reset_iter_state_non_root)


# --- collective counts and bytes --------------------------------------------------------------
def collective_counts(rank: int, world: int, reshard: bool | None) -> dict[str, int]:
    model = make_model("gpt")
    shard_blocks(
        model, fully_shard, **({} if reshard is None else {"reshard_after_forward": reshard})
    )
    batch = make_batch("gpt", rank)
    loss_fn("gpt", model(batch), batch).backward()  # warm-up: lazy init's consistency check
    model.zero_grad()
    with count_collectives() as counts:
        out = model(batch)
        fwd = counts["all_gather_single"]
        loss_fn("gpt", out, batch).backward()
    n_layers = len(model.layers)  # type: ignore[arg-type]
    groups = n_layers + 1
    bwd_ag = {None: n_layers, True: groups, False: 0}[reshard]
    assert fwd == groups, f"forward all-gathers: {fwd} != {groups}"
    assert counts["all_gather_single"] - fwd == bwd_ag, dict(counts)
    assert counts["reduce_scatter_single"] == groups, dict(counts)
    assert counts["all_reduce"] == 0
    # bytes: each all-gather sends this rank's padded shard; each reduce-scatter the full grads
    padded = sum(
        p.to_local().numel()
        for p in model.parameters()  # unpadded lower bound
    )
    assert counts["all_gather_single_bytes"] >= padded * 4
    return dict(counts)


@pytest.mark.parametrize("reshard", [None, True, False])
def test_collective_counts(world2: WorkerPool, reshard: bool | None) -> None:
    """Oracle: closed form. One all-gather per group per unshard (forward: every group;
    backward: the resharded ones), one reduce-scatter per group, no all-reduce."""
    world2.run(collective_counts, reshard)


# --- FSDPModule surface -----------------------------------------------------------------------
def module_surface(rank: int, world: int) -> None:
    model = make_model("gpt")
    shard_blocks(model, fully_shard)
    assert isinstance(model, FSDPModule) and isinstance(model, TinyGPT)
    assert type(model).__name__ == "FSDPTinyGPT"
    assert not isinstance(model.layers, FSDPModule)  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match="deepcopy"):
        copy.deepcopy(model)
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(seq)
    sliced = seq[:2]
    assert type(sliced) is nn.Sequential and not isinstance(sliced, FSDPModule)
    # reshard_after_forward=False keeps unsharded params registered after forward
    model.set_reshard_after_forward(False)  # type: ignore[operator]
    model(make_batch("gpt", 0))
    assert not isinstance(model.layers[0].qkv.weight, DTensor)  # type: ignore[index, union-attr]
    sd = model.state_dict()  # state dict of an unsharded module reshards first
    assert isinstance(sd["layers.0.qkv.weight"], DTensor)
    model.reshard()  # type: ignore[operator]
    for layer in model.layers:  # type: ignore[union-attr]
        layer.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model.reset_iter_state()  # type: ignore[operator]


def test_fsdp_module_surface(world2: WorkerPool) -> None:
    """Oracle: closed form (torch's documented class swap, slicing, deepcopy and reshard)."""
    world2.run(module_surface)
