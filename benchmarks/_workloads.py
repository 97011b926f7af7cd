"""Workloads (models, batches, losses, optimizers) and the theoretical minimum traffic."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import torch
from _engines import FSDP_IMPLS, REPLICATE_IMPLS, load_engine  # puts demos/ on sys.path
from model import GPT, GPTConfig
from torch import nn


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    # Modules to fully_shard, in order (children before the root, which comes last).
    shard_units: Callable[[nn.Module], list[nn.Module]]
    # Called with the parameters and the optimizer keywords of the run (``--foreach``).
    make_optimizer: Callable[..., torch.optim.Optimizer]
    make_batch: Callable[[int], tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    # Implementation name -> engine (see ``load_engine``); the first is the one under test,
    # the others are the baselines its median step time is divided by.
    impls: dict[str, str] = field(default_factory=lambda: dict(FSDP_IMPLS))
    # Timed steps per implementation when ``--steps`` is not given (the whole default run
    # takes about 3 minutes on 2 cores).
    default_steps: int = 100
    # "fsdp": fully_shard every unit; "replicate": replicate every unit (``ddp``: wrap the root).
    mode: str = "fsdp"

    @property
    def baselines(self) -> list[str]:
        return [impl for impl in self.impls if impl != "shardweave"]

    def wrap(self, engine: str, model: nn.Module) -> nn.Module:
        apply = load_engine(engine)
        if engine == "ddp":
            return apply(model)  # type: ignore[no-any-return]
        for unit in self.shard_units(model):
            apply(unit)
        return model


MLP_LAYERS: Final = 48


def _mlp() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(MLP_LAYERS)))


def _mlp_batch(rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)


def _mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out: torch.Tensor = model(batch[0])
    return (out - batch[1]).square().mean()


GPT_CONFIG: Final = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _gpt_batch(rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(2000 + rank)
    tokens = torch.randint(GPT_CONFIG.vocab_size, (8, GPT_CONFIG.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    _, loss = model(batch[0], batch[1])
    assert loss is not None
    return loss  # type: ignore[no-any-return]


def _gpt_units(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, GPT)
    return [*model.blocks, model]


_GPT_NAME: Final = (
    f"GPT {GPT_CONFIG.n_layer} blocks, n_embd {GPT_CONFIG.n_embd}, vocab {GPT_CONFIG.vocab_size}"
)
_GPT_STEP: Final = f"AdamW; batch 8x{GPT_CONFIG.block_size} tokens"

# The demo's GPT under fully_shard; the replicate workload below trains the same model.
_GPT: Final = Workload(
    name="gpt",
    description=f"{_GPT_NAME}: per-block fully_shard + root; {_GPT_STEP}",
    build=lambda: GPT(GPT_CONFIG),
    shard_units=_gpt_units,
    make_optimizer=lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, **kw),
    make_batch=_gpt_batch,
    loss=_gpt_loss,
)

WORKLOADS: Final = (
    Workload(
        name=f"mlp{MLP_LAYERS}",
        description=(
            f"{MLP_LAYERS} x (Linear(64,64)+ReLU), each fully_shard-ed + root; SGD; batch 32x64"
        ),
        build=_mlp,
        shard_units=lambda m: [*m.children(), m],
        make_optimizer=lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, **kw),
        make_batch=_mlp_batch,
        loss=_mlp_loss,
    ),
    _GPT,
    dataclasses.replace(
        _GPT,
        name="replicate",
        description=(
            f"{_GPT_NAME}: per-block replicate + root (ddp: DistributedDataParallel on the plain"
            f" model); {_GPT_STEP}"
        ),
        impls=dict(REPLICATE_IMPLS),
        default_steps=60,
        mode="replicate",
    ),
)


def theoretical_min(model: nn.Module, units: list[nn.Module], world_size: int) -> dict[str, int]:
    """Bytes per training step that the sharding layout cannot avoid.

    Every group is all-gathered once in forward; groups that reshard after forward (all but
    the root, whose ``reshard_after_forward=None`` keeps it unsharded) are all-gathered again
    in backward; every group's gradients are reduce-scattered once. ``*_padded`` adds FSDP's
    padding of each parameter's dim 0 to a multiple of the world size.
    """
    claimed: set[nn.Parameter] = set()
    fwd = bwd = rs = fwd_pad = bwd_pad = rs_pad = groups_with_params = 0
    for unit in units:  # children first, so the root is left with what no child claimed
        params = [p for p in unit.parameters() if p not in claimed]
        claimed.update(params)
        groups_with_params += bool(params)
        full = sum(p.nbytes for p in params)
        padded = sum(
            math.ceil(p.shape[0] / world_size) * world_size * p[0].nbytes if p.dim() else p.nbytes
            for p in params
        )
        grad_full = sum(p.nbytes for p in params if p.requires_grad)
        grad_padded = sum(
            math.ceil(p.shape[0] / world_size) * world_size * p[0].nbytes if p.dim() else p.nbytes
            for p in params
            if p.requires_grad
        )
        is_root = unit is model
        fwd, fwd_pad = fwd + full, fwd_pad + padded
        if not is_root:
            bwd, bwd_pad = bwd + full, bwd_pad + padded
        rs, rs_pad = rs + grad_full, rs_pad + grad_padded
    return {
        "all_gather_bytes": fwd + bwd,
        "all_gather_bytes_padded": fwd_pad + bwd_pad,
        "reduce_scatter_bytes": rs,
        "reduce_scatter_bytes_padded": rs_pad,
        "all_reduce_bytes": 0,
        "groups": len(units),
        "groups_with_own_params": groups_with_params,
    }


def theoretical_min_replicate(model: nn.Module, units: list[nn.Module]) -> dict[str, int]:
    """Bytes per training step data parallelism cannot avoid: every gradient all-reduced once
    (the parameters are already whole on every rank, so nothing is gathered)."""
    claimed: set[nn.Parameter] = set()
    grads = groups_with_params = 0
    for unit in units:
        params = [p for p in unit.parameters() if p not in claimed]
        claimed.update(params)
        groups_with_params += bool(params)
        grads += sum(p.nbytes for p in params if p.requires_grad)
    return {
        "all_gather_bytes": 0,
        "all_gather_bytes_padded": 0,
        "reduce_scatter_bytes": 0,
        "reduce_scatter_bytes_padded": 0,
        "all_reduce_bytes": grads,
        "groups": len(units),
        "groups_with_own_params": groups_with_params,
    }
