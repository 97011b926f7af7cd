"""Which parameters each ``fully_shard`` call would manage, read off a (meta) model.

Mirrors the engine's discovery rules without calling it: ``fully_shard`` is applied to every
wrapped module in post-order (inner modules first, as users write it), then to the root. A call
manages the direct parameters of the modules under it that no earlier call claimed, visiting
modules in post-order and each module's own parameters in registration order; a parameter
reachable twice within one call (a tied weight) is managed once, where it is first met; ignored
parameters are skipped. A parameter claimed by two calls is an error, as in the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardweave.fsdp._torch_compat import has_grad_dtype_override

__all__ = ["GroupSpec", "ParamSpec", "PlanError", "discover_groups", "module_wrap_predicate"]

ROOT_KEY = "<root>"  # the tracer's key for the root module's group (its FQN is "")


class PlanError(ValueError):
    """The planned configuration would be rejected by ``fully_shard``.

    A ``ValueError``; the CLI prints it and exits with status 2.

    Example::

        try:
            plan(build_model, mesh=1024, wrap="Block", reshard_after_forward=3)
        except PlanError as e:
            print(e)  # 3 does not divide the shard size 1024; lists the sizes that do
    """


@dataclass(frozen=True)
class ParamSpec:
    """One managed parameter as the engine sees it (``shape`` is what is gathered)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    shard_dim: int = 0  # from ``shard_placement_fn``
    grad_dtype: torch.dtype | None = None  # an explicit ``Parameter.grad_dtype`` (torch 2.15)


@dataclass(frozen=True)
class GroupSpec:
    """One ``fully_shard`` call's parameter group.

    ``key`` is the group's module FQN as the tracer names it (``"<root>"`` for the root);
    ``depth`` is its nesting level among wrapped modules (root 0); ``parent`` the key of the
    nearest wrapped ancestor; ``children`` the direct submodules holding parameters this group
    manages, with their numel (candidates to wrap separately); ``input_is_integer`` marks an
    ``nn.Embedding`` (its input needs no grad, so its post-backward runs in the final callback).
    """

    key: str
    module_type: str
    depth: int
    parent: str | None
    params: tuple[ParamSpec, ...]
    children: tuple[tuple[str, int], ...]
    input_is_integer: bool


WrapPredicate = Callable[[nn.Module], bool]


def module_wrap_predicate(wrap: type | str | WrapPredicate | Sequence[str] | None) -> WrapPredicate:
    """A predicate from a class, a class name (``"Block"``, ``"pkg.mod.Block"`` or several
    comma-separated), a list of names, or a callable; ``None`` wraps nothing but the root."""
    if wrap is None:
        return lambda module: False
    if isinstance(wrap, type):
        cls = wrap
        return lambda module: isinstance(module, cls)
    if isinstance(wrap, str) or (
        isinstance(wrap, Sequence) and all(isinstance(w, str) for w in wrap)
    ):
        names = (
            {n.strip() for n in wrap.split(",") if n.strip()}
            if isinstance(wrap, str)
            else set(wrap)
        )
        if not names:
            raise PlanError("plan: wrap names no class; pass e.g. wrap='TransformerBlock'")

        def by_name(module: nn.Module) -> bool:
            cls = type(module)
            return cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

        return by_name
    if callable(wrap):
        return wrap
    raise PlanError(
        f"plan: wrap must be a module class, a class name or a callable, got "
        f"{type(wrap).__name__} {wrap!r:.80}; pass e.g. wrap='TransformerBlock'"
    )


def _tp_local_shape(shape: tuple[int, ...], tp: int, tp_dim: int | None) -> tuple[int, ...]:
    # A tensor-parallel DTensor's local tensor is a torch.chunk piece: rank 0's is the largest.
    if tp == 1 or tp_dim is None or not shape:
        return shape
    dim = tp_dim % len(shape)
    size = shape[dim]
    local = -(-size // tp) if size else 0
    return (*shape[:dim], local, *shape[dim + 1 :])


def discover_groups(
    model: nn.Module,
    wrap: WrapPredicate,
    *,
    ignored_params: set[nn.Parameter] | None = None,
    tp: int = 1,
    tp_shard_dim: Callable[[str, nn.Parameter], int | None] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    shard_size: int = 1,
) -> list[GroupSpec]:
    """The groups in forward order (the root first, then wrapped modules in pre-order)."""
    # Past 80 lines: its rules are closures over one visit order and one claimed set (the
    # engine's discovery, mirrored as one piece).
    ignored = ignored_params or set()
    names: dict[nn.Module, str] = {}
    for name, module in model.named_modules():
        names.setdefault(module, name)
    param_names: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        param_names.setdefault(param, name)
    wrapped = {m for m in names if m is not model and wrap(m)}
    owners: dict[nn.Parameter, str] = {}  # parameter -> key of the group that claimed it
    groups: dict[nn.Module, GroupSpec] = {}

    def key_of(module: nn.Module) -> str:
        return ROOT_KEY if module is model else names[module]

    def visit_order(root: nn.Module) -> list[nn.Module]:
        # Post-order over the modules this call manages: stop at other wrapped modules.
        seen: set[nn.Module] = set()
        order: list[nn.Module] = []

        def visit(module: nn.Module) -> None:
            if module in seen:
                return
            seen.add(module)
            if module is not root and (module in wrapped or module is model):
                return
            for child in module.children():
                visit(child)
            order.append(module)

        visit(root)
        return order

    def build(root: nn.Module, depth: int, parent: str | None) -> GroupSpec:
        key = key_of(root)
        params: list[ParamSpec] = []
        seen: set[nn.Parameter] = set()
        child_numel: dict[str, int] = {}
        for module in visit_order(root):
            for param in module.parameters(recurse=False):
                if param in ignored or param in seen:
                    continue
                seen.add(param)
                fqn = param_names.get(param, f"{names.get(module, '?')}.<unnamed>")
                if param in owners:
                    raise PlanError(
                        f"plan: parameter '{fqn}' is managed by group '{owners[param]}' and would "
                        f"also be managed by '{key}' (a tied/shared parameter across groups); "
                        "fully_shard rejects this at the first forward. Put both modules in one "
                        "group (fully_shard([a, b]) or wrap a common ancestor), or unwrap one."
                    )
                owners[param] = key
                if param.ndim == 0:
                    raise PlanError(
                        f"plan: '{fqn}' is a 0-dim parameter, which fully_shard does not support; "
                        "make it a 1-D tensor with one element"
                    )
                tp_dim = None if tp_shard_dim is None else tp_shard_dim(fqn, param)
                shape = _tp_local_shape(tuple(param.shape), tp, tp_dim)
                dim = _shard_dim(fqn, param, shape, shard_placement_fn, shard_size)
                grad_dtype = param.grad_dtype if has_grad_dtype_override(param) else None
                params.append(
                    ParamSpec(fqn, shape, param.dtype, param.requires_grad, dim, grad_dtype)
                )
                if module is not root:
                    child = _direct_child_name(names.get(module, ""), key)
                    child_numel[child] = child_numel.get(child, 0) + param.numel()
        return GroupSpec(
            key=key,
            module_type=type(root).__name__,
            depth=depth,
            parent=parent,
            params=tuple(params),
            children=tuple(sorted(child_numel.items(), key=lambda kv: -kv[1])),
            input_is_integer=isinstance(root, nn.Embedding) and root is not model,
        )

    # Apply in post-order (inner wrapped modules claim their parameters first) ...
    def apply(module: nn.Module, depth: int, parent: str | None) -> None:
        inner_depth, inner_parent = depth, parent
        if module in wrapped or module is model:
            inner_depth, inner_parent = depth + 1, key_of(module)
        for child in module.children():
            if child not in visited:
                visited.add(child)
                apply(child, inner_depth, inner_parent)
        if module in wrapped or module is model:
            groups[module] = build(module, depth, parent)

    visited: set[nn.Module] = {model}
    apply(model, 0, None)
    # ... but report them in forward order: the root's pre-forward runs first, then the wrapped
    # modules in the order named_modules lists them (the order a sequential forward runs them).
    return [groups[m] for m in names if m in groups]


def _shard_dim(
    fqn: str,
    param: nn.Parameter,
    shape: tuple[int, ...],
    placement_fn: Callable[[nn.Parameter], object] | None,
    world: int,
) -> int:
    """The dim ``fully_shard`` shards ``param`` on, rejected where the engine rejects it."""
    placement = None if placement_fn is None else placement_fn(param)
    if placement is None:
        return 0
    dim = getattr(placement, "dim", None)
    if not isinstance(dim, int):
        raise PlanError(
            f"plan: shard_placement_fn must return Shard(dim) or None, got {placement!r} for "
            f"'{fqn}'"
        )
    if not -len(shape) <= dim < len(shape):
        raise PlanError(f"plan: Shard({dim}) is invalid for the {len(shape)}-D '{fqn}'")
    dim %= len(shape)
    if dim > 0 and shape[dim] % world:
        raise PlanError(
            f"plan: '{fqn}' has size {shape[dim]} on dim {dim}, which the shard size {world} "
            f"does not divide; fully_shard only shards dim 0 unevenly"
        )
    return dim


def _direct_child_name(module_fqn: str, group_key: str) -> str:
    prefix = "" if group_key == ROOT_KEY else group_key + "."
    rest = module_fqn[len(prefix) :] if module_fqn.startswith(prefix) else module_fqn
    head = rest.split(".", 1)[0]
    return prefix + head if head else group_key
