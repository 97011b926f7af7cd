"""The engine's accelerator branches at world size 4 (HSDP 2x2, int reshard), on the test
accelerator; see ``tests/fsdp/world_2/test_accelerator_branches.py`` for the oracle."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import WorkerPool
from tests.fsdp._stream_order import check_watched, mutated, sanitized_vs_plain, torch_lacks

BF16_REDUCE = {"mp": True, "reduce_dtype": torch.bfloat16}

SCENARIOS: dict[str, dict[str, Any]] = {
    "per-block-and-root": {},
    "hsdp-2x2": {"hsdp": True},
    "hsdp-2x2-bf16-reduce": {"hsdp": True, **BF16_REDUCE},
    "hsdp-2x2-grad-accumulation": {"hsdp": True, "micro": 2},
    # set_requires_all_reduce(False): the partial sum kept, then repacked for a parameter
    # whose first gradient comes in the second microbatch.
    "hsdp-2x2-partial-all-reduce": {"hsdp": True, "micro": 2, "partial": "same"},
    "hsdp-2x2-partial-all-reduce-grows": {"hsdp": True, "micro": 2, "partial": "grows"},
    "reshard-after-forward-2": {"reshard_after_forward": 2},
}


@pytest.mark.parametrize("cfg", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_accelerator_branches_match_cpu_branches(world4: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracle: the CPU branches' numbers, bitwise, and torch's engine's where it can run the
    scenario (``torch_lacks``); no race, no unsafe reuse (2 steps)."""
    check_watched(world4.run(sanitized_vs_plain, cfg, True, torch_lacks(cfg) is None), cfg)


def test_removed_all_reduce_keep_alive_is_reported(world4: WorkerPool) -> None:
    """Mutation test: HSDP's reduce-scatter output is all-reduced on the all-reduce stream and
    then cast to fp32 there; without the reduce-scatter stream's wait that ends its keep-alive
    (Design note point 8) the next group's reduce-scatter output takes its block while the
    all-reduce may still write it. Oracle: the allocator model's report names that reuse."""
    cfg = {"hsdp": True, **BF16_REDUCE}
    drop = "ReductionSchedule._release_all_reduce_buffers"
    for result in world4.run(mutated, cfg, drop, True):
        assert isinstance(result, dict)
        assert result["dropped"], result
        assert any("unsafe reuse" in r and "c10d::allreduce_" in r for r in result["races"]), result


def test_removed_all_reduce_wait_is_reported(world4: WorkerPool) -> None:
    """Mutation test (Design note point 5): HSDP's all-reduce stream waits for the
    reduce-scatter stream, whose collective wrote the buffer it all-reduces. With the waits
    of ``GradientReduction._run`` removed, the report must name the all-reduce reading that
    output unordered (beside the reduce-scatter's own race, which the world-2 test checks).
    Oracle: the stream-race checker's report."""
    drop = "GradientReduction._run"
    for result in world4.run(mutated, {"hsdp": True}, drop, True):
        assert isinstance(result, dict)
        assert result["dropped"], result
        races = result["races"]
        assert any("c10d::allreduce_" in r and "c10d::_reduce_scatter_base_" in r for r in races), (
            races
        )
