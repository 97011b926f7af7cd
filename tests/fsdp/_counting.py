"""Counting what a step sends: every c10d op, by name (the collective-count tests)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class C10dOps(TorchDispatchMode):
    """Counts every c10d op (all collectives, barriers and broadcasts included) by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self.counts[f"c10d.{func.__name__}"] += 1
        return func(*args, **(kwargs or {}))
