"""Helpers for the fault tests (never hang, watchdog): a small per-block model whose blocks can
raise or be skipped on one rank, a fresh process group per case, and the error contract."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardweave.fsdp import fully_shard
from tests._dist import keep_process_group

PG_TIMEOUT = datetime.timedelta(seconds=30)
DEADLINE_S = 10.0  # the target: peers learn of a failure well inside the PG timeout


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.fail_on: tuple[int, int] | None = None  # (rank, step) to raise at
        self.step = 0
        self.act: Callable[[torch.Tensor], torch.Tensor] = torch.relu  # tests compile it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        if self.fail_on == (dist.get_rank(), self.step):
            raise ValueError(f"boom in block on rank {dist.get_rank()}")
        return self.act(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.skip_on: tuple[int, int] | None = None  # (rank, block) a rank skips

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.skip_on != (dist.get_rank(), i):
                x = block(x)
        return x


def _fresh_mesh() -> DeviceMesh:
    pg = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    keep_process_group(pg)  # a fault may leave a collective on it that never completes
    return DeviceMesh.from_group(pg, "cpu")


def _build(mesh: DeviceMesh) -> Net:
    torch.manual_seed(0)
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _step(net: nn.Module, rank: int, step: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
    net(x).sum().backward()


def _expect(
    rank: int,
    body: Callable[[], None],
    errors: dict[int, tuple[type[BaseException], str]],
) -> float:
    """Run ``body``; this rank must raise ``errors[rank]`` (type, regex). Returns seconds."""
    start = time.monotonic()
    exc_type, pattern = errors[rank]
    with pytest.raises(exc_type, match=pattern):
        body()
    return time.monotonic() - start


def _agree_and_check_time(elapsed: float, what: str) -> None:
    # Every rank reports how long its error took, over the default (healthy) group.
    times = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    assert float(times) < DEADLINE_S, f"{what}: slowest rank took {float(times):.1f} s"
