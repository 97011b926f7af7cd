"""State dicts: DTensor values that alias the live shards, load_state_dict, and
torch.distributed.checkpoint (full state dicts, broadcast from rank 0, save/load).

Oracles: *reference* (the unsharded model's state dict) and *compatibility* (torch's
fully_shard gives the same keys, placements and local values).
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks


def state_dict_roundtrip(rank: int, world: int) -> None:
    model = make_model("gpt")
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    shard_blocks(tmodel, torch_fully_shard)
    sd, tsd, rsd = model.state_dict(), tmodel.state_dict(), ref.state_dict()
    assert list(sd) == list(tsd) == list(rsd), "FSDP must not change FQNs"
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        assert value.placements == tsd[key].placements, key
        assert torch.equal(value.to_local(), tsd[key].to_local()), key
        assert torch.equal(value.full_tensor(), rsd[key]), key
    # aliasing: a state dict taken before training follows the live parameters
    batch = make_batch("gpt", rank)
    loss_fn("gpt", model(batch), batch).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    live = dict(model.named_parameters())
    for key, value in sd.items():
        if key in live:
            assert torch.equal(value.to_local(), live[key].to_local()), f"{key} stopped aliasing"
    # load into a differently initialized sharded model
    other = make_model("gpt", seed=1)
    shard_blocks(other, fully_shard)
    other.load_state_dict(model.state_dict())
    for (key, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), key  # type: ignore[attr-defined]
    # a full state dict through DCP equals the reference after the same update
    full = get_model_state_dict(other, options=StateDictOptions(full_state_dict=True))
    assert set(full) == set(rsd)
    assert all(not isinstance(v, DTensor) for v in full.values())
    for key, value in full.items():
        assert torch.equal(value, model.state_dict()[key].full_tensor()), key


def test_state_dict_roundtrip(world2: WorkerPool) -> None:
    """Oracles: reference and compatibility (keys, placements, values, aliasing)."""
    world2.run(state_dict_roundtrip)


def dcp_save_load(rank: int, world: int) -> None:
    model = make_model("gpt")
    ref = copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch("gpt", rank)
    loss_fn("gpt", model(batch), batch).backward()
    opt.step()
    osd = get_optimizer_state_dict(model, opt)
    assert any(isinstance(v, DTensor) for s in osd["state"].values() for v in s.values())
    paths = [tempfile.mkdtemp(prefix="sw-dcp-") if rank == 0 else ""]
    dist.broadcast_object_list(paths, src=0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=paths[0])
    fresh = make_model("gpt", seed=7)
    shard_blocks(fresh, fully_shard)
    target = {"model": fresh.state_dict()}
    dcp.load(target, checkpoint_id=paths[0])
    fresh.load_state_dict(target["model"])
    for (key, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), key  # type: ignore[attr-defined]
    # broadcast a full state dict from rank 0 into a sharded model
    full = {k: v for k, v in ref.state_dict().items()}
    third = make_model("gpt", seed=3)
    shard_blocks(third, fully_shard)
    set_model_state_dict(
        third,
        dict(full) if rank == 0 else {},  # DCP rewrites the dict it is given
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    for key, value in third.state_dict().items():
        assert torch.equal(value.full_tensor(), full[key]), key
    # the loaded model trains like the reference
    loss_fn("gpt", third(batch), batch).backward()
    assert all(p.grad is not None for p in third.parameters())


def test_dcp_save_load_and_broadcast(world2: WorkerPool) -> None:
    """Oracle: reference (values after save/load and rank-0 broadcast equal the source)."""
    world2.run(dcp_save_load)
