"""HSDP on a 2x2 ``(replicate, shard)`` mesh at 4 ranks: training parity, divide factors,
gradient accumulation controls, state dicts and checkpoints, and int ``reshard_after_forward``.

Oracles are named per test: *reference* (an unsharded copy trained on the global batch, loss
averaged over the 4 ranks), *compatibility* (torch's own ``fully_shard`` on the same 2-D mesh,
bitwise), *DDP* (``torch.nn.parallel.DistributedDataParallel`` on a copy, within tolerance) and
*closed form* (collective counts known in advance).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool, assert_close
from tests._dist.sync import barrier
from tests.fsdp._counting import count_collectives
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import assert_matches_reference, assert_same_as_torch

HSDP_PLACEMENTS = (Replicate(), Shard(0))
# Accumulated microbatches sum in another order than the one-backward reference, on summed (not
# averaged) losses of magnitude ~10: allow fp32 rounding of that size (as world_2's training test).
ACCUMULATION_TOL: dict[str, float] = {"rtol": 2e-5, "atol": 1e-4}


def _hsdp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _n_groups(model: nn.Module) -> int:
    """FSDP groups made by ``shard_blocks``: one per block (or MLP layer) plus the root."""
    return len(model.layers) + 1 if hasattr(model, "layers") else 3  # type: ignore[arg-type]


def _global_batches(kind: str, step: int, world: int, mb: int = 0) -> list[torch.Tensor]:
    return [make_batch(kind, 1000 * step + 100 * mb + r) for r in range(world)]


def _ref_backward(ref: nn.Module, kind: str, batches: list[torch.Tensor]) -> None:
    (sum(loss_fn(kind, ref(b), b) for b in batches) / len(batches)).backward()  # type: ignore[union-attr]


def _assert_hsdp_spec(model: nn.Module, mesh: DeviceMesh, tag: str) -> None:
    """Every param is a (Replicate(), Shard(0)) DTensor on ``mesh``; a grad has the same spec."""
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{tag} {name}: {type(p).__name__}"
        assert p.placements == HSDP_PLACEMENTS, f"{tag} {name}: {p.placements}"
        assert p.device_mesh == mesh, f"{tag} {name}: param mesh {p.device_mesh}"
        assert p.device_mesh.mesh_dim_names == ("replicate", "shard"), f"{tag} {name}"
        if p.grad is not None:
            assert isinstance(p.grad, DTensor), f"{tag} {name}: grad {type(p.grad).__name__}"
            assert p.grad.device_mesh == p.device_mesh, f"{tag} {name}: grad mesh differs"
            assert p.grad.placements == p.placements, f"{tag} {name}: {p.grad.placements}"


# --- 1. training parity -----------------------------------------------------------------------
def hsdp_train_parity(rank: int, world: int, kind: str) -> None:
    model = make_model(kind)
    ref, tmodel, dmodel = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    mesh = _hsdp_mesh()
    shard_blocks(model, fully_shard, mesh=mesh)
    shard_blocks(tmodel, torch_fully_shard, mesh=mesh)
    ddp = DistributedDataParallel(dmodel)  # averages over all 4 ranks, like HSDP should
    shard_rank, n_shard = mesh.get_local_rank("shard"), mesh.size(1)
    _assert_hsdp_spec(model, mesh, "init")
    _assert_hsdp_spec(tmodel, mesh, "torch init")

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    opts = [sgd(m) for m in (model, ref, tmodel, ddp)]
    for step in range(3):
        batches = _global_batches(kind, step, world)
        mine = batches[rank]
        for m in (model, tmodel, ddp):
            loss_fn(kind, m(mine), mine).backward()
        _ref_backward(ref, kind, batches)
        tag = f"{kind} step {step}"
        assert all(p.grad is not None for p in model.parameters()), tag
        _assert_hsdp_spec(model, mesh, tag)
        assert_same_as_torch(model, tmodel, tag)
        assert_matches_reference(model, ref, "grad", shard_rank, n_shard, f"{tag} vs reference")
        assert_matches_reference(model, ddp.module, "grad", shard_rank, n_shard, f"{tag} vs DDP")
        for o in opts:
            o.step()
            o.zero_grad()
        assert_same_as_torch(model, tmodel, tag)
        assert_matches_reference(model, ref, "param", shard_rank, n_shard, f"{tag} vs reference")
        assert_matches_reference(model, ddp.module, "param", shard_rank, n_shard, f"{tag} vs DDP")


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_hsdp_train_parity(world4: WorkerPool, kind: str) -> None:
    """Oracles: reference (unsharded on the global batch), compatibility (torch's fully_shard on
    the same 2x2 mesh: placements, shards and grads bitwise) and DDP (grads and params close).
    Sharded grads carry the params' mesh and ``(Replicate(), Shard(0))`` placements."""
    world4.run(hsdp_train_parity, kind)


# --- 2. divide factors: HSDP vs 1-D FSDP vs DDP on the same global batch -----------------------
def _sum_sq_full_grads(model: nn.Module) -> torch.Tensor:
    total = torch.zeros(())
    for p in model.parameters():
        g = p.grad
        assert g is not None
        total += (g.full_tensor() if isinstance(g, DTensor) else g).double().pow(2).sum().float()
    return total


def _clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def hsdp_divide_factors(rank: int, world: int, kind: str) -> None:
    model = make_model(kind)
    fsdp1d, tmodel, dmodel, ref = (copy.deepcopy(model) for _ in range(4))
    mesh = _hsdp_mesh()
    shard_blocks(model, fully_shard, mesh=mesh)
    shard_blocks(tmodel, torch_fully_shard, mesh=mesh)
    shard_blocks(fsdp1d, fully_shard, mesh=init_device_mesh("cpu", (world,)))
    ddp = DistributedDataParallel(dmodel)
    batches = _global_batches(kind, 0, world)
    mine = batches[rank]
    for m in (model, tmodel, fsdp1d, ddp):
        loss_fn(kind, m(mine), mine).backward()
    _ref_backward(ref, kind, batches)
    named = {
        "hsdp": model,
        "torch-hsdp": tmodel,
        "fsdp-1d": fsdp1d,
        "ddp": ddp.module,
    }
    # full gradients, element by element: any stray factor of 2 (shard), 2 (replicate) or 4 shows
    for label, m in named.items():
        for (name, p), (_, rp) in zip(m.named_parameters(), ref.named_parameters(), strict=True):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            assert_close(g, rp.grad, msg=f"{label} full grad {name}")  # type: ignore[arg-type]
    # the squared norm a user would log, and clip_grad_norm_'s total norm (DTensor-aware)
    ref_sq = _sum_sq_full_grads(ref)
    for label, m in named.items():
        assert_close(_sum_sq_full_grads(m), ref_sq, msg=f"{label} sum of squared grads")
    ref_norm = _clip(ref, max_norm=0.05)
    assert ref_norm > 0.05, "max_norm must be small enough that clipping scales the grads"
    norms = {label: _clip(m, max_norm=0.05) for label, m in named.items()}
    assert torch.equal(norms["hsdp"], norms["torch-hsdp"]), norms
    for label, norm in norms.items():
        assert_close(norm, ref_norm, msg=f"{label} clip_grad_norm_ total norm")
    # the clip coefficient was applied to every shard the same way as to the reference
    shard_rank, n_shard = mesh.get_local_rank("shard"), mesh.size(1)
    assert_matches_reference(model, ref, "grad", shard_rank, n_shard, "hsdp after clipping")
    assert_matches_reference(fsdp1d, ref, "grad", rank, world, "fsdp-1d after clipping")
    assert_same_as_torch(model, tmodel, "after clipping")


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_hsdp_divide_factors_and_grad_norm(world4: WorkerPool, kind: str) -> None:
    """Oracles: reference, DDP and 1-D FSDP at world 4 (full grads, sum of squared grads and
    clip_grad_norm_'s total norm all equal: HSDP averages over shard x replicate exactly once),
    and compatibility (torch's HSDP norm bitwise, clipped shards bitwise)."""
    world4.run(hsdp_divide_factors, kind)


# --- 3. gradient accumulation: set_requires_all_reduce / set_requires_gradient_sync ------------
def hsdp_accumulate(rank: int, world: int, mode: str) -> None:
    kind = "gpt"
    model = make_model(kind)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    mesh = _hsdp_mesh()
    shard_blocks(model, fully_shard, mesh=mesh)
    shard_blocks(tmodel, torch_fully_shard, mesh=mesh)
    groups = _n_groups(model)
    shard_rank, n_shard = mesh.get_local_rank("shard"), mesh.size(1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref, tmodel)]
    micro = 3  # two microbatches without the all-reduce (or without sync), then the last with it
    for step in range(2):
        for mb in range(micro):
            last = mb == micro - 1
            for m in (model, tmodel):
                if mode == "all_reduce":
                    m.set_requires_all_reduce(last)  # type: ignore[operator]
                else:
                    m.set_requires_gradient_sync(last)  # type: ignore[operator]
            batches = _global_batches(kind, step, world, mb)
            mine = batches[rank]
            loss = loss_fn(kind, model(mine), mine)
            with count_collectives() as counts:
                loss.backward()
            loss_fn(kind, tmodel(mine), mine).backward()
            _ref_backward(ref, kind, batches)
            tag = f"{mode} step {step} microbatch {mb}"
            rs, ar = counts["reduce_scatter_single"], counts["all_reduce"]
            if last:
                assert (rs, ar) == (groups, groups), f"{tag}: {dict(counts)}"
            elif mode == "all_reduce":
                assert (rs, ar) == (groups, 0), f"{tag}: reduce-scatter only, {dict(counts)}"
            else:
                assert (rs, ar) == (0, 0), f"{tag}: no gradient communication, {dict(counts)}"
            if not last:  # partial sums are kept aside: no sharded grad yet, like torch
                assert all(p.grad is None for p in model.parameters()), tag
            assert_same_as_torch(model, tmodel, tag)
        _assert_hsdp_spec(model, mesh, f"{mode} step {step}")
        assert_matches_reference(
            model, ref, "grad", shard_rank, n_shard, f"{mode} step {step}", **ACCUMULATION_TOL
        )
        for o in opts:
            o.step()
            o.zero_grad()
        assert_same_as_torch(model, tmodel, f"{mode} step {step} after step")
        assert_matches_reference(
            model, ref, "param", shard_rank, n_shard, f"{mode} step {step}", **ACCUMULATION_TOL
        )


@pytest.mark.parametrize("mode", ["all_reduce", "gradient_sync"])
def test_hsdp_gradient_accumulation(world4: WorkerPool, mode: str) -> None:
    """Oracles: reference on the sum of the microbatches, compatibility (torch's fully_shard
    with the same setters, bitwise after every microbatch), and closed form for the collectives
    of each backward: requires_all_reduce=False reduce-scatters but never all-reduces,
    requires_gradient_sync=False does neither; the last microbatch does one of each per group."""
    world4.run(hsdp_accumulate, mode)


# --- 4. state dict and DCP --------------------------------------------------------------------
def hsdp_state_dict_dcp(rank: int, world: int) -> None:
    kind = "gpt"
    model = make_model(kind)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    mesh = _hsdp_mesh()
    shard_blocks(model, fully_shard, mesh=mesh)
    shard_blocks(tmodel, torch_fully_shard, mesh=mesh)
    sd, tsd, rsd = model.state_dict(), tmodel.state_dict(), ref.state_dict()
    assert list(sd) == list(tsd) == list(rsd), "FSDP must not change FQNs"
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        assert value.placements == HSDP_PLACEMENTS == tsd[key].placements, key
        assert value.device_mesh == mesh, key
        assert torch.equal(value.to_local(), tsd[key].to_local()), key
        assert torch.equal(value.full_tensor(), rsd[key]), key
    # train a step; the state dict then follows the reference's update
    opt, ropt = (
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(ref.parameters(), lr=0.1),
    )
    batches = _global_batches(kind, 0, world)
    loss_fn(kind, model(batches[rank]), batches[rank]).backward()
    _ref_backward(ref, kind, batches)
    for o in (opt, ropt):
        o.step()
        o.zero_grad()
    rsd = ref.state_dict()
    for key, value in model.state_dict().items():
        assert value.placements == HSDP_PLACEMENTS, key
        assert_close(value.full_tensor(), rsd[key], msg=f"trained {key}")
    # DCP save, then load into a fresh HSDP model and into a 1-D FSDP model (resharding)
    paths = [tempfile.mkdtemp(prefix="sw-hsdp-dcp-") if rank == 0 else ""]
    dist.broadcast_object_list(paths, src=0)
    try:
        dcp.save({"model": model.state_dict()}, checkpoint_id=paths[0])
        fresh = make_model(kind, seed=7)
        shard_blocks(fresh, fully_shard, mesh=mesh)
        flat = make_model(kind, seed=8)
        shard_blocks(flat, fully_shard, mesh=init_device_mesh("cpu", (world,)))
        for target_model in (fresh, flat):
            target = {"model": target_model.state_dict()}
            dcp.load(target, checkpoint_id=paths[0])
            target_model.load_state_dict(target["model"])
    finally:
        barrier()
        if rank == 0:
            shutil.rmtree(paths[0], ignore_errors=True)
    for (key, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert isinstance(q, DTensor) and q.placements == HSDP_PLACEMENTS, key
        assert torch.equal(p.to_local(), q.to_local()), f"{key}: restored shard differs"  # type: ignore[attr-defined]
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for key, value in flat.state_dict().items():
        assert value.placements == (Shard(0),), key
        assert torch.equal(value.full_tensor(), full[key]), f"{key}: resharded load differs"
    # the restored model trains bitwise like the original
    mine = make_batch(kind, 4242 + rank)
    for m in (model, fresh):
        loss_fn(kind, m(mine), mine).backward()
    for (key, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), key  # type: ignore[union-attr]


def test_hsdp_state_dict_and_dcp(world4: WorkerPool) -> None:
    """Oracles: reference (full_tensor of every value, before and after a step) and
    compatibility (torch's keys, placements, local values); DCP save/load restores the shards
    exactly, also into a 1-D FSDP model on the same 4 ranks."""
    world4.run(hsdp_state_dict_dcp)


# --- 5. int reshard_after_forward on HSDP -----------------------------------------------------
def _registered_spec(model: nn.Module) -> list[tuple[str, Any]]:
    """How each block's registered parameter looks between forward and backward."""
    spec: list[tuple[str, Any]] = []
    for name, p in model.layers.named_parameters():  # type: ignore[union-attr]
        if isinstance(p, DTensor):
            spec.append((name, (tuple(p.device_mesh.mesh.shape), p.placements, p.to_local())))
        else:
            spec.append((name, ("unsharded", p.shape)))
    return spec


def hsdp_int_reshard(rank: int, world: int, k: int) -> None:
    kind = "gpt"
    model = make_model(kind)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    mesh = _hsdp_mesh()
    shard_blocks(model, fully_shard, mesh=mesh, reshard_after_forward=k)
    shard_blocks(tmodel, torch_fully_shard, mesh=mesh, reshard_after_forward=k)
    groups = _n_groups(model)
    shard_rank, n_shard = mesh.get_local_rank("shard"), mesh.size(1)
    for step in range(2):
        batches = _global_batches(kind, step, world)
        mine = batches[rank]
        out, tout = model(mine), tmodel(mine)
        ours, theirs = _registered_spec(model), _registered_spec(tmodel)
        assert [(n, s[:2]) for n, s in ours] == [(n, s[:2]) for n, s in theirs], f"k={k}"
        for (name, s), (_, ts) in zip(ours, theirs):
            if s[0] != "unsharded":
                assert torch.equal(s[2], ts[2]), f"k={k} {name}: post-forward shard differs"
        with count_collectives() as counts:
            loss_fn(kind, out, mine).backward()
        loss_fn(kind, tout, mine).backward()
        _ref_backward(ref, kind, batches)
        # k == shard size means True (every group all-gathers again); k == 1 means False
        expected_ag = groups if k == n_shard else 0
        assert counts["all_gather_single"] == expected_ag, f"k={k}: {dict(counts)}"
        tag = f"k={k} step {step}"
        assert_same_as_torch(model, tmodel, tag)
        assert_matches_reference(model, ref, "grad", shard_rank, n_shard, tag)
        with torch.no_grad():
            for m in (model, tmodel, ref):
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)  # type: ignore[operator]
                    p.grad = None


def hsdp_int_reshard_invalid(rank: int, world: int) -> None:
    mesh = _hsdp_mesh()
    for bad in (0, 3, 4, -2):  # shard dim has size 2: only 1 and 2 divide it
        with pytest.raises(Exception) as theirs:
            torch_fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=bad)
        with pytest.raises(type(theirs.value)) as ours:
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=bad)
        assert type(ours.value) is type(theirs.value), (bad, ours.value, theirs.value)
        assert "factor of 2" in str(ours.value), ours.value


@pytest.mark.parametrize("k", [2, 1])
def test_hsdp_int_reshard_after_forward(world4: WorkerPool, k: int) -> None:
    """Oracles: compatibility (torch on the same 2x2 mesh: the registered params between forward
    and backward, then grads, bitwise), reference (grads), and closed form for the backward
    all-gathers (k = shard size behaves as True, k = 1 as False)."""
    world4.run(hsdp_int_reshard, k)


def test_hsdp_int_reshard_after_forward_invalid(world4: WorkerPool) -> None:
    """Oracle: compatibility (torch raises for an int that does not divide the shard dim size;
    we raise the same exception type with the same message)."""
    world4.run(hsdp_int_reshard_invalid)
