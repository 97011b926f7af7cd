"""The watchdog at world size 4 (the last rank is the faulty one; a pause is on rank 0 or the
last rank). Oracles: the error contract (type, text naming the rank and the module, time) and,
for pauses, the run without the pause (the same losses)."""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp import _watchdog_cases as cases
from tests.fsdp._watchdog_cases import SLACK_S


@pytest.mark.parametrize("case", cases.FAULTS)
def test_fault_named_within_threshold(world4: WorkerPool, case: str) -> None:
    """Ranks 0-2 each raise the case's error naming rank 3."""
    elapsed = world4.run(getattr(cases, case), timeout=60.0)
    for t in elapsed[:3]:
        assert 0 < t < cases.STALL_S + SLACK_S, elapsed


def test_rank_that_left_the_loop_is_idle_until_the_idle_timeout(world4: WorkerPool) -> None:
    """Rank 3 leaves the loop and stays alive: ranks 0-2 each warn within the stall threshold
    + 5 s and raise PeerIdleError at the idle timeout."""
    results = world4.run(cases.leaves_the_loop, timeout=60.0)
    for elapsed, warned, _ in results[:3]:  # type: ignore[misc]
        assert cases.IDLE_S - 1.0 <= elapsed < cases.IDLE_S + SLACK_S, results
        assert warned, results


@pytest.mark.parametrize("case", list(cases.PAUSES))
def test_healthy_pause_is_not_an_error(world4: WorkerPool, case: str) -> None:
    """One rank pauses 3 x the stall threshold: no error on any rank, the losses of the
    unpaused run, a warning on every other rank naming it and where it is."""
    cases.check_healthy_pause(world4.run(cases.healthy_pause, case, timeout=90.0), case)  # type: ignore[arg-type]


def test_slow_rank_is_not_an_error(world4: WorkerPool) -> None:
    """Rank 3 is 3 s late (default settings): no error anywhere."""
    elapsed = world4.run(cases.slow_rank, timeout=60.0)
    assert min(elapsed[:3]) >= 2.5, elapsed
