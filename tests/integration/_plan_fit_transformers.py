"""``fit`` on transformers models built from configs, a Llama and a Qwen3-MoE: the bodies of
``tests/integration/world_{2,4}/test_plan_fit_transformers`` (collected where transformers is
installed: ``nox -s integration``).

Oracle: *measurement* on 2 and 4 ranks: the top three (2 ranks) or the best (4 ranks)
configurations for a budget below the default's peak (every decoder layer wrapped and
resharded, no checkpointing), applied with ``apply``, train; each rank's measured peak
(``tests/fsdp/_plan_real``'s profiler window) fits the budget and is within 10% of the
prediction, and ``apply`` leaves the parameter names of the plain model. Eight decoder
layers each: ``fit``'s fake steps fold them (``shardweave.fsdp.plan._fold``), which the
measurement then checks on transformers' own layers. Qwen3-MoE runs transformers' ``batched_mm`` experts: its default ``eager`` experts
route with ``nonzero``, a data-dependent shape a fake-tensor step cannot run (``fit`` says so
and names ``experts_implementation``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardweave.fsdp.plan import FitConfig, apply, fit
from tests._dist import WorkerPool
from tests.fsdp._plan_fit_real import check_fitted
from tests.fsdp._plan_real import _peak_in_window, memory_profile, warm_then_measure

SAMPLE = (8, 32)


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


def qwen3_moe() -> nn.Module:
    """Qwen3-MoE with transformers' ``batched_mm`` experts: its shapes do not depend on the
    routing (the default ``eager`` experts loop over ``nonzero``, which a fake step cannot
    run; ``fit`` says so and names this switch)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=97,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        experts_implementation="batched_mm",
    )
    return AutoModelForCausalLM.from_config(config)


# name -> (factory, the decoder layer class fit wraps)
MODELS: dict[str, tuple[Any, str]] = {
    "llama": (llama, "LlamaDecoderLayer"),
    "qwen3_moe": (qwen3_moe, "Qwen3MoeDecoderLayer"),
}


def _loss(out: Any, inp: Any) -> torch.Tensor:
    return out.logits.float().pow(2).mean()


def _measure(rank: int, world: int, cfg: dict[str, Any], kind: str) -> int:
    with memory_profile() as prof:
        torch.manual_seed(0)
        model = MODELS[kind][0]()
        names = [n for n, _ in model.named_parameters()]
        apply(model, FitConfig(**cfg), mesh=init_device_mesh("cpu", (world,)))
        assert [n for n, _ in model.named_parameters()] == names
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = torch.randint(0, 97, SAMPLE, generator=torch.Generator().manual_seed(rank))
        warm_then_measure(model, opt, batch, _loss)
    return _peak_in_window(prof)[0]


def _search(world: int, kind: str, budget: int) -> Any:
    factory, layer = MODELS[kind]
    return fit(
        factory,
        mesh=world,
        sample_input=(SAMPLE, torch.long),
        budget=budget,
        wrap=layer,
        backend="gloo",
        loss_fn=_loss,
        offload_choices=(False,),
    )


def check_top(pool: WorkerPool, kind: str, top: int) -> None:
    world = pool.world_size
    default = FitConfig(
        MODELS[kind][1], True, False, None, None, 0, False, target="cpu/gloo", mesh=(world,)
    )
    everything = check_fitted(
        pool, functools.partial(_search, world, kind), default, _measure, kind, top
    )
    assert everything.folded and len(everything.folded) == everything.fake_steps
