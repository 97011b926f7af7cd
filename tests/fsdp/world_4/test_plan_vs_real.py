"""The planner's predictions against real training steps on 4 ranks (HSDP on 2x2 and 4x1 meshes).

Oracle: *measurement* on real ranks (``tests/fsdp/_plan_real``): the bytes each rank holds
(parameter shards, sharded gradients, optimizer state) and the peaks of gathered parameters
and of unsharded gradients must match the plan exactly; the step's peak live tensor bytes, counted as the benchmark counts
them, within 5% of the plan's peak with activations and, on R x 1 meshes computing in fp32,
never above it (``_plan_real.never_below``: the smallest peak of three steps).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import WorkerPool
from tests.fsdp._plan_real import assert_plan_matches, case_id, measure

CASES: list[dict[str, Any]] = [
    {"kind": "gpt", "reshard": 2},
    {"kind": "gpt_ac"},
    {"kind": "mlp"},
    {"kind": "gpt", "mp": True, "reshard": 2},
    {"kind": "gpt", "mesh": (2, 2)},
    {"kind": "gpt", "mesh": (4, 1), "mp": True},
    {"kind": "gpt", "placement": True, "reshard": False},
    {"kind": "mlp", "mesh": (4, 1)},
    {"kind": "mlp", "mesh": (2, 2)},
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_plan_vs_real_world4(world4: WorkerPool, case: dict[str, Any]) -> None:
    assert_plan_matches(world4.run(measure, case), case)
