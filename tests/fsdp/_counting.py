"""Counting what a step sends: the collectives the engines call by name and bytes, and every
c10d op by name (the collective-count tests)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
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


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count calls of ``dist.all_gather_single``, ``reduce_scatter_single`` and ``all_reduce`` by
    name, and the bytes each sends under ``<name>_bytes``; the tensor may come positionally or by
    keyword (torch's FSDP passes keywords)."""
    counts: Counter[str] = Counter()
    # Counted under torch 2.13's names; torch 2.11 and 2.12 have only the older ones, which
    # both engines call there (shardweave through shardweave.fsdp._torch_compat).
    names = {
        "all_gather_single": "all_gather_into_tensor",
        "reduce_scatter_single": "reduce_scatter_tensor",
        "all_reduce": "all_reduce",
    }
    patched = {name: name if hasattr(dist, name) else older for name, older in names.items()}
    originals = {name: getattr(dist, attr) for name, attr in patched.items()}

    # The tensor each call sends: the input of all-gather / reduce-scatter (second
    # positional, or by keyword), the tensor of all-reduce (first).
    sent = {
        "all_gather_single": (1, "input_tensor"),
        "reduce_scatter_single": (1, "input"),
        "all_reduce": (0, "tensor"),
    }

    def wrap(name: str, fn: Any) -> Any:
        position, keyword = sent[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[position] if len(args) > position else kwargs[keyword]
            counts[name] += 1
            counts[f"{name}_bytes"] += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, patched[name], wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, patched[name], fn)
