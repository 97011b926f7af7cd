"""``fit`` against real training on 4 ranks (``tests/fsdp/_plan_fit_real``).

Oracle: *measurement*: the best configuration for a budget below the default's peak, applied
with ``apply``, trains; each rank's measured peak fits the budget and is within 10% of the
prediction (one configuration here to keep CI time down; 2 ranks check the top three).
"""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp._plan_fit_real import check_top


@pytest.mark.parametrize("kind", ["gpt", "demo_gpt", "mlp"])
def test_fit_best_trains_within_budget_world4(world4: WorkerPool, kind: str) -> None:
    check_top(world4, 4, top=1, kind=kind)
