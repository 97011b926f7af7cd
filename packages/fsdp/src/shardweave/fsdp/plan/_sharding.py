"""One parameter's per-rank layout, from the engine's own rules (``_sharding_rules``).

Every rank holds ``ceil(dim0 / W)`` rows of padded storage; rank 0 holds the most real rows and
trailing ranks may hold none, so rank 0 and the last rank bound every rank: no per-rank loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardweave.fsdp._sharding_rules import (
    padded_shard_size,
    reduce_dtype,
    shard_size,
    unsharded_dtype,
)
from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE

__all__ = ["ParamLayout", "grad_made_in", "layout", "reduce_dtype", "unsharded_dtype"]


def grad_made_in(
    orig: torch.dtype,
    compute: torch.dtype,
    reduce: torch.dtype | None,
    explicit: torch.dtype | None = None,
) -> torch.dtype:
    """The dtype autograd makes an unsharded gradient in, with gradient sync
    (``FSDPParam.set_unsharded_grad_dtype``): from torch 2.15 the dtype it is reduced or kept
    in (the policy's ``reduce_dtype``, else an explicit ``grad_dtype``, else the parameter's)
    where that is not wider than the compute dtype; else, and before 2.15, the compute dtype."""
    if not REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE or not orig.is_floating_point:
        return compute
    target = reduce or explicit or orig
    return target if target.itemsize <= compute.itemsize else compute


@dataclass(frozen=True)
class ParamLayout:
    """One parameter sharded over ``W`` ranks (numels, not bytes)."""

    numel: int  # the whole (gathered) parameter
    padded_shard_numel: int  # per rank, identical on every rank
    rank0_numel: int  # real elements on shard rank 0 (the most any rank holds)
    last_numel: int  # real elements on shard rank W - 1 (the fewest)


def layout(shape: tuple[int, ...], world: int, dim: int = 0) -> ParamLayout:
    return ParamLayout(
        math.prod(shape),
        math.prod(padded_shard_size(shape, world, dim)),
        math.prod(shard_size(shape, world, 0, dim)),
        math.prod(shard_size(shape, world, world - 1, dim)),
    )
