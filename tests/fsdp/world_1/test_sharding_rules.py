"""The shared sharding rules against ``torch.chunk`` (what the engine cuts the data with).

Oracle: ``torch.chunk`` on real tensors, for every rank of random shapes and world sizes.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardweave.fsdp._sharding_rules import (
    group_reduce_dtype,
    padded_shard_size,
    reduce_dtype,
    resolve_dtypes,
    shard_size,
    unsharded_dtype,
)
from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(0, 40),
    cols=st.integers(1, 3),
    world=st.integers(1, 9),
    dim=st.integers(0, 1),
)
def test_sizes_match_torch_chunk(rows: int, cols: int, world: int, dim: int) -> None:
    size = (rows, cols) if dim == 0 else (cols, rows)
    chunks = list(torch.chunk(torch.empty(size), world, dim=dim))
    for rank in range(world):
        expected = chunks[rank].size() if rank < len(chunks) and chunks[rank].numel() else None
        got = shard_size(size, world, rank, dim)
        if expected is not None:
            assert got == expected, (size, world, rank)
        else:
            assert got[dim] == 0 and got[1 - dim] == size[1 - dim], (size, world, rank, got)
    assert padded_shard_size(size, world, dim) == chunks[0].size(), (size, world)


def test_dtype_rules() -> None:
    f32, bf16, i64 = torch.float32, torch.bfloat16, torch.int64
    assert resolve_dtypes(f32, bf16, f32) == (bf16, f32)
    assert resolve_dtypes(f32, bf16, bf16) == (bf16, None)  # reduce equal to param: dropped
    assert resolve_dtypes(f32, f32, None) == (None, None)  # param equal to orig: dropped
    assert resolve_dtypes(i64, bf16, None) == (None, None)  # integers are never cast
    assert unsharded_dtype(f32, bf16) == bf16 and unsharded_dtype(i64, bf16) == i64
    assert reduce_dtype(f32, bf16, f32) == f32
    # reduce_dtype=None: the parameter's own dtype from torch 2.15, param_dtype before
    default = f32 if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE else bf16
    assert reduce_dtype(f32, bf16, None) == default
    assert resolve_dtypes(f32, bf16, None) == (
        bf16,
        f32 if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE else None,
    )
    # one group, bf16 and fp32 gradients (param_dtype_override_fn): their promoted dtype
    assert group_reduce_dtype([(f32, bf16, None), (f32, None, None)]) == f32
    assert group_reduce_dtype([(f32, bf16, None), (f32, bf16, None)]) is None
    assert group_reduce_dtype([(f32, bf16, f32), (f32, None, f32)]) == f32
    assert group_reduce_dtype([]) is None
