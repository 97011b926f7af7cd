"""Tensor subclasses that shape their own all-gather: torch's fsdp_pre/post_all_gather protocol.

A sharded local tensor that defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (as
methods of its class or attributes patched onto it), or whose class's parameter kind
(``PARAM_KINDS``) has an ``all_gather`` part, sends what its pre-hook returns through the
all-gather instead of its own bytes, and its post-hook builds the unsharded tensor from what
arrives. ``SubclassAllGather`` is that
protocol as the all-gather strategy of one ``FSDPParam``; ``detect_subclass_all_gather``
decides whether a parameter has one. Everything the protocol keeps between calls is one
``SubclassGatherState``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardweave.fsdp._fsdp_common import alloc_storage, contiguous_strides, free_storage
from shardweave.mesh.extension_points import PARAM_KINDS, AllGatherExtension

if TYPE_CHECKING:
    from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy

__all__ = [
    "GatheredParam",
    "SubclassAllGather",
    "SubclassGatherState",
    "detect_subclass_all_gather",
]


class GatheredParam(Protocol):
    """What the protocol reads of the parameter it gathers; ``FSDPParam`` is one. (Declared
    here, where it is read: ``_param`` imports this module, not the other way round.)"""

    @property
    def param_fqn(self) -> str: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def orig_size(self) -> torch.Size: ...
    @property
    def sharded_size(self) -> torch.Size: ...
    @property
    def padded_sharded_size(self) -> torch.Size: ...
    @property
    def shard_world_size(self) -> int: ...
    @property
    def unsharded_dtype(self) -> torch.dtype: ...

    def shard_mesh(self) -> DeviceMesh: ...

    def sharded_local_tensor(self) -> torch.Tensor: ...


@dataclass
class SubclassGatherState:
    """The protocol's hooks and what they left for the next call, for one parameter."""

    pre: Callable[..., Any]
    post: Callable[..., Any]
    legacy: bool  # fsdp_pre_all_gather(mesh), torch's first signature
    mp_policy: MixedPrecisionPolicy
    metadata: Any = None  # from the last pre-hook, handed to the next post-hook
    input_shapes: list[torch.Size] = field(default_factory=list)
    input_dtypes: list[torch.dtype] = field(default_factory=list)
    outputs: list[torch.Tensor] | None = None  # 1D each, every rank's input i, rank-major
    inner: tuple[torch.Tensor, ...] = ()  # tensors post_all_gather allocated; freed on reshard
    # torch 2.15's fsdp_should_release_all_gather_outputs_after_post_all_gather: the post-hook
    # made its own copy, so the outputs are freed as soon as it returns, not at reshard
    release_outputs: bool = False


class SubclassAllGather:
    """The all-gather of one parameter whose sharded local tensor brings its own hooks."""

    is_extension = True

    def __init__(self, state: SubclassGatherState) -> None:
        self.state = state

    def inputs(self, param: GatheredParam) -> list[torch.Tensor]:
        """The pre-hook's tensors, 1D on the compute device."""
        state = self.state
        mesh = param.shard_mesh()
        if state.legacy:
            inputs, state.metadata = state.pre(mesh)
        else:
            inputs, state.metadata = state.pre(
                mesh,
                param.orig_size,
                contiguous_strides(param.orig_size),
                param.module,
                state.mp_policy,
            )
        if param.sharded_size != param.padded_sharded_size and any(
            t.size() != param.padded_sharded_size for t in inputs
        ):
            raise AssertionError(
                f"'{param.param_fqn}': with uneven sharding every fsdp_pre_all_gather output "
                f"must have the padded size {tuple(param.padded_sharded_size)}, got "
                f"{[tuple(t.size()) for t in inputs]}"
            )
        state.input_shapes = [t.size() for t in inputs]
        state.input_dtypes = [t.dtype for t in inputs]
        return [t.to(param.device).contiguous().view(-1) for t in inputs]

    def alloc_outputs(self, param: GatheredParam) -> list[torch.Tensor]:
        """One 1D buffer per input, storage allocated."""
        state = self.state
        outs = state.outputs
        if outs is None:
            # Shapes and dtypes are fixed after the first pre-all-gather, as torch assumes.
            outs = [
                torch.empty(param.shard_world_size * s.numel(), dtype=d, device=param.device)
                for s, d in zip(state.input_shapes, state.input_dtypes, strict=True)
            ]
            state.outputs = outs
        else:
            for out in outs:
                alloc_storage(out)
        return outs

    def unsharded(self, param: GatheredParam, current: nn.Parameter | None) -> torch.Tensor | None:
        """The post-hook's tensor on the first unshard; later ones refill ``current``."""
        state = self.state
        assert state.outputs is not None
        outs = [
            o.view(-1, *shape[1:])
            for o, shape in zip(state.outputs, state.input_shapes, strict=True)
        ]
        dtype = param.unsharded_dtype
        result: torch.Tensor | None = None
        if current is None:
            unsharded, inner = state.post(outs, state.metadata, dtype)
            state.inner = tuple(inner)
            # The post-hook may return the padded gather (uneven shards padded by the
            # pre-hook): like torch, take the leading orig_size elements, not a view.
            result = torch.as_strided(
                unsharded, param.orig_size, contiguous_strides(param.orig_size), 0
            )
        else:
            for t in state.inner:
                alloc_storage(t)
            # Refill in place: the parameter autograd saved must keep its version (an inference
            # tensor has none, and autograd never saved it).
            keep = (
                contextlib.nullcontext()
                if current.is_inference()
                else torch.autograd.grad_mode._unsafe_preserve_version_counter(current)
            )
            with keep:
                state.post(outs, state.metadata, dtype, out=current)
        state.metadata = None
        self.release_outputs_after_post()
        return result

    def release_outputs_after_post(self) -> None:
        """Free the output buffers once the post-hook has run, where the tensor asked for it
        (the next unshard allocates them again)."""
        if self.state.release_outputs:
            for t in self.state.outputs or ():
                free_storage(t)

    def free(self) -> None:
        """Release the output buffers and the post-hook's tensors (at reshard)."""
        for t in (*(self.state.outputs or ()), *self.state.inner):
            free_storage(t)


RELEASE_HOOK = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


def detect_subclass_all_gather(
    param: GatheredParam,
    local: torch.Tensor,
    mp_policy: MixedPrecisionPolicy,
    int_reshard: bool = False,
) -> SubclassAllGather | None:
    """The protocol for ``param`` whose sharded local tensor is ``local``, if it has one.

    torch's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the tensor win; else the
    ``all_gather`` part of the ``PARAM_KINDS`` kind registered for its class. Detected at the
    root's lazy init, so hooks patched on after ``to_empty`` count. A tensor may also define
    torch 2.15's ``fsdp_should_release_all_gather_outputs_after_post_all_gather()`` (a bool:
    free the all-gather outputs right after the post-hook; refused with an int
    ``reshard_after_forward``, ``int_reshard``, whose post-forward shard is cut from them), on
    every torch.
    """
    pre = getattr(local, "fsdp_pre_all_gather", None)
    post = getattr(local, "fsdp_post_all_gather", None)
    if pre is None and post is None and type(local) is not torch.Tensor:
        # torch's methods win (STYLE: torch compatibility first); the registry is for
        # tensor classes their owner cannot give those methods.
        kind = PARAM_KINDS.find_for_type(type(local))
        plugin = None if kind is None else kind.all_gather
        if plugin is not None:
            pre, post = _plugin_hooks(param, plugin)
    if (pre is None) != (post is None):
        raise AssertionError(
            f"'{param.param_fqn}': a tensor defining one of fsdp_pre_all_gather / "
            "fsdp_post_all_gather must define both"
        )
    release_fn = getattr(local, RELEASE_HOOK, None)
    if release_fn is not None and post is None:
        raise AssertionError(
            f"'{param.param_fqn}': {RELEASE_HOOK} needs fsdp_pre_all_gather and "
            "fsdp_post_all_gather on the same tensor"
        )
    if pre is None or post is None:
        return None
    release = False
    if release_fn is not None:
        release = release_fn()
        if not isinstance(release, bool):
            raise AssertionError(
                f"'{param.param_fqn}': {RELEASE_HOOK} must return a bool, got "
                f"{type(release).__name__}"
            )
        if release and int_reshard:
            raise NotImplementedError(
                f"'{param.param_fqn}': {RELEASE_HOOK} returned True with an int "
                "reshard_after_forward, whose post-forward shard is cut from the all-gather "
                "outputs; use reshard_after_forward=True or False"
            )
    arity = len(inspect.signature(pre).parameters)
    if arity not in (1, 5):
        raise AssertionError(
            f"'{param.param_fqn}': fsdp_pre_all_gather must take (mesh) or (mesh, "
            f"outer_size, outer_stride, module, mp_policy), got {arity} parameters"
        )
    return SubclassAllGather(
        SubclassGatherState(pre, post, arity == 1, mp_policy, release_outputs=release)
    )


def _plugin_hooks(param: GatheredParam, plugin: AllGatherExtension) -> tuple[Any, Any]:
    """An ``AllGatherExtension`` as torch's one-argument ``fsdp_pre_all_gather`` and its
    ``fsdp_post_all_gather`` (which refills ``out`` in place from the second unshard on)."""

    def pre(mesh: DeviceMesh) -> tuple[tuple[torch.Tensor, ...], object]:
        # The local tensor at call time: reset_sharded_param may have moved the shard.
        tensors, meta = plugin.pre_all_gather(param.sharded_local_tensor(), mesh)
        return tuple(tensors), meta

    def post(
        outs: Sequence[torch.Tensor],
        meta: object,
        dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        full = plugin.post_all_gather(outs, meta, dtype)
        if out is None:
            return full, (full,)
        with torch.no_grad():
            out.copy_(full.view_as(out))
        return None

    return pre, post
