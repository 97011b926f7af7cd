"""Checking ``fully_shard``'s arguments, in one pass, before anything is built or moved.

``fully_shard_arguments`` runs every check of the call (the module argument, a second
application, the policies, ``shard_placement_fn``, ``ignored_params``,
``reshard_after_forward``, the mesh and ``dp_mesh_dims``) in one pass, and returns what
assembly (``_assembly``) needs as one ``FullyShardArgs``. The checks are also published one by
one (``shardweave.fsdp.engine``) for APIs built on the engine, as ``replicate``. Nothing here
builds a group, attaches a state or swaps a class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardweave.fsdp._fsdp_api import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_own_policies,
    torch_policy_types,
)
from shardweave.fsdp._torch_interop import managed_by_torch
from shardweave.fsdp.core._state import get_fsdp_state
from shardweave.mesh import (
    ArgumentTypeError,
    DataParallelMeshDims,
    DataParallelMeshInfo,
    FSDPMeshInfo,
    default_mesh,
    mesh_device,
    resolve_mesh_info,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "FullyShardArgs",
    "check_not_applied",
    "fully_shard_arguments",
    "module_arguments",
    "resolve_policies",
    "validate_ignored_params",
    "validate_module",
    "validate_reshard_after_forward",
    "validate_reshard_factor",
    "validate_shard_placement_fn",
]


@dataclass(frozen=True)
class FullyShardArgs:
    """``fully_shard``'s arguments once checked: what assembly builds from."""

    modules: tuple[nn.Module, ...]
    mesh_info: DataParallelMeshInfo
    device: torch.device
    reshard_after_forward: bool | int | None
    shard_placement_fn: Callable[[nn.Parameter], Any] | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    ignored_params: set[nn.Parameter]


def fully_shard_arguments(
    module: object,
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mp_policy: object,
    offload_policy: object,
    ignored_params: object,
    dp_mesh_dims: DataParallelMeshDims | None,
    api: str = "fully_shard",
) -> FullyShardArgs:
    """Every check of one ``fully_shard`` call, in the order they have always run (the first
    failure raises); what comes back is all assembly needs."""
    modules = module_arguments(module, api)
    check_not_applied(modules, api)
    mp, offload = resolve_policies(mp_policy, offload_policy, api)
    validate_shard_placement_fn(shard_placement_fn, api)
    ignored = validate_ignored_params(ignored_params, api)
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
    if (
        isinstance(mesh_info, FSDPMeshInfo)
        and isinstance(reshard_after_forward, int)
        and not isinstance(reshard_after_forward, bool)
    ):
        validate_reshard_factor(reshard_after_forward, mesh_info.shard_mesh_size)
    return FullyShardArgs(
        modules=modules,
        mesh_info=mesh_info,
        device=device,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp,
        offload_policy=offload,
        ignored_params=ignored,
    )


def check_not_applied(modules: tuple[nn.Module, ...], api: str) -> None:
    """Refuse a module that ``api`` (or another API on this engine) already manages."""
    for m in modules:
        existing = get_fsdp_state(m)
        if existing is not None and existing.api.name == api:
            # starts with torch 2.13's sentence (its `contract` raises it), which users match on
            raise AssertionError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"{api} has already been applied to {type(m).__name__}: remove the second call "
                "(change settings with the FSDPModule setters instead)"
            )
        if existing is not None:
            raise AssertionError(
                f"{api} was already applied to {type(m).__name__} (by {existing.api.name}); "
                "each distinct composable distributed API can only be applied to a module once: "
                "remove the second call (change settings with the FSDPModule setters instead)"
            )


def resolve_policies(
    mp_policy: object, offload_policy: object, api: str = "fully_shard"
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """Our policy objects for ``mp_policy`` and ``offload_policy``: ours as they are, torch's
    (``torch.distributed.fsdp``) converted field by field; anything else raises TypeError."""
    mp_policy, offload_policy = as_own_policies(mp_policy, offload_policy)
    torch_types = torch_policy_types() or ()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        mp_classes = (MixedPrecisionPolicy, *torch_types[:1])
        if isinstance(mp_policy, type) and issubclass(mp_policy, mp_classes):
            fix = "instantiate it: mp_policy=MixedPrecisionPolicy(param_dtype=...)"
        elif isinstance(mp_policy, torch.dtype):
            fix = f"pass mp_policy=MixedPrecisionPolicy(param_dtype={mp_policy})"
        else:
            fix = "pass mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)"
        raise TypeError(
            f"{api}: mp_policy must be a MixedPrecisionPolicy instance (shardweave.fsdp's or "
            f"torch.distributed.fsdp's), got {type(mp_policy).__name__} {mp_policy!r:.80}; {fix}"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        offload_classes = (OffloadPolicy, *torch_types[1:2])
        if isinstance(offload_policy, type) and issubclass(offload_policy, offload_classes):
            fix = f"instantiate it: offload_policy={offload_policy.__name__}()"
        else:
            fix = "pass offload_policy=CPUOffloadPolicy() to offload, or omit it"
        raise TypeError(
            f"{api}: offload_policy must be an OffloadPolicy instance (shardweave.fsdp's or "
            f"torch.distributed.fsdp's), got {type(offload_policy).__name__} "
            f"{offload_policy!r:.80}; {fix}"
        )
    if (
        isinstance(offload_policy, CPUOffloadPolicy)
        and offload_policy.pin_memory
        and not torch.accelerator.is_available()
    ):
        # Pinning allocates page-locked memory through the accelerator's runtime.
        raise RuntimeError(
            f"{api}: offload_policy=CPUOffloadPolicy() pins memory (pin_memory=True by "
            "default), which needs an accelerator, and none is available; pass "
            "offload_policy=CPUOffloadPolicy(pin_memory=False)"
        )
    return mp_policy, offload_policy


def validate_module(module: nn.Module, api: str) -> None:
    if (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    ):
        raise ValueError(
            f"{api} does not support containers that do not implement forward: "
            f"{type(module).__name__}; apply {api} to each child, or to a module whose forward "
            "runs them"
        )


def module_arguments(module: object, api: str) -> tuple[nn.Module, ...]:
    """The modules of ``api``'s ``module`` argument (one module, or a list or tuple of them)."""
    if isinstance(module, nn.Module):
        validate_module(module, api)
        _reject_torch_managed(module, api)
        return (module,)
    if isinstance(module, (str, bytes, torch.Tensor)) or not isinstance(module, Iterable):
        raise ArgumentTypeError(
            f"{api}: module must be an nn.Module or a list of nn.Modules, got "
            f"{type(module).__name__} {module!r:.80}; pass the model or one of its blocks, "
            f"e.g. {api}(model.layers[0])"
        )
    modules = tuple(module)
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise ArgumentTypeError(
                f"{api}: module[{i}] is a {type(m).__name__} ({m!r:.80}), not an nn.Module; "
                "pass a list of nn.Modules that form one group"
            )
        _reject_torch_managed(m, api)
    return modules


def _reject_torch_managed(module: nn.Module, api: str) -> None:
    # Checked before anything moves: the class swap would fail later with an MRO TypeError.
    if managed_by_torch(module):
        raise AssertionError(
            "Each distinct composable distributed API can only be applied to a module once. "
            f"torch's own fully_shard or replicate already manages {type(module).__name__}, so "
            f"shardweave's {api} cannot: use one engine for the whole model"
        )


def validate_ignored_params(ignored_params: object, api: str) -> set[nn.Parameter]:
    """``ignored_params`` as a set, after checking it holds parameters (``None``: empty)."""
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor):
        # A lone tensor is iterable (over its rows), which would silently mean something else.
        raise TypeError(
            f"{api}: ignored_params must be a set of parameters, got a single "
            f"{type(ignored_params).__name__} of shape {tuple(ignored_params.shape)}; wrap it "
            "in a set, e.g. ignored_params={module.weight}"
        )
    if isinstance(ignored_params, nn.Module):
        raise TypeError(
            f"{api}: ignored_params must be a set of parameters, got the module "
            f"{type(ignored_params).__name__}; pass set(module.parameters())"
        )
    if not isinstance(ignored_params, (set, frozenset, list, tuple)):
        raise TypeError(
            f"{api}: ignored_params must be a set of parameters, got "
            f"{type(ignored_params).__name__}; pass e.g. set(module.parameters())"
        )
    for item in ignored_params:
        if isinstance(item, nn.Module):
            raise TypeError(
                f"{api}: ignored_params holds the module {type(item).__name__}, not its "
                "parameters; pass set(module.parameters()) to ignore all of them"
            )
        if not isinstance(item, nn.Parameter):
            raise TypeError(
                f"{api}: ignored_params must hold nn.Parameters, got a {type(item).__name__}; "
                "pass the module's parameters, e.g. set(module.parameters())"
            )
    return set(ignored_params)


def validate_shard_placement_fn(shard_placement_fn: object, api: str) -> None:
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"{api}: shard_placement_fn must be a callable taking a parameter, got "
            f"{shard_placement_fn!r} ({type(shard_placement_fn).__name__}); pass a function, "
            "e.g. shard_placement_fn=lambda param: Shard(1)"
        )


def validate_reshard_after_forward(reshard_after_forward: object) -> None:
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {reshard_after_forward!r}; pass True, False, None (the default) "
            "or an int that divides the shard world size"
        )


def validate_reshard_factor(k: int, size: int) -> None:
    """An int ``reshard_after_forward`` must divide the shard group's size ``size``."""
    if k < 1 or k > size or size % k != 0:
        factors = tuple(d for d in range(1, size + 1) if size % d == 0)
        raise ValueError(
            "If passing reshard_after_forward as an int, it should be a factor of "
            f"{size}, not {k}; pass one of {factors} (the group size to reshard to), or "
            "True/False"
        )
