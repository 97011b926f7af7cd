"""Test-only helpers for distributed tests: the spawn pool, seeding and tolerances."""

from tests._dist._worker import keep_process_group
from tests._dist.pool import GRACE_PERIOD_S, WorkerError, WorkerPool
from tests._dist.seeding import seed_everything
from tests._dist.tolerances import TOLERANCES, assert_close, tolerances

__all__ = [
    "GRACE_PERIOD_S",
    "TOLERANCES",
    "WorkerError",
    "WorkerPool",
    "assert_close",
    "keep_process_group",
    "seed_everything",
    "tolerances",
]
