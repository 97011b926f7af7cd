"""The watchdog at world size 2, with real faults and real pauses (see
``tests/fsdp/_watchdog_cases.py``). Oracles: the error contract (type, text naming the rank and
the module, time within the stall threshold + 5 s; for an idle peer, a warning within that and
the error at the idle timeout) and, for pauses, the run without the pause (the same losses)."""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp import _watchdog_cases as cases
from tests.fsdp._watchdog_cases import DEFAULT_STALL_S, SLACK_S


@pytest.mark.parametrize("case", cases.FAULTS)
def test_fault_named_within_threshold(world2: WorkerPool, case: str) -> None:
    """Rank 0 raises the case's error naming rank 1 (PeerFailureError for a raise,
    CollectiveMismatchError for a skipped module) within the stall threshold + 5 s."""
    elapsed = world2.run(getattr(cases, case), timeout=60.0)
    assert 0 < elapsed[0] < cases.STALL_S + SLACK_S, elapsed


def test_default_threshold_names_a_skipped_module(world2: WorkerPool) -> None:
    """With the real default (10 s) a rank that skipped a module is named within 15 s."""
    elapsed = world2.run(cases.skips_a_module, None, timeout=60.0)
    assert 0 < elapsed[0] < DEFAULT_STALL_S + SLACK_S, elapsed


def test_rank_that_left_the_loop_is_idle_until_the_idle_timeout(world2: WorkerPool) -> None:
    """Rank 1 leaves the loop and stays alive: rank 0 warns (naming rank 1 and where it is)
    within the stall threshold + 5 s, and raises PeerIdleError at the idle timeout."""
    (elapsed, warned, _), _ = world2.run(cases.leaves_the_loop, timeout=60.0)  # type: ignore[misc]
    assert cases.IDLE_S - 1.0 <= elapsed < cases.IDLE_S + SLACK_S, elapsed
    assert len(warned) >= 2, warned  # repeated, with doubling gaps, before the error


@pytest.mark.parametrize("case", list(cases.PAUSES))
def test_healthy_pause_is_not_an_error(world2: WorkerPool, case: str) -> None:
    """One rank pauses 3 x the stall threshold: no error, the losses of the unpaused run, a
    warning on the other rank naming it and where it is."""
    cases.check_healthy_pause(world2.run(cases.healthy_pause, case, timeout=90.0), case)  # type: ignore[arg-type]


def test_slow_rank_is_not_an_error(world2: WorkerPool) -> None:
    """A rank 3 s late (default settings): the step completes, the others simply waited."""
    elapsed = world2.run(cases.slow_rank, timeout=60.0)
    assert elapsed[0] >= 2.5, elapsed  # rank 0 really waited for the slow rank
