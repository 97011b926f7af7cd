"""The one seam every engine collective passes through, and the group copy-in/copy-out.

Functions here take explicit buffers, process groups, comm objects and streams; they never
look at modules or training state (the param group decides *when*, this module decides
*how*). See Design note: tensor vocabulary (``_fsdp_common``) and Design note: stream ordering
(``_fsdp_streams``).

Design note: the collective seam
    Every collective the engine issues (all-gather, reduce-scatter, the HSDP all-reduce,
    replicate's bucketed all-reduce) goes through ``issue``, and is finished through
    ``InFlight.wait``. Issuing runs the opt-in collective check, opens the tracer's record,
    and calls the comm inside ``stream(...)`` of the stream it belongs to, then records an
    event there. Waiting makes the consuming stream wait for that event and, where the
    backend completes work on its own threads (CPU: gloo, the threaded test group), waits for
    the ``Work`` on the host, polling the failure channel (``_fault.wait``). On stream-ordered
    devices (``CommStreams.stream_ordered``: accelerators, and the test accelerator) the comm
    is called with ``async_op=False`` inside the stream context, as torch's FSDP2 does: the
    backend runs it on that stream, the host never blocks, and buffers live by the engine's
    own references (see Design note: stream ordering); only ``unshard(async_op=True)`` keeps
    a ``Work`` for later, waited without a timeout (stream-ordered on NCCL). The watchdog
    (``_watchdog``) polls each ``Work``, or the event after a stream-ordered collective, for
    completion to diagnose stalls; on stream-ordered devices a wait here never marks a
    collective done (see Design note: the watchdog). Before issuing, the seam raises a
    failure or verdict this rank adopted (``_fault.raise_if_failed``). The c10d calls themselves come
    from the ``COLLECTIVES`` extension point (c10d by default, shipped by this package).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.distributed as dist

from shardweave.fsdp import _fault, _trace, _watchdog
from shardweave.fsdp._fsdp_api import AllGather, ReduceScatter
from shardweave.fsdp._fsdp_streams import CommStreams, wait_event
from shardweave.fsdp._torch_compat import all_gather_single, reduce_scatter_single
from shardweave.mesh.extension_points import COLLECTIVES, Collectives

if TYPE_CHECKING:
    from shardweave.fsdp._fsdp_param import FSDPParam
    from shardweave.fsdp._trace import CollectiveRecord

__all__ = [
    "AllGatherResult",
    "C10dCollectives",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "GradientReduction",
    "InFlight",
    "ProcessGroupAllocAllGather",
    "ProcessGroupAllocReduceScatter",
    "SymmMemAllGather",
    "SymmMemReduceScatter",
    "all_gather_copy_in",
    "all_gather_copy_out",
    "collectives_for",
    "gradient_divide_factors",
    "issue",
    "release_finished_buffer",
]

ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType


class _EmptyAllocate:
    """Staging buffers from ``torch.empty`` (the caching allocator on GPUs)."""

    def allocate(
        self, size: tuple[int, ...] | torch.Size, *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _GroupAllocate:
    """Staging buffers from the process group's own allocator when its backend has one (NCCL
    zero-copy registration); otherwise (gloo) ``torch.empty``, as torch's FSDP2 does."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(
        self, size: tuple[int, ...] | torch.Size, *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        backend = self._group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            numel = 1
            for s in size:
                numel *= int(s)
            return backend.allocate_tensor(numel, dtype=dtype, device=device)
        return torch.empty(size, dtype=dtype, device=device)


class _SymmMemAllocate:
    """Staging buffers in symmetric memory (CUDA with NCCL): every peer can address them, so
    NCCL may pick its copy-engine or symmetric-kernel collectives. They come from the
    symmetric-memory pool, so a step reuses the segments registered by the previous one
    instead of registering new ones."""

    def __init__(self, group: dist.ProcessGroup, backend: Literal["NCCL"] = "NCCL") -> None:
        # Imported here: the module needs a CUDA-enabled build to be useful, and CPU-only users
        # never construct this class.
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self._group = group
        symm_mem.set_backend(backend)
        # The first rendezvous needs the group's communicator to exist; a barrier creates it
        # once, at setup, instead of inside the first all-gather.
        dist.barrier(group=group)

    def allocate(
        self, size: tuple[int, ...] | torch.Size, *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        pool = self._symm_mem.get_mem_pool(device)
        with torch.cuda.use_mem_pool(pool):
            return torch.empty(size, dtype=dtype, device=device)

    def _rendezvous(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        self._symm_mem.rendezvous(tensor, group=group.group_name)


class C10dCollectives:
    """The engine's collectives as plain c10d calls: the default ``COLLECTIVES`` plugin.

    Registered under the key ``"default"`` through this package's entry point; a plugin
    registered for a device type (``"cuda"``, ``"cpu"``, ...) replaces it for that type.
    """

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        async_op: bool = False,
    ) -> dist.Work | None:
        return all_gather_single(output, input, group=group, async_op=async_op)

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        return reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        return cast(
            "dist.Work | None", dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        )


_C10D = C10dCollectives()
_collectives_cache: dict[str, Collectives] = {}


def collectives_for(device: torch.device) -> Collectives:
    """The ``COLLECTIVES`` plugin for ``device``'s type, else the ``"default"`` one.

    Looked up once per device type and process (a plugin registered later applies to the
    next process). Without installed metadata (sources on ``PYTHONPATH``) the entry point
    is not discoverable, so the built-in c10d default is used directly.
    """
    found = _collectives_cache.get(device.type)
    if found is None:
        registered = COLLECTIVES.registered()
        found = registered.get(device.type) or registered.get("default") or _C10D
        _collectives_cache[device.type] = found
    return found


class _AllGatherSingle(AllGather):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return collectives_for(output_tensor.device).all_gather_into_tensor(
            output_tensor, input_tensor, group, async_op=async_op
        )


class _ReduceScatterSingle(ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        return collectives_for(output_tensor.device).reduce_scatter_tensor(
            output_tensor, input_tensor, group, op=op, async_op=async_op
        )


class SymmMemAllGather(_SymmMemAllocate, _AllGatherSingle):
    """``all_gather_single`` into a symmetric-memory output buffer (``set_symm_mem_for_comm``).

    The all-gather is in place: the group copies its input into this rank's slot of the
    symmetric output (``FSDPParamGroup.unshard``), so only the output is exchanged with the
    peers."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self._rendezvous(output_tensor, group)
        return super().__call__(output_tensor, input_tensor, group, async_op)


class SymmMemReduceScatter(_SymmMemAllocate, _ReduceScatterSingle):
    """``reduce_scatter_single`` with input and output in symmetric memory."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        self._rendezvous(input_tensor, group)
        self._rendezvous(output_tensor, group)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class DefaultAllGather(_EmptyAllocate, _AllGatherSingle):
    """``all_gather_single`` on the group, into a ``torch.empty`` buffer."""


class DefaultReduceScatter(_EmptyAllocate, _ReduceScatterSingle):
    """``reduce_scatter_single`` on the group, into a ``torch.empty`` buffer."""


class ProcessGroupAllocAllGather(_GroupAllocate, _AllGatherSingle):
    """All-gather whose buffers come from the process group's allocator when it has one."""


class ProcessGroupAllocReduceScatter(_GroupAllocate, _ReduceScatterSingle):
    """Reduce-scatter whose buffers come from the process group's allocator when it has one."""


def release_finished_buffer(buffer: torch.Tensor, comm: AllGather | ReduceScatter) -> None:
    """Free a collective's engine-allocated buffer once the collective has been waited on.

    Design note: releasing collective buffers
        A backend's Work keeps the tensors it was given until the Work object is destroyed, and
        gloo destroys it on its worker thread, on that thread's schedule: often well after
        ``wait()`` returned. On the benchmark GPT, all-gather outputs and reduce-scatter inputs
        of groups long finished were still allocated at the backward peak, 3-6 MiB (10-20%) on
        some ranks and steps and nothing on others, so the peak depended on thread timing.
        After ``wait()`` on CPU the collective has finished and nothing reads the buffer again
        (the all-gather output has been copied out, the reduce-scatter input was only read), so
        its storage is freed here (resized to 0 bytes; the Work keeps an empty tensor).

        Only ``torch.empty`` buffers of the default comms, and only where the collective was
        finished by a host wait (``InFlight.finished_on_host``: not on stream-ordered devices),
        are released: a custom comm's ``allocate`` may hand out memory it reuses (a pool,
        symmetric memory), and on accelerators dropping the last reference after the owning
        stream waited is the release. Callers release only after the stream that allocated
        the buffer has waited for its last use (see Design note: stream ordering), so the
        discipline is the accelerators' one even where streams are no-ops.
    """
    if type(comm) in (DefaultAllGather, DefaultReduceScatter):
        buffer.untyped_storage().resize_(0)


class _EventCompletion:
    """What the watchdog polls for a stream-ordered collective: its event, device-side."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def is_completed(self) -> bool:
        return bool(self._event.query())


@dataclass
class InFlight:
    """An issued collective: what its consumer waits on before reading the output."""

    what: str | Callable[[], str]  # names the collective in errors
    device: torch.device
    work: dist.Work | None  # waited on the host (CPU backends, async unshards); else None
    event: Any  # recorded on the issuing stream after the collective; None on CPU
    record: CollectiveRecord | None = None  # the tracer's, when tracing
    tracked: _watchdog.Tracked | None = None  # the watchdog's entry
    ignores_timeout: bool = False  # see _fault._wait_on_thread (gloo's reduce-scatter)
    done: bool = field(default=False, init=False)
    # Its Work was waited on the host on a device whose streams do not order collectives
    # (CPU): the collective has finished writing, and its buffers may be released early.
    finished_on_host: bool = field(default=False, init=False)

    def wait(self, streams: CommStreams, stream: Any) -> None:
        """Make ``stream`` wait for the collective (idempotent); see Design note: the
        collective seam."""
        if self.done:
            return
        self.done = True
        wait_event(stream, self.event)
        if self.work is not None:
            self.finished_on_host = not streams.stream_ordered
            record = self.record
            if record is not None and record.wait_ns is None:
                record.wait_ns = _trace.now()
            if self.tracked is not None and self.finished_on_host:
                self.tracked.host_waits()  # the watchdog times a CPU stall from here
            with streams.use(stream):  # NCCL orders an untimed wait on the current stream
                try:
                    _fault.wait(
                        self.work, self.what, self.device, ignores_timeout=self.ignores_timeout
                    )
                except (_fault.PeerFailureError, _fault.CollectiveMismatchError):
                    raise
                except RuntimeError as error:
                    # The backend gave up (a peer's connection closed): name the rank.
                    named = _watchdog.explain(self.tracked) if self.tracked else None
                    if named is None:
                        raise
                    raise named from error
        if self.record is not None:
            self.record.complete_ns = _trace.now()
        if self.tracked is not None and not streams.stream_ordered:
            # Waited on the host: done, whatever is_completed() says (gloo's reduce-scatter
            # finishes its copy inside wait() and its Work never reports completion). On
            # stream-ordered devices the wait only ordered streams: the watchdog keeps
            # polling the device-side completion (see Design note: the watchdog).
            self.tracked.finish()
        self.work = None  # a finished Work only keeps its tensors alive

    def abandon(self) -> None:
        """Wait for the work after a failed step, swallowing its error (nothing reads it)."""
        if self.work is not None and not self.done:
            self.done = True
            with contextlib.suppress(Exception):
                _fault.wait(self.work, self.what, self.device)
        if self.tracked is not None:
            self.tracked.finish()


def issue(
    kind: str,
    launch: Callable[[bool], dist.Work | None],
    *,
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    name: str,
    trace_key: str | Callable[[], str],
    streams: CommStreams,
    stream: Any,
    what: str | Callable[[], str],
    host_wait: bool = False,
) -> InFlight:
    """Issue one collective on ``stream`` (see Design note: the collective seam).

    ``launch(async_op)`` calls the comm; ``tensor`` is what the check and the tracer
    describe (the all-gather output, the reduce-scatter input, the all-reduced tensor).
    On stream-ordered devices the comm is called with ``async_op=False`` inside the stream
    context, as torch's FSDP2 does: the backend runs it on ``stream`` (NCCL on the current
    stream, no hop through its internal one) and nothing waits on the host; the watchdog
    then polls the event recorded after it. ``host_wait`` keeps a ``Work`` for a later wait
    there too (torch's ``unshard(async_op=True)``); on CPU the ``Work`` is always kept.
    """
    _fault.raise_if_failed(what)  # a published failure or verdict: see _fault
    step, seq = _fault.next_collective()
    if _fault.checks_enabled():
        checks: list[_watchdog.Tracked] = []

        def watch_check(work: dist.Work) -> None:
            entry = _watchdog.Tracked(
                step, seq, kind, name, group, tensor.device.type, work, check=True
            )
            entry.host_waits()  # the check is waited at once, on the host
            _watchdog.track(entry)
            checks.append(entry)

        try:
            _fault.check_collective(
                group, kind, name, tensor.numel(), tensor.dtype, tensor.device, seq, watch_check
            )
        except (_fault.PeerFailureError, _fault.CollectiveMismatchError):
            raise
        except RuntimeError as error:  # the backend gave up under the check: name the rank
            named = _watchdog.explain(checks[0]) if checks else None
            if named is None:
                raise
            raise named from error
        for entry in checks:
            entry.finish()  # its result was read on the host
    record = None
    if _trace.ACTIVE is not None:  # see Design note: tracing hooks (_trace)
        key = trace_key if isinstance(trace_key, str) else trace_key()
        record = _trace.ACTIVE.collective_issue(kind, key, tensor, group)
    host_side = host_wait or not streams.stream_ordered
    with streams.use(stream):
        work = launch(True) if host_side else launch(False)
        event = stream.record_event()
    if not host_side:
        work = None  # a backend may return one anyway; the event is what orders it
    tracked = None
    polled = work if work is not None else _EventCompletion(event) if event is not None else None
    if polled is not None:
        tracked = _watchdog.Tracked(
            step,
            seq,
            kind,
            name,
            group,
            tensor.device.type,
            polled,
            device_side=streams.stream_ordered,
        )
        _watchdog.track(tracked)
    return InFlight(
        what,
        tensor.device,
        work,
        event,
        record,
        tracked,
        # gloo's reduce-scatter blocks in a timed wait; other CPU collectives honor it.
        ignores_timeout=kind == "reduce_scatter" and tensor.device.type == "cpu",
    )


@dataclass
class AllGatherResult:
    """An issued all-gather whose copy-out has not run yet."""

    output: torch.Tensor  # 1D, world_size * input numel, rank-major
    in_flight: InFlight | None  # None when nothing was gathered (one rank per shard)
    world_size: int
    split_sizes: list[int]  # each param's numel per rank, in units of ``output``'s dtype
    as_bytes: bool  # output is uint8 because the inputs' dtypes differed
    post_forward: bool  # gathered from the post-forward shards (already in final layout)
    # The all-gather input when it is not the sharded storage itself (a cast, a
    # concatenation): read on the all-gather stream, so kept as long as the output.
    input: torch.Tensor | None = None


def all_gather_copy_in(
    fsdp_params: Sequence[FSDPParam],
    flat_sharded: torch.Tensor | None,
    param_dtype: torch.dtype | None,
    device: torch.device,
    post_forward: bool,
) -> tuple[torch.Tensor, list[int], bool]:
    """The 1D all-gather input, each param's numel in it, and whether it is a byte view.

    With the group's flat sharded storage (see Design note: flat storage in
    ``_fsdp_param_group``) the input *is* the storage, or one cast of it: no per-parameter copy.
    """
    if flat_sharded is not None and not post_forward:
        data = flat_sharded
        if data.device != device:
            data = data.to(device, non_blocking=True)
        if param_dtype is not None and data.dtype != param_dtype:
            data = data.to(param_dtype)
        return data, [p.padded_sharded_numel for p in fsdp_params], False
    inputs = [t for p in fsdp_params for t in p.all_gather_inputs()]
    dtypes = {t.dtype for t in inputs}
    as_bytes = len(dtypes) > 1
    if as_bytes:
        # Mixed dtypes (e.g. frozen bf16 beside fp32) travel as one byte buffer.
        inputs = [t.contiguous().view(torch.uint8) for t in inputs]
    sizes = [t.numel() for t in inputs]
    if len(inputs) == 1:
        return inputs[0], sizes, as_bytes
    return torch.cat(inputs), sizes, as_bytes


def all_gather_copy_out(result: AllGatherResult, fsdp_params: Sequence[FSDPParam]) -> None:
    """Split the gathered buffer into each parameter's all-gather output in one pass."""
    world = result.world_size
    outs: list[torch.Tensor] = []
    fixups: list[tuple[FSDPParam, torch.Tensor]] = []
    for fsdp_param in fsdp_params:
        targets = fsdp_param.alloc_all_gather_outputs()
        if fsdp_param.shard_dim != 0 and not result.post_forward and not fsdp_param.has_extension:
            # Rows of a dim-d shard are chunks along d: gather into a scratch buffer, then
            # concatenate along d into the real layout.
            scratch = torch.empty_like(targets[0])
            fixups.append((fsdp_param, scratch))
            targets = [scratch]
        for target in targets:
            if result.as_bytes:
                target = target.view(torch.uint8)
            outs.append(target.view(world, -1))
    gathered = result.output.view(world, -1)
    if len(outs) == 1:
        outs[0].copy_(gathered)
    else:
        torch.split_with_sizes_copy(gathered, result.split_sizes, dim=1, out=outs)
    for fsdp_param, scratch in fixups:
        shards = scratch.view(world * fsdp_param.padded_sharded_size[0], -1)
        pieces = [c.view(fsdp_param.padded_sharded_size) for c in torch.chunk(shards, world, dim=0)]
        torch.cat(
            pieces,
            dim=fsdp_param.shard_dim,
            out=fsdp_param.all_gather_output.view(fsdp_param.orig_size),
        )


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


def _div_(tensor: torch.Tensor, factor: float | None) -> None:
    if factor is not None and factor != 1:
        tensor.div_(factor)


class GradientReduction:
    """One group's gradient reduction: copy-in, reduce-scatter, (HSDP) all-reduce, the hook,
    then the sharded gradients; a resumable sequence that pauses at each collective.

    ``start()`` fills the reduce-scatter input and issues the first collective; each
    ``advance()`` waits for the collective in flight and runs on to the next one (or to the
    end). The comm context decides when to advance: at once on accelerators, where waits are
    stream-ordered and cost the host nothing; at a later group's post-backward or at the end
    of backward on CPU, where waiting blocks the host but the backend's threads run the
    collective meanwhile (see Design note: stream ordering, points 5-7).
    """

    def __init__(
        self,
        fsdp_params: Sequence[FSDPParam],
        grads: list[torch.Tensor],
        *,
        reduce_scatter_group: dist.ProcessGroup | None,
        reduce_scatter_comm: ReduceScatter,
        orig_dtype: torch.dtype,
        reduce_dtype: torch.dtype | None,
        device: torch.device,
        divide_factor: float | None,
        all_reduce_group: dist.ProcessGroup | None,
        all_reduce_grads: bool,
        partial_reduce_output: torch.Tensor | None,
        all_reduce_hook: Callable[[torch.Tensor], None] | None,
        all_reduce_hook_stream: Any,
        force_sum: bool,
        streams: CommStreams,
        group_name: str,
        trace_key: str | Callable[[], str],
        on_done: Callable[[torch.Tensor | None], None],
    ) -> None:
        grad_dtypes = {g.dtype for g in grads}
        if len(grad_dtypes) != 1:
            names = ", ".join(p.param_fqn for p in fsdp_params)
            raise AssertionError(
                f"FSDP reduce-scatter expects one gradient dtype per group, got {grad_dtypes} "
                f"for [{names}]"
            )
        self._params = list(fsdp_params)
        self._grads = grads
        self._rs_group = reduce_scatter_group
        self._rs_comm = reduce_scatter_comm
        self._orig_dtype = orig_dtype
        self._rdtype = reduce_dtype or grads[0].dtype
        self._device = device
        self._divide_factor = divide_factor
        self._ar_group = all_reduce_group
        self._all_reduce_grads = all_reduce_grads
        self._partial = partial_reduce_output
        self._hook = all_reduce_hook
        self._hook_stream = all_reduce_hook_stream
        self._force_sum = force_sum
        self._streams = streams
        self._name = group_name
        self._trace_key = trace_key
        self._on_done = on_done
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
            self._on_done(stop.value)

    def _run(self) -> Generator[tuple[InFlight, Any], None, torch.Tensor | None]:
        streams, rdtype = self._streams, self._rdtype
        rs_group, ar_group = self._rs_group, self._ar_group
        world = rs_group.size() if rs_group is not None else 1
        ar_size = ar_group.size() if ar_group is not None else 1
        pre, post, rs_op, ar_op = gradient_divide_factors(
            world, ar_size, rdtype, self._divide_factor, self._force_sum
        )
        laid_out = [
            p.grad_for_reduce_scatter(g, world)
            for p, g in zip(self._params, self._grads, strict=True)
        ]
        out_numel = sum(p.padded_sharded_numel for p in self._params)
        current = streams.current()
        rs_input = self._rs_comm.allocate((world * out_numel,), dtype=rdtype, device=self._device)
        # One kernel, on the current stream (where the gradients were computed): chunk every
        # grad into `world` dim-0 pieces (zero padded), cast, and lay rank i's pieces side by
        # side in row i.
        torch._chunk_cat(laid_out, dim=0, num_chunks=world, out=rs_input.view(world, -1))
        self._grads.clear()  # the unsharded grads can be freed now: the copy-in read them
        del laid_out
        if _trace.ACTIVE is not None:  # see Design note: tracing hooks (_trace)
            _trace.ACTIVE.grads_reduced()
        self.reduce_scatter_input = rs_input
        rs_stream = streams.reduce_scatter
        rs_stream.wait_stream(current)
        with streams.use(rs_stream):
            _div_(rs_input, pre)
            # The output is the reduce-scatter stream's own block, also with one rank: the input
            # belongs to the current stream, which must not have to wait for the all-reduce or
            # the casts before reusing it (see Design note: stream ordering, points 6 and 8).
            output = self._rs_comm.allocate((out_numel,), dtype=rdtype, device=self._device)
        if world > 1:
            assert rs_group is not None
            comm, out = self._rs_comm, output

            def launch(async_op: bool) -> dist.Work | None:
                return comm(
                    output_tensor=out,
                    input_tensor=rs_input,
                    group=rs_group,
                    op=rs_op,
                    async_op=async_op,
                )

            in_flight = issue(
                "reduce_scatter",
                launch,
                group=rs_group,
                tensor=rs_input,
                name=self._name,
                trace_key=self._trace_key,
                streams=streams,
                stream=rs_stream,
                what=lambda: f"the reduce-scatter of group '{self._name}'",
            )
            self.reduce_scatter_event = in_flight.event
            yield in_flight, rs_stream
            self.reduce_scatter_finished_on_host = in_flight.finished_on_host
        else:
            with streams.use(rs_stream):
                if self._divide_factor is not None and pre is None and post is None:
                    # Difference from torch: torch divides by the factor here *and* applies
                    # pre/post factors in the fp16/force-sum cases; we divide exactly once.
                    torch.div(rs_input, self._divide_factor, out=output)
                else:
                    output.copy_(rs_input)
            self.reduce_scatter_event = rs_stream.record_event()
        post_stream = rs_stream
        if ar_group is not None:
            with streams.use(rs_stream):
                if not self._all_reduce_grads:
                    # HSDP accumulation: keep the partial sum for the synchronized microbatch.
                    if self._partial is not None:
                        self._partial += output
                        output = self._partial
                    self.post_reduce_event = rs_stream.record_event()
                    return output
                if self._partial is not None:
                    output += self._partial
            ar_stream = streams.all_reduce
            ar_stream.wait_stream(rs_stream)
            reduced = output
            in_flight = issue(
                "all_reduce",
                lambda async_op: collectives_for(self._device).all_reduce(
                    reduced, ar_group, op=ar_op, async_op=async_op
                ),
                group=ar_group,
                tensor=reduced,
                name=self._name,
                trace_key=self._trace_key,
                streams=streams,
                stream=ar_stream,
                what=lambda: f"the all-reduce of group '{self._name}'",
            )
            yield in_flight, ar_stream
            post_stream = ar_stream
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
            if output.dtype != self._orig_dtype:
                output = output.to(self._orig_dtype)
            offset = 0
            offloaded = False
            for fsdp_param in self._params:
                numel = fsdp_param.padded_sharded_numel
                offloaded |= fsdp_param.assign_sharded_grad(output.narrow(0, offset, numel))
                offset += numel
            self.post_reduce_event = post_stream.record_event()
            if offloaded:  # the same event orders the non-blocking device-to-host copies
                self.offload_event = self.post_reduce_event
        return None
