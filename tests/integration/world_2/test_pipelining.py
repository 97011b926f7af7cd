"""``torch.distributed.pipelining`` over stages our ``fully_shard`` wraps, with torch's own
``PipelineStage`` (no adapter): the stage recognizes the module as FSDP (torch's public
``FSDPModule`` marker), accumulates micro-batch gradients without communication, reduces once in
its ``perform_reduce_grad`` (``fully_shard.state(m)`` and the state methods it calls) and
reshards after metadata inference.

Two ranks, two meshes ``(pp, dp)``: ``1 x 2`` (one stage per rank, real reduce-scatters: the
FSDP side of the stage) and ``2 x 1`` (two stages, real sends and receives: the pipeline side,
including an interleaved schedule with two stages per rank).

Oracles: *compatibility* (torch's ``fully_shard`` under the same stage and schedule: losses,
parameter shards and reduce-scatter counts equal, bitwise) and *closed form* (one
reduce-scatter per FSDP group and step, not one per micro-batch).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from tests._dist import WorkerPool
from tests.fsdp._counting import C10dOps
from tests.integration._frameworks import (
    ENGINES,
    assert_same_tensors,
    engine_of,
    local_params,
    no_torch_engine,
    reduce_scatters,
)

STEPS = 3
ROWS = 2  # rows per micro-batch
WIDTHS = (5, 7, 6, 7, 3)  # four blocks, odd widths: padded shards at dp=2
SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


def _blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(WIDTHS)]


def _batch(step: int, dp_rank: int, n_micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    rows = n_micro * ROWS
    return torch.randn(rows, WIDTHS[0], generator=g), torch.randn(rows, WIDTHS[-1], generator=g)


def _run(engine: str, pp_size: int, schedule: str, n_micro: int) -> dict[str, Any]:
    """STEPS schedule steps; losses (last stage), reduce-scatters per step, local shards."""
    mesh = init_device_mesh("cpu", (pp_size, 2 // pp_size), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    blocks = _blocks()
    per_rank = 2 if schedule.startswith("interleaved") else 1
    n_stages = pp_size * per_rank
    per_stage = len(blocks) // n_stages
    # stage i holds blocks [i * per_stage, (i + 1) * per_stage); rank pp holds stages pp, pp + pp_size
    indices = [pp + k * pp_size for k in range(per_rank)]
    stages, submods = [], []
    for i in indices:
        submod = nn.Sequential(*copy.deepcopy(blocks[i * per_stage : (i + 1) * per_stage]))
        for block in submod:
            ENGINES[engine](block, mesh=mesh["dp"])
        ENGINES[engine](submod, mesh=mesh["dp"])
        assert isinstance(submod, TorchFSDPModule), "pipelining needs torch's FSDPModule marker"
        assert engine_of(submod) == engine
        submods.append(submod)
        stages.append(
            PipelineStage(submod, i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        )
    loss_fn = F.mse_loss
    cls = SCHEDULES[schedule]
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=n_micro, loss_fn=loss_fn)
    params = [p for m in submods for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    has_first, has_last = 0 in indices, n_stages - 1 in indices
    out: dict[str, Any] = {"losses": [], "reduce_scatters": []}
    for step in range(STEPS):
        x, y = _batch(step, dp, n_micro)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if has_last:
            kwargs.update(target=y, losses=losses)
        with C10dOps() as ops:
            sched.step(*([x] if has_first else []), **kwargs)
        out["reduce_scatters"].append(reduce_scatters(ops.counts))
        out["losses"].append([loss.item() for loss in losses])
        opt.step()
        opt.zero_grad()
    out["params"] = {
        f"{k}.{n}": t for k, m in enumerate(submods) for n, t in local_params(m).items()
    }
    out["groups"] = sum(1 for m in submods for b in m if any(True for _ in b.parameters()))
    return out


def pipeline_parity(rank: int, world: int, pp_size: int, schedule: str, n_micro: int) -> Any:
    with no_torch_engine():
        ours = _run("shardweave", pp_size, schedule, n_micro)
    theirs = _run("torch", pp_size, schedule, n_micro)
    tag = f"rank {rank} {schedule} pp={pp_size}"
    assert ours["losses"] == theirs["losses"], (tag, ours["losses"], theirs["losses"])
    assert_same_tensors(ours["params"], theirs["params"], tag)
    assert ours["reduce_scatters"] == theirs["reduce_scatters"], (
        tag,
        ours["reduce_scatters"],
        theirs["reduce_scatters"],
    )
    if pp_size == 1:  # dp=2: one reduce-scatter per FSDP group and step, not per micro-batch
        assert ours["reduce_scatters"] == [ours["groups"]] * STEPS, (tag, ours)
    return ours["losses"]


@pytest.mark.parametrize(
    ("pp_size", "schedule", "n_micro"),
    [
        (1, "gpipe", 2),
        (1, "1f1b", 3),
        (2, "gpipe", 2),
        (2, "1f1b", 3),
        (2, "interleaved_1f1b", 4),
    ],
)
def test_pipeline_stage_without_adapter(
    world2: WorkerPool, pp_size: int, schedule: str, n_micro: int
) -> None:
    """Oracles: compatibility (torch's fully_shard, same stage and schedule, bitwise) and closed
    form (one reduce-scatter per group and step)."""
    losses = world2.run(pipeline_parity, pp_size, schedule, n_micro)
    last = losses[-1]
    assert isinstance(last, list) and all(len(step) == n_micro for step in last), losses
