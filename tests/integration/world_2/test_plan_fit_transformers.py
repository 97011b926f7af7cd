"""``fit`` on a transformers Llama and Qwen3-MoE, measured on 2 ranks
(``tests/integration/_plan_fit_transformers``).

Oracle: *measurement*: the top three configurations for a budget below the default's peak
train within the budget and within 10% of their predicted peaks.
"""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.integration._plan_fit_transformers import check_top


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_fit_top_trains_within_budget(world2: WorkerPool, kind: str) -> None:
    check_top(world2, kind, top=3)
