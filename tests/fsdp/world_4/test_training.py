"""Training parity at 4 ranks: more padding, empty shards, and an int reshard_after_forward."""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import WorkerPool
from tests.fsdp._training import train_parity

CONFIGS: list[dict[str, Any]] = [
    {"kind": "mlp", "optim": "adamw"},
    {"kind": "gpt"},
    {"kind": "gpt", "reshard_after_forward": 2},
    {"kind": "gpt", "micro": 2, "reshard_after_forward": False},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_train_parity(world4: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracles: reference and compatibility (torch's fully_shard)."""
    world4.run(train_parity, cfg)
