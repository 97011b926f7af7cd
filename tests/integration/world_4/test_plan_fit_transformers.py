"""``fit`` on a transformers Llama and Qwen3-MoE, measured on 4 ranks
(``tests/integration/_plan_fit_transformers``).

Oracle: *measurement*: the best configuration for a budget below the default's peak trains
within the budget and within 10% of its predicted peak.
"""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.integration._plan_fit_transformers import check_top


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_fit_best_trains_within_budget(world4: WorkerPool, kind: str) -> None:
    check_top(world4, kind, top=1)
