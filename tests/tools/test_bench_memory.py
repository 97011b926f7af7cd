"""The benchmark's peak-memory accounting (``benchmarks/_memory.py``) on planted profiler
events: what the process group allocates for itself is left out for every engine alike, on the
issuing thread (under a ``c10d::`` op) and on gloo's worker thread (under its ``gloo:`` scope,
whose timing is the worker's own and made either engine's peak move by a block from run to
run); what the engines and the model allocate is counted.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.tools._load import REPO


@pytest.fixture(scope="module")
def memory() -> ModuleType:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import _memory

        return _memory
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _event(ptr: int, *scopes: str) -> Any:
    """An allocation event under ``scopes`` (innermost first)."""
    parent = None
    for name in reversed(scopes):
        parent = SimpleNamespace(name=name, parent=parent)
    return SimpleNamespace(parent=parent, typed=(None, SimpleNamespace(ptr=ptr)))


def test_process_group_staging_is_left_out(memory: ModuleType) -> None:
    step = "shardweave_bench::memory_step"
    allocs = [
        (1, 100, 100, _event(1, "aten::mm", step)),  # the model's: counted
        (2, 180, 80, _event(2, "aten::empty", "gloo:all_gather")),  # gloo's worker stages
        (3, 230, 50, _event(3, "aten::clone", "c10d::reduce_scatter_", step)),  # issuing thread
        (4, 150, -80, _event(2, "gloo:all_gather")),  # the worker frees its staging
        (5, 170, 20, _event(4, "aten::empty", "FSDP::all_gather", step)),  # an engine's: counted
    ]
    totals = memory._engine_totals(allocs)
    assert [total for _, total, _ in totals] == [100, 100, 100, 100, 120]
    assert [size for *_, size in totals] == [100, 0, 0, 0, 20]
