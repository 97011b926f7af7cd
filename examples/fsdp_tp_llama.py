"""FSDP x tensor parallelism on a Llama-style model, on a 2-D ``(dp, tp)`` mesh.

Tensor parallelism first (``parallelize_module`` on ``mesh["tp"]``: attention heads and the
SwiGLU hidden dim are split column-wise, the output projections row-wise), then
``shardweave.fsdp.fully_shard`` on ``mesh["dp"]`` per block and on the root. The DTensor
parameters that tensor parallelism creates are handled by the ``shardweave-extensions`` DTensor
kind (found through the ``shardweave.param_kinds`` entry point), so it must be installed.

Run on 4 CPU processes (dp=2, tp=2)::

    torchrun --standalone --nproc-per-node 4 examples/fsdp_tp_llama.py
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardweave.fsdp import fully_shard

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ = 64, 32, 4, 64, 2, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them.
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) / math.sqrt(DIM))
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos[: tokens.size(1)]
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build_model(seed: int = 0) -> Llama:
    """The unsharded model; the same ``seed`` gives the same weights on every rank."""
    torch.manual_seed(seed)
    return Llama()


def batch(step: int, dp_rank: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s (tokens, next tokens) at ``step``; deterministic."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    seq = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def parallelize(model: Llama, mesh: DeviceMesh) -> Llama:
    """Tensor parallelism on ``mesh["tp"]``, then FSDP on ``mesh["dp"]`` (block by block)."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def train(
    steps: int = 5, lr: float = 1e-2, dp: int = 2, tp: int = 2
) -> tuple[nn.Module, list[float]]:
    """Train for ``steps`` and return the model and each step's loss averaged over dp ranks.

    Needs an initialized process group of ``dp * tp`` ranks (``main`` makes one).
    """
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize(build_model(), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, dp_rank)  # the tp ranks of one dp rank see the same batch
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=mesh["dp"].get_group())
        losses.append(reported.item() / dp)
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
        _, losses = train(steps=10)
        if dist.get_rank() == 0:
            print("loss per step:", " ".join(f"{x:.4f}" for x in losses))


if __name__ == "__main__":
    main()
