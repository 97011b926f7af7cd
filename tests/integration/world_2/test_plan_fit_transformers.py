"""``fit`` on transformers models, measured on 2 ranks
(``tests/integration/_plan_fit_transformers``).

Oracle: *measurement*: the top configurations for 70% of the default's peak, planned for the
model's own loss (``labels``), train with that loss within the budget and within 10% of their
predicted peaks; on the test accelerator too (planned for cuda/gloo, CPU offload searched).
"""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.integration._plan_fit_transformers import check_top


@pytest.mark.parametrize(
    ("kind", "top"), [("llama", 3), ("gpt2", 1), ("bert", 1), ("qwen3_moe", 1)]
)
def test_fit_top_trains_within_budget(world2: WorkerPool, kind: str, top: int) -> None:
    check_top(world2, kind, top=top)


def test_fit_top_on_the_test_accelerator(world2: WorkerPool) -> None:
    check_top(world2, "llama", top=2, target="cuda/gloo")
