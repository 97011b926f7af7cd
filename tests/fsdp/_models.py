"""Small models for engine tests: uneven shapes on purpose, so padding and empty shards show."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """Odd widths: at 2 and 4 ranks some shards are padded and some ranks hold empty shards."""

    def __init__(self, dim: int = 5, hidden: int = 7, out: int = 3) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, out)
        self.head = nn.Linear(out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.out_proj(torch.relu(self.in_proj(x)))))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim + 1)
        self.fc2 = nn.Linear(3 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    """Token + position embedding, blocks, final norm, LM head tied to the token embedding."""

    def __init__(self, vocab: int = 13, dim: int = 8, layers: int = 2, seq: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, 13 rows: uneven at 2 and 4 ranks
        self.checkpoint = False  # activation checkpointing of each block

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for layer in self.layers:
            if self.checkpoint:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.norm(x))


class TwoLinear(nn.Module):
    """Linear(4, hidden) then Linear(hidden, 2): ranks that pass different ``hidden`` build
    models that disagree in shape (the consistency-check tests)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.a = nn.Linear(4, hidden)
        self.b = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    if kind == "gpt":
        return TinyGPT()
    raise ValueError(kind)


def make_batch(kind: str, seed: int, batch: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return torch.randn(batch, 5, generator=g)
    return torch.randint(0, 13, (batch, 6), generator=g)


def loss_fn(kind: str, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return out.pow(2).sum()
    # next-token loss on the input shifted by one (wrapping), summed so averaging is explicit
    target = torch.roll(inp, -1, dims=1)
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1), reduction="sum")


def shard_blocks(model: nn.Module, fully_shard: object, **kwargs: object) -> None:
    """Per-block fully_shard then the root, the way users apply FSDP."""
    apply = fully_shard  # the shardweave or torch function under test
    if isinstance(model, TinyGPT):
        for layer in model.layers:
            apply(layer, **kwargs)  # type: ignore[operator]
    elif isinstance(model, MLP):
        apply(model.in_proj, **kwargs)  # type: ignore[operator]
        apply(model.out_proj, **kwargs)  # type: ignore[operator]
    apply(model, **kwargs)  # type: ignore[operator]
