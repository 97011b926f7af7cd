"""One parameter's per-rank layout, from the engine's own rules (``_sharding_rules``).

Every rank holds ``ceil(dim0 / W)`` rows of padded storage; rank 0 holds the most real rows and
trailing ranks may hold none, so rank 0 and the last rank bound every rank: no per-rank loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardweave.fsdp._sharding_rules import (
    grad_made_in,
    padded_shard_size,
    reduce_dtype,
    shard_size,
    unsharded_dtype,
)

__all__ = ["ParamLayout", "grad_made_in", "layout", "reduce_dtype", "unsharded_dtype"]


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
