"""The root's consistency check on a 2x2 HSDP mesh, where each rank compares with two process
groups (its shard group, then its replicate group) through the c10d store.

Oracles: *closed form* (which ranks raise, and what they name) and *compatibility* (torch's
``fully_shard`` issues the same collectives at the first step).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import FSDPConsistencyError, fully_shard
from tests._dist import WorkerPool
from tests.fsdp._counting import C10dOps, count_collectives
from tests.fsdp._models import TwoLinear


def divergent_hsdp(rank: int, world: int) -> tuple[float, str]:
    """Rank 3 differs: its shard group {2, 3} disagrees; ranks 0 and 1 (whose shard group
    agrees) learn it from their replicate groups {0, 2} and {1, 3}."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = TwoLinear(8 if rank == 3 else 6)
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    started = time.monotonic()
    with pytest.raises(FSDPConsistencyError) as err:
        model(torch.randn(2, 4))
    return time.monotonic() - started, str(err.value)


def test_hsdp_mismatch_raises_on_every_rank(world4: WorkerPool) -> None:
    """Oracle: closed form. All four ranks raise within seconds, each naming rank 3 and the
    parameter that differs (the ranks outside rank 3's shard group included)."""
    results = world4.run(divergent_hsdp, timeout=60)
    for rank, (elapsed, text) in enumerate(results):  # type: ignore[misc]
        assert elapsed < 10, (rank, elapsed)
        assert "First difference" in text and "rank 3" in text and "b.weight" in text, text


def first_step(rank: int, world: int) -> list[dict[str, int]]:
    counts_per_api = []
    for api in (fully_shard, torch_fully_shard):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = TwoLinear(6)
        api(model.a, mesh=mesh)
        api(model, mesh=mesh)
        with count_collectives() as counts, C10dOps() as ops:
            model(torch.randn(2, 4)).sum().backward()
        seen = {k: v for k, v in counts.items() if not k.endswith("_bytes")}
        counts_per_api.append({**seen, **ops.counts})
    return counts_per_api


def test_hsdp_first_step_issues_torchs_collectives(world4: WorkerPool) -> None:
    """Oracle: compatibility. The first HSDP step issues as many collectives of each kind as
    torch's fully_shard (the consistency check adds none)."""
    for ours, theirs in world4.run(first_step):  # type: ignore[misc]
        assert ours == theirs, f"ours {ours} vs torch {theirs}"
