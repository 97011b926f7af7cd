"""The streams and events of one comm context, and the device module they come from.

Design note: stream ordering
    Four side streams per comm context (one root's groups), from the device module
    ``torch.get_device_module(device)``. On CPU that is ``torch.cpu``, whose streams are no-ops
    and whose ``record_event()`` returns None, so the same code runs everywhere; every event
    below is optional for that reason (``wait_event`` skips None).

    ========================  ==========================================================
    stream                    runs
    ========================  ==========================================================
    current (compute)         forward/backward, all-gather copy-out, reduce-scatter
                              copy-in, the optimizer
    all-gather copy-in        building the all-gather input (cast, offload H2D copy)
    all-gather                the all-gather
    reduce-scatter            pre-divide, the reduce-scatter, then (no HSDP) post-divide,
                              cast, sharded-gradient views, offload D2H copy
    all-reduce                the HSDP / replicate all-reduce, the all-reduce hook (unless
                              the user gave its own stream), then post-divide and the rest
    ========================  ==========================================================

    Who waits for what, in the order of a step:

    1. The root's pre-forward: both all-gather streams wait for the current stream (the
       optimizer wrote the shards there), or only for the user's post-optim event.
    2. A synchronous unshard in forward or pre-backward: the all-gather stream waits for the
       copy-in's event; the current stream waits for the all-gather's event before copy-out.
       An async or idle unshard (``unshard(async_op=True)``, outside forward) uses the current
       stream for both, as torch's FSDP2 does.
    3. An all-gather output is read by the current stream's copy-out, so it is not freed
       before the all-gather streams have waited for the copy-out's event: in forward the
       comm context keeps the last output and its event until the next unshard (the next
       all-gather waits, then drops it); elsewhere the all-gather streams wait at once.
    4. An int ``reshard_after_forward`` copies the post-forward shards on the current stream
       and records an event that the next unshard's streams wait for.
    5. A post-backward: the reduce-scatter stream waits for the current stream (the
       reduce-scatter input was filled there); the all-reduce stream waits for the
       reduce-scatter stream; a hook stream given by the user waits for the last of them.
    6. The reduce-scatter input is allocated on the current stream and read on the
       reduce-scatter stream, so it stays referenced until the current stream waited for the
       reduce-scatter's event: at a later group's post-backward, keeping at most
       ``reduce_scatter_max_input_buffers``, or at the end of backward.
    7. The end of backward: the current stream waits for every post-reduce event (the
       optimizer reads the sharded gradients there); with CPU offload to pinned memory, the
       host waits for the last device-to-host copy's event before the CPU optimizer runs.

    Nothing calls ``record_stream``: a buffer used on another stream is simply kept alive
    until the stream that allocated it has waited (points 3 and 6). On accelerators the host
    never blocks on a collective: they are issued inside ``stream(...)`` and ordered by
    events (see ``_fsdp_collectives``). This ordering is checked on CPU by the stream
    sanitizer in the test suite (``tests/_dist/stream_sanitizer.py``), which substitutes a
    fake device module through ``use_device_module``; it has not yet run on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CommStreams", "device_module", "use_device_module", "wait_event"]

_override: Any = None


def device_module(device: torch.device) -> Any:
    """``torch.get_device_module(device)``, unless a test substituted one."""
    if _override is not None:
        return _override
    return torch.get_device_module(device)


@contextlib.contextmanager
def use_device_module(module: object) -> Iterator[None]:
    """Make every comm context created inside use ``module``'s streams and events.

    The seam of the CPU stream sanitizer: it passes a fake device module whose streams are
    distinct, so a missing wait shows up as a race even though CPU streams are no-ops.
    """
    global _override
    previous, _override = _override, module
    try:
        yield
    finally:
        _override = previous


def wait_event(stream: Any, event: Any) -> None:
    """``stream.wait_event(event)``; CPU streams record no events (None)."""
    if event is not None:
        stream.wait_event(event)


class CommStreams:
    """The side streams of one comm context; see Design note: stream ordering."""

    def __init__(self, device: torch.device) -> None:
        self.device_handle = device_module(device)
        # High priority for the communication streams on CUDA, as torch's FSDP2: their kernels
        # are short and gate compute; other backends take the default.
        high = -1 if device.type == "cuda" else 0
        self.all_gather_copy_in = self.device_handle.Stream(priority=high)
        self.all_gather = self.device_handle.Stream(priority=high)
        self.reduce_scatter = self.device_handle.Stream(priority=high)
        self.all_reduce = self.device_handle.Stream(priority=0)

    def current(self) -> Any:
        return self.device_handle.current_stream()

    def all_gather_waits(self, event: Any) -> None:
        """Both all-gather streams wait for ``event`` (points 1 and 3): a copy-out or the
        optimizer, whose memory they are about to reuse or read."""
        wait_event(self.all_gather_copy_in, event)
        wait_event(self.all_gather, event)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current for the ops inside."""
        return self.device_handle.stream(stream)  # type: ignore[no-any-return]
