"""The engine surface for sibling packages: what a data-parallel API built on the shardweave FSDP
engine calls, as ``shardweave.replicate`` builds ``replicate``.

Such an API checks its arguments with the validators below, resolves its mesh to a mesh info
(:mod:`shardweave.mesh`), then hands the engine a state factory and a group factory through
:func:`attach_engine`, which collects the managed parameters, builds the groups, attaches the
state and swaps the module classes. The state is an ``FSDPState`` given the API's
``EngineAPI`` description: its name (in every error), torch's name for its state (in the
root-check messages users match on) and the APIs whose states a root of it adopts. Nothing
subclasses ``FSDPState``.

Stability: everything here is keyword-only past the first argument, and follows the versioning
promise of the framework guide ("Versioning between the four packages"): a patch release
(``0.1.x``) keeps these names and signatures; a minor release may change them, says so in
``CHANGELOG.md``, and dependents opt in by widening their range. The ``shardweave.fsdp._*``
modules behind it are private and may change in any release; ``tools/check_layout.py`` keeps
sibling packages from importing them.

Example, a replicate-like API in full (``tests/fsdp/world_1/test_engine_surface.py`` runs it as
written)::

    from torch import nn

    from shardweave.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, engine
    from shardweave.mesh import DDPMeshInfo, default_mesh, mesh_device

    MY_API = engine.EngineAPI("my_api", torch_state_name="MyAPI", adopts=frozenset({"my_api"}))

    class MyModule(FSDPModule):  # mixed into every module my_api is applied to
        pass

    def my_api(module, *, mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy()):
        modules = engine.module_arguments(module, api="my_api")
        mp, offload = engine.resolve_policies(
            mp_policy=mp_policy, offload_policy=offload_policy, api="my_api"
        )
        mesh = default_mesh(mesh_dim_names=("replicate",))
        info, device = DDPMeshInfo(mesh, replicate_mesh_dim=0), mesh_device(mesh)
        engine.attach_engine(
            modules, ignored_params=None, device=device, module_cls=MyModule,
            class_prefix="My", mark_managed=False,
            make_state=lambda roots: engine.FSDPState(
                roots, device=device, mp_policy=mp, mesh_info=info, api=MY_API
            ),
            make_groups=lambda params, roots: engine.build_groups(
                params, placements=[(None, info)] * len(params), roots=roots,
                mesh_info=info, post_forward_mesh_info=None, reshard_after_forward=None,
                device=device, mp_policy=mp, offload_policy=offload,
            ),
        )
        return module
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from shardweave.fsdp import _fully_shard
from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy, OffloadPolicy
from shardweave.fsdp.core import _args
from shardweave.fsdp.core._assembly import attach_engine, build_groups
from shardweave.fsdp.core._state import FULLY_SHARD_API, EngineAPI, FSDPState, get_fsdp_state

if TYPE_CHECKING:
    # Typing-only aliases (ours or torch's policy class), for signatures like fully_shard's:
    # import them under TYPE_CHECKING.
    from shardweave.fsdp._fsdp_api import AnyMixedPrecisionPolicy as AnyMixedPrecisionPolicy
    from shardweave.fsdp._fsdp_api import AnyOffloadPolicy as AnyOffloadPolicy

__all__ = [
    "FULLY_SHARD_API",
    "EngineAPI",
    "FSDPState",
    "attach_engine",
    "build_groups",
    "get_fsdp_state",
    "module_arguments",
    "resolve_policies",
    "validate_ignored_params",
    "validate_module",
    "with_state",
]


def module_arguments(module: object, *, api: str) -> tuple[nn.Module, ...]:
    """The modules of ``api``'s ``module`` argument (one module, or a list or tuple of them);
    anything else raises ``ArgumentTypeError`` naming ``api``."""
    return _args.module_arguments(module, api)


def validate_module(module: nn.Module, *, api: str) -> None:
    """Refuse a container without a forward (``ModuleList``, ``ModuleDict``): ``ValueError``."""
    _args.validate_module(module, api)


def validate_ignored_params(ignored_params: object, *, api: str) -> set[nn.Parameter]:
    """``ignored_params`` as a set (``None``: empty), after checking it holds parameters."""
    return _args.validate_ignored_params(ignored_params, api)


def resolve_policies(
    *, mp_policy: object, offload_policy: object, api: str
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """Our policy objects for ``mp_policy`` and ``offload_policy`` (torch's are converted
    field by field); anything else raises ``TypeError`` naming ``api``."""
    return _args.resolve_policies(mp_policy, offload_policy, api)


def with_state(fn: Callable[..., object], *, api: str) -> object:
    """``fn`` named ``api``, with the ``state(module)`` attribute torch's ``contract`` gives
    its APIs (the state ``api`` attached to ``module``, else None); cast the result to the
    API's Protocol."""
    return _fully_shard.with_state(fn, api)
