"""``fit`` against real training on 2 ranks: the top three configurations, applied with
``apply``, train, and their measured peak fits the budget and is within 10% of the prediction.

Oracle: *measurement* (``tests/fsdp/_plan_real``: profiler allocation totals in the measured
step's window, after a warm-up step so optimizer state exists). The budget is chosen below the
default configuration's own peak (every block wrapped, resharded, no checkpointing), so the
default does not fit and ``fit`` must find what does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

from shardweave.fsdp.plan import FitConfig, apply, fit
from tests._dist import WorkerPool
from tests.fsdp._plan_real import GPT_INPUT, WINDOW, _peak_in_window, gpt, loss_of, make_input

DEFAULT = FitConfig("Block", True, False, None, None, 0, False)


def _search(budget: int | None = None) -> Any:
    return fit(
        gpt,
        mesh=2,
        sample_input=(GPT_INPUT, torch.long),
        budget=budget or 2**40,
        wrap="Block",
        backend="gloo",
        loss_fn=loss_of("gpt"),
        offload_choices=(False,),
    )


def _measure(rank: int, world: int, cfg: dict[str, Any]) -> int:
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with prof:
        torch.manual_seed(0)
        model = gpt()
        apply(model, FitConfig(**cfg), mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = make_input("gpt", rank)
        loss_fn = loss_of("gpt")
        loss_fn(model(batch), batch).backward()
        opt.step()
        opt.zero_grad()
        with record_function(WINDOW):
            loss = loss_fn(model(batch), batch)
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad()
    return _peak_in_window(prof)[0]


def test_fit_top3_train_within_budget(world2: WorkerPool) -> None:
    default_peak = next(f for f in _search().kept if f.config == DEFAULT).peak_bytes
    budget = int(default_peak * 0.9)
    result = _search(budget)
    assert result.kept, result.advice
    assert DEFAULT not in {f.config for f in result.kept}
    for fitted in result.kept[:3]:
        peaks = world2.run(_measure, dataclasses.asdict(fitted.config))
        for rank, measured in enumerate(peaks):
            assert measured <= budget, (fitted.config, rank, measured, budget)
            assert abs(measured - fitted.peak_bytes) <= 0.10 * measured, (
                fitted.config,
                rank,
                measured,
                fitted.peak_bytes,
            )
