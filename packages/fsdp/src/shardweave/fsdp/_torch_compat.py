"""What differs between the torch releases shardweave supports (2.11 to 2.15), in one place.

Our behaviour follows the torch the user has installed: where a release changed an API or a
default, the engine reads a named rule here, never ``torch.__version__``. A new torch release
is: diff its FSDP2 against the last one, add a rule (or a capability) per difference below,
each with the release that introduced it, and add the release to ``nox -s compat``.

Collectives, resolved when called so that a test or a user that patches torch's function (a
collective counter, a tracer) is seen:

* torch 2.13 renamed the tensor collectives ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` to ``all_gather_single`` and ``reduce_scatter_single`` and
  deprecated the old names; 2.11 and 2.12 have only the old ones.
* torch 2.11 and 2.12's ``PipelineStage`` finishes a stage's backward through
  ``state._fsdp_param_group`` (one group per state, or None) where 2.13 reads
  ``state._fsdp_param_groups``: ``STATE_EXPOSES_ONE_GROUP`` says which (``FSDPState``).

Rules:

* ``REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE`` (torch 2.15): with ``reduce_dtype=None`` gradients are
  reduced in the parameter's gradient dtype (its ``grad_dtype``, else its original dtype), no
  longer in ``param_dtype``; a group whose gradients differ in dtype reduces in their promoted
  dtype. Accumulation while gradient sync is off follows the same dtype (a backward's first
  gradient is made in it, so the uses of a tied weight are summed in it). Under the same rule
  autograd makes each unsharded gradient in the dtype it is reduced or kept in, unless that is
  wider than the compute dtype and no tensor-parallel reduction comes first
  (``FSDPParam.set_unsharded_grad_dtype``).
* torch 2.15 also honours a ``grad_dtype`` set explicitly on a parameter (before or after
  ``fully_shard``): the gradients are made, reduced (with no ``reduce_dtype``) and kept in it.
  ``has_grad_dtype_override`` reads the flag (``FSDPParam.sharded_grad_dtype``); it is False
  before 2.15, where parameters have no such flag.

* ``RESET_ITER_STATE_DROPS_SHARDED_GRADS`` (torch 2.15): ``reset_iter_state`` clears every
  sharded gradient too, so a failed step leaves none of its groups' reduced gradients behind;
  before 2.15 they stay (``FSDPParamGroup.reset_iter_state``).

* ``SPMD_TYPES_PARAMS`` (torch 2.14): with ``dp_mesh_dims``, a plain parameter annotated by the
  ``spmd_types`` package is accepted (stored as a DTensor on the SPMD mesh, computed on as a
  plain tensor) instead of rejected for not being a DTensor; torchtitan 0.3.0's default
  ``spmd_types`` backend relies on it. torch 2.13 and older raise, and so do we there
  (``_spmd_types``).

Tested in ``tests/fsdp/world_1/test_torch_compat.py`` with either name hidden.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = [
    "REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE",
    "RESET_ITER_STATE_DROPS_SHARDED_GRADS",
    "SPMD_TYPES_PARAMS",
    "STATE_EXPOSES_ONE_GROUP",
    "TORCH_RELEASE",
    "TORCH_VERSION",
    "all_gather_single",
    "has_grad_dtype_override",
    "reduce_scatter_single",
]


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string ("2.15.0+cu132" -> (2, 15))."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


# The installed torch's version, for messages that name it, and its release: every rule below
# is a comparison with the release, made once.
TORCH_VERSION: str = str(torch.__version__)
TORCH_RELEASE: tuple[int, int] = _release(TORCH_VERSION)

# torch's pipelining reads a state's single ``_fsdp_param_group`` before 2.13.
STATE_EXPOSES_ONE_GROUP: bool = TORCH_RELEASE < (2, 13)

# torch 2.15: ``reduce_dtype=None`` reduces in the gradient's dtype, not in ``param_dtype``.
REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE: bool = TORCH_RELEASE >= (2, 15)

# torch 2.15: reset_iter_state also drops the sharded gradients (a failed step's partial ones).
RESET_ITER_STATE_DROPS_SHARDED_GRADS: bool = TORCH_RELEASE >= (2, 15)

# torch 2.14: dp_mesh_dims accepts plain parameters annotated by spmd_types (torchtitan's default).
SPMD_TYPES_PARAMS: bool = TORCH_RELEASE >= (2, 14)


def all_gather_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Every rank's ``input_tensor`` into ``output_tensor``, rank-major (2.13's name)."""
    fn: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return cast("dist.Work | None", fn(output_tensor, input_tensor, group=group, async_op=async_op))


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """This rank's reduced slice of every rank's ``input`` into ``output`` (2.13's name)."""
    fn: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return cast("dist.Work | None", fn(output, input, op=op, group=group, async_op=async_op))


def has_grad_dtype_override(param: torch.Tensor) -> bool:
    """Whether ``param.grad_dtype`` was set explicitly (torch 2.15's flag; never before)."""
    return bool(getattr(param, "_has_grad_dtype_override", False))
