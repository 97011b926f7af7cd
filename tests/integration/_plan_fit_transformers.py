"""``fit`` on transformers models built from configs (a Llama, a Qwen3-MoE, a GPT-2 with tied
embeddings, a BERT with its masked-LM head): the bodies of
``tests/integration/world_{2,4}/test_plan_fit_transformers`` (collected where transformers is
installed: ``nox -s integration``).

Oracle: *measurement* on 2 and 4 ranks: the configurations ``fit`` keeps for a budget of 70% of
the default's peak (every decoder layer wrapped and resharded, no checkpointing), the step
planned being the model's own loss (``labels``, picked because its forward takes them),
applied with ``apply`` and trained with that step; each rank's measured peak
(``tests/fsdp/_plan_real``'s profiler window) fits the budget and is within 10% of the
prediction, and ``apply`` leaves the parameter names of the plain model. On 4 ranks with a
global batch, fit also picks the layout (HSDP 2x2 among the rows measured) and the
microbatch. Eight layers each: ``fit``'s fake steps fold them (``shardweave.fsdp.plan._fold``).
Qwen3-MoE runs transformers' ``batched_mm`` experts: its default ``eager`` experts route with
``nonzero``, a data-dependent shape a fake-tensor step cannot run (``fit`` says so and names
``experts_implementation``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from shardweave.fsdp.plan import FitConfig, FitResult, fit
from shardweave.fsdp.plan._activations import labels_step
from tests._dist import WorkerPool
from tests.fsdp._plan_fit_real import check_fitted, default, measure_step

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


def gpt2() -> nn.Module:
    """GPT-2: its LM head is the token embedding (tied), as transformers builds it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=8, n_head=4, vocab_size=97, n_positions=64)
    return GPT2LMHeadModel(config)


def bert() -> nn.Module:
    """BERT with its masked-LM head (tied to the word embedding), dropout as configured."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=97,
        max_position_embeddings=64,
    )
    return BertForMaskedLM(config)


# name -> (factory, the layer class fit wraps)
MODELS: dict[str, tuple[Any, str]] = {
    "llama": (llama, "LlamaDecoderLayer"),
    "qwen3_moe": (qwen3_moe, "Qwen3MoeDecoderLayer"),
    "gpt2": (gpt2, "GPT2Block"),
    "bert": (bert, "BertLayer"),
}


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 97, SAMPLE, generator=torch.Generator().manual_seed(seed))


def measure(rank: int, world: int, cfg: dict[str, Any], kind: str) -> int:
    return measure_step(rank, FitConfig(**cfg), MODELS[kind][0], _tokens, labels_step)


def _search(world: int, kind: str, global_batch: int | None, target: str, budget: int) -> FitResult:
    factory, layer = MODELS[kind]
    return fit(
        factory,
        mesh=world,
        sample_input=(SAMPLE, torch.long),
        budget=budget,
        wrap=layer,
        target=target,
        global_batch=global_batch,
        accumulation_choices=(1, 2),
        checkpoint_choices=(0, 1),  # every 2nd block too is checked on the project's models
    )


def check_top(
    pool: WorkerPool,
    kind: str,
    top: int,
    global_batch: int | None = None,
    target: str = "cpu/gloo",
) -> FitResult:
    world = pool.world_size
    stated: dict[str, Any] = {"target": target}
    if global_batch:
        stated |= {"local_batch": global_batch // world, "grad_accumulation": 1}
    result = check_fitted(
        pool,
        functools.partial(_search, world, kind, global_batch, target),
        dataclasses.replace(default("gpt", world, **stated), wrap=MODELS[kind][1]),
        measure,
        kind,
        top,
        fraction=0.7,
    )
    assert result.step.startswith("labels") and result.folded
    return result
