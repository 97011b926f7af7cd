"""``fit`` on a transformers Llama, measured on 2 ranks (``tests/integration/_plan_fit_transformers``).

Oracle: *measurement*: the best configuration for a budget below the default's peak trains
within the budget and within 10% of its predicted peak.
"""

from __future__ import annotations

from tests._dist import WorkerPool
from tests.integration._plan_fit_transformers import check_best


def test_fit_llama_best_trains_within_budget(world2: WorkerPool) -> None:
    check_best(world2)
