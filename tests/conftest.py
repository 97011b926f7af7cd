"""Session-wide fixtures: one spawned worker pool per world size for the whole pytest run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._dist import WorkerPool


def _pool(world_size: int) -> Iterator[WorkerPool]:
    # Session scope, so a pool is spawned the first time a test asks for it and shared by every
    # later test of that world size; a failing body restarts the pool's workers, not the fixture.
    pool = WorkerPool(world_size)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def world1() -> Iterator[WorkerPool]:
    """One spawned rank: for world-size-1 bodies that need a process group of their own."""
    yield from _pool(1)


@pytest.fixture(scope="session")
def world2() -> Iterator[WorkerPool]:
    """Two spawned gloo ranks."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def world4() -> Iterator[WorkerPool]:
    """Four spawned gloo ranks (2x2 meshes for HSDP and FSDP+TP)."""
    yield from _pool(4)
