"""Assembling what ``fully_shard`` builds once its arguments are checked (``_args``):
the managed modules and parameters, the state, the parameter groups and the class swap.

As torch's ``_fsdp_init.py``: the module argument comes down here once, and nothing here calls
back up to ``fully_shard``; the class to mix in is passed in (``module_cls``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy, OffloadPolicy
from shardweave.fsdp._fsdp_common import ShardPlacementResult
from shardweave.fsdp._torch_interop import expose_state_to_torch, torch_marker_bases
from shardweave.fsdp.core._args import (
    FullyShardArgs,
    validate_reshard_after_forward,
    validate_reshard_factor,
)
from shardweave.fsdp.core._param_group import FSDPParamGroup
from shardweave.fsdp.core._state import FSDPState, get_fsdp_state
from shardweave.mesh import DataParallelMeshInfo, FSDPMeshInfo, HSDPMeshInfo, as_own_mesh_info

__all__ = [
    "attach_engine",
    "build_groups",
    "init_fully_shard",
    "managed_modules",
    "managed_params_and_buffers",
    "move_states_to_device",
    "post_forward_mesh_info",
    "resolve_shard_placements",
    "root_modules",
    "swap_class",
]

logger = logging.getLogger("shardweave.fsdp")


def init_fully_shard(args: FullyShardArgs, *, module_cls: type) -> None:
    """Build and attach what one checked ``fully_shard`` call manages; its roots become
    ``FSDP<their class>`` instances, also of ``module_cls``."""
    mesh_info, device = args.mesh_info, args.device
    reshard_after_forward = args.reshard_after_forward
    auto_reshard = reshard_after_forward is None
    # Replicate-only dp_mesh_dims: nothing is sharded, so nothing reshards after forward.
    post_info = (
        post_forward_mesh_info(
            True if reshard_after_forward is None else reshard_after_forward, mesh_info
        )
        if isinstance(mesh_info, FSDPMeshInfo)
        else None
    )

    def make_groups(
        params: list[nn.Parameter], roots: tuple[nn.Module, ...]
    ) -> list[FSDPParamGroup]:
        placements: list[tuple[Any, DataParallelMeshInfo]] = [(None, mesh_info)] * len(params)
        if isinstance(mesh_info, FSDPMeshInfo):
            placements = list(resolve_shard_placements(params, args.shard_placement_fn, mesh_info))
        return build_groups(
            params,
            placements=placements,
            roots=roots,
            mesh_info=mesh_info,
            post_forward_mesh_info=post_info,
            reshard_after_forward=reshard_after_forward,
            device=device,
            mp_policy=args.mp_policy,
            offload_policy=args.offload_policy,
        )

    attach_engine(
        args.modules,
        ignored_params=args.ignored_params,
        device=device,
        make_state=lambda roots: FSDPState(
            roots,
            device=device,
            mp_policy=args.mp_policy,
            mesh_info=mesh_info,
            auto_reshard_after_forward=auto_reshard,
        ),
        make_groups=make_groups,
        module_cls=module_cls,
        class_prefix="FSDP",
        mark_managed=True,
    )


def attach_engine(
    modules: tuple[nn.Module, ...],
    *,
    ignored_params: set[nn.Parameter] | None,
    device: torch.device,
    make_state: Callable[[tuple[nn.Module, ...]], FSDPState],
    make_groups: Callable[[list[nn.Parameter], tuple[nn.Module, ...]], list[FSDPParamGroup]],
    module_cls: type,
    class_prefix: str,
    mark_managed: bool,
) -> None:
    """What ``fully_shard`` and ``replicate`` share once their arguments are checked.

    Collects the parameters and buffers of ``modules`` that no inner call manages (less the
    ignored ones), moves them to ``device``, attaches ``make_state(roots)`` with
    ``make_groups(params, roots)`` (detached again if building a group fails, so a failed call
    leaves the modules as they were) and swaps each root's class to
    ``<class_prefix><its class>``, which also derives from ``module_cls``. ``mark_managed`` sets
    the two attributes torch's ``fully_shard`` puts on managed modules (its ``replicate`` does
    not). Published as ``shardweave.fsdp.engine.attach_engine``: its signature is under that
    module's promise.
    """
    ignored = set(ignored_params or ())
    roots = root_modules(modules)
    managed = managed_modules(roots, ignored)
    params, buffers = managed_params_and_buffers(managed, ignored)
    move_states_to_device(params, buffers, device)
    state = make_state(roots)
    try:
        state._fsdp_param_groups = make_groups(params, roots)
    except BaseException:
        state.detach()
        raise
    if mark_managed:
        for m in managed:
            m._is_fsdp_managed_module = True  # type: ignore[assignment]
            m._fsdp_use_orig_params = True  # type: ignore[assignment]
    for root in roots:
        expose_state_to_torch(root, state, state.api.name)
        swap_class(root, module_cls, class_prefix)


def root_modules(modules: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    """The listed modules that are not inside another listed module."""
    roots: list[nn.Module] = []
    for m in modules:
        inside = any(other is not m and m in set(other.modules()) for other in modules)
        if not inside and m not in roots:
            roots.append(m)
    return tuple(roots)


def build_groups(
    params: list[nn.Parameter],
    *,
    placements: list[tuple[Any, DataParallelMeshInfo]],
    roots: tuple[nn.Module, ...],
    mesh_info: DataParallelMeshInfo,
    post_forward_mesh_info: FSDPMeshInfo | None,
    reshard_after_forward: bool | int | None,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> list[FSDPParamGroup]:
    """The parameter groups of one call: one per distinct mesh among ``placements`` (each
    parameter's ``(Shard placement or None, mesh info)``, in ``params`` order), since
    ``shard_placement_fn`` may move parameters to another mesh.

    ``post_forward_mesh_info`` is where ``mesh_info``'s parameters reshard to after forward
    (None: fully); ``reshard_after_forward`` derives it for the other meshes. Published as
    ``shardweave.fsdp.engine.build_groups``: its signature is under that module's promise.
    """
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
            post_forward_mesh_info
            if info is mesh_info or not isinstance(info, FSDPMeshInfo)
            # the module's function: the argument of the same name shadows it here
            else _post_forward_mesh_info(
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


def post_forward_mesh_info(
    reshard_after_forward: bool | int, mesh_info: FSDPMeshInfo
) -> FSDPMeshInfo | None:
    """The mesh parameters live on between forward and backward (None: stay unsharded)."""
    validate_reshard_after_forward(reshard_after_forward)
    size = mesh_info.shard_mesh_size
    if not isinstance(reshard_after_forward, bool):
        k = reshard_after_forward
        validate_reshard_factor(k, size)
        if k == 1:
            logger.warning(
                "reshard_after_forward=1 (int) means resharding to world size 1, i.e. keeping "
                "parameters unsharded; use reshard_after_forward=False (bool) to say so"
            )
            reshard_after_forward = False
        elif k == size:
            reshard_after_forward = True
        else:
            mesh = _post_forward_mesh(mesh_info.mesh, k)
            return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    return mesh_info if reshard_after_forward else None


# (id of a data-parallel mesh, factor) -> its post-forward mesh, while that mesh lives.
_POST_FORWARD_MESHES: dict[tuple[int, int], DeviceMesh] = {}


def _post_forward_mesh(mesh: DeviceMesh, k: int) -> DeviceMesh:
    """A (n/k, k) view of the whole data-parallel mesh, whose rows are the smaller groups; one
    per mesh object and factor. Torch builds a new one, so new process groups, at every
    ``fully_shard`` call: a model sharded per layer with ``reshard_after_forward=k`` then holds
    a communicator set per layer (on gloo, two threads per rank per group).
    Sharing one is safe because every rank issues every group's collectives in the same order,
    and deterministic across ranks because a hit needs the very mesh object an earlier call
    got (an entry leaves with its mesh, before its id can be reused). Creating one is a
    collective: every rank makes the call in the same order."""
    key = (id(mesh), k)
    if key not in _POST_FORWARD_MESHES:
        _POST_FORWARD_MESHES[key] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, k))
        weakref.finalize(mesh, _POST_FORWARD_MESHES.pop, key, None)
    return _POST_FORWARD_MESHES[key]


_post_forward_mesh_info = post_forward_mesh_info  # for build_groups, whose argument shadows it


def managed_modules(
    roots: Sequence[nn.Module], ignored_params: set[nn.Parameter]
) -> list[nn.Module]:
    """Modules whose direct parameters this call manages: everything under the roots except
    subtrees that already have their own state (nested ``fully_shard``), post-order."""
    seen: set[nn.Module] = set()
    order: list[nn.Module] = []
    root_set = set(roots)

    def visit(module: nn.Module) -> None:
        if module in seen:
            return
        seen.add(module)
        if module not in root_set and get_fsdp_state(module) is not None:
            return
        for child in module.children():
            visit(child)
        order.append(module)

    for root in roots:
        visit(root)
    if not ignored_params:
        return order
    ignorable: dict[nn.Module, bool] = {}
    for module in order:  # post-order: children decided first
        own = list(module.parameters(recurse=False))
        ignorable[module] = (
            not list(module.buffers(recurse=False))
            and all(p in ignored_params for p in own)
            and all(ignorable.get(c, False) for c in module.children())
        )
    return [m for m in order if not ignorable[m]]


def managed_params_and_buffers(
    modules: Sequence[nn.Module], ignored_params: set[nn.Parameter]
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    params: list[nn.Parameter] = []
    buffers: list[torch.Tensor] = []
    seen_params: set[nn.Parameter] = set()
    seen_buffers: set[torch.Tensor] = set()
    for module in modules:
        for param in module.parameters(recurse=False):
            if param in ignored_params or param in seen_params:
                continue
            seen_params.add(param)
            params.append(param)
        for buffer in module.buffers(recurse=False):
            if buffer not in seen_buffers:
                seen_buffers.add(buffer)
                buffers.append(buffer)
    return params, buffers


def move_states_to_device(
    params: Sequence[nn.Parameter], buffers: Sequence[torch.Tensor], device: torch.device
) -> None:
    """Move managed parameters and buffers to the mesh's device, keeping object identity."""
    for tensor in (*params, *buffers):
        if tensor.device == device or tensor.device.type == "meta":
            continue
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"fully_shard: a DTensor parameter on {tensor.device} does not match the mesh "
                f"device {device}; build its mesh on '{device.type}'"
            )
        # .data keeps the Parameter object (and any optimizer/user references to it).
        tensor.data = tensor.data.to(device)


def resolve_shard_placements(
    params: Sequence[nn.Parameter],
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mesh_info: FSDPMeshInfo,
) -> list[tuple[Shard | None, FSDPMeshInfo]]:
    """Each parameter's shard placement and mesh (``shard_placement_fn`` may pick both)."""
    resolved: list[tuple[Shard | None, FSDPMeshInfo]] = []
    # torch's mesh infos (torchtitan's expert parallelism returns them), each converted once so
    # that the parameters sharing one still share one group
    converted: dict[int, tuple[object, object]] = {}
    for param in params:
        result = None if shard_placement_fn is None else shard_placement_fn(param)
        if _is_torch_placement_result(result):
            torch_info = cast(Any, result).mesh_info
            if id(torch_info) not in converted:
                converted[id(torch_info)] = (torch_info, as_own_mesh_info(torch_info))
            own = cast(FSDPMeshInfo, converted[id(torch_info)][1])
            result = ShardPlacementResult(cast(Any, result).placement, own)
        if result is None:
            resolved.append((None, mesh_info))
        elif isinstance(result, Shard):
            resolved.append((result, mesh_info))
        elif isinstance(result, ShardPlacementResult):
            resolved.append((result.placement, result.mesh_info))
        else:
            raise ValueError(
                "shard_placement_fn must return None, a Shard or a ShardPlacementResult, "
                f"got {result!r} for a parameter of shape {tuple(param.shape)}; return "
                "Shard(dim) to shard another dim or None for Shard(0) (to keep a parameter "
                "whole on every rank, list it in ignored_params or use replicate())"
            )
    return resolved


def _is_torch_placement_result(result: object) -> bool:
    """Whether ``result`` is torch's ``ShardPlacementResult`` (recognized by module and name:
    shardweave never imports torch's FSDP engine)."""
    cls = type(result)
    return cls.__name__ == "ShardPlacementResult" and cls.__module__.startswith(
        "torch.distributed.fsdp."
    )


_CLASS_CACHE: dict[tuple[type, type], type] = {}


def _no_deepcopy(self: nn.Module, memo: dict[int, Any]) -> NoReturn:
    raise AssertionError(
        "FSDP does not support deepcopy of a sharded module; deepcopy the model before "
        "fully_shard, or use its state_dict"
    )


def swap_class(module: nn.Module, mixin: type, prefix: str) -> None:
    """Make ``module`` an instance of ``FSDP<Its class>``: ``mixin`` first, so its methods win,
    then the guard of torch's methods and torch's ``FSDPModule`` as a marker (see _torch_interop),
    then the module's own class."""
    cls = type(module)
    key = (cls, mixin)
    new_cls = _CLASS_CACHE.get(key)
    if new_cls is None:
        bases = (mixin, *torch_marker_bases(), cls)
        new_cls = type(f"{prefix}{cls.__name__}", bases, {"__deepcopy__": _no_deepcopy})
        _CLASS_CACHE[key] = new_cls
    module.__class__ = new_cls
