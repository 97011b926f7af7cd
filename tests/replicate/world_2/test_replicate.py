"""replicate() on the shardweave engine against DDP and torch's own replicate.

Oracles: *compatibility* (torch's FSDP-engine ``replicate``: bitwise placements, values,
gradients), *reference* (``DistributedDataParallel``, and an unsharded model on the global
batch, within fp32 tolerance: DDP divides before summing, we average in the collective).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel

from shardweave.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, trace
from shardweave.replicate import ReplicateModule, replicate
from tests._dist import WorkerPool, assert_close
from tests.fsdp._models import TinyGPT, loss_fn, make_batch, make_model
from tests.fsdp._oracle import assert_same_as_torch


def _per_block(model: nn.Module, api: Callable[..., Any], **kwargs: Any) -> None:
    assert isinstance(model, TinyGPT)
    for layer in model.layers:
        api(layer, **kwargs)
    api(model, **kwargs)


def replicate_parity(rank: int, world: int, micro: int) -> None:
    model = make_model("gpt")
    ref, tmodel, ddp_base = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))
    _per_block(model, replicate, mesh=mesh)
    _per_block(tmodel, torch_replicate, mesh=mesh)
    ddp = DistributedDataParallel(ddp_base)
    assert isinstance(model, ReplicateModule) and isinstance(model, FSDPModule)
    assert type(model).__name__ == "ReplicateTinyGPT"
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(),)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, tmodel, ddp, ref)]
    for step in range(3):
        for mb in range(micro):
            sync = mb == micro - 1
            model.set_requires_gradient_sync(sync)
            tmodel.set_requires_gradient_sync(sync)  # type: ignore[operator]
            batches = [make_batch("gpt", 1000 * step + 100 * mb + r) for r in range(world)]
            mine = batches[rank]
            for m in (model, tmodel):
                loss_fn("gpt", m(mine), mine).backward()
            if sync:
                loss_fn("gpt", ddp(mine), mine).backward()
            else:
                with ddp.no_sync():
                    loss_fn("gpt", ddp(mine), mine).backward()
            (sum(loss_fn("gpt", ref(b), b) for b in batches) / world).backward()  # type: ignore[union-attr]
        assert_same_as_torch(model, tmodel, f"step {step}")
        tol = {"rtol": 2e-5, "atol": 1e-4} if micro > 1 else {}
        for (name, p), dp, rp in zip(
            model.named_parameters(), ddp.parameters(), ref.parameters(), strict=True
        ):
            assert p.grad.placements == (Replicate(),)  # type: ignore[union-attr]
            assert_close(p.grad.to_local(), dp.grad, msg=f"vs DDP {name}", **tol)  # type: ignore[union-attr, arg-type]
            assert_close(p.grad.to_local(), rp.grad, msg=f"vs reference {name}", **tol)  # type: ignore[union-attr, arg-type]
        for o in opts:
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("micro", [1, 2])
def test_replicate_parity(world2: WorkerPool, micro: int) -> None:
    """Oracles: compatibility (torch's replicate, bitwise), DDP and reference."""
    world2.run(replicate_parity, micro)


def collectives_per_step(rank: int, world: int) -> None:
    from shardweave.fsdp.comm._reduction import BUCKET_BYTES, FIRST_BUCKET_BYTES
    from tests.fsdp._counting import count_collectives

    model = make_model("gpt")
    _per_block(model, replicate)
    batch = make_batch("gpt", rank)
    loss_fn("gpt", model(batch), batch).backward()
    with count_collectives() as counts, trace() as tracer:
        loss_fn("gpt", model(batch), batch).backward()
    # The tracer sees the buckets too: same count, and every gradient byte once.
    traced = [c for c in tracer.collectives if c.kind == "all_reduce"]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(traced) == counts["all_reduce"], (traced, dict(counts))
    assert sum(c.nbytes for c in traced) == grad_bytes, (traced, grad_bytes)
    assert counts["all_reduce_bytes"] == grad_bytes, (dict(counts), grad_bytes)
    assert all(c.complete_ns is not None for c in traced), traced
    # Gradients travel in DDP-sized buckets (see shardweave.fsdp.comm._reduction, ReductionSchedule.submit): groups are
    # packed in backward order into a bucket until it holds FIRST_BUCKET_BYTES (then
    # BUCKET_BYTES); whatever is left goes at the end of backward.
    sizes = [
        sum(p.numel() * 4 for p in group.parameters() if p.requires_grad)
        for group in [model, *model.layers]  # type: ignore[misc]
    ]
    sizes[0] -= sum(sizes[1:])  # the root's own parameters only
    expected, open_bytes, cap = 0, 0, FIRST_BUCKET_BYTES
    for size in reversed(sizes[1:]):  # blocks in backward order; the root comes last
        open_bytes += size
        if open_bytes >= cap:
            expected, open_bytes, cap = expected + 1, 0, BUCKET_BYTES
    expected += (open_bytes + sizes[0]) > 0
    groups = len(model.layers) + 1  # type: ignore[arg-type]
    assert counts["all_reduce"] == expected < groups, (dict(counts), expected, sizes)
    assert counts["all_gather_single"] == 0 and counts["reduce_scatter_single"] == 0, dict(counts)
    # parameters stay unsharded after forward (no reshard, no second all-gather)
    model(batch)
    assert not isinstance(model.layers[0].qkv.weight, DTensor)  # type: ignore[index, union-attr]


def test_one_all_reduce_per_group(world2: WorkerPool) -> None:
    """Oracle: closed form: one all-reduce per group per backward, no all-gather/scatter."""
    world2.run(collectives_per_step)


def mixed_precision(rank: int, world: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    _per_block(model, replicate, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    _per_block(tmodel, torch_replicate, mp_policy=TorchMP(torch.bfloat16, torch.float32))
    batch = make_batch("gpt", rank)
    for m in (model, tmodel):
        loss_fn("gpt", m(batch).float(), batch).backward()
    assert_same_as_torch(model, tmodel)


def test_replicate_mixed_precision(world2: WorkerPool) -> None:
    """Oracle: compatibility (bf16 compute, fp32 all-reduce)."""
    world2.run(mixed_precision)


def composition(rank: int, world: int) -> None:
    # replicate a child, fully_shard the root: the root adopts the replicated child
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    for m, rep, fs in (
        (model, replicate, fully_shard),
        (tmodel, torch_replicate, torch_fully_shard),
    ):
        rep(m.layers[0])  # type: ignore[index]
        fs(m)
    batch = make_batch("gpt", rank)
    for m in (model, tmodel):
        loss_fn("gpt", m(batch), batch).backward()
    assert model.layers[0].qkv.weight.placements == (Replicate(),)  # type: ignore[index, union-attr]
    assert_same_as_torch(model, tmodel)


def test_replicate_child_fully_shard_root(world2: WorkerPool) -> None:
    """Oracle: compatibility (mixed placements, shared root)."""
    world2.run(composition)


_APPLIED_ONCE = "Each distinct composable distributed API can only be applied to a module once."
_ONE_DIM_MESH = "replicate expects a 1D DeviceMesh but got DeviceMesh("


def misuse(rank: int, world: int) -> None:
    for rep, fs in ((torch_replicate, torch_fully_shard), (replicate, fully_shard)):
        a = nn.Linear(2, 2)
        fs(a)
        with pytest.raises(RuntimeError, match="fully_shard"):
            rep(a)
        b = nn.Linear(2, 2)
        rep(b)
        with pytest.raises(AssertionError):
            fs(b)
        # torch 2.13's sentences (both libraries' messages start with them)
        with pytest.raises(AssertionError, match=re.escape(_APPLIED_ONCE)):
            rep(b)
        with pytest.raises(AssertionError):
            b.set_reshard_after_forward(True)  # type: ignore[operator]
        with pytest.raises(ValueError, match=re.escape(_ONE_DIM_MESH)):
            rep(
                nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
            )
        with pytest.raises(ValueError):
            rep(nn.ModuleList([nn.Linear(2, 2)]))


def test_replicate_misuse_raises_like_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility (same exception types as torch's replicate)."""
    world2.run(misuse)


def composable_state(rank: int, world: int) -> None:
    from torch.distributed._composable.replicate_with_fsdp import _ReplicateState

    def is_replicate_state(state: object) -> bool:  # ours: the engine state, described
        return getattr(getattr(state, "api", None), "name", None) == "replicate"

    for rep, fs, is_state in (
        (torch_replicate, torch_fully_shard, lambda st: isinstance(st, _ReplicateState)),
        (replicate, fully_shard, is_replicate_state),
    ):
        r, s, plain = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
        rep(r)
        fs(s)
        assert is_state(rep.state(r)), rep  # type: ignore[attr-defined]
        assert not is_state(fs.state(s)), fs  # type: ignore[attr-defined]
        assert rep.state(s) is None and rep.state(plain) is None, rep  # type: ignore[attr-defined]
        assert fs.state(r) is None and fs.state(plain) is None, fs  # type: ignore[attr-defined]
        assert fs.state(s) is not None, fs  # type: ignore[attr-defined]


def test_replicate_state_like_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility. replicate.state returns the replicate state of a replicated
    module and None for a fully_shard or plain module; fully_shard.state is None for a
    replicated module; the same as torch's."""
    world2.run(composable_state)


def torch_policy_objects(rank: int, world: int) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    from shardweave.fsdp import CPUOffloadPolicy

    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    with_theirs, with_ours, oracle = (make_model("gpt") for _ in range(3))
    torch_policies = {"mp_policy": TorchMP(**mp), "offload_policy": TorchCPUOffload(False)}
    _per_block(with_theirs, replicate, **torch_policies)
    _per_block(
        with_ours,
        replicate,
        mp_policy=MixedPrecisionPolicy(**mp),
        offload_policy=CPUOffloadPolicy(pin_memory=False),
    )
    _per_block(oracle, torch_replicate, **torch_policies)
    models = (with_theirs, with_ours, oracle)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(2):
        batch = make_batch("gpt", 100 * step + rank)
        for m in models:
            loss_fn("gpt", m(batch).float(), batch).backward()
        assert all(p.device.type == "cpu" for p in with_theirs.parameters())
        assert_same_as_torch(with_theirs, with_ours, f"theirs vs ours step {step}")
        assert_same_as_torch(with_theirs, oracle, f"vs torch's replicate step {step}")
        for o in opts:
            o.step()
            o.zero_grad()
        assert_same_as_torch(with_theirs, oracle, f"vs torch's replicate after step {step}")


def test_replicate_accepts_torch_policy_objects(world2: WorkerPool) -> None:
    """Oracle: compatibility, bitwise, two steps: replicate with torch's MixedPrecisionPolicy
    and CPUOffloadPolicy(pin_memory=False) equals it with ours and torch's replicate."""
    world2.run(torch_policy_objects)
