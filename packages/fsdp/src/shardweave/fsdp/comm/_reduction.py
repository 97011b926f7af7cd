"""Gradient reduction: how a group's gradients are reduced (``GradientReduction``: copy-in,
reduce-scatter, the HSDP all-reduce, the hook, the sharded gradients) and when each
collective is waited and its buffers retired (``ReductionSchedule``), side by side.

The param group decides *that* its gradients are reduced (at its post-backward); this
module decides how and when, and the planner (``plan/_schedule``) reads the schedule's
rules from here. See Design note: stream ordering (``_streams``), points 5-8. A
parameter is known here only through ``ReducedParam``, what the reduction reads and sets of
it; the engine's ``FSDPParam`` is one.

Design note: one reduction pipeline, buckets as a variant
    FSDP, HSDP and replicate, on every device, reduce through ``GradientReduction``: copy-in
    on the current stream, pre-divide and the reduce-scatter (or, with one shard rank, a copy
    into the reduce-scatter stream's own block) on the reduce-scatter stream, the all-reduce
    on its stream, then post-divide, cast and the sharded gradients. Without sharding a
    group's reduction is a plain all-reduce whose cost on small groups is mostly
    per-collective latency, so replicate's groups with default reduction are bucketed as DDP
    does: a bucket is one ``GradientReduction`` over several groups' gradients laid side by
    side (``absorb``), started once it holds ``FIRST_BUCKET_BYTES`` (then ``BUCKET_BYTES``)
    or at the end of backward (``ReductionSchedule.submit`` / ``finish``). It has the same
    divide factors, casts, slices, waits and keep-alives as any reduction; averaging is
    elementwise, so the numbers are bitwise those of one all-reduce per group (torch's
    replicate, DDP).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardweave.fsdp._fsdp_api import ReduceScatter
from shardweave.fsdp._fsdp_common import CollectiveKind
from shardweave.fsdp.comm._collectives import ReduceOpLike, collectives_for, release_finished_buffer
from shardweave.fsdp.comm._seam import InFlight, issue
from shardweave.fsdp.comm._streams import CommStreams, wait_event
from shardweave.fsdp.tracing import _recorder

__all__ = [
    "BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "GradSource",
    "GradientReduction",
    "ReducedParam",
    "ReductionSchedule",
    "gradient_divide_factors",
    "reduce_scatters_to_retire",
]

# Bucketed reduction (replicate): DDP's defaults. A small first bucket starts communication
# early, later ones amortize latency (see ReductionSchedule.submit).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def gradient_divide_factors(
    reduce_scatter_size: int,
    all_reduce_size: int,
    reduce_dtype: torch.dtype,
    factor: float | None,
    force_sum: bool,
) -> tuple[float | None, float | None, ReduceOpLike, ReduceOpLike]:
    """(pre-divide, post-divide, reduce-scatter op, all-reduce op) for a gradient reduction.

    The default averages over every data-parallel rank; ``factor`` replaces that divisor.
    fp32/bf16 divide inside the collective (AVG); other dtypes (fp16's narrow range) and
    ``force_sum`` use SUM with explicit division, split before and after the collective for
    overflow-prone dtypes. The choices match torch's FSDP2 so results are bitwise comparable.
    """
    size = reduce_scatter_size * all_reduce_size
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            if size == 1:
                return None, None, dist.ReduceOp.SUM, dist.ReduceOp.SUM
            return None, None, dist.ReduceOp.AVG, dist.ReduceOp.AVG
        if factor == reduce_scatter_size:
            return None, None, dist.ReduceOp.AVG, dist.ReduceOp.SUM
        premul = torch._C._distributed_c10d._make_nccl_premul_sum(1.0 / factor)
        return None, None, premul, dist.ReduceOp.SUM
    total = float(size) if factor is None else factor
    if not overflow_risk:
        return None, total, dist.ReduceOp.SUM, dist.ReduceOp.SUM
    pre = 1
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return float(pre), total / pre, dist.ReduceOp.SUM, dist.ReduceOp.SUM


@functools.cache
def _default_divide_factors(
    reduce_scatter_size: int, all_reduce_size: int, reduce_dtype: torch.dtype, force_sum: bool
) -> tuple[float | None, float | None, ReduceOpLike, ReduceOpLike]:
    """``gradient_divide_factors`` without a user factor: constant for a group and asked for
    at every reduction, so computed once. A user factor may build a premul-sum op, built
    afresh each time as torch's FSDP2 does: not cached."""
    return gradient_divide_factors(
        reduce_scatter_size, all_reduce_size, reduce_dtype, None, force_sum
    )


def _div_(tensor: torch.Tensor, factor: float | None) -> None:
    if factor is not None and factor != 1:
        tensor.div_(factor)


class ReducedParam(Protocol):
    """What a reduction reads and sets of one parameter; ``FSDPParam`` is one. (Declared here,
    where it is read: the engine core imports this module, not the other way round.)"""

    @property
    def param_fqn(self) -> str: ...  # for errors
    @property
    def padded_sharded_numel(self) -> int: ...  # its slot in the reduced output
    @property
    def sharded_grad_dtype(self) -> torch.dtype: ...  # the dtype its sharded gradient is in

    def grad_for_reduce_scatter(self, grad: torch.Tensor, world_size: int) -> torch.Tensor: ...

    def assign_sharded_grad(self, reduce_output: torch.Tensor, offset: int) -> bool: ...


@dataclass
class GradSource:
    """One group's share of a reduction: its parameters with gradients, the gradients (emptied
    once copied in), the dtype they are handed back in, and its names."""

    params: list[ReducedParam]
    grads: list[torch.Tensor]
    orig_dtype: torch.dtype | None  # None: each parameter's own ``sharded_grad_dtype``
    name: str  # the group's module FQN, for errors and the watchdog
    trace_key: str | Callable[[], str]  # the tracer's key for the group
    traced_bytes: int = 0  # unsharded gradient bytes the tracer saw taken (0: not tracing)
    on_done: Callable[[torch.Tensor | None], None] | None = None

    def key(self) -> str:
        return self.trace_key if isinstance(self.trace_key, str) else self.trace_key()


class GradientReduction:
    """One gradient reduction: copy-in, reduce-scatter, (HSDP) all-reduce, the hook, then the
    sharded gradients; a resumable sequence that pauses at each collective.

    Usually one group's. A *bucketed* reduction (replicate, see ``ReductionSchedule.submit``)
    is the same sequence over several groups' gradients laid side by side (``absorb``), with
    one all-reduce for all of them; averaging is elementwise, so every number is the one a
    per-group reduction gives.

    ``start()`` fills the reduce-scatter input and issues the first collective; each
    ``advance()`` waits for the collective in flight and runs on to the next one (or to the
    end). The comm context decides when to advance: at once on accelerators, where waits are
    stream-ordered and cost the host nothing; at a later group's post-backward or at the end
    of backward on CPU, where waiting blocks the host but the backend's threads run the
    collective meanwhile (see Design note: stream ordering, points 5-7).
    """

    def __init__(
        self,
        fsdp_params: Sequence[ReducedParam],
        grads: list[torch.Tensor],
        *,
        reduce_scatter_group: dist.ProcessGroup | None,
        reduce_scatter_comm: ReduceScatter,
        orig_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        device: torch.device,
        divide_factor: float | None,
        all_reduce_group: dist.ProcessGroup | None,
        all_reduce_grads: bool,
        partial_reduce_output: torch.Tensor | None,
        partial_params: Sequence[ReducedParam],
        all_reduce_hook: Callable[[torch.Tensor], None] | None,
        all_reduce_hook_stream: Any,
        force_sum: bool,
        streams: CommStreams,
        group_name: str,
        trace_key: str | Callable[[], str],
        on_done: Callable[[torch.Tensor | None], None] | None = None,
        traced_bytes: int = 0,
    ) -> None:
        grad_dtypes = {g.dtype for g in grads}
        # Mixed gradient dtypes (a per-parameter param_dtype) are cast to the group's reduce
        # dtype by the copy-in; without one there is no dtype to reduce in.
        if len(grad_dtypes) != 1 and reduce_dtype is None:
            names = ", ".join(p.param_fqn for p in fsdp_params)
            raise AssertionError(
                f"FSDP reduce-scatter expects one gradient dtype per group, got {grad_dtypes} "
                f"for [{names}]"
            )
        self._sources = [
            GradSource(
                list(fsdp_params), grads, orig_dtype, group_name, trace_key, traced_bytes, on_done
            )
        ]
        self.numel = sum(g.numel() for g in grads)
        self._rs_group = reduce_scatter_group
        self._rs_comm = reduce_scatter_comm
        self._rdtype = reduce_dtype or grads[0].dtype
        self._device = device
        self._divide_factor = divide_factor
        self._ar_group = all_reduce_group
        self._all_reduce_grads = all_reduce_grads
        self._partial = partial_reduce_output
        self._partial_params = partial_params  # whose slots ``_partial`` holds, in order
        self._hook = all_reduce_hook
        self._hook_stream = all_reduce_hook_stream
        self._force_sum = force_sum
        self._streams = streams
        self._steps: Generator[tuple[InFlight, Any], None, torch.Tensor | None] | None = None
        self._waiting: tuple[InFlight, Any] | None = None
        # Kept until the current stream waited for ``reduce_scatter_event`` (point 6).
        self.reduce_scatter_input: torch.Tensor | None = None
        self.reduce_scatter_event: Any = None
        # The reduce-scatter was finished by a host wait (CPU): its input may be freed at once
        # when the current stream has waited (see release_finished_buffer).
        self.reduce_scatter_finished_on_host = False
        # The reduce-dtype output, allocated on the reduce-scatter stream and used on another
        # (the all-reduce, a hook): kept until the reduce-scatter stream waited for
        # ``post_reduce_event`` (point 8), as the next reduction would take its block.
        self.all_reduce_buffer: torch.Tensor | None = None
        self.post_reduce_event: Any = None
        self.offload_event: Any = None  # after this reduction's non-blocking offload copies
        self.done = False

    @property
    def reduce_scatter_comm(self) -> ReduceScatter:
        return self._rs_comm

    @property
    def bucket_key(self) -> tuple[Any, ...]:
        """What reductions must share to be one bucket: the all-reduce group, the reduce and
        gradient dtypes, the device."""
        grad_dtypes = frozenset(g.dtype for g in self._sources[0].grads)
        return (self._ar_group, self._rdtype, grad_dtypes, self._device)

    @property
    def reduce_bytes(self) -> int:
        """Bytes of the reduced tensor (a bucket is full at ``BUCKET_BYTES``)."""
        return self.numel * self._rdtype.itemsize

    def absorb(self, other: GradientReduction) -> None:
        """Lay ``other``'s gradients after this one's (a bucket); neither may have started."""
        assert self._steps is None and other._steps is None
        self._sources.extend(other._sources)
        self.numel += other.numel

    @property
    def _name(self) -> str:
        return ",".join(s.name for s in self._sources)

    def _trace_key(self) -> str:
        return "+".join(s.key() for s in self._sources)

    def _what(self, collective: str) -> str:
        if len(self._sources) == 1:
            return f"the {collective} of group '{self._sources[0].name}'"
        names = ", ".join(f"'{s.name}'" for s in self._sources)
        return f"the {collective} of groups {names}"

    @property
    def in_all_reduce(self) -> bool:
        """Whether the collective in flight is the all-reduce (the reduce-scatter is done)."""
        return self._waiting is not None and self._waiting[1] is self._streams.all_reduce

    def start(self) -> None:
        self._steps = self._run()
        self._resume()

    def advance(self) -> None:
        """Wait for the collective in flight, then run until the next one is issued."""
        if self._waiting is not None:
            in_flight, stream = self._waiting
            in_flight.wait(self._streams, stream)
        self._resume()

    def finish(self) -> None:
        while not self.done:
            self.advance()

    def abandon(self) -> None:
        """After a failed step: wait out what is in flight, run nothing more."""
        if self._waiting is not None:
            self._waiting[0].abandon()
        self._waiting = None
        if self._steps is not None:
            self._steps.close()
        self.done = True

    def _resume(self) -> None:
        assert self._steps is not None
        if self.done:
            return
        try:
            self._waiting = next(self._steps)
        except StopIteration as stop:
            self._waiting = None
            self.done = True
            for source in self._sources:
                if source.on_done is not None:
                    source.on_done(stop.value)

    def _issue_reduce_scatter(
        self,
        rs_input: torch.Tensor,
        output: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
    ) -> InFlight:
        comm = self._rs_comm

        def launch(async_op: bool) -> dist.Work | None:
            return comm(
                output_tensor=output, input_tensor=rs_input, group=group, op=op, async_op=async_op
            )

        return issue(
            CollectiveKind.REDUCE_SCATTER,
            launch,
            group=group,
            tensor=rs_input,
            name=self._name,
            trace_key=self._trace_key,
            streams=self._streams,
            stream=self._streams.reduce_scatter,
            what=lambda: self._what("reduce-scatter"),
        )

    def _run(self) -> Generator[tuple[InFlight, Any], None, torch.Tensor | None]:
        """The steps of one reduction, pausing at each collective: copy-in and reduce-scatter,
        then (HSDP, replicate) the all-reduce, the hook, and the sharded gradients. Returns the
        kept partial sum when HSDP accumulates without the all-reduce."""
        streams = self._streams
        rs_group, ar_group = self._rs_group, self._ar_group
        world = rs_group.size() if rs_group is not None else 1
        ar_size = ar_group.size() if ar_group is not None else 1
        if self._divide_factor is None:
            factors = _default_divide_factors(world, ar_size, self._rdtype, self._force_sum)
        else:
            factors = gradient_divide_factors(
                world, ar_size, self._rdtype, self._divide_factor, self._force_sum
            )
        pre, post, rs_op, ar_op = factors
        current = streams.current()
        rs_input = self._copy_in(world)
        rs_stream = post_stream = streams.reduce_scatter
        rs_stream.wait_stream(current)  # point 5: the gradients were laid out on ``current``
        output = yield from self._reduce_scatter(rs_input, world, pre, post, rs_op)
        # Read in full: from here only ``reduce_scatter_input`` keeps it, until the schedule
        # retires this reduce-scatter (point 6). A reference held here would keep it through
        # the all-reduce on CPU, where this sequence pauses there.
        del rs_input
        if ar_group is not None:
            with streams.use(rs_stream):
                partial = self._partial_in_this_layout()
                if not self._all_reduce_grads:
                    # HSDP accumulation: keep the partial sum for the synchronized microbatch.
                    if partial is not None:
                        partial += output
                        output = partial
                    self.post_reduce_event = rs_stream.record_event()
                    return output
                if partial is not None:
                    output += partial
            post_stream = streams.all_reduce
            post_stream.wait_stream(rs_stream)
            yield from self._all_reduce(output, ar_group, ar_op)
        if self._hook is not None:
            hook_stream = self._hook_stream or streams.all_reduce
            hook_stream.wait_stream(post_stream)
            with streams.use(hook_stream):
                self._hook(output)
            post_stream = hook_stream
        if post_stream is not rs_stream:
            self.all_reduce_buffer = output  # point 8
        with streams.use(post_stream):
            _div_(output, post)
            offloaded = self._assign_sharded_grads(output)
            self.post_reduce_event = post_stream.record_event()
            if offloaded:  # the same event orders the non-blocking device-to-host copies
                self.offload_event = self.post_reduce_event
        return None

    def _copy_in(self, world: int) -> torch.Tensor:
        """The reduce-scatter input (1D, rank-major) filled from every source's gradients on
        the current stream; the gradients are released, and the input kept as
        ``reduce_scatter_input`` (point 6)."""
        rdtype, sources = self._rdtype, self._sources
        laid_out = [
            p.grad_for_reduce_scatter(g, world)
            for s in sources
            for p, g in zip(s.params, s.grads, strict=True)
        ]
        if len({g.dtype for g in laid_out}) > 1:
            # _chunk_cat takes one input dtype: cast the others first (exact for the widening
            # casts a mixed group has, so the values are those of a cast inside the copy-in)
            laid_out = [g if g.dtype == rdtype else g.to(rdtype) for g in laid_out]
        out_numel = _numel([p for s in sources for p in s.params])
        rs_input = self._rs_comm.allocate((world * out_numel,), dtype=rdtype, device=self._device)
        # One kernel, on the current stream (where the gradients were computed): chunk every
        # grad into `world` dim-0 pieces (zero padded), cast, and lay rank i's pieces side by
        # side in row i.
        torch._chunk_cat(laid_out, dim=0, num_chunks=world, out=rs_input.view(world, -1))
        for source in sources:
            source.grads.clear()  # the unsharded grads can be freed now: the copy-in read them
        del laid_out
        if _recorder.ACTIVE is not None:  # see Design note: tracing hooks (tracing/_recorder)
            for source in sources:
                if source.traced_bytes:
                    _recorder.ACTIVE.grads_reduced(source.key(), source.traced_bytes)
        self.reduce_scatter_input = rs_input
        return rs_input

    def _reduce_scatter(
        self,
        rs_input: torch.Tensor,
        world: int,
        pre: float | None,
        post: float | None,
        rs_op: ReduceOpLike,
    ) -> Generator[tuple[InFlight, Any], None, torch.Tensor]:
        """Reduce-scatter ``rs_input`` on the reduce-scatter stream (with one rank, a copy or
        one division); returns the reduced shard, the reduce-scatter stream's own block."""
        streams, rdtype = self._streams, self._rdtype
        rs_stream = streams.reduce_scatter
        out_numel = rs_input.numel() // world
        # With one rank and only the divide factor to apply, the "reduce-scatter" is one
        # out-of-place division, none for a factor of 1 (as torch 2.15's FSDP2 divides there:
        # one ``div``, which its tests count). Difference from torch: torch also applies the
        # pre/post factors in the fp16/force-sum cases; we divide exactly once.
        factor = self._divide_factor
        one_rank_div = (
            None if world > 1 or pre is not None or post is not None or factor == 1 else factor
        )
        with streams.use(rs_stream):
            _div_(rs_input, pre)
            # The output is the reduce-scatter stream's own block, also with one rank: the input
            # belongs to the current stream, which must not have to wait for the all-reduce or
            # the casts before reusing it (see Design note: stream ordering, points 6 and 8).
            if one_rank_div is not None:
                output = torch.div(rs_input, one_rank_div)
            else:
                output = self._rs_comm.allocate((out_numel,), dtype=rdtype, device=self._device)
        if world > 1:
            assert self._rs_group is not None
            in_flight = self._issue_reduce_scatter(rs_input, output, self._rs_group, rs_op)
            self.reduce_scatter_event = in_flight.event
            yield in_flight, rs_stream
            self.reduce_scatter_finished_on_host = in_flight.finished_on_host
        else:
            if one_rank_div is None:
                with streams.use(rs_stream):
                    output.copy_(rs_input)
            self.reduce_scatter_event = rs_stream.record_event()
        return output  # this frame, and its reference to the input, ends here

    def _all_reduce(
        self, reduced: torch.Tensor, group: dist.ProcessGroup, op: ReduceOpLike
    ) -> Generator[tuple[InFlight, Any], None, None]:
        """The HSDP / replicate all-reduce of ``reduced``, in place on its stream."""
        streams = self._streams
        ar_stream = streams.all_reduce
        in_flight = issue(
            CollectiveKind.ALL_REDUCE,
            lambda async_op: collectives_for(self._device).all_reduce(
                reduced, group, op=op, async_op=async_op
            ),
            group=group,
            tensor=reduced,
            name=self._name,
            trace_key=self._trace_key,
            streams=streams,
            stream=ar_stream,
            what=lambda: self._what("all-reduce"),
        )
        yield in_flight, ar_stream

    def _assign_sharded_grads(self, output: torch.Tensor) -> bool:
        """Hand each parameter its slot of the reduced ``output`` (cast to the dtype its
        sharded gradient is in); whether any of them issued a non-blocking offload copy."""
        offset = 0
        offloaded = False
        # Each parameter views its slot by offset (no narrow per parameter); a cast makes
        # a new buffer of one run's slots only. Views of an uncast run keep the whole
        # output alive, the cast runs' slots with it: where those are the larger part the
        # uncast runs are copied instead, as torch 2.15 does.
        runs = [(params, dtype, _numel(params)) for params, dtype in _cast_runs(self._sources)]
        cast = sum(numel for _, dtype, numel in runs if dtype != output.dtype)
        copy_uncast = 2 * cast > sum(numel for *_, numel in runs)
        for params, dtype, size in runs:
            out, start = output, offset
            if out.dtype != dtype:
                out, start = output.narrow(0, offset, size).to(dtype), 0
            elif copy_uncast:
                out, start = output.narrow(0, offset, size).clone(), 0
            inner = start
            for fsdp_param in params:
                offloaded |= fsdp_param.assign_sharded_grad(out, inner)
                inner += fsdp_param.padded_sharded_numel
            offset += inner - start
        return offloaded

    def _partial_in_this_layout(self) -> torch.Tensor | None:
        """The pending partial sum (``set_requires_all_reduce(False)``) laid out as this
        reduction's output: itself when the same parameters have gradients, else, as torch
        2.15 repacks it, a zero buffer with each pending slot copied to its parameter's new
        offset. Every parameter with a pending slot has a gradient here (a zero one where its
        microbatch left it without: ``FSDPParamGroup.post_backward``), so no slot is lost;
        the layout only changes when a parameter first gets a gradient partway through."""
        partial, old = self._partial, self._partial_params
        params = self._sources[0].params
        if partial is None or (len(old) == len(params) and all(map(operator.is_, old, params))):
            return partial
        slots: dict[ReducedParam, int] = {}
        offset = 0
        for p in old:
            slots[p] = offset
            offset += p.padded_sharded_numel
        repacked = torch.zeros(_numel(params), dtype=partial.dtype, device=partial.device)
        offset = 0
        for p in params:
            start = slots.get(p)
            if start is not None:
                n = p.padded_sharded_numel
                repacked.narrow(0, offset, n).copy_(partial.narrow(0, start, n))
            offset += p.padded_sharded_numel
        return repacked


def _cast_runs(sources: Sequence[GradSource]) -> Iterator[tuple[list[ReducedParam], torch.dtype]]:
    """The reduced output's slots in order, as runs that are handed back in one dtype: a
    source's whole share, or, where explicit ``grad_dtype``s differ, each stretch of one dtype
    (the group laid its gradients out by dtype, ``FSDPParamGroup.post_backward``)."""
    for source in sources:
        if source.orig_dtype is not None:
            yield source.params, source.orig_dtype
        else:
            for dtype, run in itertools.groupby(source.params, lambda p: p.sharded_grad_dtype):
                yield list(run), dtype


def _numel(params: Sequence[ReducedParam]) -> int:
    return sum(p.padded_sharded_numel for p in params)


def reduce_scatters_to_retire(alive: int, max_input_buffers: int) -> int:
    """How many of the oldest ``alive`` reduce-scatters a new reduction retires before it
    starts (point 6), so that at most ``max_input_buffers`` inputs are alive with its own.

    The schedule's rule, read by the planner's replay too (``plan/_schedule``): before a
    reduction starts, the all-reduces issued when earlier reductions were retired finish
    first, then this many reduce-scatters are retired (waited for, their inputs released,
    an HSDP all-reduce issued), then the new one is copied in and issued.
    """
    return max(0, alive - max_input_buffers + 1)


class ReductionSchedule:
    """When each gradient reduction of one comm context is waited and its buffers retired
    (Design note: stream ordering, points 6-8); shared by every group under one root.

    The rules, which the planner (``plan/_schedule``) reads from here rather than
    re-encoding them:

    - ``start``: a new reduction first finishes the all-reduces issued at the previous
      post-backward (they overlapped one group's backward), then retires the oldest
      reduce-scatters until fewer than ``max_input_buffers`` inputs are alive
      (``set_reduce_scatter_max_input_buffers``), then copies in and issues.
    - On stream-ordered devices a reduction runs to its end at once (events order it; the
      host never waits); on CPU its waits happen at the next ``start`` or at ``finish``.
    - ``finish`` (end of backward) starts the open buckets, finishes everything and orders
      the current stream after every post-reduce event.
    - Bucketed reductions (``submit(..., bucketed=True)``, replicate's groups with default
      reduction) are the same reductions started later: a group's gradients join the open
      bucket of its all-reduce group and dtypes, and the bucket starts, as one reduction,
      once it holds ``FIRST_BUCKET_BYTES`` (the first of a backward) or ``BUCKET_BYTES``
      (DDP's sizes), else at ``finish``. From then on every rule above applies to it, on
      every device.
    """

    def __init__(self) -> None:
        self.max_input_buffers = 1
        self._streams: CommStreams | None = None
        # Buckets being filled, by ``GradientReduction.bucket_key``; bytes of buckets started
        # this backward (the first one's cap is smaller).
        self._open: dict[tuple[Any, ...], GradientReduction] = {}
        self._started_bytes = 0
        # Point 6: reductions whose reduce-scatter input is still referenced, oldest first;
        # then those whose all-reduce is in flight (CPU only: on accelerators every reduction
        # runs to its end at issue, ordered by events).
        self._reduce_scatters: deque[GradientReduction] = deque()
        self._all_reduces: list[GradientReduction] = []
        # Point 8: reduce-scatter outputs another stream used, with the event after that use;
        # dropped once the reduce-scatter stream waited for it.
        self._all_reduce_buffers: list[tuple[torch.Tensor, Any]] = []
        self._post_reduce_events: list[Any] = []
        # One per reduction that offloaded non-blocking: they end on different streams (the
        # reduce-scatter, all-reduce or a hook stream), so no one of them stands for the rest.
        self._offload_events: list[Any] = []

    def submit(self, reduction: GradientReduction, streams: CommStreams, *, bucketed: bool) -> None:
        """A group's post-backward hands over its reduction: started now, or (``bucketed``)
        added to the open bucket, which starts once it is full."""
        if not bucketed:
            self.start(reduction, streams)
            return
        self._streams = streams
        key = reduction.bucket_key
        bucket = self._open.get(key)
        if bucket is None:
            bucket = self._open[key] = reduction
        else:
            bucket.absorb(reduction)
        cap = FIRST_BUCKET_BYTES if self._started_bytes == 0 else BUCKET_BYTES
        if bucket.reduce_bytes >= cap:
            del self._open[key]
            self._started_bytes += bucket.reduce_bytes
            self.start(bucket, streams)

    def start(self, reduction: GradientReduction, streams: CommStreams) -> None:
        """Point 6: make room (at most ``max_input_buffers`` reduce-scatter inputs alive),
        then copy in and issue ``reduction``."""
        self._streams = streams
        self._finish_all_reduces()
        for _ in range(
            reduce_scatters_to_retire(len(self._reduce_scatters), self.max_input_buffers)
        ):
            self._retire_reduce_scatter(self._reduce_scatters.popleft())
        self._release_all_reduce_buffers(streams)
        reduction.start()
        if streams.stream_ordered:
            reduction.finish()  # ordered by events: the host does not wait
        self._reduce_scatters.append(reduction)

    def _release_all_reduce_buffers(self, streams: CommStreams) -> None:
        """Point 8: the reduce-scatter stream waits for the last use of its earlier outputs
        on other streams, so its next allocations may take their blocks."""
        for _, event in self._all_reduce_buffers:
            wait_event(streams.reduce_scatter, event)
        self._all_reduce_buffers.clear()

    def finish(self) -> None:
        """Point 7, at the end of backward: finish every reduction, make the current stream
        wait for their results, and the host for every non-blocking gradient offload."""
        if self._streams is not None:
            for bucket in list(self._open.values()):
                self.start(bucket, self._streams)
        self._open.clear()
        self._started_bytes = 0
        self._finish_all_reduces()
        while self._reduce_scatters:
            reduction = self._reduce_scatters.popleft()
            reduction.finish()
            self._retire_reduce_scatter(reduction)
        if self._streams is not None:
            current = self._streams.current()
            for event in self._post_reduce_events:
                wait_event(current, event)
            self._release_all_reduce_buffers(self._streams)
        self._post_reduce_events.clear()
        # The CPU optimizer reads the offloaded gradients next: they must have landed.
        for event in self._offload_events:
            event.synchronize()
        self._offload_events.clear()

    def abandon(self) -> None:
        """After a failed step: wait out what is in flight and drop it."""
        for reduction in (*self._all_reduces, *self._reduce_scatters):
            reduction.abandon()
        self._open.clear()
        self._started_bytes = 0
        self._all_reduces.clear()
        self._reduce_scatters.clear()
        self._all_reduce_buffers.clear()
        self._post_reduce_events.clear()
        self._offload_events.clear()

    def _finish_all_reduces(self) -> None:
        # Issued at the previous post-backward: they overlapped one group's backward.
        for reduction in self._all_reduces:
            reduction.finish()
            self._finished(reduction)
        self._all_reduces.clear()

    def _retire_reduce_scatter(self, reduction: GradientReduction) -> None:
        if not reduction.done and not reduction.in_all_reduce:
            reduction.advance()  # wait for the reduce-scatter; may issue the all-reduce
        assert self._streams is not None
        wait_event(self._streams.current(), reduction.reduce_scatter_event)
        # The current stream may reuse its memory now.
        rs_input, reduction.reduce_scatter_input = reduction.reduce_scatter_input, None
        if rs_input is not None and reduction.reduce_scatter_finished_on_host:
            release_finished_buffer(rs_input, reduction.reduce_scatter_comm)
        del rs_input
        if reduction.done:
            self._finished(reduction)
        else:
            self._all_reduces.append(reduction)

    def _finished(self, reduction: GradientReduction) -> None:
        self._post_reduce_events.append(reduction.post_reduce_event)
        if reduction.all_reduce_buffer is not None:
            self._all_reduce_buffers.append(
                (reduction.all_reduce_buffer, reduction.post_reduce_event)
            )
            reduction.all_reduce_buffer = None
        if reduction.offload_event is not None:
            self._offload_events.append(reduction.offload_event)
