"""``fit`` against real training: bodies and checks for ``tests/fsdp/world_*/test_plan_fit_real``.

The top configurations ``fit`` keeps for a model (the test GPT, the demo's GPT, or an MLP
stack of residual blocks), applied with ``apply``, train on real ranks; their measured peak
(``tests/fsdp/_plan_real``: live bytes from the profiler's allocation events in the measured
step's window, after a warm-up step so optimizer state exists) must fit the budget and be
within 10% of the prediction. The budget is 90% of the default configuration's own peak (every block
wrapped and resharded, no checkpointing), so the default does not fit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardweave.fsdp._fsdp_streams import use_device_module
from shardweave.fsdp.plan import FitConfig, FitResult, PlanError, apply, fit
from tests._dist import WorkerPool
from tests.fsdp._plan_real import (
    GPT_INPUT,
    MLP_INPUT,
    _peak_in_window,
    gpt,
    loss_of,
    make_input,
    memory_profile,
    warm_then_measure,
)


class MLPBlock(nn.Module):
    """A residual two-layer MLP block: what checkpointing saves is its 4x-wide hidden layer."""

    def __init__(self, dim: int = MLP_INPUT[1], hidden: int = 4 * MLP_INPUT[1] + 3) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def mlp_blocks() -> nn.Sequential:
    """An MLP stack: four blocks and a head (odd widths: padded shards at 2 and 4 ranks)."""
    return nn.Sequential(*(MLPBlock() for _ in range(4)), nn.Linear(MLP_INPUT[1], 3))


def demo_gpt() -> nn.Module:
    """The demo's GPT (``demos/model.py``, what ``demos/train_gpt.py`` trains), small."""
    from demos.model import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=67, block_size=GPT_INPUT[1], n_layer=4, n_head=4, n_embd=32))


def _demo_loss(out: Any, inp: torch.Tensor) -> torch.Tensor:
    return loss_of("gpt")(out[0], inp)  # GPT.forward returns (logits, loss or None)


# Per model: its factory, the class fit wraps, the sample input, the input and loss (every
# block wrapped and resharded, no checkpointing, is the default configuration the budget rules
# out).
MODELS: dict[str, tuple[Any, str, tuple[tuple[int, ...], torch.dtype], str, Any]] = {
    "gpt": (gpt, "Block", (GPT_INPUT, torch.long), "gpt", loss_of("gpt")),
    "demo_gpt": (demo_gpt, "Block", (GPT_INPUT, torch.long), "gpt", _demo_loss),
    "mlp": (mlp_blocks, "MLPBlock", (MLP_INPUT, torch.float32), "mlp", loss_of("mlp")),
}


def default(kind: str, world: int = 2) -> FitConfig:
    return FitConfig(
        MODELS[kind][1], True, False, None, None, 0, False, target="cpu/gloo", mesh=(world,)
    )


def search(world: int, kind: str, budget: int | None = None) -> FitResult:
    factory, wrap, sample, _, loss_fn = MODELS[kind]
    return fit(
        factory,
        mesh=world,
        sample_input=sample,
        budget=budget or 2**40,
        wrap=wrap,
        backend="gloo",
        loss_fn=loss_fn,
        offload_choices=(False,),
    )


def measure(rank: int, world: int, cfg: dict[str, Any], kind: str) -> int:
    with memory_profile() as prof:
        torch.manual_seed(0)
        model = MODELS[kind][0]()
        apply(model, FitConfig(**cfg), mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _, _, _, input_kind, loss_fn = MODELS[kind]
        warm_then_measure(model, opt, make_input(input_kind, rank), loss_fn)
    return _peak_in_window(prof)[0]


def check_top(pool: WorkerPool, world: int, top: int, kind: str = "gpt") -> None:
    check_fitted(
        pool, functools.partial(search, world, kind), default(kind, world), measure, kind, top
    )


def check_fitted(
    pool: WorkerPool,
    search_for: Callable[[int], FitResult],
    default_config: FitConfig,
    measure_fn: Callable[..., int],
    kind: str,
    top: int,
) -> FitResult:
    """The check of every fit real-run test: the budget is 90% of ``default_config``'s peak;
    the ``top`` configurations kept for it, each measured by ``measure_fn(rank, world, cfg,
    kind)`` on ``pool``, fit it and are within 10% of their predictions. Returns the
    unconstrained search."""
    everything = search_for(2**40)
    default_row = next(f for f in everything.kept if default_config in (f.config, *f.alternatives))
    budget = int(default_row.peak_bytes * 0.9)
    result = search_for(budget)
    assert result.kept, result.advice
    assert default_config not in {c for f in result.kept for c in (f.config, *f.alternatives)}
    for fitted in result.kept[:top]:
        peaks = pool.run(measure_fn, dataclasses.asdict(fitted.config), kind)
        for rank, measured in enumerate(peaks):
            assert measured <= budget, (kind, fitted.config, rank, measured, budget)
            assert abs(measured - fitted.peak_bytes) <= 0.10 * measured, (
                kind,
                fitted.config,
                rank,
                measured,
                fitted.peak_bytes,
            )
    return everything


def apply_on_its_target(rank: int, world: int) -> None:
    """A configuration planned for cuda/nccl, applied on this cpu/gloo mesh: a PlanError
    naming both. One planned for cuda/gloo with CPU offload, on the test accelerator (the
    engine's accelerator branches over CPU tensors, gloo): applied (no pinned memory, which
    needs a runtime) and trained."""
    mesh = init_device_mesh("cpu", (world,))
    cfg = default("mlp")
    with pytest.raises(PlanError, match=r"planned for cuda/nccl, and is applied on cpu/gloo"):
        apply(mlp_blocks(), dataclasses.replace(cfg, target="cuda/nccl"), mesh=mesh)
    with (
        pytest.raises(PlanError, match=r"planned for cpu/gloo, and is applied on cpu/gloo \(the"),
        use_device_module(torch.cpu, stream_ordered=True),
    ):
        apply(mlp_blocks(), cfg, mesh=mesh)
    with use_device_module(torch.cpu, stream_ordered=True):
        model = mlp_blocks()
        apply(model, dataclasses.replace(cfg, target="cuda/gloo", offload=True), mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = make_input("mlp", rank)
        loss_of("mlp")(model(batch), batch).backward()
        opt.step()
