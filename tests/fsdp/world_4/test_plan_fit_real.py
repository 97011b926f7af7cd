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


def test_fit_layout_and_microbatch_world4(world4: WorkerPool) -> None:
    """With a global batch fit also chooses the layout (FSDP 4, HSDP 2x2 or 4x1) and the
    microbatch (16x1 or 8x2 per rank): the best row, the best HSDP 2x2 and the best
    accumulating one, applied by ``apply`` (which builds the mesh), each measured over its
    whole optimizer step (every microbatch)."""
    result = check_top(world4, 4, top=1, kind="gpt", global_batch=64)
    assert {c.mesh for f in result.kept for c in (f.config, *f.alternatives)} >= {(4,), (2, 2)}
