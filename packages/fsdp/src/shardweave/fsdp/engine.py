"""The engine surface for sibling packages: what a data-parallel API built on the shardweave FSDP
engine calls, as ``shardweave.replicate`` builds ``replicate``.

Such an API checks its arguments with the validators below, resolves its mesh to a mesh info
(:mod:`shardweave.mesh`), then hands the engine a state factory and a group factory through
:func:`attach_engine`, which collects the managed parameters, builds the groups, attaches the
state and swaps the module classes. ``FSDPState`` is the state to subclass (``api_name`` names
the API in every error; ``state_class_for_root`` says which states a root of this API adopts).

Stability: everything here is keyword-only past the first argument, and follows the versioning
promise of the framework guide ("Versioning between the four packages"): a patch release
(``0.1.x``) keeps these names and signatures; a minor release may change them, says so in
``CHANGELOG.md``, and dependents opt in by widening their range. The ``shardweave.fsdp._*``
modules behind it are private and may change in any release; ``tools/check_layout.py`` keeps
sibling packages from importing them.

Example (the shape of ``replicate``; checks of its own arguments left out)::

    from shardweave.fsdp import engine
    from shardweave.mesh import DDPMeshInfo, default_mesh, mesh_device

    class MyState(engine.FSDPState):
        api_name = "my_api"

    def my_api(module, *, mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy()):
        modules = engine.module_arguments(module, api="my_api")
        mp, offload = engine.resolve_policies(
            mp_policy=mp_policy, offload_policy=offload_policy, api="my_api"
        )
        mesh = default_mesh(mesh_dim_names=("replicate",))
        info, device = DDPMeshInfo(mesh, replicate_mesh_dim=0), mesh_device(mesh)
        engine.attach_engine(
            modules,
            ignored_params=None,
            device=device,
            make_state=lambda roots: MyState(
                roots, device=device, mp_policy=mp, mesh_info=info,
                auto_reshard_after_forward=False,
            ),
            make_groups=lambda params, roots: engine.build_groups(
                params, placements=[(None, info)] * len(params), roots=roots,
                mesh_info=info, post_forward_mesh_info=None, reshard_after_forward=None,
                device=device, mp_policy=mp, offload_policy=offload,
            ),
            module_cls=MyModule,  # an FSDPModule subclass
            class_prefix="My",
            mark_managed=False,
        )
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardweave.fsdp import _fsdp_init, _fully_shard
from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy, OffloadPolicy
from shardweave.fsdp._fsdp_param_group import FSDPParamGroup
from shardweave.fsdp._fsdp_state import FSDPState, get_fsdp_state

if TYPE_CHECKING:
    # Typing-only aliases (ours or torch's policy class), for signatures like fully_shard's:
    # import them under TYPE_CHECKING.
    from shardweave.fsdp._fsdp_api import AnyMixedPrecisionPolicy as AnyMixedPrecisionPolicy
    from shardweave.fsdp._fsdp_api import AnyOffloadPolicy as AnyOffloadPolicy
    from shardweave.mesh import DataParallelMeshInfo, FSDPMeshInfo

__all__ = [
    "FSDPParamGroup",
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
    return _fsdp_init.module_arguments(module, api)


def validate_module(module: nn.Module, *, api: str) -> None:
    """Refuse a container without a forward (``ModuleList``, ``ModuleDict``): ``ValueError``."""
    _fsdp_init.validate_module(module, api)


def validate_ignored_params(ignored_params: object, *, api: str) -> set[nn.Parameter]:
    """``ignored_params`` as a set (``None``: empty), after checking it holds parameters."""
    return _fsdp_init.validate_ignored_params(ignored_params, api)


def resolve_policies(
    *, mp_policy: object, offload_policy: object, api: str
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """Our policy objects for ``mp_policy`` and ``offload_policy`` (torch's are converted
    field by field); anything else raises ``TypeError`` naming ``api``."""
    return _fully_shard.resolve_policies(mp_policy, offload_policy, api)


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
    parameter's ``(Shard placement or None, mesh info)``, in ``params`` order).

    ``post_forward_mesh_info`` is where ``mesh_info``'s parameters reshard to after forward
    (None: fully); ``reshard_after_forward`` derives it for the other meshes.
    """
    return _fully_shard.build_groups(
        params,
        placements,
        roots,
        mesh_info,
        post_forward_mesh_info,
        reshard_after_forward,
        device,
        mp_policy,
        offload_policy,
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
    """Put ``modules`` under the engine, once their API has checked its arguments.

    Collects the parameters and buffers no inner call manages (less ``ignored_params``), moves
    them to ``device``, attaches ``make_state(roots)`` with ``make_groups(params, roots)`` (a
    failure leaves the modules as they were) and swaps each root's class to
    ``<class_prefix><its class>`` deriving from ``module_cls`` too. ``mark_managed`` sets the
    attributes torch's ``fully_shard`` puts on the modules it manages.
    """
    _fully_shard.attach_engine(
        modules,
        ignored_params,
        device,
        make_state,
        make_groups,
        module_cls,
        class_prefix,
        mark_managed=mark_managed,
    )


def with_state(fn: Callable[..., object], *, api: str) -> object:
    """``fn`` named ``api``, with the ``state(module)`` attribute torch's ``contract`` gives
    its APIs (the state ``api`` attached to ``module``, else None); cast the result to the
    API's Protocol."""
    return _fully_shard.with_state(fn, api)
