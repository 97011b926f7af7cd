"""A healthy job is never killed (issue 27): one rank pausing outside the engine for 2.5 x the
stall threshold (below the idle timeout) is a warning on the waiting ranks, not an error.
Scaled thresholds (both by 5): see ``tests/fsdp/_watchdog_cases.py``. Oracle: the same steps
without the pause (losses equal) and the warning contract (the idle rank named)."""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.fsdp import _watchdog_cases as cases


@pytest.mark.parametrize("case", list(cases.PAUSES), ids=list(cases.PAUSES))
def test_healthy_pause_is_a_warning(world2: WorkerPool, case: str) -> None:
    results = world2.run(cases.healthy_pause, case, timeout=60.0)
    cases.check_pause(results, case)
