"""Policies and communication interfaces users pass to ``fully_shard`` (torch's public names)."""

from __future__ import annotations

import dataclasses
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    # torch's public policy dataclasses, accepted wherever ours are: for annotations only, so
    # importing shardweave never loads torch's FSDP package (tools/check_layout.py allows
    # exactly these names)
    from torch.distributed.fsdp import (  # noqa: TID251
        MixedPrecisionPolicy as TorchMixedPrecisionPolicy,
    )
    from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy  # noqa: TID251

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gather/compute, the gradient reduction and the module output.

    Sharded parameters and their gradients always stay in the parameters' original dtype, so the
    optimizer steps in full precision.

    Args:
        param_dtype: all-gather and compute in this dtype (halves all-gather bytes for bf16 over
            fp32, at the cost of compute precision). ``None`` keeps the original dtype.
        reduce_dtype: reduce gradients (and accumulate them while gradient sync is off) in this
            dtype; e.g. fp32 with ``param_dtype=bfloat16`` keeps full-precision reduction at
            twice the reduce-scatter bytes. ``None`` follows the installed torch: from torch
            2.15 the parameter's original dtype (fp32 for fp32 parameters, whatever
            ``param_dtype`` is); before 2.15 the gradient's dtype (``param_dtype`` if set). A
            group whose gradients differ in dtype reduces in their promoted dtype.
        output_dtype: floating-point outputs of the module are cast to this dtype.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
        param_dtype_override_fn: keyword-only; called once per managed parameter at
            ``fully_shard`` time. ``None`` or ``param_dtype`` keeps the default; the parameter's
            own dtype keeps that parameter unconverted (e.g. norms in fp32 next to bf16
            weights, in one all-gather); anything else raises ``ValueError``. Forward inputs
            are still cast to ``param_dtype``. It must answer the same on every rank.

    Example::

        fully_shard(model, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    # torch 2.15's field; offered on every torch since the all-gather is ours
    param_dtype_override_fn: Callable[[torch.nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )

    def resolve_param_dtype(self, param: torch.nn.Parameter) -> torch.dtype | None:
        """The ``param_dtype`` for ``param``: the default, or what ``param_dtype_override_fn``
        answers for it (checked as torch 2.15 checks it, with the same ``ValueError``)."""
        if self.param_dtype_override_fn is None:
            return self.param_dtype
        override = self.param_dtype_override_fn(param)
        if override is None:
            return self.param_dtype
        if not isinstance(override, torch.dtype):
            raise ValueError(
                "param_dtype_override_fn must return a torch.dtype or None, got "
                f"{type(override)} ({override!r:.60})"
            )
        if override not in (self.param_dtype, param.dtype):
            raise ValueError(
                "param_dtype_override_fn must return None, param_dtype, or the parameter's "
                f"original dtype, got {override} for a parameter of dtype {param.dtype} with "
                f"param_dtype {self.param_dtype}"
            )
        return override

    def for_param(self, param: torch.nn.Parameter) -> MixedPrecisionPolicy:
        """This policy as it applies to ``param``: its resolved ``param_dtype``, no callable."""
        if self.param_dtype_override_fn is None:
            return self
        return dataclasses.replace(
            self, param_dtype=self.resolve_param_dtype(param), param_dtype_override_fn=None
        )

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(
                    f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {value!r} "
                    f"({type(value).__name__}); e.g. {name}=torch.bfloat16"
                )
            # Integer or bool compute/reduction would truncate parameters and gradients.
            if value is not None and not (value.is_floating_point or value.is_complex):
                raise ValueError(
                    f"MixedPrecisionPolicy.{name} must be a floating-point dtype, got {value}; "
                    f"use e.g. {name}=torch.bfloat16, or None to keep the parameters' dtype"
                )
        fn = self.param_dtype_override_fn
        if fn is not None and not callable(fn):
            raise TypeError(
                f"MixedPrecisionPolicy.param_dtype_override_fn must be callable or None, got "
                f"{fn!r:.60}"
            )
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, "
                f"got {self.cast_forward_inputs!r}; pass True or False"
            )


@dataclass
class OffloadPolicy:
    """No offloading; the base class of offload policies.

    The default: shards, gradients and optimizer state stay on the device, the fastest choice
    and the one with the most device memory per rank.

    Example::

        fully_shard(model, offload_policy=OffloadPolicy())  # same as leaving it out
        assert isinstance(CPUOffloadPolicy(), OffloadPolicy)  # either fits offload_policy=
    """


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on the CPU.

    Shards are copied to the device before each all-gather and gradients back after each
    reduce-scatter; the optimizer steps on the CPU. Trades step time for device memory.

    Args:
        pin_memory: pin the CPU shards so host/device copies can run asynchronously (needs an
            accelerator).

    Not worth it when the model fits on the device: every step then pays the copies for no
    memory it needs.

    Example::

        policy = CPUOffloadPolicy()  # CPUOffloadPolicy(pin_memory=False) with no accelerator
        for block in model.layers:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        optim = torch.optim.AdamW(model.parameters())  # steps on the CPU shards
    """

    pin_memory: bool = True


def policy_repr(policy: MixedPrecisionPolicy) -> str:
    """``repr(policy)`` that is the same on every rank: a ``param_dtype_override_fn`` shows as
    its name only (its answers, the per-parameter dtypes, are compared instead of its address)."""
    fn = policy.param_dtype_override_fn
    if fn is None:
        return repr(policy)
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    return repr(dataclasses.replace(policy, param_dtype_override_fn=None)).replace(
        "param_dtype_override_fn=None", f"param_dtype_override_fn=<{name}>"
    )


if TYPE_CHECKING:
    AnyMixedPrecisionPolicy: TypeAlias = "MixedPrecisionPolicy | TorchMixedPrecisionPolicy"
    AnyOffloadPolicy: TypeAlias = "OffloadPolicy | TorchOffloadPolicy"


def torch_policy_types() -> tuple[type, type, type] | None:
    """torch's ``MixedPrecisionPolicy``, ``OffloadPolicy`` and ``CPUOffloadPolicy`` when
    ``torch.distributed.fsdp`` is loaded, else None (then no object can be one of them)."""
    module = sys.modules.get("torch.distributed.fsdp")
    if module is None:
        return None
    return module.MixedPrecisionPolicy, module.OffloadPolicy, module.CPUOffloadPolicy


def as_own_policies(mp_policy: object, offload_policy: object) -> tuple[object, object]:
    """torch's policy objects converted to ours, field by field (the dataclasses have the same
    fields: a field torch adds later fails here, loudly, instead of being dropped); anything
    else is returned unchanged for the caller to check."""
    torch_types = torch_policy_types()
    if torch_types is None:
        return mp_policy, offload_policy
    torch_mp, torch_offload, torch_cpu_offload = torch_types
    if isinstance(mp_policy, torch_mp):
        mp_policy = MixedPrecisionPolicy(**_fields(mp_policy))
    if isinstance(offload_policy, torch_cpu_offload):
        offload_policy = CPUOffloadPolicy(**_fields(offload_policy))
    elif isinstance(offload_policy, torch_offload):
        # torch offloads only for its CPUOffloadPolicy; any other OffloadPolicy means none
        offload_policy = OffloadPolicy()
    return mp_policy, offload_policy


def _fields(policy: object) -> dict[str, Any]:  # values checked by our __post_init__
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}  # type: ignore[arg-type]


class Comm(ABC):
    """How a collective allocates its staging buffer.

    The base of ``AllGather`` and ``ReduceScatter``. The engine stages the all-gather output
    and the reduce-scatter input and output through ``allocate``, several times per step, so
    keep it cheap: ``torch.empty`` on the caching allocator is the usual answer.

    Example::

        class PlainBuffers(Comm):
            def allocate(self, size, *, dtype, device):
                return torch.empty(size, dtype=dtype, device=device)

        class MyAllGather(PlainBuffers, AllGather):  # __call__ as in AllGather's example
            ...
    """

    @abstractmethod
    def allocate(
        self,
        size: tuple[int, ...] | torch.Size,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Return a tensor of ``size`` for the collective's input or output."""


class AllGather(Comm):
    """A user-provided all-gather (``FSDPModule.set_custom_all_gather``).

    The engine calls it with keywords and ``async_op=True``, and waits on the returned
    ``Work``. The comm owns its buffers: once one is set, ``set_symm_mem_for_comm`` and
    ``set_allocate_memory_from_process_group_for_comm`` raise ``AssertionError``.

    Example::

        class MyAllGather(AllGather):
            def allocate(self, size, *, dtype, device):
                return torch.empty(size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                return dist.all_gather_into_tensor(
                    output_tensor, input_tensor, group=group, async_op=async_op
                )

        model.layers[0].set_custom_all_gather(MyAllGather())
    """

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather every rank's flat ``input_tensor`` into ``output_tensor`` (rank-major)."""


class ReduceScatter(Comm):
    """A user-provided reduce-scatter (``FSDPModule.set_custom_reduce_scatter``).

    Called like ``AllGather`` (keywords, ``async_op=True``), plus the reduction ``op``; as
    there, it rules out ``set_symm_mem_for_comm`` and process-group allocation.

    Example::

        class MyReduceScatter(ReduceScatter):
            def allocate(self, size, *, dtype, device):
                return torch.empty(size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                return dist.reduce_scatter_tensor(
                    output_tensor, input_tensor, op=op, group=group, async_op=async_op
                )

        model.layers[0].set_custom_reduce_scatter(MyReduceScatter())
    """

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input_tensor`` across ranks and keep this rank's chunk in ``output_tensor``."""
