"""The engine's dim-0 sharding arithmetic and dtype rules, as closed forms over sizes.

Every rank holds ``ceil(dim0 / W)`` rows of padded storage (``torch.chunk``'s chunk size: the
engine keeps a padded shard, and the flat group buffer, on every rank); rank ``r`` holds
``clamp(dim0 - r * ceil(dim0 / W), 0, ceil(dim0 / W))`` real rows, so rank 0 holds the most and
trailing ranks may hold none. No per-rank loop is ever needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ParamLayout", "layout", "reduce_dtype", "unsharded_dtype"]


@dataclass(frozen=True)
class ParamLayout:
    """One parameter sharded over ``W`` ranks (numels, not bytes)."""

    numel: int  # the whole (gathered) parameter
    padded_shard_numel: int  # per rank, identical on every rank
    rank0_numel: int  # real elements on shard rank 0 (the most any rank holds)
    last_numel: int  # real elements on shard rank W - 1 (the fewest)


def layout(shape: tuple[int, ...], world: int) -> ParamLayout:
    dim0 = shape[0]
    row = math.prod(shape[1:])
    rows = -(-dim0 // world) if dim0 else 0
    last_rows = max(0, min(rows, dim0 - (world - 1) * rows))
    return ParamLayout(dim0 * row, rows * row, min(rows, dim0) * row, last_rows * row)


def unsharded_dtype(orig: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    """The all-gather / compute dtype: ``param_dtype`` applies to floating-point params only."""
    if param_dtype is None or not orig.is_floating_point:
        return orig
    return param_dtype


def reduce_dtype(
    orig: torch.dtype, param_dtype: torch.dtype | None, policy_reduce: torch.dtype | None
) -> torch.dtype:
    """The reduce-scatter dtype: the policy's, unless it equals the policy's ``param_dtype``
    (then the gradients' own dtype, which is the compute dtype)."""
    if policy_reduce is not None and policy_reduce != param_dtype:
        return policy_reduce
    return unsharded_dtype(orig, param_dtype)
