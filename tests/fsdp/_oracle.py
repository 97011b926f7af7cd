"""Oracles for engine parity tests: an unsharded reference and torch's own fully_shard."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests._dist import assert_close
from tests.fsdp._models import loss_fn, make_batch

# torch 2.15's parameters record an explicit ``grad_dtype`` (the oracle honours one); older
# releases have no such flag, and their tests of it skip.
TORCH_HAS_EXPLICIT_GRAD_DTYPE = hasattr(nn.Parameter(torch.ones(1)), "_has_grad_dtype_override")


def local_chunk(full: torch.Tensor, placement_dim: int, world: int, rank: int) -> torch.Tensor:
    """What ``rank`` holds of ``full`` under torch.chunk sharding (empty for trailing ranks)."""
    chunks = list(torch.chunk(full, world, dim=placement_dim))
    if rank < len(chunks):
        return chunks[rank]
    size = list(full.shape)
    size[placement_dim] = 0
    return full.new_empty(size)


def assert_matches_reference(
    model: nn.Module,
    ref: nn.Module,
    what: str,
    rank: int,
    world: int,
    tag: str = "",
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Each rank's shard (of params or grads) equals its chunk of the reference's full tensor."""
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        ours = p if what == "param" else p.grad
        theirs = rp if what == "param" else rp.grad
        if theirs is None:
            assert ours is None, f"{tag} {name}: reference has no {what} but ours does"
            continue
        assert ours is not None, f"{tag} {name}: missing {what}"
        assert isinstance(ours, DTensor), f"{tag} {name}: {what} is {type(ours).__name__}"
        dim = ours.placements[-1].dim  # type: ignore[attr-defined]
        expected = local_chunk(theirs.detach(), dim, world, rank)
        assert_close(
            ours.to_local(), expected, msg=f"{tag} rank {rank} {what} {name}", rtol=rtol, atol=atol
        )


def assert_same_as_torch(model: nn.Module, torch_model: nn.Module, tag: str = "") -> None:
    """Bitwise: same placements, same local shards, same local grads as torch's FSDP2."""
    pairs = zip(model.named_parameters(), torch_model.named_parameters(), strict=True)
    for (name, p), (tname, tp) in pairs:
        assert name == tname, f"{tag} names differ: {name} vs {tname}"
        assert isinstance(p, DTensor) and isinstance(tp, DTensor), f"{tag} {name}"
        assert p.placements == tp.placements, f"{tag} {name}: {p.placements} vs {tp.placements}"
        assert p.shape == tp.shape and p.to_local().shape == tp.to_local().shape, f"{tag} {name}"
        assert torch.equal(p.to_local(), tp.to_local()), f"{tag} {name}: params differ from torch"
        if tp.grad is None:
            assert p.grad is None, f"{tag} {name}: torch has no grad, we do"
        else:
            assert p.grad is not None, f"{tag} {name}: torch has a grad, we don't"
            assert torch.equal(p.grad.to_local(), tp.grad.to_local()), (  # type: ignore[attr-defined]
                f"{tag} {name}: grads differ from torch's FSDP2"
            )


def sgd_step(*models: nn.Module, lr: float = 0.1) -> None:
    """A plain SGD step on each model's parameters that have a gradient, which is then dropped
    (the same update on ours, torch's and a reference)."""
    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                if p.grad is not None:
                    p.sub_(lr * p.grad)
                    p.grad = None


def train_both_as_torch(
    model: nn.Module, torch_model: nn.Module, kind: str, rank: int, steps: int
) -> None:
    """``steps`` AdamW steps on ours and on torch's model (same batches), then bitwise shards."""
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, torch_model)]
    for step in range(steps):
        batch = make_batch(kind, 10 * step + rank)
        for m, optim in zip((model, torch_model), optims, strict=True):
            loss_fn(kind, m(batch), batch).backward()
            optim.step()
            optim.zero_grad()
    assert_same_as_torch(model, torch_model, f"after {steps} AdamW steps")


def registered_sharded(model: nn.Module) -> list[tuple[str, bool]]:
    """Each registered parameter's name and whether it is sharded (a DTensor) right now."""
    return [(name, isinstance(p, DTensor)) for name, p in model.named_parameters()]
