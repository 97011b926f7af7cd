"""Peak live tensor bytes: the profiler-based recorder, state bytes, and its self-check.

How the measurement works is described in the docstring of ``run.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

MEMORY_STEP: Final = "shardweave_bench::memory_step"
MIB: Final = 1 << 20


@dataclass
class MemoryStats:
    peak: int  # the largest running total of live bytes inside the window
    live_before: int  # the running total when the window opened
    live_after: int  # ... and when it closed


class LiveBytesRecorder:
    """Profiles CPU allocations; ``window()`` marks the span whose peak ``stats()`` returns."""

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> LiveBytesRecorder:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(None, None, None)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        with record_function(MEMORY_STEP):
            yield

    def stats(self) -> MemoryStats:
        from torch._C._profiler import _EventType

        kineto = self._prof.profiler.kineto_results if self._prof.profiler else None
        if kineto is None:
            raise RuntimeError("LiveBytesRecorder.stats: the profiler has not run")
        events: list[Any] = []
        todo = list(kineto.experimental_event_tree())
        while todo:
            ev = todo.pop()
            events.append(ev)
            todo.extend(ev.children)
        windows = [e for e in events if e.name == MEMORY_STEP]
        if len(windows) != 1:
            raise RuntimeError(f"LiveBytesRecorder.stats: {len(windows)} windows, expected 1")
        start, end = windows[0].start_time_ns, windows[0].end_time_ns
        # Each allocation event carries the allocator's running total right after it
        # (``total_allocated``, updated under the allocator's lock, so exact across threads
        # and independent of how equal timestamps sort). It counts every allocation made
        # while a profiler ran that is still live, so an earlier session's leftovers give a
        # constant offset, removed with the first event's total before its own size.
        raw = [
            (e.start_time_ns, e.typed[1].total_allocated, e.typed[1].alloc_size, e)
            for e in events
            if e.tag == _EventType.Allocation and e.typed[1].device.type == "cpu"
        ]
        allocs = _engine_totals(sorted(raw, key=lambda a: a[:3]))
        if not allocs:
            return MemoryStats(peak=0, live_before=0, live_after=0)
        offset = allocs[0][1] - allocs[0][2]
        before_events = [total for t, total, _ in allocs if t < start]
        before = before_events[-1] - offset if before_events else 0
        in_window = [total - offset for t, total, _ in allocs if start <= t <= end]
        after = [total for t, total, _ in allocs if t <= end][-1] - offset
        return MemoryStats(peak=max([before, *in_window]), live_before=before, live_after=after)


# The scopes a process group's own allocations happen in: the c10d op on the issuing thread,
# and gloo's own scope on its worker thread ("gloo:all_gather" stages each rank's input there,
# at a moment only the worker's schedule decides).
_COLLECTIVE_SCOPES: Final = ("c10d::", "gloo:")


def _in_collective(event: Any) -> bool:
    parent = event.parent
    while parent is not None:
        if parent.name.startswith(_COLLECTIVE_SCOPES):
            return True
        parent = parent.parent
    return False


def _engine_totals(allocs: list[tuple[int, int, int, Any]]) -> list[tuple[int, int, int]]:
    """(time, running total, size) of each allocation event, the running total less what the
    process group allocated inside a collective call (``c10d::...`` ops: gloo's reduce-scatter
    clones its input to all-reduce it).

    Such staging is freed by whichever thread finishes the collective, and the profiler hears
    of a free only on a thread it instruments (the issuing thread, and gloo's workers, which
    carry its state). A thread of the engine's own that waits for the collective (shardweave
    waits for gloo's reduce-scatter on one, so that its training thread keeps watching for
    failed peers) is not one: the bytes would stay in the total for the rest of the run. So
    the process group's staging is left out for every implementation alike; what is counted
    is what the engines and the model allocate.
    """
    staged: dict[int, int] = {}  # pointer -> size of a staging block not seen freed
    staged_bytes = 0
    out: list[tuple[int, int, int]] = []
    for t, total, size, event in allocs:
        ptr = event.typed[1].ptr
        counted = size  # what this event changes in the total returned (0: staging)
        if size > 0:
            # A block at this address again: an earlier staging block there was freed unseen
            # (its bytes stay in the total, and in staged_bytes).
            staged.pop(ptr, None)
            if _in_collective(event):
                staged[ptr] = size
                staged_bytes += size
                counted = 0
        elif ptr in staged:
            staged_bytes -= staged.pop(ptr)
            counted = 0
        out.append((t, total - staged_bytes, counted))
    return out


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind parameters, gradients, buffers and optimizer
    state (DTensors by their local shard)."""
    storages: dict[int, int] = {}

    def add(t: object) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        with contextlib.suppress(Exception):  # wrapper subclasses without a storage
            s = local.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    storages.pop(0, None)  # empty storages share address 0
    return sum(storages.values())


def memory_self_check() -> int:
    """The peak increase a 1 MiB tensor held through the window causes; must be exactly 1 MiB.

    The window holds a small forward, backward and a real all-reduce (so gloo's threads are
    exercised); run twice, identical but for the extra tensor.
    """

    def measure(extra: bool) -> int:
        gen = torch.Generator().manual_seed(0)
        # Everything is freed before the profiler stops, so no allocation it tracked is
        # left behind for a later session to see freed (see LiveBytesRecorder.stats).
        with LiveBytesRecorder() as rec:
            w = torch.randn(256, 256, generator=gen, requires_grad=True)
            x = torch.randn(32, 256, generator=gen)
            with rec.window():
                held = torch.empty(MIB, dtype=torch.uint8) if extra else None
                (x @ w).relu().sum().backward()
                assert w.grad is not None
                dist.all_reduce(w.grad)
                w.grad = None
            del held, w, x
        return rec.stats().peak

    return measure(True) - measure(False)
