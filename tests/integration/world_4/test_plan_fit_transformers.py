"""``fit`` on a transformers Llama, measured on 4 ranks
(``tests/integration/_plan_fit_transformers``).

Oracle: *measurement*: with a global batch fit also chooses the layout (FSDP 4, HSDP 2x2 or
4x1) and the microbatch; the fastest HSDP 2x2 row and the fastest accumulating one for 70%
of the default's peak, applied by ``apply`` (which builds the mesh) and trained with the
model's own loss over a whole optimizer step, fit the budget and are within 10% of their
predicted peaks.
"""

from __future__ import annotations

from tests._dist import WorkerPool
from tests.integration._plan_fit_transformers import check_top


def test_fit_layout_and_microbatch_trains_within_budget(world4: WorkerPool) -> None:
    result = check_top(world4, "llama", top=0, global_batch=32)
    assert {c.mesh for f in result.kept for c in (f.config, *f.alternatives)} >= {(4,), (2, 2)}
