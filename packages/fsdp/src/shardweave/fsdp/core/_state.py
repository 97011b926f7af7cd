"""FSDPState: the hooks of one ``fully_shard`` call and the root's per-iteration duties."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from shardweave.fsdp._fsdp_api import policy_repr
from shardweave.fsdp._fsdp_common import (
    TrainingState,
    apply_to_tensors,
    cast_floating,
    collect_grad_tensors,
    in_backward,
    inputs_to_device,
    moves_forward_inputs,
    run_eagerly,
)
from shardweave.fsdp._torch_compat import STATE_EXPOSES_ONE_GROUP
from shardweave.fsdp.core._param_group import FSDPCommContext, FSDPParamGroup
from shardweave.fsdp.core._spmd_types import activate_outside_typecheck, outside_typecheck
from shardweave.fsdp.faults import _failures, _watchdog
from shardweave.fsdp.faults._consistency import check_ranks_agree, describe_groups
from shardweave.fsdp.tracing import _recorder
from shardweave.mesh import DDPMeshInfo

if TYPE_CHECKING:
    from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy
    from shardweave.mesh import DataParallelMeshInfo

__all__ = [
    "FULLY_SHARD_API",
    "EngineAPI",
    "FSDPState",
    "FSDPStateContext",
    "GradientReductionToken",
    "get_fsdp_state",
]

# Where a module's state lives: in the module's own ``__dict__``. The state refers to its
# modules (and its hooks to the state), so a map from module to state outside the module, even a
# weak-keyed one, keeps every sharded model alive for the life of the process (the map holds the
# state strongly, the state the key). On the module, the two form a cycle the collector frees.
_STATE_ATTR = "_shardweave_fsdp_state"


def get_fsdp_state(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get(_STATE_ATTR)


@dataclass(frozen=True)
class EngineAPI:
    """What an API built on the engine says about itself; the engine's only per-API facts.

    ``fully_shard`` and ``replicate`` differ here and in their arguments, nowhere in the
    engine: a sibling package attaches the engine with its own description instead of
    subclassing ``FSDPState``.
    """

    name: str  # the API's function name, in every error message
    # torch's name for this kind of state in its root-check messages; users' and torch's own
    # tests match on those sentences, so ours start with them.
    torch_state_name: str
    # The APIs whose states a root of this API adopts (a replicate root adopts only replicate
    # states; a fully_shard root adopts both, as torch's does).
    adopts: frozenset[str]


FULLY_SHARD_API: Final = EngineAPI("fully_shard", "FSDP", frozenset({"fully_shard", "replicate"}))


class FSDPStateContext:
    """Per-iteration state shared by every FSDPState under one root."""

    def __init__(self) -> None:
        self.all_states: list[FSDPState] = []
        # The state whose forward started this iteration's forward pass; it finishes grouped
        # states that did not run and releases forward-only resources at its post-forward.
        self.iter_forward_root: FSDPState | None = None
        self.post_backward_final_callback_queued = False
        self.reductions_callback_queued = False
        self.is_last_backward = True
        self.post_optim_event: torch.Event | None = None
        # See Design note: manual finalization. What the caller asked for, and the mode the
        # current backward iteration runs in (latched at its first pre-backward, cleared when
        # the iteration ends), so that a change mid-iteration is refused instead of half-applied.
        self.manual_backward_finalization = False
        self.manual_finalization_active: bool | None = None
        # A finalize_backward(async_op=True) whose handle has not been waited on.
        self.reduction_handle_pending = False


class GradientReductionToken:
    """Identifies one asynchronous finalization; a reset replaces the comm context's token,
    which is how a handle learns it was invalidated."""

    def __init__(self, owner: FSDPStateContext) -> None:
        self.owner = owner


# Design note: manual finalization
# In the default mode the root's end-of-backward callback (queued by the first pre-backward)
# finishes the iteration: it runs the post-backward of groups autograd did not reach, waits for
# every reduction and, on the last backward, finalizes the groups. With
# ``set_manual_backward_finalization(True)`` (torch 2.15's API; ours on every torch) the caller
# owns that point instead: the callback leaves the reductions in flight (on stream-ordered
# devices; the host still waits for them on CPU, see _finish_reductions_at_backward_end_now)
# and only marks the groups autograd did not reach as pending (``_post_backward_pending``, also set by a post-backward run
# without gradient sync), and ``finalize_backward`` later runs their post-backward, waits, and
# ends the iteration. With ``async_op=True`` the wait (and the release of the reduction buffers
# the schedule keeps alive, points 6-8 of Design note: stream ordering) moves to the handle's
# ``wait()``; until then the reductions stay in the schedule, so the seam's in-flight records and
# the watchdog keep seeing them, and the next forward refuses to start. ``reset_iter_state``
# abandons them and invalidates the handle (its token is no longer the comm context's).


class FSDPState:
    """Hooks and root logic for the module(s) of one ``fully_shard`` (or ``api``) call."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        *,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        mesh_info: DataParallelMeshInfo,
        auto_reshard_after_forward: bool = False,
        api: EngineAPI = FULLY_SHARD_API,
    ) -> None:
        self.api = api
        self._modules = modules
        self._device = device
        self._mp_policy = mp_policy
        self._mesh_info = mesh_info
        self._auto_reshard_after_forward = auto_reshard_after_forward
        self._fsdp_param_groups: list[FSDPParamGroup] = []
        self._is_root: bool | None = None
        self._exc_at_forward: BaseException | None = None
        self._state_ctx = FSDPStateContext()
        self._comm_ctx = FSDPCommContext()
        self._training_state = TrainingState.IDLE
        self._states_to_forward_prefetch: list[FSDPState] = []
        self.implicit_forward_prefetch = False  # FSDPModule.set_implicit_forward_prefetch
        self._states_to_backward_prefetch: list[FSDPState] = []
        self._modules_to_run_forward: set[nn.Module] = set()
        self._hook_handles: list[RemovableHandle] = []
        for module in modules:
            if (other := get_fsdp_state(module)) is not None:
                raise AssertionError(
                    f"{api.name}: {type(module).__name__} is already managed by "
                    f"{other.api.name}; each distinct composable distributed API "
                    "can only be applied to a module once"
                )
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
        # What torch calls back into, each made once and run outside dynamo's tracing (see
        # Design note: hooks run eagerly, _fsdp_common); register_fsdp_forward_method uses the
        # forward pair too.
        # The outside_typecheck methods are looked up when called: spmd_types loaded after
        # this (activate_outside_typecheck at lazy init) still wraps them.
        activate_outside_typecheck()
        self.pre_forward_hook = run_eagerly(self._pre_forward)
        self.post_forward_hook = run_eagerly(lambda *a: self._post_forward(*a))
        self._pre_backward_hook = run_eagerly(lambda grad: self._pre_backward(grad))
        self._final_callback = run_eagerly(lambda: self._root_post_backward_final_callback())
        self._reductions_callback = run_eagerly(self._finish_reductions_at_backward_end)
        self._register_forward_hooks()

    @property
    def _fsdp_param_group(self) -> FSDPParamGroup | None:
        # torch's FSDPState has this private attribute; code that reads it (torch's
        # FSDPMemTracker, some of torch's own tests) reaches into torch's engine, which ours is
        # not. Still an AttributeError (hasattr stays False), with a sentence that says so.
        # Except on torch < 2.13, whose PipelineStage finishes a stage's backward through it
        # (see _torch_compat): there a state of at most one group answers with it.
        if STATE_EXPOSES_ONE_GROUP and len(self._fsdp_param_groups) <= 1:
            return self._fsdp_param_groups[0] if self._fsdp_param_groups else None
        raise AttributeError(
            "'FSDPState' object has no attribute '_fsdp_param_group': this is shardweave's "
            "FSDPState, and _fsdp_param_group is a private attribute of torch's engine. Code that "
            "reaches into torch's FSDP internals (e.g. torch.distributed._tools.FSDPMemTracker) "
            "does not work with shardweave; for memory and timing, use shardweave.fsdp.trace, "
            "and shardweave.fsdp.plan to predict the peak"
        )

    def detach(self) -> None:
        """Undo the registration (a failed ``fully_shard`` leaves the modules untouched)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for module in self._modules:
            if get_fsdp_state(module) is self:
                del module.__dict__[_STATE_ATTR]

    # --- hook registration --------------------------------------------------------------------
    def _register_forward_hooks(self) -> None:
        modules = self._modules
        if len(modules) == 1:
            module = modules[0]
            self._hook_handles.append(
                module.register_forward_pre_hook(
                    self.pre_forward_hook, prepend=True, with_kwargs=True
                )
            )
            self._hook_handles.append(module.register_forward_hook(self.post_forward_hook))
            return
        # fully_shard([a, b]): one group, several modules, possibly not all run per pass.
        every = set(modules)

        def pre_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if not self._modules_to_run_forward:
                self._modules_to_run_forward.update(every)
            return self._pre_forward(module, args, kwargs)

        def make_post_hook(owner: nn.Module) -> Callable[[nn.Module, Any, Any], Any]:
            def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
                if owner in self._modules_to_run_forward:
                    self._modules_to_run_forward.discard(owner)
                    if not self._modules_to_run_forward:
                        return self._post_forward(module, args, output)
                return self._cast_output(output)

            return post_hook

        for module in modules:
            self._hook_handles.append(
                module.register_forward_pre_hook(
                    run_eagerly(pre_hook), prepend=True, with_kwargs=True
                )
            )
            self._hook_handles.append(
                module.register_forward_hook(run_eagerly(make_post_hook(module)), always_call=True)
            )

    # --- lazy init ----------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self._is_root is not None:
            return  # already a root, or adopted by one
        activate_outside_typecheck()  # spmd_types loaded after fully_shard
        if len(self._modules) > 1:
            kinds = ", ".join(type(m).__name__ for m in self._modules)
            raise RuntimeError(
                f"{self.api.torch_state_name} requires a single root module but got "
                f"{len(self._modules)} modules ({kinds}); call forward through a module that "
                f"contains them all (and apply {self.api.name} to it) first"
            )
        root = self._modules[0]
        for module in root.modules():
            state = get_fsdp_state(module)
            if (
                state is not None
                and state is not self
                and state._state_ctx.manual_backward_finalization
            ):
                raise RuntimeError(
                    "set_manual_backward_finalization must be called on the root "
                    f"{self.api.torch_state_name} module (it was called on "
                    f"{type(module).__name__}, which is not the root)"
                )
        self._is_root = True
        ctx = self._state_ctx
        ctx.all_states = []
        for name, module in root.named_modules():
            state = get_fsdp_state(module)
            if state is None or state.api.name not in self.api.adopts:
                continue
            if state in ctx.all_states:
                continue
            if state is not self:
                if state._is_root is not None:
                    who = self.api.torch_state_name
                    raise RuntimeError(
                        f"{who} state has already been lazily initialized for {name}\n"
                        f"{who} requires running forward through the root module first "
                        f"(the forward of {self.api.name} submodule '{name}' ran before the "
                        "root's)"
                    )
                state._is_root = False
            ctx.all_states.append(state)
        if self._auto_reshard_after_forward:
            # The root is all-gathered again right at backward's start: keep it unsharded.
            for group in self._fsdp_param_groups:
                group.post_forward_mesh_info = None
        self._adopt_tied_after_fully_shard()
        self._init_fqns()
        self._init_shared_state()
        self._validate_no_duplicate_params()
        for state in ctx.all_states:
            for group in state._fsdp_param_groups:
                group.lazy_init()
        groups = [g for s in ctx.all_states for g in s._fsdp_param_groups]
        nonce = check_ranks_agree(
            describe_groups(
                [g.consistency_lines(i) for i, g in enumerate(groups)],
                policy_repr(self._mp_policy),
                self.api.name,
            ),
            self._mesh_info,
            self._device,
            self.api.name,
        )
        _failures.new_epoch(nonce)
        _watchdog.new_epoch()
        self._register_failure_hooks(root)

    def _register_failure_hooks(self, root: nn.Module) -> None:
        """Publish an exception escaping the root's forward (see ``faults/_failures``) so peers waiting
        in a collective raise instead of hanging."""

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            exc = sys.exc_info()[1]
            # An exception the caller was already handling when forward began is not ours.
            if exc is not None and exc is not self._exc_at_forward:
                _failures.publish_failure(exc, f"forward of {type(module).__name__}")
            self._exc_at_forward = None

        # A forward hook, not a pre-hook: this runs inside the pre-hooks' iteration.
        self._hook_handles.append(root.register_forward_hook(run_eagerly(leave), always_call=True))

    def _adopt_tied_after_fully_shard(self) -> None:
        """Several FSDPParams whose modules hold one sharded parameter now (tied after
        fully_shard, as transformers does after loading) share one storage; see FSDPParam,
        Design note: tied after fully_shard. The owner is the one registered first in module
        order, where ``named_parameters()`` names the tied parameter."""
        order = {m: i for i, m in enumerate(self._modules[0].modules())}
        claims: dict[int, list[Any]] = {}  # FSDPParams by what their modules hold
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for p in group.fsdp_params:
                    if p.storage_owner is None:
                        claims.setdefault(id(p.registered_param()), []).append(p)
        for claimants in claims.values():
            if len(claimants) < 2:
                continue
            claimants.sort(key=lambda p: order.get(p.module, len(order)))
            for p in claimants[1:]:
                p.adopt_tied(claimants[0])

    def _init_fqns(self) -> None:
        root = self._modules[0]
        by_param: dict[nn.Parameter, Any] = {}
        by_module: dict[nn.Module, list[FSDPParamGroup]] = {}
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group._module_fqn = None
                for p in group.fsdp_params:
                    by_param[p.sharded_param] = p
                for module in group.modules:
                    by_module.setdefault(module, []).append(group)
        for name, param in root.named_parameters():
            if param in by_param:
                by_param[param].param_fqn = name
        for name, module in root.named_modules():
            for group in by_module.get(module, []):
                group._module_fqn = (
                    name if group._module_fqn is None else f"{group._module_fqn}, {name}"
                )

    def _init_shared_state(self) -> None:
        for state in self._state_ctx.all_states:
            state._state_ctx = self._state_ctx
            state._comm_ctx = self._comm_ctx
            count = len(state._fsdp_param_groups)
            for i, group in enumerate(state._fsdp_param_groups):
                group.comm_ctx = self._comm_ctx
                group.after_autograd_post_backward = state._ensure_reductions_finish
                group._param_group_index = i
                group._num_param_groups = count
        self.update_reduce_scatter_max_input_buffers()

    def update_reduce_scatter_max_input_buffers(self) -> None:
        """The shared comm context keeps the largest count any of its groups asked for."""
        states = self._state_ctx.all_states or [self]
        self._comm_ctx.reduce_scatter_max_input_buffers = max(
            (g.reduce_scatter_max_input_buffers for s in states for g in s._fsdp_param_groups),
            default=1,
        )

    def _validate_no_duplicate_params(self) -> None:
        seen: dict[int, str] = {}
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for p in group.fsdp_params:
                    if p.orig_param_uid in seen:
                        raise ValueError(
                            f"Parameter '{p.param_fqn}' is shared with a parameter already "
                            f"managed by another FSDP group ('{seen[p.orig_param_uid]}'). For "
                            "shared/tied parameters, use fully_shard([module_a, module_b]) to "
                            "place them in the same FSDP group."
                        )
                    seen[p.orig_param_uid] = p.param_fqn

    @property
    def _trace_key(self) -> str:
        """The tracer files this state's hook times under its first group's bare FQN."""
        groups = self._fsdp_param_groups
        return groups[0].fqn if groups else "<no params>"

    # --- forward ------------------------------------------------------------------------------
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if (
            _recorder.ACTIVE is not None and _recorder.ACTIVE.hook_depth == 0
        ):  # see tracing/_recorder
            return _recorder.ACTIVE.time_hook(
                "pre_forward", self._trace_key, self._pre_forward, module, args, kwargs
            )
        if (
            self._state_ctx.reduction_handle_pending
            or self._comm_ctx.pending_reduction_owner is not None
        ):
            raise RuntimeError(
                "The previous gradient reduction must be waited on before forward: call wait() "
                "on the GradientReductionHandle that finalize_backward(async_op=True) returned"
            )
        if self._training_state == TrainingState.PRE_BACKWARD:
            # Activation-checkpoint recompute inside backward: just make the params available.
            for group in self._fsdp_param_groups:
                if not group.is_unsharded:
                    group.unshard()
                    group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first_in_pass = self._training_state != TrainingState.FORWARD
        self._training_state = TrainingState.FORWARD
        if first_in_pass:
            args, kwargs = self._root_pre_forward(args, kwargs)
        args, kwargs = self._cast_inputs(args, kwargs)
        for group in self._fsdp_param_groups:
            args, kwargs = group.pre_forward(module, args, kwargs)
        if first_in_pass:
            targets = self._states_to_forward_prefetch
            if not targets and self.implicit_forward_prefetch:
                targets = self._comm_ctx.next_in_forward(self)
            self._comm_ctx.forward_order.append(self)
            for state in targets:
                for group in state._fsdp_param_groups:
                    group.prefetch_unshard(TrainingState.FORWARD)
        return args, kwargs

    @outside_typecheck
    def _root_pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._exc_at_forward = sys.exc_info()[1]
        self._lazy_init()
        if self._state_ctx.iter_forward_root is not None:
            return args, kwargs
        self._state_ctx.iter_forward_root = self
        _failures.new_step()
        # See Design note: stream ordering (comm/_streams), point 1: the optimizer wrote the
        # shards that this iteration's all-gathers read.
        streams = self._comm_ctx.streams(self._device)
        event, self._state_ctx.post_optim_event = self._state_ctx.post_optim_event, None
        if event is not None:
            streams.all_gather_waits(event)
        else:
            current = streams.current()
            streams.all_gather_copy_in.wait_stream(current)
            streams.all_gather.wait_stream(current)
        if (args or kwargs) and moves_forward_inputs(self._device):
            args, kwargs = inputs_to_device(args, kwargs, self._device)
        return args, kwargs

    @outside_typecheck
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if _recorder.ACTIVE is not None and _recorder.ACTIVE.hook_depth == 0:
            return _recorder.ACTIVE.time_hook(
                "post_forward", self._trace_key, self._post_forward, module, args, output
            )
        if self._training_state == TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        for group in self._fsdp_param_groups:
            output = group.post_forward(module, args, output)
        self._register_pre_backward_hook(output)
        self._training_state = TrainingState.IDLE
        if self._state_ctx.iter_forward_root is self:
            self._complete_unfinished_states(output)
            self._comm_ctx.wait_for_previous_all_gather()  # the forward's last copy-out
            self._comm_ctx.end_forward()
            self._state_ctx.iter_forward_root = None
            _failures.enter_phase(_failures.Phase.AFTER_FORWARD)  # the watchdog's position
        return self._cast_output(output)

    def _complete_unfinished_states(self, output: Any) -> None:
        """Finish grouped states some of whose modules did not run (e.g. a chunked-loss head)."""
        for state in reversed(self._state_ctx.all_states):
            if state is self or not state._modules_to_run_forward:
                continue
            for group in state._fsdp_param_groups:
                group.post_forward(None, None, output)
            state._register_pre_backward_hook(output)
            state._training_state = TrainingState.IDLE
            state._modules_to_run_forward.clear()

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self._mp_policy.param_dtype
        if not (self._mp_policy.cast_forward_inputs and dtype is not None):
            return args, kwargs
        cast = cast_floating(dtype)
        return apply_to_tensors(cast, args), apply_to_tensors(cast, kwargs)

    def _cast_output(self, output: Any) -> Any:
        dtype = self._mp_policy.output_dtype
        if dtype is None:
            return output
        return apply_to_tensors(cast_floating(dtype), output)

    # --- backward -----------------------------------------------------------------------------
    def _register_pre_backward_hook(self, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for tensor in collect_grad_tensors(output):
            if tensor._base is not None:
                names = ", ".join(type(m).__name__ for m in self._modules)
                warnings.warn(
                    f"{self.api.name}-wrapped module ({names}) returned a view tensor; an "
                    "in-place op on it (x += y) drops the pre-backward hook and skips the "
                    "all-gather. Use out-of-place ops or .clone() the output first.",
                    UserWarning,
                    stacklevel=3,
                )
            tensor.register_hook(self._pre_backward_hook)  # type: ignore[no-untyped-call]

    @outside_typecheck
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if _recorder.ACTIVE is not None and _recorder.ACTIVE.hook_depth == 0:
            return _recorder.ACTIVE.time_hook(
                "pre_backward", self._trace_key, self._pre_backward, grad
            )
        self._training_state = TrainingState.PRE_BACKWARD
        _failures.enter_phase(_failures.Phase.BACKWARD)  # the watchdog's position
        self._queue_final_callback()
        default_prefetch = not self._states_to_backward_prefetch
        for group in self._fsdp_param_groups:
            group.pre_backward(default_prefetch)
        for state in self._states_to_backward_prefetch:
            for group in reversed(state._fsdp_param_groups):
                group.prefetch_unshard(TrainingState.PRE_BACKWARD)
        return grad

    def _queue_final_callback(self) -> None:
        ctx = self._state_ctx
        if ctx.post_backward_final_callback_queued:
            return
        if ctx.manual_finalization_active is None:
            ctx.manual_finalization_active = ctx.manual_backward_finalization
        ctx.post_backward_final_callback_queued = True
        Variable._execution_engine.queue_callback(self._final_callback)

    def _ensure_reductions_finish(self) -> None:
        """After a group's post-backward that autograd ran: if no pre-backward hook queued the
        final callback, this backward saw none of this iteration's hooked outputs (a module of a
        grouped call run on its own, say a chunked-loss head per chunk). Its reduction must still
        land when the backward ends, as torch's does, not one backward later."""
        ctx = self._state_ctx
        if ctx.post_backward_final_callback_queued or ctx.reductions_callback_queued:
            return
        ctx.reductions_callback_queued = True
        Variable._execution_engine.queue_callback(self._reductions_callback)

    def _finish_reductions_at_backward_end(self) -> None:
        # Only the reductions: the iteration's states stay as they are for the backward through
        # the rest of the model, which runs the final callback. Under manual finalization they
        # wait for finalize_backward (see Design note: manual finalization).
        try:
            if self._finish_reductions_at_backward_end_now():
                self._comm_ctx.reductions.finish()
        finally:
            self._state_ctx.reductions_callback_queued = False

    def _manual_finalization(self) -> bool:
        """The mode of this backward iteration, or the one asked for if it has not started."""
        ctx = self._state_ctx
        active = ctx.manual_finalization_active
        return ctx.manual_backward_finalization if active is None else active

    def _finish_reductions_at_backward_end_now(self) -> bool:
        """Whether the reductions autograd started are finished when a backward ends. Under
        manual finalization they stay in flight until finalize_backward on stream-ordered
        devices, whose watchdog polls their events; on CPU the host waits for them here, as
        in the default mode: a gloo reduce-scatter's Work never reports completion until
        waited, so one left unwaited would make this rank look busy in a collective to the
        watchdog of a peer stuck on a finalization this rank never runs, and that peer would
        get no PeerIdleError (see Design note: manual finalization)."""
        if not self._manual_finalization():
            return True
        return not self._comm_ctx.streams(self._device).stream_ordered

    @outside_typecheck
    def _root_post_backward_final_callback(self) -> None:
        ctx = self._state_ctx
        try:
            manual = ctx.manual_finalization_active
            if manual is None:
                raise AssertionError("the backward's finalization mode was not latched")
            ctx.iter_forward_root = None
            for state in ctx.all_states:
                state._modules_to_run_forward.clear()
                for group in reversed(state._fsdp_param_groups):
                    if group._training_state != TrainingState.POST_BACKWARD:
                        if manual and group.reduce_grads:
                            # finalize_backward reduces it, after any later backward
                            # (see Design note: manual finalization).
                            group._post_backward_pending = True
                        else:
                            # Inputs needed no grad, or the module was unused: reduce what
                            # exists.
                            group.post_backward()
                    group._training_state = TrainingState.IDLE
                state._training_state = TrainingState.IDLE
            if not manual:
                self._comm_ctx.reductions.finish()
                if ctx.is_last_backward:
                    self._end_backward_iteration()
            elif self._finish_reductions_at_backward_end_now():
                self._comm_ctx.reductions.finish()
            _failures.enter_phase(_failures.Phase.AFTER_BACKWARD)  # the watchdog's position
        finally:
            ctx.post_backward_final_callback_queued = False

    def _end_backward_iteration(self) -> None:
        """The iteration's reductions have finished: release what the groups keep for it."""
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.finalize_backward()
        self._comm_ctx.post_forward_order.clear()
        self._state_ctx.manual_finalization_active = None

    # --- manual finalization (see Design note: manual finalization) ---------------------------
    def set_manual_backward_finalization(self, enabled: bool) -> None:
        ctx = self._state_ctx
        if self._is_root is False:
            raise RuntimeError(
                "set_manual_backward_finalization must be called on the root "
                f"{self.api.torch_state_name} module"
            )
        if enabled != ctx.manual_backward_finalization and in_backward():
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode during backward"
            )
        active = ctx.manual_finalization_active
        if active is not None and enabled != active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts; "
                "finalize the backward iteration (or reset_iter_state) first"
            )
        ctx.manual_backward_finalization = enabled

    def finalize_backward(self, *, async_op: bool) -> GradientReductionToken | None:
        """Reduce the pending groups' gradients; wait unless ``async_op`` (then the caller
        waits through the returned token). Before the first forward there is nothing to do."""
        ctx = self._state_ctx
        if self._is_root is None:
            return None
        if ctx.reduction_handle_pending:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing backward "
                "again: call wait() on its GradientReductionHandle"
            )
        if self._comm_ctx.pending_reduction_owner is not None:
            raise RuntimeError(
                "Another gradient reduction sharing this communication context must be waited "
                "on before finalizing backward"
            )
        self._check_finalize_backward()
        token: GradientReductionToken | None = None
        if async_op:
            own = {g for s in ctx.all_states for g in s._fsdp_param_groups}
            if any(g not in own for g in self._comm_ctx.post_forward_order):
                raise RuntimeError(
                    "Asynchronous gradient finalization cannot overlap work from another "
                    f"{self.api.torch_state_name} root sharing the communication context"
                )
            token = GradientReductionToken(ctx)
            self._comm_ctx.pending_reduction_owner = token
        # Autograd has finished; torch's order: the deepest state's groups first.
        for state in reversed(ctx.all_states):
            for group in reversed(state._fsdp_param_groups):
                if group._post_backward_pending:
                    group.post_backward()
                elif group.reshard_after_backward:
                    group.reshard()
                group._training_state = TrainingState.IDLE
        if token is None:
            self.wait_for_gradient_reduction(None)
        else:
            ctx.reduction_handle_pending = True
        return token

    def _check_finalize_backward(self) -> None:
        name = self.api.torch_state_name
        ctx = self._state_ctx
        if not self._is_root:
            raise RuntimeError(f"finalize_backward must be called on the root {name} module")
        if not self._manual_finalization():
            raise RuntimeError(
                f"{name} finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if ctx.post_backward_final_callback_queued:
            raise RuntimeError(f"{name} finalize_backward must be called after backward completes")
        groups = [g for s in ctx.all_states for g in s._fsdp_param_groups]
        for group in groups:
            if group._partial_reduce_output is not None:
                raise RuntimeError(
                    f"{name} manual backward finalization does not support partial gradient "
                    f"reductions for parameter group {group._module_fqn or '<root>'!r}. Use "
                    "automatic backward finalization for this configuration"
                )
        for group in groups:
            if (
                group._post_backward_pending
                and group.reduce_grads
                and isinstance(group.mesh_info, DDPMeshInfo)
                and not group.all_reduce_grads
            ):
                raise RuntimeError(
                    f"{name} manual backward finalization requires all-reduce for parameter "
                    f"group {group._module_fqn or '<root>'!r}. Call "
                    "set_requires_all_reduce(True) before finalization"
                )

    def wait_for_gradient_reduction(self, token: GradientReductionToken | None) -> None:
        """Finish the reductions in flight and end the backward iteration; with ``token``, only
        if it is still the comm context's pending finalization."""
        if token is not None and self._comm_ctx.pending_reduction_owner is not token:
            raise RuntimeError(
                "This gradient reduction handle was invalidated (reset_iter_state ran after "
                "finalize_backward(async_op=True))"
            )
        self._comm_ctx.reductions.finish()
        self._end_backward_iteration()
        if token is not None:
            self._state_ctx.reduction_handle_pending = False
            self._comm_ctx.pending_reduction_owner = None
        _failures.enter_phase(_failures.Phase.AFTER_BACKWARD)  # the watchdog's position

    # --- recovery -----------------------------------------------------------------------------
    def reset_iter_state(self) -> None:
        if self._is_root is False:
            raise RuntimeError(
                f"reset_iter_state must be called on the root {self.api.name} module"
            )
        ctx = self._state_ctx
        pending = self._comm_ctx.pending_reduction_owner
        if isinstance(pending, GradientReductionToken) and pending.owner is not ctx:
            raise RuntimeError(
                "reset_iter_state cannot reset a gradient reduction owned by another "
                f"{self.api.torch_state_name} root sharing the communication context"
            )
        states: Sequence[FSDPState] = ctx.all_states or [self]
        self._comm_ctx.post_forward_order.clear()
        for state in states:
            state._modules_to_run_forward.clear()
            state._training_state = TrainingState.IDLE
            for group in state._fsdp_param_groups:
                group.reset_iter_state()
        self._comm_ctx.abandon_reductions()
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False
        ctx.reductions_callback_queued = False
        ctx.manual_finalization_active = None
        ctx.reduction_handle_pending = False
        self._comm_ctx.pending_reduction_owner = None  # invalidates an unwaited handle
