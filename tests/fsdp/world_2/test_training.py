"""Training parity of shardweave's fully_shard on 2 ranks (the body, shared with world_4, is
``tests/fsdp/_training.py``).

Oracles: *reference* (an unsharded copy trained on the global batch, loss averaged over ranks)
and *compatibility* (torch's own ``fully_shard`` on a copy in the same processes: bitwise equal
placements, shards and gradients).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import WorkerPool
from tests.fsdp._training import train_parity

CONFIGS: list[dict[str, Any]] = [
    {"kind": "mlp", "optim": "adamw"},
    {"kind": "mlp", "reshard_after_forward": False},
    {"kind": "gpt"},
    {"kind": "gpt", "reshard_after_forward": True},
    {"kind": "gpt", "reshard_after_forward": False},
    {"kind": "gpt", "micro": 3},
    {"kind": "gpt", "checkpoint": True},
    {"kind": "gpt", "shard_largest_dim": True},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_train_parity(world2: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracles: reference and compatibility (torch's fully_shard), several steps each."""
    world2.run(train_parity, cfg)
