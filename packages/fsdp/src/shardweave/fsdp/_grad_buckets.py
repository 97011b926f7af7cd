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

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardweave.fsdp import _fault, _trace
from shardweave.fsdp._fsdp_collectives import gradient_divide_factors

if TYPE_CHECKING:
    from shardweave.fsdp._fsdp_param import FSDPParam
    from shardweave.fsdp._fsdp_param_group import FSDPParamGroup
    from shardweave.fsdp._trace import CollectiveRecord

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
    entries: list[_Entry] = field(default_factory=list)
    numel: int = 0
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None
    post_divide: float | None = None
    record: CollectiveRecord | None = None  # when tracing


class GradBuckets:
    """The open and in-flight gradient buckets of one root (shared by its replicate groups)."""

    def __init__(self) -> None:
        self._open: dict[tuple[dist.ProcessGroup, torch.dtype], _Bucket] = {}
        self._in_flight: list[_Bucket] = []
        self._sent_bytes = 0  # this backward: decides whether the small first cap applies

    def add(
        self,
        owner: FSDPParamGroup,
        params: Sequence[FSDPParam],
        grads: list[torch.Tensor],
        group: dist.ProcessGroup,
        reduce_dtype: torch.dtype,
        orig_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Queue ``owner``'s gradients (``grads`` is emptied: the bucket owns them now)."""
        key = (group, reduce_dtype)
        bucket = self._open.get(key)
        if bucket is None:
            bucket = self._open[key] = _Bucket(group, reduce_dtype)
        entry = _Entry(list(params), list(grads), orig_dtype, owner._fqn)
        if _trace.ACTIVE is not None:
            entry.nbytes = sum(g.numel() * g.element_size() for g in grads)
            entry.trace_key = _trace.ACTIVE.bucket_grads(owner, entry.nbytes)
        bucket.entries.append(entry)
        bucket.numel += sum(g.numel() for g in grads)
        grads.clear()
        cap = FIRST_BUCKET_BYTES if self._sent_bytes == 0 else BUCKET_BYTES
        if bucket.numel * bucket.dtype.itemsize >= cap:
            del self._open[key]
            self._send(bucket, device)

    def _send(self, bucket: _Bucket, device: torch.device) -> None:
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
        if pre is not None and pre != 1:
            buffer.div_(pre)
        if _fault.checks_enabled():
            names = ",".join(e.name for e in bucket.entries)
            _fault.check_collective(bucket.group, "all_reduce", names, buffer.numel(), buffer.dtype)
        if _trace.ACTIVE is not None:
            keys = [e.trace_key or e.name for e in bucket.entries]
            bucket.record = _trace.ACTIVE.bucket_issue(keys, buffer, bucket.group)
        bucket.work = dist.all_reduce(buffer, op=op, group=bucket.group, async_op=True)
        bucket.buffer, bucket.post_divide = buffer, post
        self._sent_bytes += buffer.numel() * buffer.element_size()
        self._in_flight.append(bucket)

    def finish(self, device: torch.device) -> None:
        """Send what is open, wait for every bucket, and assign each parameter its gradient."""
        for bucket in list(self._open.values()):
            self._send(bucket, device)
        self._open.clear()
        in_flight, self._in_flight = self._in_flight, []
        self._sent_bytes = 0
        for bucket in in_flight:
            what = "the gradient all-reduce of " + ", ".join(f"'{e.name}'" for e in bucket.entries)
            tracer = _trace.ACTIVE if bucket.record is not None else None
            wait_ns = tracer.now() if tracer is not None else 0
            _fault.wait(bucket.work, what)
            if tracer is not None and bucket.record is not None:
                tracer.bucket_done(bucket.record, wait_ns)
            buffer = bucket.buffer
            assert buffer is not None
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

    def clear(self) -> None:
        """Drop everything (after a failed step); in-flight reductions are waited out."""
        for bucket in self._in_flight:
            if bucket.work is not None:
                with contextlib.suppress(Exception):
                    bucket.work.wait()
        self._open.clear()
        self._in_flight.clear()
        self._sent_bytes = 0
