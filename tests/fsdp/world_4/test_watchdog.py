"""The watchdog's stall diagnosis at world size 4 (the last rank is the faulty one). Oracle:
the error contract (type, text naming the rank and the module, time)."""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp import _watchdog_cases as cases
from tests.fsdp._watchdog_cases import SLACK_S


@pytest.mark.parametrize("case", cases.FAULTS)
def test_fault_named_within_threshold(world4: WorkerPool, case: str) -> None:
    """Ranks 0-2 each raise the case's error naming rank 3 (PeerIdleError at the idle
    timeout for a rank that stays alive outside the loop, else within the stall threshold +
    5 s; see ``tests/fsdp/_watchdog_cases.py``)."""
    elapsed = world4.run(getattr(cases, case), timeout=60.0)
    limit = cases.IDLE_S if case in cases.IDLE_FAULTS else cases.THRESHOLD_S
    for t in elapsed[:3]:
        assert 0 < t < limit + SLACK_S, elapsed


@pytest.mark.parametrize("case", list(cases.PAUSES), ids=list(cases.PAUSES))
def test_healthy_pause_is_a_warning(world4: WorkerPool, case: str) -> None:
    """One rank pausing 2.5 x the stall threshold outside the engine: no error, the same
    losses as without the pause, and every waiting rank warned naming it."""
    results = world4.run(cases.healthy_pause, case, timeout=60.0)
    cases.check_pause(results, case)


def test_slow_rank_is_not_an_error(world4: WorkerPool) -> None:
    """Rank 3 is 3 s late (default settings): no error anywhere."""
    elapsed = world4.run(cases.slow_rank, timeout=60.0)
    assert min(elapsed[:3]) >= 2.5, elapsed
