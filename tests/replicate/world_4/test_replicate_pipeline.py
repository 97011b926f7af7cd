"""``torch.distributed.pipelining`` over ``replicate``d stages: 2 pipeline stages x 2-way data
parallelism, the plain ``PipelineStage`` (no adapter).

torch's stage recognizes our module through ``isinstance(submod, torch's FSDPModule)``; as our
modules are not torch's own ``ReplicateModule``, it reads the state with torch's
``fully_shard.state(submod)``, which answers with our replicate state (see _torch_interop).

Oracle: *compatibility* (torch's ``replicate`` under the same stage and schedule: bitwise losses,
parameters and gradients over 3 AdamW steps, and the same c10d ops per step).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from shardweave.replicate import replicate
from tests._dist import WorkerPool
from tests.fsdp._counting import C10dOps
from tests.fsdp._oracle import assert_same_as_torch

N_MICRO = 2
STEPS = 3
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def replicate_pipeline(rank: int, world: int, schedule: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6)), nn.Linear(6, 3)]
    scheds, models, opts = {}, {}, {}
    for name, apply in {"ours": replicate, "torch": torch_replicate}.items():
        model = copy.deepcopy(stages[pp])
        apply(model, mesh=mesh["dp"])
        stage = PipelineStage(model, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        scheds[name] = SCHEDULES[schedule](stage, n_microbatches=N_MICRO, loss_fn=F.mse_loss)
        models[name] = model
        opts[name] = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dp)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        losses: dict[str, list[torch.Tensor]] = {}
        ops = {}
        for name, sched in scheds.items():
            losses[name] = []
            with C10dOps() as counter:
                if pp == 0:
                    sched.step(x)
                else:
                    sched.step(target=y, losses=losses[name])
            ops[name] = counter.counts
        tag = f"{schedule} step {step} rank {rank}"
        if step > 0:  # the first step also runs the stage's shape inference
            assert ops["ours"] == ops["torch"], f"{tag}: {ops}"
            assert ops["ours"]["c10d.allreduce_.default"] == 1, (
                f"{tag}: one all-reduce per step, {ops}"
            )
        assert [t.item() for t in losses["ours"]] == [t.item() for t in losses["torch"]], tag
        assert_same_as_torch(models["ours"], models["torch"], tag)
        for opt in opts.values():
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_replicate_pipeline_parity(world4: WorkerPool, schedule: str) -> None:
    """Compatibility with torch's replicate under the plain PipelineStage (see module doc)."""
    world4.run(replicate_pipeline, schedule)
