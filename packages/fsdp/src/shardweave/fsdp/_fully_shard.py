"""The public API: ``fully_shard``, ``FSDPModule``, ``UnshardHandle`` and friends (torch's names)."""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardweave.fsdp._fsdp_api import AllGather, MixedPrecisionPolicy, OffloadPolicy, ReduceScatter
from shardweave.fsdp._torch_interop import ManagedModule
from shardweave.fsdp.core._args import fully_shard_arguments
from shardweave.fsdp.core._assembly import init_fully_shard, post_forward_mesh_info
from shardweave.fsdp.core._param_group import FSDPParamGroup
from shardweave.fsdp.core._state import FSDPState, GradientReductionToken, get_fsdp_state
from shardweave.fsdp.faults import _failures, _watchdog
from shardweave.mesh import DataParallelMeshDims, FSDPMeshInfo

if TYPE_CHECKING:
    from torch.distributed.tensor import Shard

    from shardweave.fsdp._fsdp_api import AnyMixedPrecisionPolicy, AnyOffloadPolicy
    from shardweave.fsdp._fsdp_common import ShardPlacementResult

__all__ = [
    "FSDPModule",
    "GradientReductionHandle",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

ShardPlacementFn = Callable[[nn.Parameter], "Shard | ShardPlacementResult | None"]


class FullyShardFn(Protocol):
    """The type of ``fully_shard``: the function (module or list overloads) and ``state``.

    torch's composable ``contract`` gives its ``fully_shard`` a ``state(module)`` attribute;
    a Protocol keeps ours typed under ``mypy --strict`` while it stays a plain function.
    """

    @overload
    def __call__(
        self,
        module: nn.Module,
        *,
        mesh: DeviceMesh | None = ...,
        reshard_after_forward: bool | int | None = ...,
        shard_placement_fn: ShardPlacementFn | None = ...,
        mp_policy: AnyMixedPrecisionPolicy = ...,
        offload_policy: AnyOffloadPolicy = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        dp_mesh_dims: DataParallelMeshDims | None = ...,
    ) -> FSDPModule: ...

    @overload
    def __call__(
        self,
        module: list[nn.Module],
        *,
        mesh: DeviceMesh | None = ...,
        reshard_after_forward: bool | int | None = ...,
        shard_placement_fn: ShardPlacementFn | None = ...,
        mp_policy: AnyMixedPrecisionPolicy = ...,
        offload_policy: AnyOffloadPolicy = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        dp_mesh_dims: DataParallelMeshDims | None = ...,
    ) -> list[nn.Module]: ...

    def state(self, module: nn.Module | FSDPModule) -> FSDPState | None:
        """The ``FSDPState`` that ``fully_shard`` attached to ``module``, or None when
        ``fully_shard`` was not applied to it (a submodule of a sharded module, a module of
        ``replicate``, a plain module), as torch's ``fully_shard.state`` returns."""
        ...


def _fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    mp_policy: AnyMixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: AnyOffloadPolicy = OffloadPolicy(),  # noqa: B008 (stateless)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> FSDPModule | list[nn.Module]:
    """Shard ``module``'s parameters across ``mesh`` and all-gather them around its forward and
    backward (fully sharded data parallelism).

    A drop-in for ``torch.distributed.fsdp.fully_shard`` (torch 2.13): same arguments,
    defaults, class swap and exceptions. Apply it to each block, then to the root::

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)

    Each call makes one communication group: one all-gather per unshard and one reduce-scatter
    per backward over all its parameters (more, smaller groups lower peak memory; fewer, larger
    groups cost fewer collectives).

    Args:
        module: the module, or a list of modules that form one group (e.g. a tied embedding and
            output head).
        mesh: the data-parallel mesh: 1-D to shard, 2-D ``(replicate, shard)`` for HSDP, or a
            full SPMD mesh with ``dp_mesh_dims``. Defaults to all ranks of the default process
            group on the accelerator (CPU when none).
        reshard_after_forward: ``True`` frees parameters after forward (all-gather again in
            backward: least memory); ``False`` keeps them (no second all-gather); ``None``
            means ``True`` except for the root, which is all-gathered again right away; an int
            ``k`` keeps a 1/k slice after forward and all-gathers over ``k`` ranks in backward.
        shard_placement_fn: per parameter, ``Shard(dim)`` to shard another dim (must divide
            evenly), a ``ShardPlacementResult`` for another mesh, or ``None`` for ``Shard(0)``.
        mp_policy: mixed precision (see ``MixedPrecisionPolicy``).
        offload_policy: ``CPUOffloadPolicy()`` keeps shards, grads and optimizer state on CPU.
        ignored_params: parameters left alone: not sharded, moved or reduced.
        dp_mesh_dims: names the data-parallel dims when ``mesh`` is a full SPMD mesh.

    Returns:
        The module (now also an ``FSDPModule``), or the same list. Afterwards
        ``fully_shard.state(module)`` returns the state attached to each module passed (the
        roots of a list), and None for any other module, as torch's does.

    Differences from torch:
        At the root's first forward every rank compares a digest of what it manages (names,
        shapes, dtypes, policies) and raises ``FSDPConsistencyError`` naming the first
        difference instead of hanging in a mismatched collective.
    """
    args = fully_shard_arguments(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
    )
    init_fully_shard(args, module_cls=FSDPModule)
    if isinstance(module, nn.Module):
        return cast(FSDPModule, module)
    return module


def with_state(fn: Callable[..., object], api: str) -> object:
    """``fn`` with a ``state(module)`` attribute returning the state ``api`` attached to a
    module (None for any other module), as torch's ``contract`` decorator adds; the caller
    casts the result to its Protocol."""

    def state(module: nn.Module | FSDPModule) -> FSDPState | None:
        found = get_fsdp_state(cast(nn.Module, module))
        return found if found is not None and found.api.name == api else None

    state.__qualname__ = f"{api}.state"
    state.__doc__ = f"The state ``{api}`` attached to ``module``, or None."
    # named after the public binding, so pickling finds it and reprs read as torch's
    fn.__name__ = fn.__qualname__ = api
    fn.state = state  # type: ignore[attr-defined]
    return fn


fully_shard: Final[FullyShardFn] = cast(FullyShardFn, with_state(_fully_shard, "fully_shard"))


class UnshardHandle:
    """Waits on an asynchronous ``FSDPModule.unshard(async_op=True)``.

    Unsharding early hides the all-gather behind other work, but the gathered parameters
    stay in memory from then until the module reshards.

    Example::

        def forward(self, x):  # the root's forward
            handle = self.layers[1].unshard(async_op=True)  # gather while layer 0 computes
            h = self.layers[0](x)
            handle.wait()  # optional: layer 1's forward would wait anyway
            return self.layers[1](h)
    """

    def __init__(self, groups: Iterable[FSDPParamGroup] = ()) -> None:
        self._groups: list[FSDPParamGroup] | None = list(groups)

    def wait(self) -> None:
        """Finish the all-gather and register the unsharded parameters (idempotent)."""
        if self._groups is None:
            return
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = None


class GradientReductionHandle:
    """Waits on an asynchronous ``FSDPModule.finalize_backward(async_op=True)``.

    Until ``wait()`` the gradient reductions may still be in flight and their buffers stay
    alive; the gradients must not be read (by the optimizer, a clip, a check) before it, and
    the module's next forward refuses to start.

    Example::

        model.set_manual_backward_finalization(True)
        model(batch).sum().backward()
        handle = model.finalize_backward(async_op=True)
        ...  # host work that does not touch the gradients
        handle.wait()
        optimizer.step()
    """

    def __init__(
        self, state: FSDPState | None = None, token: GradientReductionToken | None = None
    ) -> None:
        self._state = state
        self._token = token

    def wait(self) -> None:
        """Finish the reductions and release their buffers; a second call does nothing.

        Raises:
            RuntimeError: ``reset_iter_state`` ran after the finalization (its reductions
                were abandoned, so the gradients are not there to wait for).
        """
        state, token = self._state, self._token
        if state is None or token is None:
            return
        state.wait_for_gradient_reduction(token)
        self._state = self._token = None


class FSDPModule(ManagedModule):
    """Mixed into every module ``fully_shard`` was applied to (placed first in its MRO; torch's
    public ``FSDPModule`` follows as a marker, so torch's and frameworks' ``isinstance`` checks
    hold and every method they reach is one of these).

    Its methods tune communication and memory per module, e.g. skipping gradient
    synchronization while accumulating saves a reduce-scatter per microbatch but keeps the
    unsharded gradients alive until the synchronized backward.

    Example::

        model = fully_shard(model)  # the same object, its class now also an FSDPModule
        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(False)
        for micro in microbatches[:-1]:
            model(micro).sum().backward()
        model.set_requires_gradient_sync(True)
        model(microbatches[-1]).sum().backward()  # reduces the accumulated gradients
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers rebuild themselves with type(self)(...) (e.g. nn.Sequential slicing); that
        # must produce a plain module, not one that looks sharded but has no state.
        return _plain_module_class(cls)(*args, **kwargs)

    def _get_fsdp_state(self) -> FSDPState:
        state = get_fsdp_state(cast(nn.Module, self))
        if state is None:
            raise AssertionError(f"No FSDP state found on {type(self).__name__}")
        return state

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        if not recurse:
            return [self]
        return [m for m in cast(nn.Module, self).modules() if isinstance(m, FSDPModule)]

    def _groups(self, recurse: bool = False) -> list[FSDPParamGroup]:
        return [
            g for m in self._fsdp_modules(recurse) for g in m._get_fsdp_state()._fsdp_param_groups
        ]

    def _single_group(self, what: str) -> FSDPParamGroup | None:
        groups = self._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(
                f"{what} requires one parameter group but this module has {len(groups)} "
                "(shard_placement_fn put parameters on several meshes)"
            )
        return groups[0] if groups else None

    def reshard(self) -> None:
        """Register the sharded parameters and free the unsharded ones' storage (not
        recursive), unless ``set_keep_unsharded_storage(True)`` keeps it."""
        groups = self._get_fsdp_state()._fsdp_param_groups
        if any(group._all_gather_result is not None for group in groups):
            # The pending all-gather would register unsharded parameters after this reshard
            # (when it is waited on), undoing it behind the caller's back.
            raise RuntimeError(
                f"reshard() on {type(self).__name__} while its unshard(async_op=True) is still "
                "in flight; call wait() on the UnshardHandle first, then reshard()"
            )
        for group in groups:
            group.reshard()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters' storage allocated when resharding.

        By default a reshard frees it and the next unshard allocates it again, so its address
        changes from use to use. With ``keep=True`` every unshard refills the same storage: the
        unsharded parameters keep their data pointers across steps and across explicit
        ``reshard()`` / ``unshard()`` (what CUDA graph capture needs). The cost is memory: the
        unsharded parameters stay allocated between uses, as with ``reshard_after_forward=False``
        (but the sharded parameters are still the ones registered, and the next unshard still
        all-gathers). ``keep=False`` frees the storage kept so far at the next reshard.

        Args:
            keep: whether a reshard keeps the unsharded storage.
            recurse: ``True`` sets it for every FSDP module under this one (this one included);
                ``False`` only for this module's own parameters.

        Example::

            model.set_keep_unsharded_storage(True)
            model(batch).sum().backward()  # later steps reuse the same unsharded storage

        Differences from torch: torch added this method in 2.15; shardweave offers it on every
        torch it supports (2.11 on), as it depends on nothing torch provides. A non-bool
        ``keep`` raises ``TypeError`` (torch stores any value).
        """
        _check_flag(keep, "set_keep_unsharded_storage", "keep")
        for group in self._groups(recurse):
            group.set_keep_unsharded_storage(keep)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (before its forward, e.g. to prefetch).

        Returns an ``UnshardHandle`` to ``wait()`` on when ``async_op``; otherwise waits. If
        never waited on, the module's next forward waits.
        """
        _check_flag(async_op, "unshard", "async_op")
        groups = self._get_fsdp_state()._fsdp_param_groups
        for group in groups:
            group.lazy_init()
            group.unshard(async_op=async_op)
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward (call on the root)."""
        self._get_fsdp_state().reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False`` for all but the last microbatch's backward (keeps per-iteration state).

        Ignored under ``set_manual_backward_finalization(True)``, where ``finalize_backward``
        ends the iteration.
        """
        _check_flag(is_last_backward, "set_is_last_backward", "is_last_backward")
        self._get_fsdp_state()._state_ctx.is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Leave the end of each backward iteration to ``finalize_backward`` (call on the root).

        By default the end of every backward waits for the gradient reductions and, on the
        last backward (``set_is_last_backward``), ends the iteration. Enabled, that point is the
        caller's: backward leaves the reductions of groups it did not reach to
        ``finalize_backward``, which must run after all of the iteration's backwards and before
        the gradients are read or cleared. It supersedes ``set_is_last_backward``. Gradient
        sync and resharding follow their own settings.

        Set it before the backward; the mode cannot change while a backward runs or once an
        iteration's backward started, until it is finalized (or ``reset_iter_state``).

        torch 2.15's API; shardweave offers it on every supported torch (2.11-2.15).

        Raises:
            RuntimeError: on a non-root module, during a backward, or when the mode differs from
                the one the current backward iteration started with.
        """
        _check_flag(enabled, "set_manual_backward_finalization", "enabled")
        self._get_fsdp_state().set_manual_backward_finalization(enabled)

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...

    @overload
    def finalize_backward(self, *, async_op: bool) -> GradientReductionHandle | None: ...

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """End the backward iteration under manual finalization (call on the root).

        Reduces the gradients still pending (groups backward did not reach, and groups whose
        backwards ran without gradient sync: re-enable sync first), reshards as configured and
        waits for every reduction. Run several backwards with gradient sync disabled before one
        finalization to accumulate microbatches. Before the root's first forward it does
        nothing. Do not call it between a forward and its backward.

        Args:
            async_op: ``True`` returns a ``GradientReductionHandle`` without waiting: the
                reductions overlap whatever the caller does next, but their buffers live until
                ``wait()``, which must come before the gradients are used or the next forward.
                ``False`` waits before returning.

        Returns:
            The handle when ``async_op``, else ``None``.

        Raises:
            RuntimeError: manual finalization is off; a previous asynchronous finalization of
                this root (or of another root sharing its communication context) is not waited
                on; called on a non-root module or during backward; an HSDP/replicate group
                holds a partial reduction or has all-reduce disabled.

        Example::

            model.set_manual_backward_finalization(True)
            model.set_requires_gradient_sync(False)
            for micro in microbatches:
                model(micro).sum().backward()
            model.set_requires_gradient_sync(True)
            model.finalize_backward()  # one reduction of the accumulated gradients
            optimizer.step()
        """
        _check_flag(async_op, "finalize_backward", "async_op")
        state = self._get_fsdp_state()
        token = state.finalize_backward(async_op=async_op)
        if not async_op:
            return None
        return GradientReductionHandle(state, token)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False`` accumulates unsharded gradients locally with no communication (no_sync)."""
        _check_flag(requires_gradient_sync, "set_requires_gradient_sync", "requires_gradient_sync")
        for group in self._groups(recurse):
            group.reduce_grads = requires_gradient_sync
            group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters but skips the replicate all-reduce (accumulation)."""
        _check_flag(requires_all_reduce, "set_requires_all_reduce", "requires_all_reduce")
        for group in self._groups(recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change whether parameters are freed after forward (overrides the root default)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward: reshard_after_forward should be a bool, got "
                f"{type(reshard_after_forward)}; pass True or False (an int group size can "
                "only be given to fully_shard)"
            )
        for module in self._fsdp_modules(recurse):
            state = module._get_fsdp_state()
            state._auto_reshard_after_forward = False
            for group in state._fsdp_param_groups:
                if not isinstance(group.mesh_info, FSDPMeshInfo):
                    raise AssertionError(
                        "set_reshard_after_forward needs sharded parameters, but "
                        f"{type(module).__name__} is replicated (replicate() or replicate-only "
                        "dp_mesh_dims); its parameters stay whole, so there is nothing to "
                        "reshard: use fully_shard for modules that should reshard"
                    )
                group.post_forward_mesh_info = post_forward_mesh_info(
                    reshard_after_forward, group.mesh_info
                )

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """``False`` keeps parameters unsharded after backward (saves an all-gather while
        accumulating gradients, at the cost of memory)."""
        _check_flag(reshard_after_backward, "set_reshard_after_backward", "reshard_after_backward")
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """After this module's all-gather in forward, issue these modules' all-gathers."""
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")
        self._get_fsdp_state()._states_to_forward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_implicit_forward_prefetch(self, enable: bool = True, *, recurse: bool = True) -> None:
        """In forward, prefetch the module that ran next in the previous iteration.

        Not in torch's FSDP2, whose forward issues each all-gather at the module's own
        pre-forward (on GPUs the CPU running ahead hides it; where collectives run on host
        threads, as gloo's do, it stays exposed). With this on, after a module's own
        all-gather, the all-gather of the module whose forward followed it last iteration
        is issued, so it overlaps this module's compute: one more module's parameters in
        memory during forward. The first iteration learns the order; a module with
        ``set_modules_to_forward_prefetch`` targets uses those instead. Default off, as torch.

        Example::

            model.set_implicit_forward_prefetch()  # the root and every fully_shard'ed child
        """
        _check_flag(enable, "set_implicit_forward_prefetch", "enable")
        for module in self._fsdp_modules(recurse):
            module._get_fsdp_state().implicit_forward_prefetch = enable

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Replace the default backward prefetch of this module with these modules."""
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")
        self._get_fsdp_state()._states_to_backward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` skips the pre-backward all-gather (parameters not needed in backward)."""
        _check_flag(unshard_in_backward, "set_unshard_in_backward", "unshard_in_backward")
        for group in self._groups():
            group.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's all-gathers wait on ``event`` rather than the whole stream.

        By default the root's next forward makes the all-gather streams wait for everything
        queued on the current stream (the optimizer step and whatever follows it). Record an
        event right after the optimizer step and pass it here to let the first all-gathers
        overlap the work queued after it. Applies once, to the next forward. On CPU streams
        record no events, so this changes nothing there.

        Example::

            optim.step()
            model.set_post_optim_event(torch.cuda.current_stream().record_event())
        """
        self._get_fsdp_state()._state_ctx.post_optim_event = event

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Use ``comm`` for this module's all-gather (allocation and collective)."""
        _check_comm(comm, AllGather, "set_custom_all_gather")
        group = self._single_group("set_custom_all_gather")
        if group is not None:
            group._all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Use ``comm`` for this module's reduce-scatter (allocation and collective)."""
        _check_comm(comm, ReduceScatter, "set_custom_reduce_scatter")
        group = self._single_group("set_custom_reduce_scatter")
        if group is not None:
            group._reduce_scatter_comm = comm

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """Call ``hook(reduced_flat_grads)`` after the reduce-scatter (and HSDP all-reduce).

        The hook runs on the all-reduce stream, or on ``stream`` when given (which first waits
        for the reduce-scatter), before the gradients are divided and assigned.
        """
        if not callable(hook):
            raise TypeError(
                f"set_all_reduce_hook: hook must be callable, got {hook!r} "
                f"({type(hook).__name__}); pass a function taking the reduced gradient tensor, "
                "e.g. set_all_reduce_hook(lambda grads: grads.div_(2))"
            )
        group = self._single_group("set_all_reduce_hook")
        if group is None:
            return
        if stream is not None and group._all_reduce_group is not None:
            raise ValueError(
                "set_all_reduce_hook: stream= cannot be given with native HSDP (the hook runs "
                "after HSDP's own all-reduce); omit stream"
            )
        group._all_reduce_hook = hook
        group._all_reduce_hook_stream = stream

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size."""
        _check_divide_factor(factor, "set_gradient_divide_factor")
        for group in self._groups():
            group.gradient_divide_factor = factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use only SUM collectives, dividing explicitly before/after."""
        _check_flag(enable, "set_force_sum_reduction_for_comms", "enable")
        for group in self._groups():
            group.force_sum_reduction_for_comms = enable

    def set_reduce_scatter_unused_params(self, enable: bool, *, recurse: bool = True) -> None:
        """Reduce zero gradients for parameters that got none, so every rank issues the same
        reduce-scatter even when ranks use different parameters."""
        _check_flag(enable, "set_reduce_scatter_unused_params", "enable")
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = enable

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of ``set_gradient_divide_factor``."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatter input buffers may stay in flight (default 1).

        A group's post-backward first waits for the oldest reductions until fewer than this
        many reduce-scatter inputs remain referenced, then issues its own. More buffers let a
        slow reduce-scatter overlap more of backward, at the cost of one group's gradients in
        memory per extra buffer. Groups under one root share the largest value any of them set.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                "set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, got "
                f"{type(max_input_buffers).__name__} {max_input_buffers!r}; pass an int >= 1 "
                "(1, the default, keeps one buffer in flight)"
            )
        if max_input_buffers < 1:
            raise ValueError(
                "set_reduce_scatter_max_input_buffers: max_input_buffers must be >= 1, got "
                f"{max_input_buffers}; pass 1 (the default) or more to let reduce-scatters "
                "overlap"
            )
        groups = self._groups(recurse)
        for group in groups:
            if group.uses_symm_mem:
                group.check_symm_mem_buffers(max_input_buffers)
        for group in groups:
            group.reduce_scatter_max_input_buffers = max_input_buffers
        for module in self._fsdp_modules(recurse):
            module._get_fsdp_state().update_reduce_scatter_max_input_buffers()

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run reduce-scatters on their own process group (a collective call on every rank).

        Lets the reduce-scatter overlap the all-gather where a communicator runs one collective
        at a time (NCCL); ``False`` restores the shared shard group.
        """
        _check_flag(enable, "set_separate_reduce_scatter_group", "enable")
        cache: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            group.set_separate_reduce_scatter_group(enable, cache)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate collective staging buffers with the process group's allocator when it has
        one (NCCL zero-copy); otherwise (gloo) plain ``torch.empty``. Not with custom comms."""
        _check_flag(enable, "set_allocate_memory_from_process_group_for_comm", "enable")
        for group in self._groups():
            group.set_allocate_memory_from_process_group(enable)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Stage this module's all-gathers and reduce-scatters in symmetric memory.

        CUDA with NCCL only: with symmetric buffers NCCL can use its copy-engine all-gather
        (one node, NCCL's zero-CTA policy, e.g. ``NCCL_CTA_POLICY=2``) or its symmetric
        kernels (several nodes), which leave the SMs to compute. Applies to this module's own
        groups, not its children. Cannot be combined with ``set_custom_all_gather`` /
        ``set_custom_reduce_scatter`` (``AssertionError``, as torch) or with
        ``set_reduce_scatter_max_input_buffers(>1)`` (``ValueError``). Off CUDA it raises
        ``RuntimeError``, as torch's symmetric-memory backend does. Setup runs a barrier on
        each group's process groups, so call it on every rank.

        Not yet run on a GPU: the CPU tests check the wiring (buffers from the pool, the
        rendezvous of each staging buffer) with a stand-in symmetric-memory module.
        """
        if backend != "NCCL":
            raise ValueError(
                f"set_symm_mem_for_comm: backend must be 'NCCL' (the only symmetric-memory "
                f"backend FSDP supports), got {backend!r}"
            )
        groups = self._groups()
        for group in groups:  # custom comms first (AssertionError), as torch checks them first
            group.check_symm_mem_comms()
        device = self._get_fsdp_state()._device
        if device.type != "cuda" or not dist.is_nccl_available():
            raise RuntimeError(
                f"set_symm_mem_for_comm(backend={backend!r}) needs CUDA with NCCL symmetric "
                f"memory, but this module's parameters are on '{device.type}'; remove the "
                "set_symm_mem_for_comm call to keep the default collectives"
            )
        for group in groups:
            group.set_symm_mem(backend)

    def set_collective_checks(self, enable: bool, *, stall_timeout: float | None = None) -> None:
        """Check every collective against the peers' before issuing it (shardweave only).

        Each engine collective is preceded by a small all-gather of its signature (step,
        sequence number, group, kind, size, dtype) so that a rank that skipped a module,
        reached another step or computed another shape raises
        :class:`CollectiveMismatchError` on every rank, naming the rank, the group and the
        step, instead of hanging or aborting inside the backend. A peer that never arrives is
        judged by the watchdog like one missing from any collective (see
        :func:`set_stall_timeout`). Costs one tiny collective per collective; process-wide
        (also ``SHARDWEAVE_CHECK_COLLECTIVES=1``). Failures of peers that raise are reported
        whether or not checks are on.

        ``stall_timeout`` is deprecated: it sets the one stall threshold,
        :func:`set_stall_timeout`, for the watchdog too (it was a second, check-only
        threshold).
        """
        if not isinstance(enable, bool):
            raise TypeError(f"set_collective_checks(enable=...) expects a bool, got {enable!r}")
        if stall_timeout is not None:
            warnings.warn(
                "set_collective_checks(stall_timeout=...) is deprecated: there is one stall "
                "threshold now; call shardweave.fsdp.set_stall_timeout(seconds) instead (this "
                "call set it)",
                FutureWarning,
                stacklevel=2,
            )
            _watchdog.set_stall_timeout(stall_timeout)
        _failures.set_checks(enable)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        for group in self._groups(recurse=True):
            group.unshard_async_op = async_op

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # .to(), .double(), to_empty(): convert the sharded DTensors, then re-adopt them (new
        # storage means new padding).
        self.reshard()
        # Not super(): next in the MRO is torch's FSDPModule marker, whose _apply would reset our
        # parameters itself (then ours would see nothing changed and keep stale buffers).
        module = cast(nn.Module, self)
        ret = _plain_module_class(type(self))._apply(module, *args, **kwargs)  # type: ignore[no-untyped-call]
        for group in self._get_fsdp_state()._fsdp_param_groups:
            group.reset_sharded_params()
        return ret


def _plain_module_class(cls: type) -> type[nn.Module]:
    """The first nn.Module class of ``cls``'s MRO that is not ours (torch's marker base is not
    an nn.Module): the module's own class."""
    return next(
        c for c in cls.__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule)
    )


def _check_fsdp_modules(modules: object, api: str) -> None:
    if not isinstance(modules, Iterable):
        raise TypeError(
            f"{api} expects a list of FSDPModules, got {type(modules).__name__}; wrap a single "
            f"module in a list: {api}([module])"
        )
    for i, m in enumerate(modules):
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{api} expects FSDPModules (modules passed to fully_shard), got "
                f"{type(m).__name__} at index {i}; apply fully_shard to it first, or leave it "
                "out of the list"
            )


def _check_flag(value: object, api: str, arg: str) -> None:
    # Torch stores any value here; a string such as "False" is truthy and silently means True.
    if not isinstance(value, bool):
        raise TypeError(
            f"{api}: {arg} must be a bool, got {value!r} ({type(value).__name__}); "
            "pass True or False"
        )


def _check_comm(comm: object, base: type, api: str) -> None:
    # Duck typing is accepted (e.g. a subclass of torch's own comm ABC), but the engine calls
    # both allocate() and __call__().
    if isinstance(comm, base) or (callable(comm) and callable(getattr(comm, "allocate", None))):
        return
    raise TypeError(
        f"{api} expects an instance of {base.__name__}, got {type(comm).__name__}; subclass "
        f"shardweave.fsdp.{base.__name__} and implement allocate() and __call__()"
    )


def _check_divide_factor(factor: object, api: str) -> None:
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(
            f"{api}: factor must be a number (float), got {factor!r} "
            f"({type(factor).__name__}); pass e.g. {api}(8.0)"
        )
    if not math.isfinite(float(factor)) or factor <= 0:
        raise ValueError(
            f"{api}: factor must be positive and finite (gradients are divided by it), got "
            f"{factor}; pass a number > 0, e.g. the data-parallel world size"
        )


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's forward hooks around ``module.<method_name>`` (e.g. ``generate``).

    A module that is not an ``FSDPModule`` is left alone (as in torch), so this can be called
    unconditionally.

    Example::

        fully_shard(model)
        register_fsdp_forward_method(model, "generate")
        tokens = model.generate(prompt)  # parameters are gathered around it, as for forward
    """
    if not isinstance(module, FSDPModule):
        return
    if not isinstance(method_name, str):
        raise TypeError(
            "register_fsdp_forward_method: method_name must be a str (the method's name), got "
            f"{method_name!r} ({type(method_name).__name__}); e.g. "
            "register_fsdp_forward_method(model, 'generate')"
        )
    if not hasattr(module, method_name):
        raise ValueError(
            f"{type(module).__name__} does not have a method {method_name}; define it on the "
            "module's class before registering it, or check the name for a typo"
        )
    orig = getattr(module, method_name)
    if not callable(orig):
        raise TypeError(
            f"register_fsdp_forward_method: {type(module).__name__}.{method_name} is a "
            f"{type(orig).__name__}, not a method; pass the name of a method that runs the "
            "module (e.g. 'generate')"
        )

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state = module._get_fsdp_state()
        args, kwargs = state.pre_forward_hook(module, args, kwargs)
        out = orig(*args, **kwargs)
        return state.post_forward_hook(module, args, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Make separate roots (pipeline stages on one rank) share one communication context.

    The roots then share the order the implicit backward prefetch follows and the gradient
    buckets; leave roots that run independently with their own.

    Example::

        for stage in (stage0, stage1):  # two pipeline stages on this rank, each a root
            for block in stage.layers:
                fully_shard(block)
            fully_shard(stage)
        share_comm_ctx([stage0, stage1])
    """
    _check_fsdp_modules(modules, "share_comm_ctx")
    modules = list(modules)
    if not modules:
        return
    comm_ctx = modules[0]._get_fsdp_state()._comm_ctx
    for module in modules[1:]:
        state = module._get_fsdp_state()
        state._comm_ctx = comm_ctx
        for group in state._fsdp_param_groups:
            group.comm_ctx = comm_ctx
