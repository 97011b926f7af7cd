"""How torch's own components recognize modules shardweave manages.

Frameworks and torch itself switch behavior on ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
(torchtitan's gradient division, Lightning Fabric's ``no_backward_sync``, torch's
``PipelineStage`` and pipeline schedules). A module that fails that check is not an error for
them: they silently take the non-FSDP path (averaged gradients, a reduce-scatter per micro-batch).
So the classes ``fully_shard`` and ``replicate`` create also derive from torch's public
``FSDPModule``, as a marker only: it comes after ours in the MRO, so every method a caller reaches
through it is ours, and no torch engine object is ever created.

A torch release can add methods to its ``FSDPModule`` before we have ours (2.15 added three).
Reached through the marker they would run torch's engine code over our state: fail deep inside
torch, or worse, silently do nothing. So a guard class sits between ours and the marker, built
from torch's class as installed: for every method torch defines, a stand-in that raises
``NotImplementedError`` naming the method and the torch release. Ours come first in the MRO, so
the guard only answers for what we lack (``unimplemented_torch_methods``; empty on every release
we support, which ``tests/fsdp/world_2/test_torch_marker.py`` checks).

``PipelineStage`` also reads our state through torch's composable-API accessor
(``torch.distributed.fsdp.fully_shard.state(module)``), which looks the state up in
``module.__dict__[STATE_KEY]`` keyed by torch's function object. ``TorchStateSlot`` answers that
lookup with our state, recognizing torch's functions by name so that this package never imports
them. The state is handed down with the name of the API that made it; nothing here reads it.

Nothing here is imported until ``fully_shard`` or ``replicate`` is first called: importing
shardweave never loads ``torch.distributed.fsdp``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, NoReturn

from torch import nn

from shardweave.fsdp._torch_compat import TORCH_VERSION

__all__ = [
    "ManagedModule",
    "TorchStateSlot",
    "expose_state_to_torch",
    "managed_by_torch",
    "torch_marker_bases",
    "unimplemented_torch_methods",
]


class ManagedModule:
    """The base of every mixin shardweave puts on the modules it manages (``FSDPModule``, and
    so ``ReplicateModule``): how this module tells our classes from torch's without importing
    the API that defines them."""


# torch's composable APIs, by (module, name) of the function its ``contract`` returns, and the
# shardweave APIs whose state each one's ``.state(module)`` returns. torch's ``fully_shard`` answers
# for our ``replicate`` too: torch's PipelineStage asks ``fully_shard.state`` of any FSDPModule that
# is not torch's own ReplicateModule (a class this package does not import, so ours is never one).
_TORCH_APIS: dict[tuple[str, str], tuple[str, ...]] = {
    ("torch.distributed.fsdp._fully_shard._fully_shard", "fully_shard"): (
        "fully_shard",
        "replicate",
    ),
    ("torch.distributed._composable.replicate_with_fsdp", "replicate"): ("replicate",),
}


@functools.cache
def torch_marker_bases() -> tuple[type, ...]:
    """The extra bases of the classes we create, after ours: the guard of torch's methods, then
    torch's public ``FSDPModule`` (the marker, always last); or none.

    None when torch has no ``torch.distributed.fsdp`` (a build without distributed), or when
    that name is already shardweave's own class (a process that swapped torch's public names for
    ours, as tools/torch_fsdp_suite.py does, where the marker would be a duplicate base)."""
    try:
        from torch.distributed.fsdp import FSDPModule as marker  # noqa: TID251 (the marker only)
    except ImportError:
        return ()
    if not isinstance(marker, type) or issubclass(marker, ManagedModule):
        return ()
    return (_method_guard(marker), marker)


class TorchMethodGuard:
    """The base of the guard class: its stand-ins are made per torch release (``_method_guard``)."""


def _method_guard(marker: type) -> type:
    """A class with a raising stand-in for every method (function, static or class method,
    property) torch's ``marker`` defines, dunders aside (its ``__new__`` and ours do the same)."""
    stand_ins: dict[str, Any] = {}
    for name, attr in vars(marker).items():
        if name.startswith("__") and name.endswith("__"):
            continue
        if inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod)):
            stand_ins[name] = _refusing_method(name)
        elif isinstance(attr, property):
            stand_ins[name] = property(_refusing_method(name))
    return type("TorchFSDPModuleMethodGuard", (TorchMethodGuard,), stand_ins)


def _refusing_method(name: str) -> Any:
    def refused(self: object, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{type(self).__name__}.{name} is a method of torch {TORCH_VERSION}'s "
            f"FSDPModule that shardweave does not implement yet, and shardweave never runs "
            "torch's FSDP code over its own modules; apply torch's fully_shard for this feature, "
            "or ask shardweave for it"
        )

    refused.__name__ = refused.__qualname__ = name
    return refused


def unimplemented_torch_methods(cls: type) -> list[str]:
    """The methods of torch's ``FSDPModule`` that, on ``cls``, reach the guard's stand-in."""
    guards = [
        c for c in cls.__mro__ if issubclass(c, TorchMethodGuard) and c is not TorchMethodGuard
    ]
    return sorted(
        name
        for guard in guards
        for name in vars(guard)
        if not name.startswith("__") and next(c for c in cls.__mro__ if name in vars(c)) is guard
    )


def managed_by_torch(module: nn.Module) -> bool:
    """Whether torch's own ``fully_shard`` (or its ``replicate``) was applied to ``module``.

    Imports nothing: when torch's FSDP was never loaded, no module can be one of its."""
    if "torch.distributed.fsdp" not in sys.modules or not torch_marker_bases():
        return False
    return isinstance(module, torch_marker_bases()[-1]) and not isinstance(module, ManagedModule)


class TorchStateSlot(dict[Any, Any]):
    """``module.__dict__[STATE_KEY]`` of a module shardweave manages.

    torch's contract-made ``api.state(module)`` reads this dict with ``.get(api)``; for torch's
    FSDP2 APIs it gets our state. Other composable APIs (torch's activation ``checkpoint``, say)
    store and find their own states in it as in a plain dict."""

    __slots__ = ("_api_name", "_state")

    def __init__(self, state: object, api_name: str, existing: dict[Any, Any]) -> None:
        super().__init__(existing)
        self._state = state
        self._api_name = api_name  # the shardweave API that made ``state``: "fully_shard", ...

    def get(self, key: Any, default: Any = None) -> Any:
        found = super().get(key, _MISSING)
        if found is not _MISSING:
            return found
        api = (getattr(key, "__module__", None), getattr(key, "__name__", None))
        if self._api_name in _TORCH_APIS.get(api, ()):  # type: ignore[arg-type]
            return self._state
        return default


_MISSING = object()


def expose_state_to_torch(module: nn.Module, state: object, api_name: str) -> None:
    """Let torch's ``fully_shard.state(module)`` (and ``replicate.state``) find ``state``, the
    state that the shardweave API ``api_name`` attached to ``module``."""
    from torch.distributed._composable.contract import STATE_KEY as key

    existing = module.__dict__.get(key)
    slot = TorchStateSlot(state, api_name, existing if isinstance(existing, dict) else {})
    module.__dict__[key] = slot
