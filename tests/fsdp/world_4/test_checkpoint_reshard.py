"""Distributed checkpoints that change the world size or the parallel layout between save and load.

Model and AdamW state go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` and ``dcp.save`` / ``dcp.load``; values are compared through ``full_tensor()``.

Oracles: *reference* (the full tensors that were saved, bitwise; an uninterrupted run, bitwise;
an unsharded single-process model on the global batch, within fp32 tolerance).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool, assert_close, seed_everything
from tests.extensions._tp_models import Stack
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks

# ------------------------------------------------------------------------------------ helpers


def _adamw(model: nn.Module, eps: float = 1e-8) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=eps)


# Test 2 compares runs that reduce gradients in different orders. TinyGPT's key bias gets a
# mathematically zero gradient (softmax ignores it), and with AdamW's default eps its rounding
# noise becomes lr-sized steps of random sign; an eps far above that noise keeps it negligible.
# (eps is saved in the checkpoint's param_groups, so it is set from the first step.)
RESUME_EPS = 1e-3


def _full(value: object) -> object:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """Flat ``{key: full tensor}`` of what ``get_state_dict`` hands DCP (collective)."""
    msd, osd = get_state_dict(model, opt)
    flat: dict[str, object] = {f"model/{k}": _full(v) for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for name, value in state.items():
            flat[f"optim/{fqn}/{name}"] = _full(value)
    flat["optim/param_groups"] = [
        {k: v for k, v in group.items() if k != "params"} for group in osd["param_groups"]
    ]
    return flat


def _assert_same_state(got: dict[str, object], expected: dict[str, object], tag: str) -> None:
    assert sorted(got) == sorted(expected), f"{tag}: keys differ"
    for key, value in expected.items():
        ours = got[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(ours, torch.Tensor), f"{tag} {key}: {type(ours).__name__}"
            assert ours.dtype == value.dtype and ours.shape == value.shape, f"{tag} {key}"
            assert torch.equal(ours, value), f"{tag} {key}: differs from what was saved"
        else:
            assert ours == value, f"{tag} {key}: {ours} != {value}"
    assert any(k.endswith("/exp_avg_sq") for k in expected), f"{tag}: no optimizer state saved"


def _save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    msd, osd = get_state_dict(model, opt)  # also creates the optimizer state DCP loads into
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _gpt(seed: int, world: int) -> nn.Module:
    model = make_model("gpt", seed=seed)
    shard_blocks(model, fully_shard, mesh=init_device_mesh("cpu", (world,)))
    return model


def _mesh_sizes(model: nn.Module) -> set[tuple[int, ...]]:
    return {tuple(p.device_mesh.shape) for p in model.parameters()}  # type: ignore[attr-defined]


# ---------------------------------------------------- 1. world 2 -> world 4 -> world 2, bitwise


def save_gpt_world2(rank: int, world: int, root: str) -> None:
    seed_everything(0)
    torch.use_deterministic_algorithms(True)
    model = _gpt(0, world)
    opt = _adamw(model)
    for step in range(2):  # non-trivial exp_avg / exp_avg_sq / step
        batch = make_batch("gpt", 1000 * step + rank)
        loss_fn("gpt", model(batch), batch).backward()
        opt.step()
        opt.zero_grad()
    _save(model, opt, os.path.join(root, "world2"))
    expected = _full_state(model, opt)
    if rank == 0:
        torch.save(expected, os.path.join(root, "expected.pt"))


def load_gpt(rank: int, world: int, root: str, src: str, dst: str | None) -> None:
    seed_everything(0)
    torch.use_deterministic_algorithms(True)
    model = _gpt(1, world)  # another init, so a no-op load cannot pass
    opt = _adamw(model)
    _load(model, opt, os.path.join(root, src))
    assert _mesh_sizes(model) == {(world,)}
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    _assert_same_state(_full_state(model, opt), expected, f"world {world} from {src}")
    for name, p in model.named_parameters():  # the live parameters, not only the state dict
        assert isinstance(p, DTensor), name
        assert torch.equal(p.full_tensor(), expected[f"model/{name}"]), name
    for name, p in model.named_parameters():  # and the live optimizer state
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_full(opt.state[p][key]), expected[f"optim/{name}/{key}"]), name
    if dst is not None:
        _save(model, opt, os.path.join(root, dst))


def test_gpt_adamw_world2_to_world4_and_back(
    world2: WorkerPool, world4: WorkerPool, tmp_path: Path
) -> None:
    """Oracle: reference (the full tensors saved at world 2: params, exp_avg, exp_avg_sq, step,
    param_groups) equal, bitwise, after loading at world 4 and after saving there and loading at
    world 2 again into a fresh model."""
    root = str(tmp_path)
    world2.run(save_gpt_world2, root)
    world4.run(load_gpt, root, "world2", "world4")
    world2.run(load_gpt, root, "world4", None)


# ------------------------------------------------------- 2. resumed training == uninterrupted

GLOBAL_BATCH = 8  # rows per step over all ranks: 4 per rank at world 2, 2 per rank at world 4


def _global_batch(kind: str, step: int) -> torch.Tensor:
    return make_batch(kind, 1000 + step, batch=GLOBAL_BATCH)


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, kind: str, step: int, rank: int, world: int
) -> float:
    """One step on this rank's slice of the global batch; returns the slice's (unscaled) loss.

    Scaling the loss by ``world / 2`` keeps the averaged gradient equal to the world-2 one
    (sum of the global batch's losses / 2) at any world size; at world 2 it is exactly 1.
    """
    mine = _global_batch(kind, step).chunk(world)[rank]
    loss = loss_fn(kind, model(mine), mine)
    (loss * (world / 2)).backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _ref_step(model: nn.Module, opt: torch.optim.Optimizer, kind: str, step: int) -> float:
    batch = _global_batch(kind, step)
    loss = loss_fn(kind, model(batch), batch)
    (loss / 2).backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _sharded(kind: str, seed: int, world: int) -> nn.Module:
    model = make_model(kind, seed=seed)
    shard_blocks(model, fully_shard, mesh=init_device_mesh("cpu", (world,)))
    return model


def continued_world2(rank: int, world: int, root: str, kind: str, k: int, m: int) -> None:
    seed_everything(0)
    torch.use_deterministic_algorithms(True)
    model = _sharded(kind, 0, world)
    opt = _adamw(model, RESUME_EPS)
    for step in range(k):
        _train_step(model, opt, kind, step, rank, world)
    _save(model, opt, os.path.join(root, f"{kind}-step{k}"))
    losses = [_train_step(model, opt, kind, step, rank, world) for step in range(k, k + m)]

    resumed = _sharded(kind, 1, world)
    resumed_opt = _adamw(resumed, RESUME_EPS)
    _load(resumed, resumed_opt, os.path.join(root, f"{kind}-step{k}"))
    resumed_losses = [
        _train_step(resumed, resumed_opt, kind, step, rank, world) for step in range(k, k + m)
    ]
    assert resumed_losses == losses, f"rank {rank}: {resumed_losses} != {losses}"
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), f"rank {rank} {name}"  # type: ignore[attr-defined]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            ours, theirs = resumed_opt.state[q][key], opt.state[p][key]
            ours = ours.to_local() if isinstance(ours, DTensor) else ours
            theirs = theirs.to_local() if isinstance(theirs, DTensor) else theirs
            assert torch.equal(ours, theirs), f"rank {rank} {name} {key}"
    final = {n: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    if rank == 0:
        torch.save(final, os.path.join(root, f"{kind}-uninterrupted.pt"))


def resumed_world4(rank: int, world: int, root: str, kind: str, k: int, m: int) -> None:
    seed_everything(0)
    torch.use_deterministic_algorithms(True)
    path = os.path.join(root, f"{kind}-step{k}")
    model = _sharded(kind, 1, world)
    opt = _adamw(model, RESUME_EPS)
    _load(model, opt, path)
    ref = make_model(kind, seed=2)  # unsharded, loaded from the same checkpoint
    ref_opt = _adamw(ref, RESUME_EPS)
    _load(ref, ref_opt, path)
    for (name, p), rp in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), rp), f"{name}: loaded values differ"  # type: ignore[attr-defined]
    for step in range(k, k + m):
        local = torch.tensor(_train_step(model, opt, kind, step, rank, world))
        dist.all_reduce(local)
        ref_loss = _ref_step(ref, ref_opt, kind, step)
        assert_close(local, torch.tensor(ref_loss), msg=f"step {step} loss")
        for (name, p), rp in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close(p.full_tensor(), rp.detach(), msg=f"step {step} {name}")  # type: ignore[attr-defined]
    uninterrupted = torch.load(os.path.join(root, f"{kind}-uninterrupted.pt"), weights_only=True)
    for name, p in model.named_parameters():
        assert_close(p.full_tensor(), uninterrupted[name], msg=f"vs world-2 run: {name}")  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_resumed_training_equals_uninterrupted(
    world2: WorkerPool, world4: WorkerPool, tmp_path: Path, kind: str
) -> None:
    """Oracles: reference, two of them. At world 2, a fresh model + AdamW loaded from the step-k
    checkpoint and trained m more steps equals the uninterrupted run bitwise (losses, shards,
    optimizer state). At world 4, with the same global batch split 4 ways, the resumed run is
    not bitwise reproducible (two half-batch gradients summed by the reduce-scatter round
    differently from one 4-row matmul), so it is compared within fp32 tolerance to an unsharded
    single-process model resumed from the same checkpoint on the global batch, and to the world-2
    uninterrupted run."""
    root, k, m = str(tmp_path), 2, 3
    world2.run(continued_world2, root, kind, k, m)
    world4.run(resumed_world4, root, kind, k, m)


# ----------------------------------------------- 3. layout changes at world 4: 1-D, HSDP, TP


def _layout(name: str, seed: int) -> tuple[nn.Module, int]:
    """``Stack`` sharded as 1-D FSDP, HSDP on (2, 2), or FSDP x TP on (dp=2, tp=2).

    Returns the model and this rank's data-parallel index (which batch it trains on).
    """
    torch.manual_seed(seed)
    model = Stack()
    mesh: DeviceMesh
    if name == "fsdp":
        mesh = init_device_mesh("cpu", (4,))
    elif name == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, tp_mesh["tp"], plan)
        mesh = tp_mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dp_rank = mesh.get_local_rank() if name == "tp" else dist.get_rank()
    return model, dp_rank


EXPECTED_MESHES = {"fsdp": {(4,)}, "hsdp": {(2, 2)}, "tp": {(2, 2), (2,)}}


def layout_transfer(rank: int, world: int, root: str, src: str, dst: str) -> None:
    seed_everything(0)
    torch.use_deterministic_algorithms(True)
    model, dp_rank = _layout(src, 0)
    opt = _adamw(model)
    for step in range(2):
        seed = 10 * step + dp_rank
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).sum().backward()
        opt.step()
        opt.zero_grad()
    expected = _full_state(model, opt)
    path = os.path.join(root, f"{src}-to-{dst}")
    _save(model, opt, path)

    other, _ = _layout(dst, 1)
    other_opt = _adamw(other)
    _load(other, other_opt, path)
    assert _mesh_sizes(other) == EXPECTED_MESHES[dst], _mesh_sizes(other)
    _assert_same_state(_full_state(other, other_opt), expected, f"{src} -> {dst}")
    for name, p in other.named_parameters():
        assert torch.equal(p.full_tensor(), expected[f"model/{name}"]), name  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("src", "dst"), [("fsdp", "hsdp"), ("fsdp", "tp"), ("hsdp", "fsdp"), ("tp", "fsdp")]
)
def test_layout_change_at_world4(world4: WorkerPool, tmp_path: Path, src: str, dst: str) -> None:
    """Oracle: reference (the saved full tensors of params and AdamW state equal, bitwise, the
    loaded ones after 1-D FSDP <-> HSDP (2, 2) and 1-D FSDP <-> FSDP x TP (dp=2, tp=2))."""
    world4.run(layout_transfer, str(tmp_path), src, dst)
