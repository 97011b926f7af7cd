"""The public API: ``fully_shard``, ``FSDPModule``, ``UnshardHandle`` and friends (torch's names)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardweave.fsdp._fsdp_api import (
    AllGather,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReduceScatter,
)
from shardweave.fsdp._fsdp_collectives import DefaultAllGather
from shardweave.fsdp._fsdp_init import (
    managed_modules,
    managed_params_and_buffers,
    move_states_to_device,
    post_forward_mesh_info,
    resolve_shard_placements,
    validate_module,
    validate_reshard_after_forward,
)
from shardweave.fsdp._fsdp_param_group import FSDPParamGroup
from shardweave.fsdp._fsdp_state import FSDPState, get_fsdp_state
from shardweave.mesh import (
    DataParallelMeshDims,
    DataParallelMeshInfo,
    FSDPMeshInfo,
    default_mesh,
    mesh_device,
    resolve_mesh_info,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import Shard

    from shardweave.fsdp._fsdp_common import ShardPlacementResult

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

ShardPlacementFn = Callable[[nn.Parameter], "Shard | ShardPlacementResult | None"]


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: ShardPlacementFn | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: ShardPlacementFn | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (stateless)
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
        The module (now also an ``FSDPModule``), or the same list.

    Differences from torch:
        At the root's first forward every rank compares a digest of what it manages (names,
        shapes, dtypes, policies) and raises ``FSDPConsistencyError`` naming the first
        difference instead of hanging in a mismatched collective.
    """
    api = "fully_shard"
    if isinstance(module, nn.Module):
        validate_module(module, api)
        modules: tuple[nn.Module, ...] = (module,)
    else:
        modules = tuple(module)
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"{api} expects nn.Module or a list of them, got {type(m).__name__}")
        existing = get_fsdp_state(m)
        if existing is not None:
            raise AssertionError(
                f"{api} was already applied to {type(m).__name__} (by {existing.api_name}); "
                "each distinct composable distributed API can only be applied to a module once"
            )
    check_policy_types(mp_policy, offload_policy)
    if reshard_after_forward is not None:
        # before the default mesh is built, which may initialize the process group
        validate_reshard_after_forward(reshard_after_forward)
    mesh = mesh if mesh is not None else default_mesh()
    if dp_mesh_dims is not None and not isinstance(reshard_after_forward, (bool, type(None))):
        raise NotImplementedError(
            f"{api}: an int reshard_after_forward is not supported with dp_mesh_dims; "
            "pass True or False"
        )
    mesh_info = resolve_mesh_info(mesh, dp_mesh_dims, api=api)
    if not isinstance(mesh_info, FSDPMeshInfo) and shard_placement_fn is not None:
        raise ValueError(
            f"{api}: shard_placement_fn needs a shard dim, but dp_mesh_dims={dp_mesh_dims} "
            "names only replicate dims; add a shard dim or drop shard_placement_fn"
        )
    device = mesh_device(mesh)
    auto_reshard = reshard_after_forward is None
    # Replicate-only dp_mesh_dims: nothing is sharded, so nothing reshards after forward.
    post_info = (
        post_forward_mesh_info(
            True if reshard_after_forward is None else reshard_after_forward, mesh_info
        )
        if isinstance(mesh_info, FSDPMeshInfo)
        else None
    )
    ignored = set(ignored_params or ())
    roots = root_modules(modules)
    managed = managed_modules(roots, ignored)
    params, buffers = managed_params_and_buffers(managed, ignored)
    move_states_to_device(params, buffers, device)
    placements: list[tuple[Any, DataParallelMeshInfo]] = [(None, mesh_info)] * len(params)
    if isinstance(mesh_info, FSDPMeshInfo):
        placements = list(resolve_shard_placements(params, shard_placement_fn, mesh_info))
    state = FSDPState(roots, device, mp_policy, mesh_info, auto_reshard)
    try:
        state._fsdp_param_groups = _build_groups(
            params,
            placements,
            roots,
            mesh_info,
            post_info,
            reshard_after_forward,
            device,
            mp_policy,
            offload_policy,
        )
    except BaseException:
        state.detach()
        raise
    for m in managed:
        m._is_fsdp_managed_module = True  # type: ignore[assignment]
        m._fsdp_use_orig_params = True  # type: ignore[assignment]
    for root in roots:
        swap_class(root, FSDPModule, "FSDP")
    if isinstance(module, nn.Module):
        return cast(FSDPModule, module)
    return module


def check_policy_types(mp_policy: object, offload_policy: object) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "offload_policy must be an OffloadPolicy (e.g. CPUOffloadPolicy()), got "
            f"{type(offload_policy).__name__}"
        )


def root_modules(modules: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    """The listed modules that are not inside another listed module."""
    roots: list[nn.Module] = []
    for m in modules:
        inside = any(other is not m and m in set(other.modules()) for other in modules)
        if not inside and m not in roots:
            roots.append(m)
    return tuple(roots)


def _build_groups(
    params: list[nn.Parameter],
    placements: list[tuple[Any, DataParallelMeshInfo]],
    roots: tuple[nn.Module, ...],
    mesh_info: DataParallelMeshInfo,
    post_info: FSDPMeshInfo | None,
    reshard_after_forward: bool | int | None,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> list[FSDPParamGroup]:
    """One group per distinct mesh (``shard_placement_fn`` may move parameters to another)."""
    if not params:
        return []
    by_key: dict[tuple[Any, Any], tuple[DataParallelMeshInfo, list[int]]] = {}
    for i, (_, info) in enumerate(placements):
        shard = getattr(info, "shard_process_group", None)
        replicate = getattr(info, "replicate_process_group", None)
        key = (shard, replicate)
        entry = by_key.setdefault(key, (info, []))
        if entry[0] is not info:
            raise ValueError(
                "shard_placement_fn returned different FSDPMeshInfo objects for the same process "
                "groups; reuse one FSDPMeshInfo per mesh"
            )
        entry[1].append(i)
    groups: list[FSDPParamGroup] = []
    for info, indices in by_key.values():
        group_post = (
            post_info
            if info is mesh_info or not isinstance(info, FSDPMeshInfo)
            else post_forward_mesh_info(
                True if reshard_after_forward is None else reshard_after_forward, info
            )
        )
        groups.append(
            FSDPParamGroup(
                [params[i] for i in indices],
                roots,
                info,
                group_post,
                device,
                [placements[i][0] for i in indices],
                mp_policy,
                offload_policy,
            )
        )
    return groups


_CLASS_CACHE: dict[tuple[type, type], type] = {}


def _no_deepcopy(self: nn.Module, memo: dict[int, Any]) -> NoReturn:
    raise AssertionError(
        "FSDP does not support deepcopy of a sharded module; deepcopy the model before "
        "fully_shard, or use its state_dict"
    )


def swap_class(module: nn.Module, mixin: type, prefix: str) -> None:
    cls = type(module)
    key = (cls, mixin)
    new_cls = _CLASS_CACHE.get(key)
    if new_cls is None:
        new_cls = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__deepcopy__": _no_deepcopy})
        _CLASS_CACHE[key] = new_cls
    module.__class__ = new_cls


class UnshardHandle:
    """Waits on an asynchronous ``FSDPModule.unshard(async_op=True)``."""

    def __init__(self, groups: Iterable[FSDPParamGroup] = ()) -> None:
        self._groups: list[FSDPParamGroup] | None = list(groups)

    def wait(self) -> None:
        """Finish the all-gather and register the unsharded parameters (idempotent)."""
        if self._groups is None:
            return
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = None


class FSDPModule:
    """Mixed into every module ``fully_shard`` was applied to (placed first in its MRO)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers rebuild themselves with type(self)(...) (e.g. nn.Sequential slicing); that
        # must produce a plain module, not one that looks sharded but has no state.
        orig = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
        return orig(*args, **kwargs)

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
        """Free the unsharded parameters and register the sharded ones."""
        for group in self._get_fsdp_state()._fsdp_param_groups:
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (before its forward, e.g. to prefetch).

        Returns an ``UnshardHandle`` to ``wait()`` on when ``async_op``; otherwise waits. If
        never waited on, the module's next forward waits.
        """
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
        """``False`` for all but the last microbatch's backward (keeps per-iteration state)."""
        self._get_fsdp_state()._state_ctx.is_last_backward = is_last_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False`` accumulates unsharded gradients locally with no communication (no_sync)."""
        for group in self._groups(recurse):
            group.reduce_grads = requires_gradient_sync
            group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters but skips the replicate all-reduce (accumulation)."""
        for group in self._groups(recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change whether parameters are freed after forward (overrides the root default)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for module in self._fsdp_modules(recurse):
            state = module._get_fsdp_state()
            state._auto_reshard_after_forward = False
            for group in state._fsdp_param_groups:
                if not isinstance(group.mesh_info, FSDPMeshInfo):
                    raise AssertionError("set_reshard_after_forward needs sharded parameters")
                group.post_forward_mesh_info = post_forward_mesh_info(
                    reshard_after_forward, group.mesh_info
                )

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """``False`` keeps parameters unsharded after backward (saves an all-gather while
        accumulating gradients, at the cost of memory)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """After this module's all-gather in forward, issue these modules' all-gathers."""
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")
        self._get_fsdp_state()._states_to_forward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Replace the default backward prefetch of this module with these modules."""
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")
        self._get_fsdp_state()._states_to_backward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` skips the pre-backward all-gather (parameters not needed in backward)."""
        for group in self._groups():
            group.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's all-gathers wait on ``event`` rather than the whole stream.

        The engine issues collectives on the current stream, so ordering after the optimizer is
        already guaranteed; the event is accepted for API compatibility.
        """
        self._get_fsdp_state()._state_ctx.post_optim_event = event

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Use ``comm`` for this module's all-gather (allocation and collective)."""
        group = self._single_group("set_custom_all_gather")
        if group is not None:
            group._all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Use ``comm`` for this module's reduce-scatter (allocation and collective)."""
        group = self._single_group("set_custom_reduce_scatter")
        if group is not None:
            group._reduce_scatter_comm = comm

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """Call ``hook(reduced_flat_grads)`` after the reduce-scatter (and HSDP all-reduce)."""
        group = self._single_group("set_all_reduce_hook")
        if group is None:
            return
        if stream is not None and group._all_reduce_group is not None:
            raise ValueError(
                "set_all_reduce_hook: stream= cannot be given with native HSDP (the hook runs "
                "after HSDP's own all-reduce); omit stream"
            )
        group._all_reduce_hook = hook

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size."""
        for group in self._groups():
            group.gradient_divide_factor = factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use only SUM collectives, dividing explicitly before/after."""
        for group in self._groups():
            group.force_sum_reduction_for_comms = enable

    def set_reduce_scatter_unused_params(self, enable: bool, *, recurse: bool = True) -> None:
        """Reduce zero gradients for parameters that got none, so every rank issues the same
        reduce-scatter even when ranks use different parameters."""
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

        More buffers let a slow reduce-scatter overlap the next copy-in at the cost of memory.
        The engine reduces synchronously on the current stream, so the value only matters for
        parity with torch (it is resolved once, at root lazy init, as the maximum over groups).
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run reduce-scatters on their own process group (a collective call on every rank).

        Lets the reduce-scatter overlap the all-gather where a communicator runs one collective
        at a time (NCCL); ``False`` restores the shared shard group.
        """
        cache: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            group.set_separate_reduce_scatter_group(enable, cache)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate collective staging buffers with the process group's allocator when it has
        one (NCCL zero-copy); otherwise (gloo) plain ``torch.empty``. Not with custom comms."""
        for group in self._groups():
            group.set_allocate_memory_from_process_group(enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Symmetric-memory all-gather buffers (CUDA + NCCL only).

        Differences from torch: not implemented yet; raises ``RuntimeError`` on every backend
        (torch raises ``RuntimeError`` from its symmetric-memory backend on CPU too).
        """
        for group in self._groups():
            if type(group._all_gather_comm) is not DefaultAllGather:
                raise AssertionError(
                    "cannot call set_symm_mem_for_comm() when all gather comm is custom: "
                    f"{type(group._all_gather_comm).__name__}"
                )
        raise RuntimeError(
            f"set_symm_mem_for_comm(backend={backend!r}) needs CUDA with NCCL symmetric memory; "
            f"this module's mesh is on '{self._get_fsdp_state()._device.type}', and shardweave "
            "does not implement symmetric-memory collectives yet"
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        for group in self._groups(recurse=True):
            group.unshard_async_op = async_op

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # .to(), .double(), to_empty(): convert the sharded DTensors, then re-adopt them (new
        # storage means new padding and a new flat buffer).
        self.reshard()
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for group in self._get_fsdp_state()._fsdp_param_groups:
            group.reset_sharded_params()
        return ret


def _check_fsdp_modules(modules: Iterable[object], api: str) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{api} expects FSDPModules (modules passed to fully_shard), got {type(m).__name__}"
            )


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's forward hooks around ``module.<method_name>`` (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state = module._get_fsdp_state()
        args, kwargs = state._pre_forward(module, args, kwargs)
        out = orig(*args, **kwargs)
        return state._post_forward(module, args, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Make separate roots (pipeline stages on one rank) share one communication context."""
    if not modules:
        return
    _check_fsdp_modules(modules, "share_comm_ctx")
    comm_ctx = modules[0]._get_fsdp_state()._comm_ctx
    for module in modules[1:]:
        state = module._get_fsdp_state()
        state._comm_ctx = comm_ctx
        for group in state._fsdp_param_groups:
            group.comm_ctx = comm_ctx
