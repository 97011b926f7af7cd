"""The watchdog's stall diagnosis at world size 2, with real faults (see
``tests/fsdp/_watchdog_cases.py``). Oracle: the error contract (type, text naming the rank
and the module, time within the stall threshold + 5 s)."""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp import _watchdog_cases as cases
from tests.fsdp._watchdog_cases import SLACK_S


@pytest.mark.parametrize("case", cases.FAULTS)
def test_fault_named_within_threshold(world2: WorkerPool, case: str) -> None:
    """Every rank still in the step raises the case's error naming the faulty rank:
    PeerFailureError for a raise in forward and CollectiveMismatchError for a skipped module
    within the stall threshold + 5 s; PeerIdleError for a rank that left the loop alive, at
    the idle timeout, after a warning (checked in the body)."""
    elapsed = world2.run(getattr(cases, case), timeout=60.0)
    limit = cases.IDLE_S if case in cases.IDLE_FAULTS else cases.THRESHOLD_S
    assert 0 < elapsed[0] < limit + SLACK_S, elapsed


def test_defaults_name_a_rank_that_left(world2: WorkerPool) -> None:
    """With the real defaults (stall threshold 10 s; idle timeout the group's 30 s) a rank
    that left the loop alive is warned about in 10-15 s and an error in 30-35 s."""
    elapsed = world2.run(cases.leaves_the_step, True, timeout=90.0)
    assert 30.0 <= elapsed[0] < 30.0 + SLACK_S, elapsed


def test_slow_rank_is_not_an_error(world2: WorkerPool) -> None:
    """A rank 3 s late (default settings): the step completes, the others simply waited."""
    elapsed = world2.run(cases.slow_rank, timeout=60.0)
    assert elapsed[0] >= 2.5, elapsed  # rank 0 really waited for the slow rank
