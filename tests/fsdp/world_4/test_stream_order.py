"""The engine's stream ordering at world size 4, checked by the CPU stream sanitizer.

Oracle: torch's stream-race checker (``torch.cuda._sanitizer.EventHandler``) finds no
unordered access between the engine's streams, and the same scenario without the sanitizer
gives bitwise the same losses, gradients and parameters (the fake streams change nothing).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import WorkerPool
from tests.fsdp._stream_order import check_watched, mutated, sanitized_vs_plain

SCENARIOS: dict[str, dict[str, Any]] = {
    "per-block-and-root": {},
    "hsdp-2x2": {"hsdp": True},
    "hsdp-grad-accumulation": {"hsdp": True, "micro": 2},
    "reshard-after-forward-2": {"reshard_after_forward": 2},
}


@pytest.mark.parametrize("cfg", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_training_is_race_free(world4: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracle: CSAN reports no race; sanitized == plain run, bitwise (2 steps, TinyGPT)."""
    check_watched(world4.run(sanitized_vs_plain, cfg), cfg)


def test_removed_end_of_backward_wait_is_reported(world4: WorkerPool) -> None:
    """Mutation test: with HSDP the gradients are finished on the all-reduce stream, after the
    reduce-scatter's event, so only the end-of-backward wait for the post-reduce events
    (Design note point 7, ``ReductionSchedule.finish``) orders the optimizer after
    the all-reduce. Dropping it must surface as a race between the all-reduce and the
    optimizer.
    """
    for result in world4.run(mutated, {"hsdp": True}, "ReductionSchedule.finish"):
        assert isinstance(result, dict)
        assert result["dropped"], "finish_reductions issued no wait: the mutation did nothing"
        races = result["races"]
        assert any("c10d::allreduce_" in r for r in races), races
