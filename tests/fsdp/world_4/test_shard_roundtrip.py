"""The shard round-trip properties of ``tests/fsdp/_shard_roundtrip.py`` at 4 ranks,
where more shapes leave ranks with empty or padded shards."""

from __future__ import annotations

from tests._dist import WorkerPool
from tests.fsdp._shard_roundtrip import run_roundtrip


def test_shard_roundtrip_world4(world4: WorkerPool) -> None:
    """Oracle: closed form (padded torch.chunk layout, bitwise unshard) and compatibility
    (torch's fully_shard gives the same local shards), over ~25 drawn shapes/dims/dtypes."""
    run_roundtrip(world4)
