"""HSDP (hybrid sharding) on a 2x2 ``(replicate, shard)`` mesh.

Parameters are sharded over the ``shard`` dim (2 ranks) and replicated over the ``replicate``
dim (2 copies): each backward reduce-scatters gradients within a shard group, then all-reduces
the shards across replicas. Passing a 2-D mesh to ``fully_shard`` is all it takes.

Run on 4 CPU processes::

    torchrun --standalone --nproc-per-node 4 examples/hsdp.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardweave.fsdp import fully_shard

DIM, CLASSES, BLOCKS = 16, 5, 3
_TEACHER = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(1234))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return Classifier()


def batch(step: int, rank: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (inputs, labels) at ``step``: every rank is its own data-parallel rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, DIM, generator=g)
    return x, (x @ _TEACHER).argmax(-1)  # a learnable task: labels from a fixed linear teacher


def train(
    steps: int = 5, lr: float = 0.1, replicas: int = 2, shards: int = 2
) -> tuple[nn.Module, list[float]]:
    """Train with HSDP; returns the model and each step's loss averaged over all ranks.

    Needs an initialized process group of ``replicas * shards`` ranks (``main`` makes one).
    """
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # gradients are averaged over all replicas * shards ranks
        optim.step()
        optim.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
    return model, losses


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """Use the caller's process group, or make a gloo one (torchrun) for the duration."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> None:
    with process_group():
        model, losses = train(steps=10)
        if dist.get_rank() == 0:
            placements = next(iter(model.parameters())).placements
            print("placements:", placements)
            print("loss per step:", " ".join(f"{x:.4f}" for x in losses))


if __name__ == "__main__":
    main()
