"""Property: shard -> unshard -> reshard and state-dict round trips are exact for any shape,
shard dim and dtype, at 2 ranks (the property and its oracles: ``tests/fsdp/_shard_roundtrip.py``).
"""

from __future__ import annotations

from tests._dist import WorkerPool
from tests.fsdp._shard_roundtrip import run_roundtrip


def test_shard_roundtrip_world2(world2: WorkerPool) -> None:
    """Oracle: closed form (padded torch.chunk layout, bitwise unshard) and compatibility
    (torch's fully_shard gives the same local shards), over ~25 drawn shapes/dims/dtypes."""
    run_roundtrip(world2)
