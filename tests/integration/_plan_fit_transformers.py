"""``fit`` on a transformers Llama built from a config: the bodies of
``tests/integration/world_{2,4}/test_plan_fit_transformers`` (collected where transformers is
installed: ``nox -s integration``).

Oracle: *measurement* on 2 and 4 ranks: the best configuration for a budget below the default's
peak (every decoder layer wrapped and resharded, no checkpointing), applied with ``apply``,
trains; each rank's measured peak (``tests/fsdp/_plan_real``'s profiler window) fits the budget
and is within 10% of the prediction, and ``apply`` leaves the parameter names of the plain
model. Eight decoder layers: ``fit``'s fake steps fold them (``shardweave.fsdp.plan._fold``),
which the measurement then checks on transformers' own layers. Not covered: Qwen3-MoE (its routing, ``nonzero``, has a data-dependent shape that a
fake-tensor step cannot run; ``fit`` says so as a ``PlanError``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardweave.fsdp.plan import FitConfig, apply, fit
from tests._dist import WorkerPool
from tests.fsdp._plan_real import _peak_in_window, measured_window, memory_profile

SAMPLE = (8, 32)
LAYER = "LlamaDecoderLayer"


def llama() -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


def _loss(out: Any, inp: Any) -> torch.Tensor:
    return out.logits.float().pow(2).mean()


def _measure(rank: int, world: int, cfg: dict[str, Any]) -> tuple[int, list[str]]:
    with memory_profile() as prof:
        torch.manual_seed(0)
        model = llama()
        names = [n for n, _ in model.named_parameters()]
        apply(model, FitConfig(**cfg), mesh=init_device_mesh("cpu", (world,)))
        assert [n for n, _ in model.named_parameters()] == names
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = torch.randint(0, 97, SAMPLE, generator=torch.Generator().manual_seed(rank))
        _loss(model(batch), batch).backward()
        opt.step()
        opt.zero_grad()
        with measured_window():
            loss = _loss(model(batch), batch)
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad()
    return _peak_in_window(prof)[0], names


def _search(world: int, budget: int) -> Any:
    return fit(
        llama,
        mesh=world,
        sample_input=(SAMPLE, torch.long),
        budget=budget,
        wrap=LAYER,
        backend="gloo",
        loss_fn=_loss,
        offload_choices=(False,),
    )


def check_best(pool: WorkerPool) -> None:
    world = pool.world_size
    default = FitConfig(LAYER, True, False, None, None, 0, False)
    everything = _search(world, 2**40)
    assert everything.folded and len(everything.folded) == everything.fake_steps
    budget = int(next(f for f in everything.kept if f.config == default).peak_bytes * 0.9)
    result = _search(world, budget)
    assert result.kept and default not in {f.config for f in result.kept}, result.advice
    best = result.kept[0]
    for rank, (measured, _) in enumerate(pool.run(_measure, dataclasses.asdict(best.config))):
        assert measured <= budget, (best.config, rank, measured, budget)
        assert abs(measured - best.peak_bytes) <= 0.10 * measured, (
            best.config,
            rank,
            measured,
            best.peak_bytes,
        )
