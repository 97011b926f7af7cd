"""The FSDP x tensor-parallel model of the extensions and fsdp world_4 tests: a small MLP stack and
its 2-D (dp, tp) construction."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.out_proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class Stack(nn.Module):
    """Two residual ``MLP`` blocks and a head: the FSDP x TP model several world_4 tests share."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def build_tp_stack(api: object, mesh: object, mp: object | None = None) -> nn.Module:
    """A seeded ``Stack`` whose blocks are tensor parallel on ``mesh["tp"]`` (in_proj colwise,
    out_proj rowwise), then ``api`` (a ``fully_shard`` or ``replicate``) on ``mesh["dp"]`` per block
    and on the root."""
    torch.manual_seed(0)
    model = Stack()
    plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)  # type: ignore[index]
    kwargs = {"mesh": mesh["dp"]}  # type: ignore[index]
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.blocks:
        api(block, **kwargs)  # type: ignore[operator]
    api(model, **kwargs)  # type: ignore[operator]
    return model
