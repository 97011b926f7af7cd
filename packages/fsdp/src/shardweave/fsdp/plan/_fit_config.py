"""One configuration ``fit`` searches and ``apply`` applies: ``FitConfig``, and the short
labels the answer prints for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE

__all__ = ["DTYPES", "FitConfig", "dtype_name", "every_label", "reduce_label"]

DTYPES: Final[dict[str | None, torch.dtype | None]] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


@dataclass(frozen=True)
class FitConfig:
    """One configuration: everything ``apply`` needs to reproduce it."""

    wrap: str | None  # module class name wrapped with fully_shard (None: the root only)
    reshard_after_forward: bool | int
    root_reshard_after_forward: bool
    param_dtype: str | None
    reduce_dtype: str | None
    checkpoint_every: int  # 0: none, 1: every wrapped block, k: every k-th (the 1st, k+1th, ...)
    offload: bool
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    reduce_scatter_max_input_buffers: int = 1

    def describe(self) -> str:
        ac = every_label(self.checkpoint_every)
        return (
            f"wrap={self.wrap or '-'} reshard={self.reshard_after_forward} "
            f"root_reshard={self.root_reshard_after_forward} "
            f"mp={self.param_dtype or 'fp32'}/{reduce_label(self.param_dtype, self.reduce_dtype)} "
            f"checkpoint={ac} offload={self.offload}"
        )


def reduce_label(param: str | None, reduce: str | None, model: str = "fp32") -> str:
    """The dtype gradients are reduced in: ``reduce``, or without it the parameters' own
    dtype from torch 2.15 (``REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE``) and ``param`` before."""
    if reduce is not None:
        return reduce
    if param is None or REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE:
        return model
    return param


def every_label(k: int) -> str:
    if k <= 1:
        return "none" if k == 0 else "every block"
    suffix = {2: "nd", 3: "rd"}.get(k % 10 if k % 100 not in (12, 13) else 0, "th")
    return f"every {k}{suffix} block"


def dtype_name(name: str | None) -> str:
    """``torch.<name>`` spelled out: ``bf16`` -> ``bfloat16``."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name or "", str(name))
