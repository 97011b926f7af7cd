"""``replicate()``: DDP-style data parallelism on the shardweave FSDP engine.

Parameters are ``Replicate()`` DTensors on a 1-D mesh; the engine's "all-gather" is a local
copy (the shard group has one rank) and its reduction is an all-reduce over the replicate
group, so every FSDPModule control that makes sense without sharding (gradient sync off,
prefetch, mixed precision, the all-reduce hook) works unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Protocol, cast, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardweave.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from shardweave.fsdp.engine import (
    EngineAPI,
    FSDPState,
    attach_engine,
    build_groups,
    get_fsdp_state,
    module_arguments,
    resolve_policies,
    validate_ignored_params,
    validate_module,
    with_state,
)
from shardweave.mesh import (
    DataParallelMeshDims,
    DDPMeshInfo,
    FSDPMeshInfo,
    MeshValidationError,
    check_mesh_argument,
    default_mesh,
    mesh_device,
    resolve_mesh_info,
)

if TYPE_CHECKING:
    from shardweave.fsdp.engine import AnyMixedPrecisionPolicy, AnyOffloadPolicy

__all__ = ["ReplicateModule", "replicate"]


# How replicate describes itself to the engine: its states carry this; a replicate root adopts
# only replicate states (a fully_shard root adopts both, as torch's does).
REPLICATE_API: Final = EngineAPI(
    "replicate", torch_state_name="Replicate", adopts=frozenset({"replicate"})
)


class ReplicateModule(FSDPModule):
    """Mixed into every module ``replicate`` was applied to: ``isinstance(m, FSDPModule)``
    holds and every ``FSDPModule`` method is available.

    Compared with ``fully_shard``, every rank holds whole parameters (more memory) and no
    all-gathers run; methods that only make sense for sharded parameters, such as
    ``set_reshard_after_forward``, raise.

    Example::

        model = replicate(model)
        assert isinstance(model, ReplicateModule) and isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(False)  # DDP's no_sync() for accumulation
        model(micro_0).sum().backward()
        model.set_requires_gradient_sync(True)
        model(micro_1).sum().backward()  # one all-reduce of the summed gradients
    """


class ReplicateFn(Protocol):
    """The type of ``replicate``: the function (module or list overloads) and ``state``, as
    torch's ``contract`` decorator gives its ``replicate``."""

    @overload
    def __call__(
        self,
        module: nn.Module,
        *,
        mesh: DeviceMesh | None = ...,
        mp_policy: AnyMixedPrecisionPolicy = ...,
        offload_policy: AnyOffloadPolicy = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        dp_mesh_dims: DataParallelMeshDims | None = ...,
    ) -> ReplicateModule: ...

    @overload
    def __call__(
        self,
        module: list[nn.Module],
        *,
        mesh: DeviceMesh | None = ...,
        mp_policy: AnyMixedPrecisionPolicy = ...,
        offload_policy: AnyOffloadPolicy = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        dp_mesh_dims: DataParallelMeshDims | None = ...,
    ) -> list[nn.Module]: ...

    def state(self, module: nn.Module | FSDPModule) -> FSDPState | None:
        """The engine state that ``replicate`` attached to ``module``, or None when
        ``replicate`` was not applied to it, as torch's ``replicate.state`` returns."""
        ...


def _check_not_applied(module: nn.Module, api: str) -> None:
    """Refuse a module that ``fully_shard`` or ``replicate`` already manages (torch's errors)."""
    state = get_fsdp_state(module)
    if state is not None and state.api is not REPLICATE_API:
        raise RuntimeError(
            "Cannot apply `replicate()` on a Module already managed by `fully_shard` "
            f"({type(module).__name__}); a module takes one of the two: drop one of the calls, "
            "or apply replicate() to a submodule before fully_shard() on the parent"
        )
    if state is not None:
        # starts with torch 2.13's sentence (its `contract` raises it), which users match on
        raise AssertionError(
            "Each distinct composable distributed API can only be applied to a module once. "
            f"{api} has already been applied to {type(module).__name__}: remove the second call"
        )


def _replicate_mesh_info(
    mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None, api: str
) -> DDPMeshInfo:
    """The replicate-only mesh info of ``mesh``: its only dim, or the replicate dims that
    ``dp_mesh_dims`` names in a full SPMD mesh."""
    if dp_mesh_dims is not None:
        mesh_info = resolve_mesh_info(mesh, dp_mesh_dims, api=api)
        if isinstance(mesh_info, FSDPMeshInfo) or not isinstance(mesh_info, DDPMeshInfo):
            raise ValueError(
                "replicate() with dp_mesh_dims requires replicate-only dims (no shard dims); "
                "use fully_shard() for sharding"
            )
        return mesh_info
    if mesh.ndim != 1:
        raise MeshValidationError(
            f"replicate expects a 1D DeviceMesh but got {mesh}; for "
            "replicate x tensor parallel pass dp_mesh_dims=DataParallelMeshDims(replicate=...)"
        )
    return DDPMeshInfo(mesh, replicate_mesh_dim=0)


def _replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: AnyMixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: AnyOffloadPolicy = OffloadPolicy(),  # noqa: B008 (stateless)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> ReplicateModule | list[nn.Module]:
    """Replicate ``module`` on every rank of ``mesh`` and average gradients (DDP semantics).

    A drop-in for torch 2.13's ``torch.distributed._composable.replicate_with_fsdp.replicate``.
    Apply it per block, then to the root; each call is one group: one all-reduce of all its
    gradients per backward (more groups overlap communication with backward earlier, fewer
    groups send fewer, larger messages).

    Args:
        module: the module, or a list of modules forming one group.
        mesh: a 1-D mesh (default: all ranks, dim name ``"replicate"``), or a full SPMD mesh
            with ``dp_mesh_dims`` naming only replicate dims.
        mp_policy: mixed precision (compute in ``param_dtype``, reduce in ``reduce_dtype``).
        offload_policy: ``CPUOffloadPolicy()`` keeps parameters and gradients on the CPU.
        ignored_params: parameters left alone (not replicated, moved or reduced).
        dp_mesh_dims: replicate-only data-parallel dims of a full SPMD mesh.

    Example::

        for block in model.layers:
            replicate(block)
        replicate(model)
    """
    api = "replicate"
    modules = module_arguments(module, api=api)
    for m in modules:
        _check_not_applied(m, api)
        validate_module(m, api=api)
    mp_policy, offload_policy = resolve_policies(
        mp_policy=mp_policy, offload_policy=offload_policy, api=api
    )
    validate_ignored_params(ignored_params, api=api)
    mesh = mesh if mesh is not None else default_mesh(mesh_dim_names=("replicate",))
    check_mesh_argument(mesh, api=api)
    mesh_info = _replicate_mesh_info(mesh, dp_mesh_dims, api)
    device = mesh_device(mesh)

    attach_engine(
        modules,
        ignored_params=ignored_params,
        device=device,
        # replicate never reshards after forward: nothing is sharded
        make_state=lambda roots: FSDPState(
            roots, device=device, mp_policy=mp_policy, mesh_info=mesh_info, api=REPLICATE_API
        ),
        module_cls=ReplicateModule,
        class_prefix="Replicate",
        mark_managed=False,
        # One group: every parameter Replicate() on the mesh, and unsharded from forward to
        # backward (no post-forward mesh).
        make_groups=lambda params, roots: build_groups(
            params,
            placements=[(None, mesh_info)] * len(params),
            roots=roots,
            mesh_info=mesh_info,
            post_forward_mesh_info=None,
            reshard_after_forward=None,
            device=device,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        ),
    )
    if isinstance(module, nn.Module):
        return cast(ReplicateModule, module)
    return module


replicate: Final[ReplicateFn] = cast(ReplicateFn, with_state(_replicate, api="replicate"))
