"""The watchdog's stall diagnosis at world size 2, with real faults (see
``tests/fsdp/_watchdog_cases.py``). Oracle: the error contract (type, text naming the rank
and the module, time within the stall threshold + 5 s)."""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp import _watchdog_cases as cases
from tests.fsdp._watchdog_cases import DEFAULT_STALL_S, SLACK_S


@pytest.mark.parametrize("case", cases.FAULTS)
def test_fault_named_within_threshold(world2: WorkerPool, case: str) -> None:
    """Every rank still in the step raises the case's error (PeerFailureError for a raise in
    forward, CollectiveMismatchError otherwise) naming the faulty rank."""
    elapsed = world2.run(getattr(cases, case), timeout=60.0)
    assert 0 < elapsed[0] < cases.THRESHOLD_S + SLACK_S, elapsed


def test_default_threshold_names_a_rank_that_left(world2: WorkerPool) -> None:
    """With the real default (10 s) a rank that left the step is named in 10-15 s."""
    elapsed = world2.run(cases.leaves_the_step, DEFAULT_STALL_S, timeout=60.0)
    assert DEFAULT_STALL_S <= elapsed[0] < DEFAULT_STALL_S + SLACK_S, elapsed


def test_slow_rank_is_not_an_error(world2: WorkerPool) -> None:
    """A rank 3 s late (default settings): the step completes, the others simply waited."""
    elapsed = world2.run(cases.slow_rank, timeout=60.0)
    assert elapsed[0] >= 2.5, elapsed  # rank 0 really waited for the slow rank
