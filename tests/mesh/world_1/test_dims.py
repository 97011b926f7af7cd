"""DataParallelMeshDims validation (no process group needed)."""

from __future__ import annotations

import pytest

from shardweave.mesh import DataParallelMeshDims


def test_neither_shard_nor_replicate_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one of shard= or replicate="):
        DataParallelMeshDims()


@pytest.mark.parametrize(
    ("dims", "shard", "replicate"),
    [
        (DataParallelMeshDims(shard="dp"), ("dp",), ()),
        (DataParallelMeshDims(replicate="dp"), (), ("dp",)),
        (
            DataParallelMeshDims(shard="dp_shard", replicate="dp_rep"),
            ("dp_shard",),
            ("dp_rep",),
        ),
        (DataParallelMeshDims(shard=("a", "b")), ("a", "b"), ()),
        (DataParallelMeshDims(shard="s", replicate=("r0", "r1")), ("s",), ("r0", "r1")),
    ],
)
def test_names_are_tuples(
    dims: DataParallelMeshDims, shard: tuple[str, ...], replicate: tuple[str, ...]
) -> None:
    assert dims.shard_names == shard
    assert dims.replicate_names == replicate


def test_is_frozen_and_hashable() -> None:
    dims = DataParallelMeshDims(shard="dp")
    with pytest.raises(AttributeError):
        dims.shard = "other"  # type: ignore[misc]
    assert hash(dims) == hash(DataParallelMeshDims(shard="dp"))
