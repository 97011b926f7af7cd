"""The engine's stream ordering, checked on CPU by the stream sanitizer (fake streams, CSAN).

Oracle: torch's stream-race checker (``torch.cuda._sanitizer.EventHandler``) finds no
unordered access between the engine's streams, and the same scenario without the sanitizer
gives bitwise the same losses, gradients and parameters (the fake streams change nothing).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import WorkerPool
from tests.fsdp._stream_order import (
    WAIT_MUTATIONS,
    check_watched,
    mutated,
    sanitized_vs_plain,
    torch_lacks,
)

SCENARIOS: dict[str, dict[str, Any]] = {
    "per-block-and-root": {},
    "mixed-precision": {"mp": True},
    "mixed-precision-bf16-reduce": {"mp": True, "reduce_dtype": torch.bfloat16},
    "cpu-offload": {"offload": True},
    "replicate": {"replicate": True},
    "explicit-prefetch": {"prefetch": True},
    "async-unshard": {"async_unshard": True},
    "grad-accumulation": {"micro": 2},
    "reshard-after-forward-false": {"reshard_after_forward": False},
    "activation-checkpointing": {"checkpoint": True},
    "all-reduce-hook-on-user-stream": {"hook": "stream"},
    "post-optim-event": {"post_optim_event": True},
    "two-reduce-scatter-buffers": {"max_rs_buffers": 2},
}


@pytest.mark.parametrize("cfg", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_training_is_race_free(world2: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracle: CSAN reports no race; sanitized == plain run, bitwise (2 steps, TinyGPT)."""
    if reason := torch_lacks(cfg):
        pytest.skip(reason)
    check_watched(world2.run(sanitized_vs_plain, cfg), cfg)


MUTATIONS = WAIT_MUTATIONS


@pytest.mark.parametrize("case", list(MUTATIONS.values()), ids=list(MUTATIONS))
def test_removed_engine_wait_is_reported(
    world2: WorkerPool, case: tuple[dict[str, Any], str, tuple[str, ...]]
) -> None:
    """Mutation test: dropping one engine wait (two steps) must surface as a race.

    Oracle: the sanitizer's report names the unordered pair of ops; the same scenario with
    every wait in place is race-free (``test_training_is_race_free``). Other waits of the
    engine are redundant in these scenarios on purpose (e.g. the end-of-backward wait for
    the post-reduce events is implied by the reduce-scatter event in 1-D FSDP when nothing
    runs after the collective), hence the scenario chosen for each.
    """
    cfg, drop, (op_a, op_b) = case
    for result in world2.run(mutated, cfg, drop):
        assert isinstance(result, dict)
        assert result["dropped"], f"{drop} issued no wait: the mutation did nothing"
        races = result["races"]
        assert any(op_a in r and op_b in r for r in races), races
