"""Full state dicts and safetensors files at 4 ranks: HSDP on a 2x2 ``(replicate, shard)`` mesh,
uneven shards (empty on trailing ranks) on a 1-D mesh, and FSDP x TP (strided shards).

Oracles: *reference* (the unsharded model's ``state_dict()``) and *compatibility* (torch's
``get_model_state_dict`` / ``set_model_state_dict`` with ``full_state_dict=True`` on torch's
``fully_shard``-ed copy on the same mesh: same values, same local shards).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import (
    fully_shard,
    get_full_state_dict,
    load_safetensors,
    save_safetensors,
    set_full_state_dict,
)
from tests._dist import WorkerPool, seed_everything
from tests._dist.sync import barrier
from tests.fsdp._full_state_dicts import (
    assert_equal_sd,
    assert_same_local_shards,
    check_broadcast_load,
    check_export,
    cleanup,
    sharded_pair,
    shared_tmpdir,
)


def hsdp_and_uneven(rank: int, world: int) -> None:
    seed_everything(0)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (4,))
    tmp = shared_tmpdir()
    cases = [
        ("hsdp", hsdp, "mlp", torch.float32),
        ("hsdp", hsdp, "gpt", torch.bfloat16),
        ("fsdp4", flat, "mlp", torch.float32),  # 7, 3 and 1 rows over 4 ranks
    ]
    for tag, mesh, kind, dtype in cases:
        name = f"{tag}/{kind}"
        model, tmodel, ref = sharded_pair(kind, dtype=dtype, mesh=mesh)
        if kind == "mlp" and tag == "fsdp4":  # head.weight: 1 row, 3 ranks hold nothing
            rows = model.head.weight.to_local().size(0)  # type: ignore[union-attr,operator]
            assert rows == (1 if rank == 0 else 0), rows
        check_export(model, tmodel, ref, name)
        if dtype == torch.float32:
            check_broadcast_load(kind, name, mesh=mesh)
        path = os.path.join(tmp, f"{tag}-{kind}.safetensors")
        save_safetensors(model, path)
        fresh, _, _ = sharded_pair(kind, seed=4, dtype=dtype, mesh=mesh)
        load_safetensors(fresh, path)
        assert_same_local_shards(fresh, model, f"{name} safetensors round trip")
    cleanup(tmp)


def test_full_state_dict_hsdp_and_uneven(world4: WorkerPool) -> None:
    """Oracles: reference and compatibility on HSDP (2x2) and on 4-way uneven shards."""
    world4.run(hsdp_and_uneven)


def fsdp_tp(rank: int, world: int) -> None:
    from tests.extensions._tp_models import Stack, build_tp_stack

    seed_everything(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, tmodel = build_tp_stack(fully_shard, mesh), build_tp_stack(torch_fully_shard, mesh)
    torch.manual_seed(0)
    ref = Stack()
    full = get_full_state_dict(model, rank0_only=False)
    assert_equal_sd(full, ref.state_dict(), "fsdp+tp export")
    oracle = get_model_state_dict(tmodel, options=StateDictOptions(full_state_dict=True))
    assert_equal_sd(full, oracle, "fsdp+tp vs torch")
    # load other values into both and compare the local (strided) shards
    torch.manual_seed(3)
    src = Stack().state_dict()
    set_full_state_dict(model, src if rank == 0 else None, broadcast_from_rank0=True)
    set_model_state_dict(
        tmodel,
        dict(src) if rank == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    assert_same_local_shards(model, tmodel, "fsdp+tp load vs torch")
    for key, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), src[key]), key
    barrier()


def test_full_state_dict_fsdp_tp(world4: WorkerPool) -> None:
    """Oracles: reference and compatibility with strided (FSDP x TP) placements."""
    pytest.importorskip("shardweave.extensions")
    world4.run(fsdp_tp)
