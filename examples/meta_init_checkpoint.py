"""Build a model on the meta device, shard it, then load a full (``torch.save``'d) checkpoint.

No rank ever materializes the whole unsharded model: ``fully_shard`` on meta parameters
creates meta shards, ``to_empty`` allocates only this rank's shards, and
``shardweave.fsdp.set_full_state_dict(..., broadcast_from_rank0=True)`` sends one tensor at a
time from rank 0 (the only rank that reads the file) into every rank's live shards.
Buffers that are not in the state dict (``persistent=False``) are not loaded: recompute them
after ``to_empty``.

Run on 2 CPU processes (writes a checkpoint to a temporary file first)::

    torchrun --standalone --nproc-per-node 2 examples/meta_init_checkpoint.py [PATH]
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardweave.fsdp import FSDPModule, fully_shard, get_full_state_dict, set_full_state_dict

DIM, BLOCKS = 16, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)
        # Derived, not learned: kept out of the state dict, so it must be recomputed after
        # to_empty (which leaves every tensor uninitialized).
        self.register_buffer("freqs", torch.empty(DIM), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.freqs.copy_(torch.exp(-math.log(100.0) * torch.arange(DIM) / DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.freqs
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def save_pretrained(path: str, seed: int = 1) -> None:
    """Rank 0 writes a full checkpoint of a freshly initialized model (a stand-in for real
    pretrained weights); other ranks wait for it."""
    if dist.get_rank() == 0:
        torch.manual_seed(seed)
        torch.save(Model().state_dict(), path)
    dist.barrier()


def load_sharded(path: str) -> nn.Module:
    """A sharded ``Model`` holding the checkpoint at ``path`` (read by rank 0 only)."""
    with torch.device("meta"):
        model = Model()  # no memory: every parameter and buffer is a meta tensor
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")  # allocates this rank's shards (uninitialized)
    model.reset_buffers()
    state_dict = torch.load(path, weights_only=True) if dist.get_rank() == 0 else None
    set_full_state_dict(model, state_dict, broadcast_from_rank0=True)
    assert isinstance(model, FSDPModule)
    return model


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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else os.path.join(tempfile.gettempdir(), "shardweave-example-ckpt.pt")
    with process_group():
        save_pretrained(path)
        model = load_sharded(path)
        out = model(torch.ones(2, DIM))
        full = get_full_state_dict(model)  # every rank calls it; rank 0 gets the tensors
        if dist.get_rank() == 0:
            print("output:", out.detach().flatten().tolist())
            print("full state dict keys:", list(full))


if __name__ == "__main__":
    main()
