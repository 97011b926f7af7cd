"""Weights tied *after* fully_shard at world size 4 (issue 29): transformers' layout with an
even (12 rows) and an uneven (13 rows: a short last shard) tied weight. Oracles and layouts:
see ``tests/fsdp/_tied_after_shard.py``.
"""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp._tied_after_shard import tied_after_shard


@pytest.mark.parametrize("vocab", [12, 13])
def test_tied_after_shard_world4(world4: WorkerPool, vocab: int) -> None:
    """Oracles: reference after every step; torch's engine bitwise when the shard is even."""
    result = world4.run(tied_after_shard, "root_keeps_head", vocab)
    if vocab % 4 == 0:
        assert result == [True] * 4
