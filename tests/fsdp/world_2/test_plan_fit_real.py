"""``fit`` against real training on 2 ranks (``tests/fsdp/_plan_fit_real``).

Oracle: *measurement*: the top three configurations for a budget below the default's peak,
applied with ``apply``, train; each rank's measured peak fits the budget and is within 10% of
the prediction.
"""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp._plan_fit_real import apply_on_its_target, check_top


@pytest.mark.parametrize("kind", ["gpt", "demo_gpt", "mlp"])
def test_fit_top3_train_within_budget_world2(world2: WorkerPool, kind: str) -> None:
    check_top(world2, 2, top=3, kind=kind)


def test_apply_on_its_target_only(world2: WorkerPool) -> None:
    """Oracle: closed form (which target is named, and that the offload configuration trains)."""
    world2.run(apply_on_its_target)


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_fit_top3_on_the_test_accelerator_world2(world2: WorkerPool, kind: str) -> None:
    """Planned for cuda/gloo (the accelerator's schedule; CPU offload searched), measured on the
    test accelerator (the engine's accelerator branches over CPU tensors, gloo) for 70% of the
    default's peak: the mlp's top three offload (host memory left out of the device peak)."""
    result = check_top(world2, 2, top=3, kind=kind, target="cuda/gloo", fraction=0.7)
    if kind == "mlp":
        assert all(f.config.offload for f in result.kept[:3])
