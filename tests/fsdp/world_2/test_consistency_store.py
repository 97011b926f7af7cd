"""The root's cross-rank consistency check goes through the c10d store: the first step issues
exactly the collectives torch's FSDP2 issues, a rank that never arrives is named after a bounded
wait, and the store keeps at most one key per rank and process group.

Oracles: *compatibility* (torch's ``fully_shard`` on the same model issues the same collectives
at the first step) and *closed form* (which ranks arrive, which keys exist).
"""

from __future__ import annotations

import datetime
import os
import time
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import FSDPConsistencyError, fully_shard
from shardweave.fsdp.faults._consistency import TIMEOUT_ENV, check_ranks_agree
from shardweave.mesh import FSDPMeshInfo
from tests._dist import WorkerPool
from tests._dist.sync import barrier
from tests.fsdp._counting import C10dOps, count_collectives
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks


def _first_step(api: Any, accumulate: bool, rank: int) -> dict[str, int]:
    model = make_model("gpt")
    shard_blocks(model, api)
    micro = [make_batch("gpt", 10 * rank + i) for i in range(2 if accumulate else 1)]
    with count_collectives() as counts, C10dOps() as ops:
        for i, batch in enumerate(micro):
            # gradient accumulation: reduce-scatter only at the last microbatch
            model.set_requires_gradient_sync(i == len(micro) - 1)  # type: ignore[operator]
            loss_fn("gpt", model(batch), batch).backward()
    seen = {k: v for k, v in counts.items() if not k.endswith("_bytes")}
    seen.update(ops.counts)
    return seen


def first_step_counts(rank: int, world: int, accumulate: bool) -> tuple[dict[str, int], ...]:
    return _first_step(fully_shard, accumulate, rank), _first_step(
        torch_fully_shard, accumulate, rank
    )


@pytest.mark.parametrize("accumulate", [False, True], ids=["one_batch", "two_microbatches"])
def test_first_step_issues_torchs_collectives(world2: WorkerPool, accumulate: bool) -> None:
    """Oracle: compatibility. The first step (root lazy init, forward, backward; with two
    microbatches, gradient sync only on the last) issues as many all-gathers, reduce-scatters
    and all-reduces as torch's fully_shard on the same model, and no other c10d collective."""
    for ours, theirs in world2.run(first_step_counts, accumulate):  # type: ignore[misc]
        assert ours == theirs, f"ours {ours} vs torch {theirs}"
        assert ours["all_gather_single"] > 0


def _mesh_info() -> FSDPMeshInfo:
    return FSDPMeshInfo(init_device_mesh("cpu", (dist.get_world_size(),)), shard_mesh_dim=0)


def late_rank(rank: int, world: int) -> tuple[float, int | None]:
    """Rank 1 reaches the check only after rank 0 gave up waiting for it."""
    info, cpu = _mesh_info(), torch.device("cpu")
    store = dist.distributed_c10d._get_default_store()
    lines = ["same model"]
    if rank == 0:
        os.environ[TIMEOUT_ENV] = "1"
        started = time.monotonic()
        try:
            with pytest.raises(FSDPConsistencyError, match=r"rank\(s\) 1 of .* did not reach") as e:
                check_ranks_agree(lines, info, cpu, "fully_shard")
        finally:
            del os.environ[TIMEOUT_ENV]
        assert TIMEOUT_ENV in str(e.value)
        store.set("consistency_test/late_go", "1")
        return time.monotonic() - started, None
    store.wait(["consistency_test/late_go"], datetime.timedelta(seconds=60))
    # rank 0's key is there: the late rank agrees with it and its ticket stays aligned
    return 0.0, check_ranks_agree(lines, info, cpu, "fully_shard")


def test_missing_rank_is_named_after_bounded_wait(world2: WorkerPool) -> None:
    """Oracle: closed form. With SHARDWEAVE_CONSISTENCY_TIMEOUT=1 rank 0 raises
    FSDPConsistencyError naming rank 1 within seconds instead of hanging; rank 1, arriving
    later, finds rank 0's key (so the next check on these ranks is still aligned)."""
    (elapsed, _), (_, nonce) = world2.run(late_rank)  # type: ignore[misc]
    assert elapsed < 10, elapsed
    assert nonce is not None
    world2.run(nonces_agree_and_keys_are_bounded)  # the scope still works afterwards


def nonces_agree_and_keys_are_bounded(rank: int, world: int) -> None:
    info, cpu = _mesh_info(), torch.device("cpu")
    store = dist.distributed_c10d._get_default_store()
    keys_before = store.num_keys()
    nonces = []
    for model in range(4):  # four root inits on the same ranks: four generations
        nonce = check_ranks_agree([f"model {model}"], info, cpu, "fully_shard")
        assert nonce is not None
        nonces.append(nonce)
    assert len(set(nonces)) == 4, "each root init gets a fresh failure scope"
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, nonces)
    assert all(g == nonces for g in gathered), gathered
    # each rank deleted its key of every generation but the last one; allow the other rank's
    # deletions to be not yet done (it may still be finishing its last check)
    barrier()
    assert store.num_keys() - keys_before <= world, (keys_before, store.num_keys())


def test_nonces_agree_and_keys_are_bounded(world2: WorkerPool) -> None:
    """Oracle: closed form. Every rank returns the same nonce for each of four root inits, the
    nonces differ between inits, and the store does not grow by a key per init."""
    world2.run(nonces_agree_and_keys_are_bounded)


def two_models_interleaved(rank: int, world: int) -> list[int]:
    """Two models on the same ranks, their roots initialized in the same order on every rank,
    with a mismatch in the second: the first still agrees, the second raises everywhere."""
    a, b = make_model("mlp"), make_model("mlp")
    shard_blocks(a, fully_shard)
    if rank == 1:
        b.head = torch.nn.Linear(3, 2)  # type: ignore[assignment]
    shard_blocks(b, fully_shard)
    batch = make_batch("mlp", rank)
    a(batch).sum().backward()
    with pytest.raises(FSDPConsistencyError, match=r"(?s)First difference.*head\.weight"):
        b(batch)
    return [Counter(type(p).__name__ for p in a.parameters())["DTensor"]]


def test_two_models_do_not_share_keys(world2: WorkerPool) -> None:
    """Oracle: closed form. A second model's mismatch is reported on every rank; the first
    model's check (same ranks, earlier generation) is unaffected."""
    world2.run(two_models_interleaved)
