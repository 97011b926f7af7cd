"""FSDPParamGroup: the parameters communicated together, and the comm context groups share.

Design note: sharded storage
    Each parameter's padded shard is an allocation of its own, its registered DTensor's local
    tensor a view of it from element 0, as in torch's FSDP2: what users hold (parameters,
    ``state_dict()`` values, their detached copies) saves, deep-copies, pickles and loads back
    as torch's own tensors do, and ``torch.save`` of one parameter writes that parameter's
    bytes. Until 2026-11 a group kept its shards in one flat buffer, each a view at an offset,
    which let the all-gather read the shards with no copy-in; DTensor carries a local tensor's
    storage offset onto its wrapper, so sharded state dicts could not be saved or copied, and
    the copy-in it saved is one op per unshard on the copy-in stream (see ``_all_gather``):
    docs/architecture.md, "What users hold", has the figures.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardweave.fsdp._fsdp_api import (
    AllGather,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReduceScatter,
    policy_repr,
)
from shardweave.fsdp._fsdp_common import (
    CollectiveKind,
    ShardedState,
    TrainingState,
    collect_grad_tensors,
    in_backward,
    replace_grad_tensors,
    run_eagerly,
)
from shardweave.fsdp._sharding_rules import group_reduce_dtype
from shardweave.fsdp._torch_compat import (
    REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE,
    RESET_ITER_STATE_DROPS_SHARDED_GRADS,
)
from shardweave.fsdp.comm._all_gather import (
    AllGatherResult,
    CopyIn,
    CopyOutViews,
    all_gather_copy_in,
    all_gather_copy_out,
    copy_in_dtype,
)
from shardweave.fsdp.comm._collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
    release_finished_buffer,
)
from shardweave.fsdp.comm._reduction import GradientReduction, ReductionSchedule
from shardweave.fsdp.comm._seam import InFlight, issue
from shardweave.fsdp.comm._streams import CommStreams, wait_event
from shardweave.fsdp.core._param import FSDPParam, ParamModuleInfo
from shardweave.fsdp.core._spmd_types import outside_typecheck, register_local_function
from shardweave.fsdp.tracing import _recorder
from shardweave.mesh import DataParallelMeshInfo, DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo

__all__ = ["FSDPCommContext", "FSDPParamGroup", "param_module_infos"]


class FSDPCommContext:
    """Communication state shared by every group under one root: its streams, the buffers
    other streams still read, and the gradient reductions in flight (see Design note: stream
    ordering in ``comm/_streams``)."""

    def __init__(self) -> None:
        # Groups in post-forward order, with repetition: the implicit backward prefetch target
        # of a group is the one whose forward finished just before it.
        self.post_forward_order: list[FSDPParamGroup] = []
        # When each gradient reduction is waited and its buffers retired (points 6-8).
        self.reductions = ReductionSchedule()
        self._streams: CommStreams | None = None
        # The owner (an FSDPStateContext) of a finalize_backward(async_op=True) whose handle
        # has not been waited on: until then its reductions are in flight in this context and
        # no root sharing it may start work (see FSDPState, Design note: manual finalization).
        self.pending_reduction_owner: object | None = None
        # Point 3: the last forward all-gather's buffers and its copy-out event.
        self.all_gather_state: tuple[AllGatherResult, Any] | None = None
        # Implicit forward prefetch: the states whose forward began, in this iteration's
        # order, and the successor of each in the previous iteration (first occurrence).
        self.forward_order: list[Any] = []
        self._next_in_forward: dict[Any, Any] = {}

    def next_in_forward(self, state: Any) -> list[Any]:
        """The state whose forward followed ``state``'s in the previous iteration, if any."""
        nxt = self._next_in_forward.get(state)
        return [] if nxt is None else [nxt]

    def end_forward(self) -> None:
        """The iteration's forward ended: its order predicts the next iteration's."""
        order, self.forward_order = self.forward_order, []
        self._next_in_forward = {}
        for state, nxt in itertools.pairwise(order):
            if nxt is not state:
                self._next_in_forward.setdefault(state, nxt)

    def streams(self, device: torch.device) -> CommStreams:
        """This context's streams, created on first use (from the device module then in effect)."""
        if self._streams is None:
            self._streams = CommStreams(device)
        return self._streams

    def wait_for_previous_all_gather(self) -> None:
        """Point 3: the all-gather streams wait for the last forward copy-out, whose buffers
        can then be dropped."""
        state, self.all_gather_state = self.all_gather_state, None
        if state is not None and self._streams is not None:
            self._streams.all_gather_waits(state[1])

    def abandon_reductions(self) -> None:
        """After a failed step: wait out what is in flight and drop it."""
        self.reductions.abandon()
        self.all_gather_state = None
        self.forward_order.clear()

    @property
    def reduce_scatter_max_input_buffers(self) -> int:
        return self.reductions.max_input_buffers

    @reduce_scatter_max_input_buffers.setter
    def reduce_scatter_max_input_buffers(self, count: int) -> None:
        self.reductions.max_input_buffers = count


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call on one mesh: one all-gather per unshard, one
    reduce-scatter (plus the HSDP all-reduce) per backward."""

    _training_state: TrainingState
    _module_fqn: str | None

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        modules: tuple[nn.Module, ...],
        mesh_info: DataParallelMeshInfo,
        post_forward_mesh_info: FSDPMeshInfo | None,
        device: torch.device,
        shard_placements: Sequence[Any],
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ) -> None:
        self.modules = modules
        self.mesh_info = mesh_info
        self.post_forward_mesh_info = post_forward_mesh_info
        self.device = device
        self.mp_policy = mp_policy
        offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.offload_policy = offload_policy
        pin = offload and getattr(offload_policy, "pin_memory", False)
        infos = param_module_infos(params, modules)
        # ``param_dtype_override_fn`` is asked once per parameter, here (at fully_shard time,
        # as torch 2.15 does), before any parameter is replaced: a bad answer raises on every
        # rank before anything is sharded.
        param_policies = [mp_policy.for_param(param) for param in params]
        self.fsdp_params = [
            FSDPParam(
                param, info, mesh_info, post_forward_mesh_info, device, placement, offload, pin
            )
            for param, info, placement in zip(params, infos, shard_placements, strict=True)
        ]
        for fsdp_param, policy in zip(self.fsdp_params, param_policies, strict=True):
            fsdp_param.mp_policy = policy
        self.comm_ctx = FSDPCommContext()
        self._training_state = TrainingState.IDLE
        self._sharded_state = ShardedState.SHARDED
        self._module_fqn = None
        self._param_group_index = 0
        self._num_param_groups = 1
        self._all_gather_result: AllGatherResult | None = None
        self._copy_out_views = CopyOutViews()
        self._partial_reduce_output: torch.Tensor | None = None
        # Which parameters (in order) the pending partial holds, and the reduction about to
        # make one: the next reduction repacks it to its own layout where they differ.
        self._partial_layout: tuple[FSDPParam, ...] = ()
        self._reducing_layout: tuple[FSDPParam, ...] = ()
        # Manual finalization: this group's reduction waits for finalize_backward, either
        # because its post-backward ran without gradient sync or because the end of backward
        # deferred it (see FSDPState, Design note: manual finalization).
        self._post_backward_pending = False
        self._post_forward_indices: list[int] = []
        self._lazy_inited = False
        self._orig_dtype: torch.dtype | None = None
        self._reduce_dtype: torch.dtype | None = None
        self._sharded_grad_dtype: torch.dtype | None = None
        self._grad_dtype_rank: dict[torch.dtype, int] = {}
        self._copy_in_dtype: torch.dtype | None = None  # see copy_in_dtype; set at lazy init
        self._state_dict_handles: list[RemovableHandle] = []
        # Controls (FSDPModule setters); defaults as torch's FSDP2.
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction_for_comms = False
        self.reduce_scatter_unused_params = False
        self.reduce_scatter_max_input_buffers = 1
        self.unshard_in_backward = True
        self.unshard_async_op = False
        self._all_gather_comm: AllGather = DefaultAllGather()
        self._reduce_scatter_comm: ReduceScatter = DefaultReduceScatter()
        self._all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self._all_reduce_hook_stream: Any = None  # set_all_reduce_hook(stream=...)
        # Point 4: recorded by an int reshard_after_forward, waited by the next unshard.
        self._reshard_after_forward_event: Any = None
        # RegisterPostBackwardFunction's work; see Design note: hooks run eagerly (_fsdp_common).
        self.post_backward_hook = run_eagerly(self.post_backward)
        # Set by the owning state at lazy init; run after a post-backward that autograd ran, so
        # the reduction it issued lands by the end of that backward (see FSDPState).
        self.after_autograd_post_backward: Callable[[], None] | None = None

    # --- communication controls ---------------------------------------------------------------
    def _require_known_comms(
        self, api: str, all_gather: tuple[type, ...], reduce_scatter: tuple[type, ...]
    ) -> None:
        """``api`` replaces both comms, so a custom one set earlier is an error (torch's type)."""
        for comm, allowed in (
            (self._all_gather_comm, all_gather),
            (self._reduce_scatter_comm, reduce_scatter),
        ):
            if type(comm) not in allowed:
                raise AssertionError(
                    f"cannot call {api}() when the comm is custom: {type(comm).__name__}"
                )

    def _comm_process_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
        """The all-gather's and the reduce-scatter's process groups; ``None`` when the group
        never all-gathers or reduce-scatters (replicate-only)."""
        info = self.mesh_info
        if not isinstance(info, FSDPMeshInfo):
            return None
        return info.shard_process_group, (
            info.reduce_scatter_process_group or info.shard_process_group
        )

    def set_allocate_memory_from_process_group(self, enable: bool) -> None:
        self._require_known_comms(
            "set_allocate_memory_from_process_group",
            (DefaultAllGather, ProcessGroupAllocAllGather, ProcessGroupAllocReduceScatter),
            (DefaultReduceScatter, ProcessGroupAllocAllGather, ProcessGroupAllocReduceScatter),
        )
        groups = self._comm_process_groups()
        if enable and groups is not None:
            self._all_gather_comm = ProcessGroupAllocAllGather(groups[0])
            self._reduce_scatter_comm = ProcessGroupAllocReduceScatter(groups[1])
        else:
            self._all_gather_comm = DefaultAllGather()
            self._reduce_scatter_comm = DefaultReduceScatter()

    def check_symm_mem_comms(self) -> None:
        self._require_known_comms(
            "set_symm_mem_for_comm",
            (DefaultAllGather, SymmMemAllGather),
            (DefaultReduceScatter, SymmMemReduceScatter),
        )

    def set_symm_mem(self, backend: Literal["NCCL"]) -> None:
        """Stage all-gathers and reduce-scatters in symmetric memory (CUDA with NCCL)."""
        self.check_symm_mem_comms()
        self.check_symm_mem_buffers(self.reduce_scatter_max_input_buffers)
        groups = self._comm_process_groups()
        if groups is None:
            return  # replicate-only groups never all-gather or reduce-scatter
        self._all_gather_comm = SymmMemAllGather(groups[0], backend)
        self._reduce_scatter_comm = SymmMemReduceScatter(groups[1], backend)

    def check_symm_mem_buffers(self, max_input_buffers: int) -> None:
        # The symmetric-memory pool hands back one segment per size, so keeping several
        # reduce-scatter inputs alive would register one symmetric segment each.
        if max_input_buffers > 1:
            raise ValueError(
                f"group '{self._fqn}': set_reduce_scatter_max_input_buffers({max_input_buffers}) "
                "cannot be combined with set_symm_mem_for_comm(): symmetric memory keeps one "
                "reduce-scatter input buffer; keep max_input_buffers=1 or drop "
                "set_symm_mem_for_comm()"
            )

    @property
    def uses_symm_mem(self) -> bool:
        return isinstance(self._reduce_scatter_comm, SymmMemReduceScatter)

    def set_separate_reduce_scatter_group(
        self, enable: bool, cache: dict[tuple[int, ...], dist.ProcessGroup]
    ) -> None:
        """Give the reduce-scatter its own process group (one per rank set, shared via
        ``cache``) so it can overlap the all-gather on backends that run one collective at a
        time per communicator."""
        info = self.mesh_info
        if not isinstance(info, FSDPMeshInfo):
            raise AssertionError(
                f"set_separate_reduce_scatter_group needs sharded parameters, got {type(info).__name__}"
            )
        if not enable:
            info.reduce_scatter_process_group = None
            return
        ranks = tuple(dist.get_process_group_ranks(info.shard_process_group))
        if ranks not in cache:
            existing = info.reduce_scatter_process_group
            cache[ranks] = (
                existing
                if existing is not None
                else dist.new_group(
                    list(ranks),
                    use_local_synchronization=True,
                    group_desc="shardweave_reduce_scatter",
                )
            )
        info.reduce_scatter_process_group = cache[ranks]

    # --- initialization -----------------------------------------------------------------------
    def reset_sharded_params(self) -> None:
        """Re-adopt the registered shards (after ``_apply`` or an assign-load). After the
        first forward the dtypes are resolved again too, so a conversion (``model.double()``)
        is trained in its new dtype, as torch 2.15 trains it with a ``param_dtype`` (without
        one every torch release fails in backward: 'Expected out tensor to have dtype
        double')."""
        moved = [p for p in self.fsdp_params if p.reset_sharded_param()]
        if self._lazy_inited:
            for p in moved:  # new storage: a kind's own all-gather starts over from it
                p.detect_extension(p.mp_policy, renew=True)
            self._init_mp_dtypes(detect=False)

    def lazy_init(self) -> None:
        if self._lazy_inited:
            return
        self.reset_sharded_params()
        self._validate_no_meta_params()
        self._validate_cpu_offload_params()
        self._init_mp_dtypes()
        self._register_state_dict_hooks()
        self._lazy_inited = True

    def _init_mp_dtypes(self, detect: bool = True) -> None:
        for p in self.fsdp_params:
            p.init_dtype_attrs(p.mp_policy)
            if detect:
                p.detect_extension(p.mp_policy)
        trainable = [p for p in self.fsdp_params if p.sharded_param.requires_grad]
        orig = {p.orig_dtype for p in trainable}
        if len(orig) > 1:
            raise AssertionError(
                f"FSDP expects uniform original parameter dtype but got {orig} in group "
                f"'{self._fqn}'; cast the module to one dtype or split it into groups"
            )
        self._orig_dtype = next(iter(orig)) if trainable else None
        # What the sharded gradients are handed back in: one dtype for the group, or None when
        # an explicit grad_dtype on some parameters makes them differ (see post_backward).
        grad_dtypes = {p.sharded_grad_dtype for p in trainable}
        self._sharded_grad_dtype = next(iter(grad_dtypes)) if len(grad_dtypes) == 1 else None
        # Where they differ, the reduction lays the gradients out by that dtype (in the order
        # the dtypes first occur; stable within each), as torch 2.15 does, so that each dtype
        # is one run of the output: one cast per dtype, not per parameter.
        first = dict.fromkeys(p.sharded_grad_dtype for p in self.fsdp_params)
        self._grad_dtype_rank = {dtype: i for i, dtype in enumerate(first)}
        # Only a per-parameter param_dtype (param_dtype_override_fn) mixes the dtypes the
        # gradients arrive in: one reduction in their promoted dtype, as torch 2.15 does.
        self._reduce_dtype = group_reduce_dtype(
            [(p.orig_dtype, p.param_dtype, p.reduce_dtype) for p in trainable]
        )
        self._copy_in_dtype = copy_in_dtype(self.fsdp_params)

    def _validate_no_meta_params(self) -> None:
        meta = [p.param_fqn for p in self.fsdp_params if p.sharded_param.device.type == "meta"]
        if meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {meta}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values."
            )

    def _validate_cpu_offload_params(self) -> None:
        if not self.fsdp_params or not self.fsdp_params[0].offload_to_cpu:
            return
        bad = [
            (p.param_fqn, str(p.sharded_param.device))
            for p in self.fsdp_params
            if p.sharded_param.device.type != "cpu"
        ]
        if bad:
            raise RuntimeError(
                "FSDP parameters should be on CPU when using CPU offloading, but got "
                f"(fqn, device): {bad}; call module.cpu() or load the state dict to CPU first"
            )

    def _register_state_dict_hooks(self) -> None:
        if self._state_dict_handles:
            return
        owners = {p._module_info.module for p in self.fsdp_params}

        def to_sharded(*args: Any, **kwargs: Any) -> None:
            # State dicts hold the sharded DTensors; an unsharded module reshards first.
            self._to_sharded()

        def adopt_loaded(*args: Any) -> None:
            # load_state_dict(assign=True) registered new parameters: adopt them now, or the
            # next reshard would put the old ones back (torch re-adopts here too).
            self.reset_sharded_params()

        for module in owners:
            self._state_dict_handles.append(
                module.register_state_dict_pre_hook(to_sharded)  # type: ignore[no-untyped-call]
            )
            self._state_dict_handles.append(
                module._register_load_state_dict_pre_hook(to_sharded)  # type: ignore[no-untyped-call]
            )
            self._state_dict_handles.append(
                module.register_load_state_dict_post_hook(adopt_loaded)  # type: ignore[no-untyped-call]
            )

    # --- unshard / reshard --------------------------------------------------------------------
    @outside_typecheck
    def unshard(self, async_op: bool = False) -> None:
        """Issue this group's all-gather (no-op if unsharded or already in flight).

        Never waits, whatever ``async_op`` says: the all-gather stays in flight until
        ``wait_for_unshard`` (``FSDPModule.unshard`` calls it at once unless ``async_op``).
        ``async_op`` only picks where it runs and how it is waited for: ``False`` in forward
        or pre-backward uses the all-gather side streams; ``True`` (or outside those states)
        uses the caller's current stream, and keeps the ``Work`` for a host-side wait on
        accelerators as well, as torch's ``unshard(async_op=True)`` does.
        """
        if self._all_gather_result is not None or self.is_unsharded:
            return
        if not self._lazy_inited:
            self.lazy_init()
        post_forward = self._sharded_state == ShardedState.SHARDED_POST_FORWARD
        info: DataParallelMeshInfo | None = (
            self.post_forward_mesh_info if post_forward else self.mesh_info
        )
        assert info is not None
        if _recorder.ACTIVE is not None:  # see Design note: tracing hooks (tracing/_recorder)
            _recorder.ACTIVE.unshard_begin(self.trace_key)
        world, rank = (
            (info.shard_mesh_size, info.shard_mesh_rank)
            if isinstance(info, FSDPMeshInfo)
            else (1, 0)
        )
        if world == 1 and self._unshards_from_shards(post_forward):
            self._unshard_from_shards()
            return
        copy_in_stream, all_gather_stream = self._all_gather_streams(async_op)
        # Point 4: a post-forward reshard wrote the shards the all-gather streams read. The
        # previous forward copy-out is not waited for here but after this group's own copy-out
        # (point 3), so this copy-in and all-gather overlap it, as in torch's FSDP2.
        event, self._reshard_after_forward_event = self._reshard_after_forward_event, None
        wait_event(copy_in_stream, event)
        wait_event(all_gather_stream, event)
        copy_in, output = self._copy_in(world, rank, copy_in_stream)
        inp, sizes, as_bytes = copy_in.input, copy_in.split_sizes, copy_in.as_bytes
        # Read on another stream than its own (see the table in comm/_streams); a shard kept
        # with it costs nothing.
        kept_input = None if output is not None else inp
        if world == 1:
            # No collective: the copy-out reads the copy-in's result directly.
            done = InFlight(self._fqn, self.device, None, copy_in_stream.record_event())
            self._all_gather_result = AllGatherResult(
                inp, done, world, sizes, as_bytes, post_forward, kept_input
            )
            return
        assert isinstance(info, FSDPMeshInfo)
        if output is None and isinstance(self._all_gather_comm, SymmMemAllGather):
            # In place, as the comm's peers address only the symmetric output: this rank's
            # input (its only parameter's shard, or a parameter kind's one input) is copied into
            # its own slot of it, on the copy-in stream.
            output, inp = self._copy_into_own_slot(inp, world, rank, copy_in_stream)
            kept_input = None
        all_gather_stream.wait_stream(copy_in_stream)
        if output is None:
            with self.comm_ctx.streams(self.device).use(all_gather_stream):
                output = self._all_gather_comm.allocate(
                    (world * inp.numel(),), dtype=inp.dtype, device=self.device
                )
        in_flight = self._issue_all_gather(inp, output, info, all_gather_stream, async_op)
        self._all_gather_result = AllGatherResult(
            output, in_flight, world, sizes, as_bytes, post_forward, kept_input
        )

    def _all_gather_output(
        self, world: int, rank: int, numel: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A new all-gather output for ``numel`` elements per rank, and this rank's slot."""
        output = self._all_gather_comm.allocate((world * numel,), dtype=dtype, device=self.device)
        return output, output.narrow(0, rank * numel, numel)

    def _copy_in(
        self, world: int, rank: int, copy_in_stream: Any
    ) -> tuple[CopyIn, torch.Tensor | None]:
        """This rank's all-gather input, built on ``copy_in_stream``, and the all-gather
        output when the copy-in wrote into this rank's slot of it (else None)."""
        slots: list[torch.Tensor] = []  # the all-gather output, when the copy-in allocated it

        def into(numel: int, dtype: torch.dtype) -> torch.Tensor:
            # On the copy-in stream, as torch's FSDP2: both all-gather streams wait for the
            # copy-out before either reuses memory (point 3).
            output, slot = self._all_gather_output(world, rank, numel, dtype)
            slots.append(output)
            return slot

        gather_into = into if world > 1 else None
        with self.comm_ctx.streams(self.device).use(copy_in_stream):
            copy_in = all_gather_copy_in(
                self.fsdp_params, self._copy_in_dtype, self.device, gather_into
            )
        if _recorder.ACTIVE is not None:
            # The gathered bytes in the parameters' dtype (one rank per shard: the input may
            # be the uncast shards, as the copy-out casts).
            inp, dtype = copy_in.input, copy_in.gathered_dtype
            staged_in_dtype = copy_in.as_bytes or inp.dtype == dtype
            numel = inp.numel() if staged_in_dtype else sum(copy_in.split_sizes)
            _recorder.ACTIVE.copy_in_end(self.trace_key, world * numel * dtype.itemsize)
        return copy_in, slots[0] if slots else None

    def _copy_into_own_slot(
        self, inp: torch.Tensor, world: int, rank: int, copy_in_stream: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A new all-gather output with ``inp`` copied into this rank's slot on the copy-in
        stream: (the output, the slot, which is the all-gather input from now on)."""
        with self.comm_ctx.streams(self.device).use(copy_in_stream):
            output, slot = self._all_gather_output(world, rank, inp.numel(), inp.dtype)
            slot.copy_(inp)
        return output, slot

    def _issue_all_gather(
        self,
        inp: torch.Tensor,
        output: torch.Tensor,
        info: FSDPMeshInfo,
        all_gather_stream: Any,
        async_op: bool,
    ) -> InFlight:
        """Issue the all-gather of ``inp`` into ``output`` on ``all_gather_stream``. Never
        waited here: the wait is at wait_for_unshard, so a prefetched all-gather overlaps
        compute (on CPU too, where gloo runs collectives on its own threads)."""
        comm, pg = self._all_gather_comm, info.shard_process_group

        def launch(async_op: bool) -> dist.Work | None:
            return comm(output_tensor=output, input_tensor=inp, group=pg, async_op=async_op)

        return issue(
            CollectiveKind.ALL_GATHER,
            launch,
            group=pg,
            tensor=output,
            name=self._fqn,
            trace_key=lambda: self.trace_key,
            streams=self.comm_ctx.streams(self.device),
            stream=all_gather_stream,
            what=lambda: f"the all-gather of group '{self._fqn}'",
            host_wait=async_op,
        )

    def _all_gather_streams(self, async_op: bool) -> tuple[Any, Any]:
        """(copy-in, all-gather) streams: the side streams for a synchronous unshard in
        forward or pre-backward, else the current stream for both (as torch's FSDP2: an
        explicit ``unshard()`` runs where its caller runs)."""
        streams = self.comm_ctx.streams(self.device)
        if not async_op and self._training_state in (
            TrainingState.FORWARD,
            TrainingState.PRE_BACKWARD,
        ):
            return streams.all_gather_copy_in, streams.all_gather
        current = streams.current()
        return current, current

    @outside_typecheck
    def wait_for_unshard(self) -> None:
        """Finish the in-flight all-gather: copy out and register the unsharded parameters."""
        result = self._all_gather_result
        if result is None:
            return
        if _recorder.ACTIVE is not None:
            _recorder.ACTIVE.wait_begin(self.trace_key)
        streams = self.comm_ctx.streams(self.device)
        current = streams.current()
        if result.in_flight is not None:
            result.in_flight.wait(streams, current)
        if _recorder.ACTIVE is not None:
            _recorder.ACTIVE.all_gather_done(self.trace_key)
        self._all_gather_result = None
        if result.split_sizes:  # empty when the unsharded params alias the shards
            outputs = [p.alloc_all_gather_outputs() for p in self.fsdp_params]
            outs = tuple(t for targets in outputs for t in targets)
            # See Design note: storage resize (FSDPParam). Refilling must not bump the version
            # counter, or autograd would reject the parameters it saved in forward. What
            # torch.no_grad() and _unsafe_preserve_version_counter(outs) do, without building
            # the two context managers on every unshard.
            # Buffers first allocated under inference_mode have no version counter (nor
            # does autograd save them): nothing to preserve, as in torch's FSDP2.
            versions = _versions(outs)
            grad_enabled = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                all_gather_copy_out(result, self.fsdp_params, outputs, outs, self._copy_out_views)
            finally:
                if versions is not None:
                    torch._C._autograd._unsafe_set_version_counter(outs, versions)
                torch._C._set_grad_enabled(grad_enabled)
            copy_out_event = current.record_event()
            # Point 3: the all-gather streams must not reuse these buffers before the copy-out.
            self.comm_ctx.wait_for_previous_all_gather()
            on_host = result.in_flight is not None and result.in_flight.finished_on_host
            if self._training_state == TrainingState.FORWARD and not on_host:
                self.comm_ctx.all_gather_state = (result, copy_out_event)
            else:
                streams.all_gather_waits(copy_out_event)
                if on_host and result.output is not None:
                    # CPU: free it now that its owner waited (a no-op there)
                    release_finished_buffer(result.output, self._all_gather_comm)
        for p in self.fsdp_params:
            p.init_unsharded_param()
            p.to_unsharded()
        self._sharded_state = ShardedState.UNSHARDED
        if _recorder.ACTIVE is not None:
            _recorder.ACTIVE.unshard_end(self.trace_key)

    @outside_typecheck
    def reshard(self) -> None:
        if self._training_state == TrainingState.FORWARD:
            if self.post_forward_mesh_info is None:
                return  # reshard_after_forward=False
            if self.post_forward_mesh_info is not self.mesh_info:
                self._to_sharded_post_forward()
                return
        self._to_sharded()

    def _to_sharded(self) -> None:
        if self._sharded_state != ShardedState.SHARDED:
            for p in self.fsdp_params:
                p.to_sharded()
            self._sharded_state = ShardedState.SHARDED
            if _recorder.ACTIVE is not None:
                _recorder.ACTIVE.reshard(self.trace_key, kept=self.keeps_unsharded_storage)

    def _to_sharded_post_forward(self) -> None:
        if self._sharded_state == ShardedState.UNSHARDED:
            for p in self.fsdp_params:
                p.to_sharded_post_forward()
            # Point 4: the copies ran on the current stream; the next unshard reads them.
            streams = self.comm_ctx.streams(self.device)
            self._reshard_after_forward_event = streams.current().record_event()
            self._sharded_state = ShardedState.SHARDED_POST_FORWARD
            if _recorder.ACTIVE is not None:
                _recorder.ACTIVE.reshard(self.trace_key, kept=self.keeps_unsharded_storage)

    def set_keep_unsharded_storage(self, keep: bool) -> None:
        """Keep (or free, the default) the unsharded storage at reshard; see Design note:
        storage resize (``FSDPParam``). Storage kept so far is freed at the next reshard."""
        for p in self.fsdp_params:
            p.keep_unsharded_storage = keep

    @property
    def keeps_unsharded_storage(self) -> bool:
        """Whether a reshard leaves every parameter's unsharded storage allocated."""
        return all(p.keep_unsharded_storage for p in self.fsdp_params)

    @property
    def is_unsharded(self) -> bool:
        return self._sharded_state == ShardedState.UNSHARDED

    # --- hooks --------------------------------------------------------------------------------
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        entering = self._training_state != TrainingState.FORWARD
        self._training_state = TrainingState.FORWARD
        self.unshard(self.unshard_async_op)  # outside spmd_types type checking (_spmd_types)
        self.wait_for_unshard()
        for fsdp_param in self.fsdp_params:
            fsdp_param.restore_spmd_types()
        if entering:
            args, kwargs = self._register_post_backward_hook(args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module | None, input: Any, output: Any) -> Any:
        if not in_backward():  # a checkpoint recompute must not reshard or reorder
            self.reshard()
            index = len(self.comm_ctx.post_forward_order)
            self.comm_ctx.post_forward_order.append(self)
            self._post_forward_indices.append(index)
        self._training_state = TrainingState.IDLE
        return output

    def pre_backward(self, default_prefetch: bool) -> None:
        if self._training_state == TrainingState.PRE_BACKWARD:
            return
        self._training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard(self.unshard_async_op)
            self.wait_for_unshard()
        if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE:
            for p in self.fsdp_params:
                p.set_unsharded_grad_dtype(self.reduce_grads)
        if default_prefetch:
            self._backward_prefetch()

    @outside_typecheck
    def post_backward(self) -> None:
        """Reshard and reduce this group's gradients (idempotent for unused groups)."""
        if _recorder.ACTIVE is not None and _recorder.ACTIVE.hook_depth == 0:
            return _recorder.ACTIVE.time_hook("post_backward", self.trace_key, self.post_backward)
        self._training_state = TrainingState.POST_BACKWARD
        for p in self.fsdp_params:
            p.accumulate_unsharded_grad_if_needed()
        if not self.reduce_grads:
            self._post_backward_pending = True
            if self.reshard_after_backward:
                self.reshard()
            for p in self.fsdp_params:
                p.to_accumulated_grad_if_needed()
            return
        self._post_backward_pending = False
        with_grad: list[FSDPParam] = []
        grads: list[torch.Tensor] = []
        # A parameter with a slot in the pending partial sum (set_requires_all_reduce(False))
        # is reduced in every later microbatch, as zeros where it has no gradient, so its slot
        # is carried to the synchronized one (torch 2.15; before, torch added the partial to
        # whatever parameters the next layout held).
        pending = frozenset(() if self._partial_reduce_output is None else self._partial_layout)
        unused_too = self.reduce_scatter_unused_params
        for p in self.fsdp_params:
            grad = p.take_unsharded_grad(unused_too or p in pending)
            if grad is not None:
                with_grad.append(p)
                grads.append(grad)
        if self.reshard_after_backward:
            self.reshard()
        if not with_grad:
            return
        # A group whose params were all frozen at lazy init has no recorded dtype; if the user
        # unfroze them since, reduce and keep the grads in their own dtype, as torch does.
        if self._orig_dtype is None:
            orig_dtype: torch.dtype | None = grads[0].dtype
        else:
            orig_dtype = self._sharded_grad_dtype
        if orig_dtype is None:  # explicit grad_dtypes differ: by dtype, see _init_mp_dtypes
            rank = self._grad_dtype_rank
            order = sorted(
                range(len(with_grad)), key=lambda i: rank[with_grad[i].sharded_grad_dtype]
            )
            with_grad, grads = [with_grad[i] for i in order], [grads[i] for i in order]
        self._reducing_layout = tuple(with_grad)
        streams = self.comm_ctx.streams(self.device)
        traced_bytes = 0
        if _recorder.ACTIVE is not None:
            traced_bytes = sum(g.numel() * g.element_size() for g in grads)
            _recorder.ACTIVE.grads_taken(self.trace_key, traced_bytes)
        reduction = GradientReduction(
            with_grad,
            grads,
            reduce_scatter_group=self._reduce_scatter_group,
            reduce_scatter_comm=self._reduce_scatter_comm,
            orig_dtype=orig_dtype,
            reduce_dtype=self._reduce_dtype,
            device=self.device,
            divide_factor=self.gradient_divide_factor,
            all_reduce_group=self._all_reduce_group,
            all_reduce_grads=self.all_reduce_grads,
            partial_reduce_output=self._partial_reduce_output,
            partial_params=self._partial_layout,
            all_reduce_hook=self._all_reduce_hook,
            all_reduce_hook_stream=self._all_reduce_hook_stream,
            force_sum=self.force_sum_reduction_for_comms,
            streams=streams,
            group_name=self._fqn,
            trace_key=lambda: self.trace_key,
            on_done=self._set_partial_reduce_output,
            traced_bytes=traced_bytes,
        )
        self.comm_ctx.reductions.submit(reduction, streams, bucketed=self._can_bucket())

    def _set_partial_reduce_output(self, partial: torch.Tensor | None) -> None:
        self._partial_reduce_output = partial
        self._partial_layout = self._reducing_layout if partial is not None else ()

    def _unshards_from_shards(self, post_forward: bool) -> bool:
        """With one rank per shard: whether unsharding needs neither a collective nor a staged
        input, as every parameter contributes its own padded shard, already on the device."""
        return not post_forward and all(
            p.gathers_padded_shard and p.sharded_param_data.device == self.device
            for p in self.fsdp_params
        )

    def _unshard_from_shards(self) -> None:
        """One rank per shard: the shard *is* the padded full parameter. The unsharded
        parameters view the shards in place where nothing is cast and no smaller post-forward
        mesh will free them (see ``FSDPParam.alias_sharded_storage``); otherwise the copy-out
        copies each shard into its unsharded storage, casting as it copies."""
        params = self.fsdp_params
        info = self.mesh_info
        if all(p.unsharded_dtype == p.sharded_param_data.dtype for p in params) and (
            self.post_forward_mesh_info is None or self.post_forward_mesh_info is info
        ):
            for p in params:
                p.alias_sharded_storage()
            self._all_gather_result = AllGatherResult(None, None, 1, [], False, False)
            return
        sources = [p.sharded_param_data for p in params]
        sizes = [s.numel() for s in sources]
        if _recorder.ACTIVE is not None:
            itemsize = params[0].unsharded_dtype.itemsize
            _recorder.ACTIVE.copy_in_end(self.trace_key, sum(sizes) * itemsize)
        self._all_gather_result = AllGatherResult(
            None, None, 1, sizes, False, False, sources=sources
        )

    def _can_bucket(self) -> bool:
        """Replicate-only groups with default reduction share gradient buckets (see
        ``ReductionSchedule.submit``), on every device; anything customized keeps its own
        all-reduce."""
        return (
            isinstance(self.mesh_info, DDPMeshInfo)
            and not isinstance(self.mesh_info, FSDPMeshInfo)
            and self.mesh_info.replicate_mesh_size > 1
            and self.all_reduce_grads
            and self._partial_reduce_output is None
            and self.gradient_divide_factor is None
            and not self.force_sum_reduction_for_comms
            and self._all_reduce_hook is None
        )

    def finalize_backward(self) -> None:
        result = self._all_gather_result
        if result is not None:
            # A prefetch nobody consumed (mistargeted): finish it so the buffer is released.
            if result.in_flight is not None:
                streams = self.comm_ctx.streams(self.device)
                current = streams.current()
                result.in_flight.wait(streams, current)
                # Point 3: dropping the buffers lets the all-gather streams reuse them.
                streams.all_gather_waits(current.record_event())
            self._all_gather_result = None
            if _recorder.ACTIVE is not None:
                _recorder.ACTIVE.discard_unshard(self.trace_key)
        self._post_forward_indices.clear()

    def reset_iter_state(self) -> None:
        """Drop in-flight work and pending reductions after a failed step."""
        result = self._all_gather_result
        if result is not None and result.in_flight is not None:
            result.in_flight.abandon()
        if result is not None and _recorder.ACTIVE is not None:
            _recorder.ACTIVE.discard_unshard(self.trace_key)
        self._all_gather_result = None
        self._partial_reduce_output = None
        self._partial_layout = ()
        self._post_backward_pending = False
        self._reshard_after_forward_event = None
        self._post_forward_indices.clear()
        for p in self.fsdp_params:
            p.unsharded_accumulated_grad = None
            if p.has_unsharded_param:
                p.unsharded_param.grad = None
            if RESET_ITER_STATE_DROPS_SHARDED_GRADS:
                p.sharded_param.grad = None
        self._training_state = TrainingState.IDLE
        self._to_sharded()

    def _backward_prefetch(self) -> None:
        if not self._post_forward_indices:
            return  # cleared by an earlier backward through the same forward
        index = self._post_forward_indices.pop()
        order = self.comm_ctx.post_forward_order
        if self._num_param_groups > 1:
            # Several groups in one state (per-parameter meshes): only the second group
            # prefetches, every group of the module that ran just before this one.
            if self._param_group_index != 1:
                return
            target_modules: tuple[nn.Module, ...] | None = None
            for i in range(index - 1, -1, -1):
                target = order[i]
                if target.modules is self.modules:
                    continue
                if target_modules is None:
                    target_modules = target.modules
                elif target.modules is not target_modules:
                    break
                target.prefetch_unshard(TrainingState.PRE_BACKWARD)
        elif index > 0:
            order[index - 1].prefetch_unshard(TrainingState.PRE_BACKWARD)

    @outside_typecheck
    def prefetch_unshard(self, training_state: TrainingState) -> None:
        """Unshard in ``training_state`` (which decides the streams), then restore the state.
        Inline rather than a context manager: it runs for every group in every step."""
        previous = self._training_state
        self._training_state = training_state
        try:
            self.unshard(self.unshard_async_op)
        finally:
            self._training_state = previous

    def _register_post_backward_hook(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not torch.is_grad_enabled():
            return args, kwargs
        inputs = collect_grad_tensors((args, kwargs))
        if not inputs:
            return args, kwargs
        register_local_function(RegisterPostBackwardFunction)  # it passes inputs through
        outputs = RegisterPostBackwardFunction.apply(self, *inputs)  # type: ignore[no-untyped-call]
        new_args, new_kwargs = replace_grad_tensors((args, kwargs), iter(outputs))
        return new_args, new_kwargs

    # --- process groups -----------------------------------------------------------------------
    @property
    def _reduce_scatter_group(self) -> dist.ProcessGroup | None:
        info = self.mesh_info
        if not isinstance(info, FSDPMeshInfo):
            return None  # replicate-only: gradients are all-reduced, never scattered
        return info.reduce_scatter_process_group or info.shard_process_group

    @property
    def _all_reduce_group(self) -> dist.ProcessGroup | None:
        info: DataParallelMeshInfo = self.mesh_info
        if isinstance(info, (HSDPMeshInfo, DDPMeshInfo)):
            return info.replicate_process_group
        return None

    @property
    def _fqn(self) -> str:
        return self._module_fqn or "<root>"

    @property
    def fqn(self) -> str:
        """The module FQN(s) of this group (``"<root>"`` for the root module)."""
        return self._fqn

    @property
    def trace_key(self) -> str:
        """The tracer's key for this group (see Design note: traced quantities, ``tracing/_recorder``)."""
        return _recorder.group_key(self._fqn, self._param_group_index, self._num_param_groups)

    def consistency_lines(self, index: int) -> list[str]:
        """What every rank must agree on about this group, one fact per line (the root's
        cross-rank check, ``_consistency.describe_groups``)."""
        info = self.mesh_info
        post = self.post_forward_mesh_info
        post_desc = (
            "none" if post is None else ("same" if post is info else str(post.shard_mesh_size))
        )
        lines = [
            f"group {index} '{self._module_fqn}': {type(info).__name__} "
            f"shard={getattr(info, 'shard_mesh_size', 1)} "
            f"replicate={getattr(info, 'replicate_mesh_size', 1)} "
            f"reshard_after_forward={post_desc} mp={policy_repr(self.mp_policy)} "
            f"offload={type(self.offload_policy).__name__}"
        ]
        for p in self.fsdp_params:
            lines.append(
                f"  param '{p.param_fqn}': shape={tuple(p.orig_size)} dtype={p.orig_dtype} "
                f"requires_grad={p.sharded_param.requires_grad} shard_dim={p.shard_dim} "
                f"param_dtype={p.param_dtype} reduce_dtype={p.reduce_dtype}"
            )
        return lines

    def __repr__(self) -> str:
        return f"FSDPParamGroup(fqn={self._module_fqn}, params={len(self.fsdp_params)})"


class RegisterPostBackwardFunction(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs the group's post-backward, i.e. once
    gradients for everything the module computed (its parameters included) are ready."""

    @staticmethod
    def forward(ctx: Any, group: FSDPParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group: FSDPParamGroup = ctx.group
        group.post_backward_hook()
        if group.after_autograd_post_backward is not None:
            group.after_autograd_post_backward()
        return (None, *grads)


def param_module_infos(
    params: Sequence[nn.Parameter], modules: tuple[nn.Module, ...]
) -> list[ParamModuleInfo]:
    """Where each parameter lives, including every alias of a tied parameter or shared module."""
    wanted = set(params)
    infos: dict[nn.Parameter, ParamModuleInfo] = {}
    for module in modules:
        for _, submodule in module.named_modules(remove_duplicate=False):
            for name, param in submodule._parameters.items():
                if param not in wanted:  # also skips slots registered as None
                    continue
                info = infos.get(param)
                if info is None:
                    infos[param] = ParamModuleInfo(submodule, name)
                elif not (info.module is submodule and info.param_name == name) and not any(
                    m is submodule and n == name
                    for m, n in zip(info.shared_modules, info.shared_param_names, strict=True)
                ):
                    info.shared_modules.append(submodule)
                    info.shared_param_names.append(name)
    missing = [p for p in params if p not in infos]
    if missing:
        raise AssertionError(f"{len(missing)} parameters are not in the module tree of {modules}")
    return [infos[p] for p in params]


def _versions(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...] | None:
    """Each tensor's version counter, or None when one is an inference tensor (which has none:
    reading it raises, so the common case pays no per-tensor check)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        if any(t.is_inference() for t in tensors):
            return None
        raise
