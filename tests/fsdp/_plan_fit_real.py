"""``fit`` against real training: bodies and checks for ``tests/fsdp/world_*/test_plan_fit_real``.

The top configurations ``fit`` keeps for a model (the test GPT, the demo's GPT, or an MLP
stack of residual blocks), applied with ``apply``, train on real ranks; their measured peak
(``tests/fsdp/_plan_real``: live bytes from the profiler's allocation events in the measured
step's window, after a warm-up step so optimizer state exists) must fit the budget and be
within 10% of the prediction. The budget is 90% of the default configuration's own peak (every block
wrapped and resharded, no checkpointing), so the default does not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardweave.fsdp.comm._streams import use_device_module
from shardweave.fsdp.plan import FitConfig, FitResult, PlanError, apply, fit
from shardweave.fsdp.plan._activations import resolve_step
from tests._dist import WorkerPool
from tests.fsdp._plan_real import (
    GPT_INPUT,
    MLP_INPUT,
    _peak_in_window,
    gpt,
    loss_of,
    make_input,
    measured_window,
    memory_profile,
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


def default(kind: str, world: int = 2, **stated: Any) -> FitConfig:
    """Every block wrapped and resharded, no checkpointing: the configuration the budget rules
    out (``stated``: its target, microbatch)."""
    cfg = FitConfig(MODELS[kind][1], True, False, None, None, 0, False, mesh=(world,))
    return dataclasses.replace(cfg, **{"target": "cpu/gloo", **stated})


def search(
    world: int,
    kind: str,
    budget: int | None = None,
    global_batch: int | None = None,
    target: str = "cpu/gloo",
) -> FitResult:
    factory, wrap, sample, _, loss_fn = MODELS[kind]
    return fit(
        factory,
        mesh=world,
        sample_input=sample,
        budget=budget or 2**40,
        wrap=wrap,
        target=target,
        loss_fn=loss_fn,
        global_batch=global_batch,
        accumulation_choices=(1, 2),
    )


def microbatch_inputs(cfg: FitConfig, rank: int, make: Callable[[int], Any]) -> list[Any]:
    """This rank's inputs for one optimizer step: ``grad_accumulation`` microbatches of
    ``local_batch`` samples each (the whole sample input when fit chose no microbatch), each
    its own storage."""
    out = []
    for i in range(cfg.grad_accumulation):
        full = make(1000 * rank + i)
        out.append(full[: cfg.local_batch].clone() if cfg.local_batch else full)
    return out


def accumulate(model: nn.Module, cfg: FitConfig, batches: list[Any], step: Any) -> None:
    """One optimizer step's forwards and backwards, as ``FitConfig.how_to_run`` says: every
    microbatch reduce-scattered, the HSDP all-reduce on the last only."""
    hsdp = len(cfg.mesh) == 2
    for i, micro in enumerate(batches):
        if hsdp and cfg.grad_accumulation > 1:
            model.set_requires_all_reduce(i == len(batches) - 1)  # type: ignore[operator]
        loss = step(model, micro)
        loss.backward()
        del loss


def measure_step(
    rank: int, cfg: FitConfig, build: Callable[[], nn.Module], make: Callable[[int], Any], step: Any
) -> int:
    """The measured peak of one optimizer step's forwards and backwards (after a warm-up step,
    so optimizer state exists), ``cfg`` applied by ``apply`` (which builds its mesh); on the
    test accelerator where ``cfg`` is planned for an accelerator."""
    branches = (
        use_device_module(torch.cpu, stream_ordered=True)
        if cfg.target != "cpu/gloo"
        else contextlib.nullcontext()
    )
    with memory_profile() as prof, branches:
        torch.manual_seed(0)
        model = build()
        names = [n for n, _ in model.named_parameters()]
        apply(model, cfg)
        assert [n for n, _ in model.named_parameters()] == names
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        accumulate(model, cfg, microbatch_inputs(cfg, rank, make), step)
        opt.step()
        opt.zero_grad()
        batches = microbatch_inputs(cfg, rank, make)
        with measured_window():
            accumulate(model, cfg, batches, step)
        host = host_storages(model, opt) if cfg.offload else frozenset()
        opt.step()
        opt.zero_grad()
    return _peak_in_window(prof, host)[0]


def host_storages(model: nn.Module, opt: torch.optim.Optimizer) -> frozenset[int]:
    """Where CPU offload keeps the sharded parameters, gradients and optimizer state: host
    memory, which the test accelerator's "device" (the CPU too) would otherwise count."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    found = set()
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        found.add(local.untyped_storage().data_ptr())
    return frozenset(found)


def measure(rank: int, world: int, cfg: dict[str, Any], kind: str) -> int:
    _, _, _, input_kind, loss_fn = MODELS[kind]
    step = resolve_step(None, loss_fn, None).run
    return measure_step(
        rank,
        FitConfig(**cfg),
        MODELS[kind][0],
        functools.partial(make_input, input_kind),
        step,
    )


def check_top(
    pool: WorkerPool,
    world: int,
    top: int,
    kind: str = "gpt",
    global_batch: int | None = None,
    target: str = "cpu/gloo",
    fraction: float = 0.9,
) -> FitResult:
    per_rank = (global_batch // world) if global_batch else 0
    stated = {"target": target}
    if global_batch:
        stated |= {"local_batch": per_rank, "grad_accumulation": 1}
    return check_fitted(
        pool,
        functools.partial(search, world, kind, global_batch=global_batch, target=target),
        default(kind, world, **stated),
        measure,
        kind,
        top,
        fraction,
    )


def _picked(result: FitResult, top: int) -> list[FitConfig]:
    """The ``top`` fastest kept rows, then, where layouts and microbatches were searched, the
    fastest HSDP row (a shard group of more than one rank) and the fastest accumulating one."""
    rows = [f.config for f in result.kept]
    picked = rows[:top]
    if result.global_batch is not None:
        for wanted in (
            lambda c: len(c.mesh) == 2 and c.mesh[1] > 1,
            lambda c: c.grad_accumulation > 1,
        ):
            if not any(wanted(c) for c in picked):
                picked += [c for c in rows if wanted(c)][:1]
    return picked


def check_fitted(
    pool: WorkerPool,
    search_for: Callable[[int], FitResult],
    default_config: FitConfig,
    measure_fn: Callable[..., int],
    kind: str,
    top: int,
    fraction: float = 0.9,
) -> FitResult:
    """The check of every fit real-run test: the budget is ``fraction`` of ``default_config``'s
    peak; the configurations ``_picked`` from those kept for it, each measured by
    ``measure_fn(rank, world, cfg, kind)`` on ``pool``, fit it and are within 10% of their
    predictions. Returns the search for the budget."""
    everything = search_for(2**40)
    default_row = next(f for f in everything.kept if default_config in (f.config, *f.alternatives))
    budget = int(default_row.peak_bytes * fraction)
    result = search_for(budget)
    assert result.kept, result.advice
    assert default_config not in {c for f in result.kept for c in (f.config, *f.alternatives)}
    peaks = {f.config: f.peak_bytes for f in result.kept}
    for cfg in _picked(result, top):
        measured_peaks = pool.run(measure_fn, dataclasses.asdict(cfg), kind)
        for rank, measured in enumerate(measured_peaks):
            assert measured <= budget, (kind, cfg, rank, measured, budget)
            assert abs(measured - peaks[cfg]) <= 0.10 * measured, (
                kind,
                cfg,
                rank,
                measured,
                peaks[cfg],
            )
    return result


def apply_on_its_target(rank: int, world: int) -> None:
    """A configuration planned for cuda/nccl, applied on this cpu/gloo mesh: a PlanError
    naming both. One planned for cuda/gloo with CPU offload, on the test accelerator (the
    engine's accelerator branches over CPU tensors, gloo): applied (no pinned memory, which
    needs a runtime) and trained."""
    mesh = init_device_mesh("cpu", (world,))
    cfg = default("mlp")
    with pytest.raises(PlanError, match=r"planned for cuda/nccl, and is applied on cpu/gloo"):
        apply(mlp_blocks(), dataclasses.replace(cfg, target="cuda/nccl"), mesh=mesh)
    with pytest.raises(PlanError, match=r"planned for 4 ranks \(mesh 2x2\), and the world has 2"):
        apply(mlp_blocks(), dataclasses.replace(cfg, mesh=(2, 2)))
    with pytest.raises(PlanError, match=r"planned for a 2x2 mesh, and the mesh given is 2"):
        apply(mlp_blocks(), dataclasses.replace(cfg, mesh=(2, 2)), mesh=mesh)
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
