"""An example of torch's tensor all-gather protocol: all-gather parameters in a lower precision.

``all_gather_in_dtype(module, torch.bfloat16)`` patches ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` onto the sharded local tensors of ``module``'s FSDP parameters: each
rank sends its shard in ``dtype`` (half the all-gather bytes for bf16 over fp32) and the
unsharded parameter is rebuilt in the compute dtype. Unlike ``MixedPrecisionPolicy(param_dtype=
...)``, compute stays in the original dtype; only the communicated copy is rounded. The same
hooks work with torch's own ``fully_shard``, which is how the tests check them.

Apply it after ``fully_shard`` (and after ``to_empty`` for meta-initialized models): the engine
detects the hooks on the local tensors at the root's first forward.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["all_gather_in_dtype"]


def all_gather_in_dtype(module: nn.Module, dtype: torch.dtype) -> int:
    """Patch every sharded (DTensor) parameter of ``module`` to all-gather in ``dtype``.

    Returns the number of parameters patched. The all-gather shrinks as with
    ``MixedPrecisionPolicy(param_dtype=dtype)``, but compute stays in the parameters' dtype
    on values rounded to ``dtype``: no faster compute, and less precision than no policy.

    Example::

        fully_shard(model)  # a meta-device model: to_empty() it before patching
        n = all_gather_in_dtype(model, torch.bfloat16)
        loss = model(x).sum()  # bf16 goes over the wire, compute stays fp32
    """
    count = 0
    for param in module.parameters():
        if not isinstance(param, DTensor):
            continue
        local = param._local_tensor
        local.fsdp_pre_all_gather = types.MethodType(_make_pre(dtype), local)  # type: ignore[attr-defined]
        local.fsdp_post_all_gather = types.MethodType(_post, local)  # type: ignore[attr-defined]
        count += 1
    return count


def _make_pre(dtype: torch.dtype) -> Any:
    def fsdp_pre_all_gather(
        self: torch.Tensor,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: object,
    ) -> tuple[tuple[torch.Tensor, ...], object]:
        # Uneven shards: the engine gathers equal-size pieces, so pad to chunk 0's rows.
        rows = math.ceil(outer_size[0] / mesh.size()) if len(outer_size) else 0
        padded = self.new_zeros((rows, *self.shape[1:]), dtype=dtype)
        padded[: self.shape[0]].copy_(self)
        return (padded,), (outer_size,)

    return fsdp_pre_all_gather


def _post(
    self: torch.Tensor,
    all_gather_outputs: tuple[torch.Tensor, ...],
    metadata: object,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    (gathered,) = all_gather_outputs
    assert isinstance(metadata, tuple)
    outer_size: torch.Size = metadata[0]
    full = gathered[: outer_size[0]]
    if out is not None:
        # Autograd saved `out` in the forward: refill it without bumping its version (torch's
        # engine leaves this to the extension; shardweave's does it too).
        with torch.no_grad(), torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
            out.copy_(full)
        return None
    unsharded = full.to(param_dtype)
    return unsharded, (unsharded,)
