"""``fit`` against real training: bodies and checks for ``tests/fsdp/world_*/test_plan_fit_real``.

The top configurations ``fit`` keeps, applied with ``apply``, train on real ranks; their
measured peak (``tests/fsdp/_plan_real``: profiler allocation totals in the measured step's
window, after a warm-up step so optimizer state exists) must fit the budget and be within 10%
of the prediction. The budget is 90% of the default configuration's own peak (every block
wrapped and resharded, no checkpointing), so the default does not fit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from shardweave.fsdp.plan import FitConfig, FitResult, apply, fit
from tests._dist import WorkerPool
from tests.fsdp._plan_real import (
    GPT_INPUT,
    _peak_in_window,
    gpt,
    loss_of,
    make_input,
    measured_window,
    memory_profile,
)

DEFAULT = FitConfig("Block", True, False, None, None, 0, False)


def search(world: int, budget: int | None = None) -> FitResult:
    return fit(
        gpt,
        mesh=world,
        sample_input=(GPT_INPUT, torch.long),
        budget=budget or 2**40,
        wrap="Block",
        backend="gloo",
        loss_fn=loss_of("gpt"),
        offload_choices=(False,),
    )


def measure(rank: int, world: int, cfg: dict[str, Any]) -> int:
    with memory_profile() as prof:
        torch.manual_seed(0)
        model = gpt()
        apply(model, FitConfig(**cfg), mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = make_input("gpt", rank)
        loss_fn = loss_of("gpt")
        loss_fn(model(batch), batch).backward()
        opt.step()
        opt.zero_grad()
        with measured_window():
            loss = loss_fn(model(batch), batch)
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad()
    return _peak_in_window(prof)[0]


def check_top(pool: WorkerPool, world: int, top: int) -> None:
    default_peak = next(f for f in search(world).kept if f.config == DEFAULT).peak_bytes
    budget = int(default_peak * 0.9)
    result = search(world, budget)
    assert result.kept, result.advice
    assert DEFAULT not in {f.config for f in result.kept}
    for fitted in result.kept[:top]:
        peaks = pool.run(measure, dataclasses.asdict(fitted.config))
        for rank, measured in enumerate(peaks):
            assert measured <= budget, (fitted.config, rank, measured, budget)
            assert abs(measured - fitted.peak_bytes) <= 0.10 * measured, (
                fitted.config,
                rank,
                measured,
                fitted.peak_bytes,
            )
