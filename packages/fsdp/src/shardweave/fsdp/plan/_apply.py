"""``apply(model, fitted)``: ``fully_shard`` a model as ``fit`` planned it (wrapping, reshard,
mixed precision, CPU offload, activation checkpointing).

Activation checkpointing replaces the chosen blocks' ``forward`` by an instance attribute that
runs the class's forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. No
wrapper module is inserted, so parameter FQNs (and state-dict keys) are those of the plain
model, and ``fully_shard``'s hooks stay on the block itself, outside the checkpointed region:
a recompute in backward runs after the block's pre-backward unshard, with no hook of its own
(as ``checkpoint_wrapper`` under ``fully_shard`` behaves, without the ``_checkpoint_wrapped_module``
prefix in every name). The fake step of ``fit`` installs the same thing, so the planned peak
and FLOPs include the recompute.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardweave.fsdp._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shardweave.fsdp._fully_shard import fully_shard
from shardweave.fsdp.comm._streams import stream_ordered
from shardweave.fsdp.plan._fit_config import DTYPES, Target, parse_target
from shardweave.fsdp.plan._model import PlanError

__all__ = ["applied_target", "apply", "checkpoint_blocks"]


def _blocks(model: nn.Module, wrap: str) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if m is not model
        and (type(m).__name__ == wrap or f"{type(m).__module__}.{type(m).__qualname__}" == wrap)
    ]


def checkpoint_blocks(model: nn.Module, wrap: str, every: int) -> list[nn.Module]:
    """Checkpoint the forward of the 1st, (1+every)th, ... block of class ``wrap``."""
    if every < 1:
        return []
    chosen = _blocks(model, wrap)[::every]
    for block in chosen:
        forward = type(block).forward

        def run(*args: Any, _block: nn.Module = block, _fwd: Any = forward, **kwargs: Any) -> Any:
            return checkpoint(functools.partial(_fwd, _block), *args, use_reentrant=False, **kwargs)

        block.forward = run
    return chosen


def apply(model: nn.Module, fitted: Any, *, mesh: Any = None) -> nn.Module:
    """Apply ``fitted`` (a ``Fitted`` from ``fit(...).kept``, or its ``FitConfig``) to
    ``model``: checkpointing first, then ``fully_shard`` on every block of the planned class
    (inner first) and on the root, with the planned mixed precision and offload policies.

    Args:
        model: the model to shard (materialized, or on meta to be initialized after).
        fitted: ``FitResult.best`` / any row of ``kept``, or a ``FitConfig``.
        mesh: the ``DeviceMesh`` for ``fully_shard``. Default: the layout fit planned
            (``FitConfig.mesh``: ``(N,)``, or ``(R, S)`` built with dims named
            ``("replicate", "shard")`` for HSDP), else the world as ``fully_shard``'s default.
            A mesh of another shape than the planned one is an error.

    Raises:
        PlanError: the configuration was planned for another target (``FitConfig.target``)
            than the one it is applied on (the mesh's device type and its process group's
            backend); the message names both.

    Returns:
        ``model``, now an ``FSDPModule``.

    Example::

        result = fit(build, mesh=2, sample_input=((4, 128), torch.long), budget="1GiB")
        model = apply(build(), result.best)
    """
    cfg = getattr(fitted, "config", fitted)
    _check_target(parse_target(cfg.target), mesh)
    mesh = _planned_mesh(cfg, mesh)
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]
    )
    # Pinned host memory where the runtime can pin it (a real accelerator); the test
    # accelerator's "device" is the host, where pinning needs a runtime there is none of.
    pin = torch.accelerator.is_available()
    offload = CPUOffloadPolicy(pin_memory=pin) if cfg.offload else OffloadPolicy()
    kwargs: dict[str, Any] = {"mp_policy": mp, "offload_policy": offload}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if cfg.wrap is not None:
        blocks = _blocks(model, cfg.wrap)
        if not blocks:
            names = sorted({type(m).__name__ for m in model.modules()})
            raise PlanError(f"apply: no module of class {cfg.wrap!r} in the model; has {names}")
        if cfg.checkpoint_every:
            checkpoint_blocks(model, cfg.wrap, cfg.checkpoint_every)
        for block in reversed(blocks):  # inner (later in pre-order) first
            fully_shard(block, reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=cfg.root_reshard_after_forward, **kwargs)
    return model


def applied_target(mesh: Any = None) -> tuple[Target, bool]:
    """The target ``fully_shard`` would run on here: the mesh's device type (default: the
    current accelerator, else the CPU) and its process group's backend (``"?"`` before
    ``init_process_group``); and whether the engine takes its accelerator branches there
    (a CPU device under a stream-ordered device module: the test accelerator)."""
    import torch.distributed as dist

    if mesh is not None:
        device = mesh.device_type
    else:
        found = (
            torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        )
        device = found.type if found is not None else "cpu"
    backend = "?"
    if dist.is_available() and dist.is_initialized():
        group = mesh.get_group(0) if mesh is not None else None
        named = str(dist.get_backend(group))
        # a default group over several backends is named "cpu:gloo,cuda:nccl"
        per_device = dict(part.split(":", 1) for part in named.split(",") if ":" in part)
        backend = per_device.get(device, named)
    return Target(device, backend), stream_ordered(device)


def _check_target(planned: Target, mesh: Any) -> None:
    here, accelerator_branches = applied_target(mesh)
    if accelerator_branches and not here.accelerator:
        # The test accelerator runs an accelerator's schedule over CPU tensors: it stands for
        # any accelerator target, and for no CPU one (whose schedule it does not run).
        device_ok = planned.accelerator
    else:
        device_ok = here.device == planned.device
    backend_ok = here.backend in ("?", planned.backend)
    if device_ok and backend_ok:
        return
    also = ""
    if accelerator_branches and not here.accelerator:
        also = " (the engine's accelerator branches over CPU tensors: the test accelerator)"
    raise PlanError(
        f"apply: this configuration was planned for {planned}, and is applied on "
        f"{here}{also}; plan it again for this target (fit(..., target='{here}'), "
        f"--target {here}) or apply it on {planned}"
    )


def _planned_mesh(cfg: Any, mesh: Any) -> Any:
    """The mesh to shard on: ``mesh`` if given (its shape must be the planned layout's), else
    the planned layout built over the world (``None`` where fit stated none)."""
    planned = tuple(getattr(cfg, "mesh", ()))
    if mesh is not None:
        if planned and tuple(mesh.shape) != planned:
            raise PlanError(
                f"apply: this configuration was planned for a {'x'.join(map(str, planned))} "
                f"mesh, and the mesh given is {'x'.join(map(str, mesh.shape))}; pass a mesh of "
                "that shape, or none (apply builds it)"
            )
        return mesh
    if not planned:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() != math.prod(planned)
    ):
        raise PlanError(
            f"apply: this configuration was planned for {math.prod(planned)} ranks (mesh "
            f"{'x'.join(map(str, planned))}), and the world has {dist.get_world_size()}; plan "
            "again for this world, or run it on that many"
        )

    device = applied_target(None)[0].device
    names = ("replicate", "shard") if len(planned) == 2 else None
    return init_device_mesh(device, planned, mesh_dim_names=names)
