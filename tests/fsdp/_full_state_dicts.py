"""Full-state-dict checks shared by the world_2 and world_4 tests: bitwise state-dict and
local-shard comparisons, a shared temporary directory, and the export and broadcast-load checks
against torch's ``get_model_state_dict`` / ``set_model_state_dict``."""

from __future__ import annotations

import copy
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import fully_shard, get_full_state_dict, set_full_state_dict
from tests._dist.sync import barrier
from tests.fsdp._models import make_model, shard_blocks


def assert_equal_sd(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tag: str) -> None:
    """Same keys in the same order, plain CPU tensors, bitwise equal values and dtypes."""
    assert list(got) == list(want), f"{tag}: keys {list(got)} != {list(want)}"
    for key, value in got.items():
        assert not isinstance(value, DTensor), f"{tag} {key}: a DTensor"
        assert value.device.type == "cpu", f"{tag} {key}: on {value.device}"
        assert value.dtype == want[key].dtype, f"{tag} {key}: {value.dtype}"
        assert torch.equal(value, want[key].cpu()), f"{tag} {key}: values differ"


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def assert_same_local_shards(model: nn.Module, other: nn.Module, tag: str) -> None:
    mine, theirs = local_shards(model), local_shards(other)
    assert list(mine) == list(theirs), tag
    for key, value in mine.items():
        assert value.shape == theirs[key].shape, f"{tag} {key}: {value.shape}"
        assert torch.equal(value, theirs[key]), f"{tag} {key}: local shards differ"


def shared_tmpdir() -> str:
    """One temporary directory, made by rank 0 and named to every rank."""
    box = [tempfile.mkdtemp(prefix="sw-fullsd-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def cleanup(path: str) -> None:
    barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def sharded_pair(
    kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs: object
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(shardweave-sharded, torch-sharded, unsharded reference) from one seed."""
    model = make_model(kind, seed=seed).to(dtype)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    shard_blocks(model, fully_shard, **kwargs)
    shard_blocks(tmodel, torch_fully_shard, **kwargs)
    return model, tmodel, ref


def check_export(model: nn.Module, tmodel: nn.Module, ref: nn.Module, tag: str) -> None:
    rank = dist.get_rank()
    full = get_full_state_dict(model)
    if rank != 0:
        assert full == {}, f"{tag}: rank {rank} kept {list(full)}"
    else:
        assert_equal_sd(full, ref.state_dict(), f"{tag} vs reference")
    oracle = get_model_state_dict(
        tmodel, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        assert_equal_sd(full, oracle, f"{tag} vs torch")
    everywhere = get_full_state_dict(model, rank0_only=False, cpu_offload=False)
    assert_equal_sd(everywhere, ref.state_dict(), f"{tag} rank0_only=False")


def check_broadcast_load(kind: str, tag: str, **kwargs: object) -> None:
    """Load the seed-0 reference into seed-1 sharded models: ours vs torch's, bitwise."""
    rank = dist.get_rank()
    src = make_model(kind, seed=0).state_dict()
    model, tmodel, _ = sharded_pair(kind, seed=1, **kwargs)
    ptrs = {k: v.to_local().data_ptr() for k, v in model.state_dict().items()}
    keys = set_full_state_dict(model, src if rank == 0 else None, broadcast_from_rank0=True)
    assert keys.missing_keys == [] and keys.unexpected_keys == [], keys
    set_model_state_dict(
        tmodel,
        dict(src) if rank == 0 else {},  # DCP rewrites the dict it is given
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    assert_same_local_shards(model, tmodel, f"{tag} broadcast vs torch")
    after = {k: v.to_local().data_ptr() for k, v in model.state_dict().items()}
    assert after == ptrs, f"{tag}: loading must copy into the live shards, not replace them"
    # every rank holding the dict: no broadcast, same shards
    again, _, _ = sharded_pair(kind, seed=2, **kwargs)
    set_full_state_dict(again, src)
    assert_same_local_shards(again, tmodel, f"{tag} local vs torch")
