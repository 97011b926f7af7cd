"""Collective accounting: a dispatch mode counting c10d collectives and their bytes by kind."""

from __future__ import annotations

from typing import Any, Final

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KINDS: Final = ("all_gather", "reduce_scatter", "all_reduce", "other")


def collective_kind(op_name: str) -> str | None:
    """Map a dispatcher op name to a collective kind, or None if it is not a collective."""
    namespace = op_name.split(".", 1)[0]
    if namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
        return None
    name = op_name.replace("_", "")
    if "waittensor" in name or "barrier" in name or "monitored" in name:
        return None
    if "allgather" in name:
        return "all_gather"
    if "reducescatter" in name:
        return "reduce_scatter"
    if "allreduce" in name:
        return "all_reduce"
    return "other"


def tensor_bytes(obj: object) -> int:
    flat, _ = tree_flatten(obj)
    return sum(t.nbytes for t in flat if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives and their bytes as seen by the dispatcher.

    Works below whatever Python API an engine calls (``all_gather_into_tensor``,
    ``all_gather_single``, ``ProcessGroup`` methods, functional collectives), since all of
    them reach a ``c10d``/``_c10d_functional`` op. Bytes are counted the way the theoretical
    minimum is: an all-gather by its gathered (output) size, a reduce-scatter by its
    unreduced (input) size, an all-reduce by its tensor size. In-place c10d ops take
    ``(outputs, inputs, ...)`` while functional ones take the input and return the output,
    so the larger side of the first two arguments (and the result) is the full-size one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.bytes: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = collective_kind(str(func))
        if kind is not None:
            sides = [tensor_bytes(a) for a in args[:2]] + [tensor_bytes(out)]
            nbytes = sides[0] if kind == "all_reduce" else max(sides)
            self.counts[kind] += 1
            self.bytes[kind] += nbytes
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return out
