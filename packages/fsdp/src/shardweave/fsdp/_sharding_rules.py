"""The sharding and dtype rules as closed forms over sizes: one source for the engine
(``FSDPParam``) and the planner (``plan``), so a prediction cannot drift from what is done.

Padding: a parameter is cut along its shard dim as ``torch.chunk`` cuts it, ``ceil(n / W)``
rows per chunk, so rank ``r`` holds ``clamp(n - r * ceil(n / W), 0, ceil(n / W))`` real rows and
every rank keeps a padded shard of ``ceil(n / W)`` rows (chunk 0, always the largest).

Dtypes: a ``param_dtype`` applies to floating-point parameters only and is dropped when it
equals the parameter's own dtype; a ``reduce_dtype`` equal to the policy's ``param_dtype`` is
dropped too (the gradient already arrives in it). With no ``reduce_dtype``, torch 2.15 reduces
(and accumulates) in the parameter's own dtype (``REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE``), earlier
releases in the dtype the gradient arrives in; a group whose parameters end up with different
reduce dtypes (only ``param_dtype_override_fn`` does that) reduces once, in their promoted dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE

__all__ = [
    "chunk_rows",
    "grad_made_in",
    "group_reduce_dtype",
    "padded_shard_size",
    "reduce_dtype",
    "resolve_dtypes",
    "shard_size",
    "unsharded_dtype",
]


def chunk_rows(n: int, world: int) -> int:
    """Rows per chunk when ``n`` rows are cut into ``world`` chunks (``torch.chunk``'s size)."""
    return -(-n // world) if n else 0


def padded_shard_size(size: Sequence[int], world: int, dim: int = 0) -> torch.Size:
    """The padded shard every rank holds (chunk 0's size)."""
    return torch.Size([*size[:dim], chunk_rows(size[dim], world), *size[dim + 1 :]])


def shard_size(size: Sequence[int], world: int, rank: int, dim: int = 0) -> torch.Size:
    """Rank ``rank``'s real (unpadded) shard; the other dims are kept when it is empty."""
    rows = chunk_rows(size[dim], world)
    real = max(0, min(rows, size[dim] - rank * rows))
    return torch.Size([*size[:dim], real, *size[dim + 1 :]])


def resolve_dtypes(
    orig: torch.dtype, param_dtype: torch.dtype | None, reduce: torch.dtype | None
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The ``(param_dtype, reduce_dtype)`` a parameter really uses; ``None`` means "its own"
    (the original dtype for the all-gather, the gradient's dtype for the reduction)."""
    if reduce is None and REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE and orig.is_floating_point:
        reduce = orig  # torch 2.15: the gradient's own dtype policy, not the compute dtype
    if reduce == param_dtype:
        reduce = None  # the gradient already arrives in that dtype
    if param_dtype == orig or not orig.is_floating_point:
        param_dtype = None
    return param_dtype, reduce


def unsharded_dtype(orig: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    """The all-gather and compute dtype."""
    return resolve_dtypes(orig, param_dtype, None)[0] or orig


def reduce_dtype(
    orig: torch.dtype, param_dtype: torch.dtype | None, policy_reduce: torch.dtype | None
) -> torch.dtype:
    """The reduce-scatter dtype (the gradients arrive in the unsharded dtype)."""
    return resolve_dtypes(orig, param_dtype, policy_reduce)[1] or unsharded_dtype(orig, param_dtype)


def group_reduce_dtype(
    dtypes: Sequence[tuple[torch.dtype, torch.dtype | None, torch.dtype | None]],
) -> torch.dtype | None:
    """The one dtype a group reduces in, from each trainable parameter's
    ``(orig, param_dtype, reduce_dtype)`` as ``resolve_dtypes`` left them; ``None`` when they
    agree on "the gradient's own dtype"."""
    resolved = {reduce for _, _, reduce in dtypes}
    arriving = {reduce or param_dtype or orig for orig, param_dtype, reduce in dtypes}
    if len(arriving) > 1:
        return functools.reduce(torch.promote_types, arriving)
    if len(resolved) == 1:
        return next(iter(resolved))
    return next(iter(arriving), None)


def grad_made_in(
    orig: torch.dtype,
    compute: torch.dtype,
    reduce: torch.dtype | None,
    explicit: torch.dtype | None = None,
    *,
    widen: bool = False,
) -> torch.dtype:
    """The dtype autograd makes an unsharded gradient in (``FSDPParam``'s
    ``set_unsharded_grad_dtype``, the planner's fake steps): from torch 2.15
    (``REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE``) the dtype it is reduced or kept in (the policy's
    ``reduce_dtype``, else an explicit ``grad_dtype``, else the parameter's own) where that
    is not wider than the compute dtype, or where ``widen`` (the engine: a first gradient
    without sync, or one a tensor-parallel reduction sums first); else, and before 2.15, the
    compute dtype (a wider target is then reached by the reduce-scatter's copy-in)."""
    if not REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE or not (
        orig.is_floating_point and compute.is_floating_point
    ):
        return compute
    target = reduce or explicit or orig
    return target if widen or target.itemsize <= compute.itemsize else compute
