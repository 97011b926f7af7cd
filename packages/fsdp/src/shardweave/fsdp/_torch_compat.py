"""What differs between the torch releases shardweave supports (2.11 to 2.14), in one place.

Every version difference the packages meet is a name here, resolved when it is called, so that
a test or a user that patches torch's function (a collective counter, a tracer) is seen:

* torch 2.13 renamed the tensor collectives ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` to ``all_gather_single`` and ``reduce_scatter_single`` and
  deprecated the old names; 2.11 and 2.12 have only the old ones.
* torch 2.11 and 2.12's ``PipelineStage`` finishes a stage's backward through
  ``state._fsdp_param_group`` (one group per state, or None) where 2.13 reads
  ``state._fsdp_param_groups``: ``STATE_EXPOSES_ONE_GROUP`` says which (``FSDPState``).

Tested in ``tests/fsdp/world_1/test_torch_compat.py`` with either name hidden.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["STATE_EXPOSES_ONE_GROUP", "all_gather_single", "reduce_scatter_single"]

# torch's pipelining reads a state's single ``_fsdp_param_group`` before 2.13.
STATE_EXPOSES_ONE_GROUP: bool = tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13)


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
