"""The FSDP tracer under HSDP on a 2x2 ``(replicate, shard)`` mesh at 4 ranks.

Oracle: *independent counter* (``count_collectives`` wraps the c10d entry points the engine
dispatches to) for counts and bytes; the process groups' ranks in closed form.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from shardweave.fsdp import fully_shard, trace
from tests._dist import WorkerPool
from tests.fsdp._counting import count_collectives
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks


def hsdp_counts(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model("gpt")
    shard_blocks(model, fully_shard, mesh=mesh)
    batch = make_batch("gpt", rank)
    loss_fn("gpt", model(batch), batch).backward()  # warm-up: lazy init's own collectives
    model.zero_grad()
    with count_collectives() as counts, trace() as tracer:
        loss_fn("gpt", model(batch), batch).backward()
    kinds = {
        k: [c for c in tracer.collectives if c.kind == k]
        for k in ("all_gather", "reduce_scatter", "all_reduce")
    }
    assert len(kinds["all_gather"]) == counts["all_gather_single"] > 0
    assert len(kinds["reduce_scatter"]) == counts["reduce_scatter_single"] == 3  # one per group
    assert len(kinds["all_reduce"]) == counts["all_reduce"] == 3
    assert sum(c.nbytes for c in kinds["all_gather"]) == 2 * counts["all_gather_single_bytes"]
    assert sum(c.nbytes for c in kinds["reduce_scatter"]) == counts["reduce_scatter_single_bytes"]
    # HSDP all-reduces the reduce-scatter output: 1/2 of its input.
    rs = {c.group: c.nbytes for c in kinds["reduce_scatter"]}
    assert {c.group: 2 * c.nbytes for c in kinds["all_reduce"]} == rs
    shard = (rank // 2 * 2, rank // 2 * 2 + 1)  # mesh rows are shard groups
    replicate = (rank % 2, rank % 2 + 2)
    assert all(c.ranks == shard for c in kinds["all_gather"] + kinds["reduce_scatter"])
    assert all(c.ranks == replicate for c in kinds["all_reduce"])
    assert tracer.summary()["total"]["end_gathered_bytes"] == 0


def test_hsdp_trace(world4: WorkerPool) -> None:
    """Oracle: independent counter; ranks in closed form."""
    world4.run(hsdp_counts)
