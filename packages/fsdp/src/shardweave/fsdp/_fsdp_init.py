"""What ``fully_shard`` does before any group exists: validate, pick modules and params, move."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardweave.fsdp._fsdp_common import ShardPlacementResult
from shardweave.fsdp._fsdp_state import get_fsdp_state
from shardweave.fsdp._torch_interop import managed_by_torch
from shardweave.mesh import ArgumentTypeError, FSDPMeshInfo, HSDPMeshInfo

__all__ = [
    "managed_modules",
    "managed_params_and_buffers",
    "module_arguments",
    "move_states_to_device",
    "post_forward_mesh_info",
    "resolve_shard_placements",
    "validate_ignored_params",
    "validate_module",
    "validate_reshard_after_forward",
    "validate_shard_placement_fn",
]

logger = logging.getLogger("shardweave.fsdp")


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


def post_forward_mesh_info(
    reshard_after_forward: bool | int, mesh_info: FSDPMeshInfo
) -> FSDPMeshInfo | None:
    """The mesh parameters live on between forward and backward (None: stay unsharded)."""
    validate_reshard_after_forward(reshard_after_forward)
    size = mesh_info.shard_mesh_size
    if not isinstance(reshard_after_forward, bool):
        k = reshard_after_forward
        if k < 1 or k > size or size % k != 0:
            factors = tuple(d for d in range(1, size + 1) if size % d == 0)
            raise ValueError(
                "If passing reshard_after_forward as an int, it should be a factor of "
                f"{size}, not {k}; pass one of {factors} (the group size to reshard to), or "
                "True/False"
            )
        if k == 1:
            logger.warning(
                "reshard_after_forward=1 (int) means resharding to world size 1, i.e. keeping "
                "parameters unsharded; use reshard_after_forward=False (bool) to say so"
            )
            reshard_after_forward = False
        elif k == size:
            reshard_after_forward = True
        else:
            # A (n/k, k) view of the whole data-parallel mesh: its rows are the smaller groups.
            # New process groups: every rank makes this call in the same order.
            ranks = mesh_info.mesh.mesh.reshape(-1, k)
            mesh = DeviceMesh(mesh_info.mesh.device_type, ranks)
            return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    return mesh_info if reshard_after_forward else None


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
    for param in params:
        result = None if shard_placement_fn is None else shard_placement_fn(param)
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
