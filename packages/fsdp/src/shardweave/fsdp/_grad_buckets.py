"""Gradient buckets for replicate: one all-reduce for several groups, issued while backward runs.

Design note: why buckets
    Without sharding, a group's gradient reduction is a plain all-reduce, and its cost on small
    groups is mostly per-collective latency. DDP packs gradients into ~25 MiB buckets (the first
    one small, so communication starts early) and all-reduces each bucket asynchronously while
    backward continues. Replicate groups here do the same: a group's post-backward copies its
    gradients into the open bucket; a full bucket is all-reduced asynchronously; the root's
    end-of-backward callback sends the last one and waits for all of them, then hands each
    parameter its slice. Averaging is elementwise, so the result is bitwise the same as one
    all-reduce per group (torch's replicate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardweave.fsdp import _trace
from shardweave.fsdp._comm import collectives_for
from shardweave.fsdp._fsdp_common import CollectiveKind
from shardweave.fsdp._fsdp_param import FSDPParam
from shardweave.fsdp._fsdp_streams import CommStreams, wait_event
from shardweave.fsdp._reduction import gradient_divide_factors
from shardweave.fsdp._seam import InFlight, issue

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "GradBuckets"]

# DDP's defaults: a small first bucket starts communication early, later ones amortize latency.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


@dataclass
class _Entry:
    params: list[FSDPParam]
    grads: list[torch.Tensor]
    orig_dtype: torch.dtype
    name: str
    trace_key: str | None = None  # the tracer's key for this group, when tracing
    nbytes: int = 0


@dataclass
class _Bucket:
    group: dist.ProcessGroup
    dtype: torch.dtype
    device: torch.device
    entries: list[_Entry] = field(default_factory=list)
    numel: int = 0
    buffer: torch.Tensor | None = None
    in_flight: InFlight | None = None
    post_divide: float | None = None


class GradBuckets:
    """The open and in-flight gradient buckets of one root (shared by its replicate groups)."""

    def __init__(self) -> None:
        self._open: dict[tuple[dist.ProcessGroup, torch.dtype], _Bucket] = {}
        self._in_flight: list[_Bucket] = []
        self._sent_bytes = 0  # this backward: decides whether the small first cap applies
        self._streams: CommStreams | None = None

    def add(
        self,
        name: str,
        trace_key: str | None,
        params: Sequence[FSDPParam],
        grads: list[torch.Tensor],
        group: dist.ProcessGroup,
        reduce_dtype: torch.dtype,
        orig_dtype: torch.dtype,
        streams: CommStreams,
    ) -> None:
        """Queue the gradients of group ``name`` (``grads`` is emptied: the bucket owns them
        now); ``trace_key`` is the tracer's key for it, when tracing."""
        self._streams = streams
        key = (group, reduce_dtype)
        bucket = self._open.get(key)
        if bucket is None:
            bucket = self._open[key] = _Bucket(group, reduce_dtype, grads[0].device)
        entry = _Entry(list(params), list(grads), orig_dtype, name)
        if _trace.ACTIVE is not None and trace_key is not None:
            entry.nbytes = sum(g.numel() * g.element_size() for g in grads)
            entry.trace_key = trace_key
            _trace.ACTIVE.bucket_grads(trace_key, entry.nbytes)
        bucket.entries.append(entry)
        bucket.numel += sum(g.numel() for g in grads)
        grads.clear()
        cap = FIRST_BUCKET_BYTES if self._sent_bytes == 0 else BUCKET_BYTES
        if bucket.numel * bucket.dtype.itemsize >= cap:
            del self._open[key]
            self._send(bucket)

    def _send(self, bucket: _Bucket) -> None:
        # See Design note: stream ordering (_fsdp_streams): filled on the current stream,
        # reduced on the all-reduce stream, which first waits for the current one.
        streams = self._streams
        assert streams is not None
        device = bucket.device
        buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        sources = [g.reshape(-1) for e in bucket.entries for g in e.grads]
        views = list(torch.split(buffer, [s.numel() for s in sources]))
        torch._foreach_copy_(views, sources)  # casts to the reduce dtype on the way
        for entry in bucket.entries:
            entry.grads.clear()  # the unsharded grads can be freed now
            if _trace.ACTIVE is not None and entry.trace_key is not None:
                _trace.ACTIVE.bucket_grads_copied(entry.trace_key, entry.nbytes)
        pre, post, _, op = gradient_divide_factors(
            1, bucket.group.size(), bucket.dtype, None, False
        )
        stream = streams.all_reduce
        stream.wait_stream(streams.current())
        with streams.use(stream):
            if pre is not None and pre != 1:
                buffer.div_(pre)
        names = ", ".join(f"'{e.name}'" for e in bucket.entries)
        group = bucket.group
        bucket.in_flight = issue(
            CollectiveKind.ALL_REDUCE,
            lambda async_op: collectives_for(device).all_reduce(
                buffer, group, op=op, async_op=async_op
            ),
            group=group,
            tensor=buffer,
            name=",".join(e.name for e in bucket.entries),
            trace_key=lambda: "+".join(e.trace_key or e.name for e in bucket.entries),
            streams=streams,
            stream=stream,
            what=f"the gradient all-reduce of {names}",
        )
        bucket.buffer, bucket.post_divide = buffer, post
        self._sent_bytes += buffer.numel() * buffer.element_size()
        self._in_flight.append(bucket)

    def finish(self) -> None:
        """Send what is open, wait for every bucket, and assign each parameter its gradient."""
        for bucket in list(self._open.values()):
            self._send(bucket)
        self._open.clear()
        in_flight, self._in_flight = self._in_flight, []
        self._sent_bytes = 0
        streams = self._streams
        if streams is None:
            return
        stream = streams.all_reduce
        for bucket in in_flight:
            assert bucket.in_flight is not None and bucket.buffer is not None
            bucket.in_flight.wait(streams, stream)
            buffer = bucket.buffer
            with streams.use(stream):
                if bucket.post_divide is not None and bucket.post_divide != 1:
                    buffer.div_(bucket.post_divide)
                offset = 0
                for entry in bucket.entries:
                    size = sum(p.padded_sharded_numel for p in entry.params)
                    out = buffer.narrow(0, offset, size)
                    if out.dtype != entry.orig_dtype:
                        out = out.to(entry.orig_dtype)
                    inner = 0
                    for p in entry.params:
                        p.assign_sharded_grad(out.narrow(0, inner, p.padded_sharded_numel))
                        inner += p.padded_sharded_numel
                    offset += size
        if in_flight:
            # The optimizer reads the gradients on the current stream.
            wait_event(streams.current(), stream.record_event())

    def clear(self) -> None:
        """Drop everything (after a failed step); in-flight reductions are waited out."""
        for bucket in self._in_flight:
            if bucket.in_flight is not None:
                bucket.in_flight.abandon()
        self._open.clear()
        self._in_flight.clear()
        self._sent_bytes = 0
