"""``ignored_params`` composed with DDP on 2 ranks, the case torch's
``test_fully_shard_ignore_params.py`` checks on GPU only: FSDP shards a subtree except one nested
module's params, and DDP (told to skip what FSDP manages) replicates the rest, ignored ones
included.

Oracles: *compatibility* (torch's own ``fully_shard`` in the same composition, same processes:
bitwise equal losses, params and grads, sharded or not) and *reference* (plain DDP on the whole
model: full values within tolerance).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool, assert_close

DIM = 6


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_c = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_b = nn.Linear(DIM, DIM)
        self.inner = Inner()
        self.subtrahend = nn.Parameter(torch.randn(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(torch.relu(self.inner(x))) - self.subtrahend


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.middle = Middle()
        self.addend = nn.Parameter(torch.randn(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.middle(x) + self.addend).pow(2).sum()


def _compose(model: Outer, api: object) -> DDP:
    """FSDP on ``middle`` and ``middle.lin_b`` ignoring ``middle.inner``; DDP for the rest."""
    apply = api  # shardweave's fully_shard or torch's
    ignored = set(model.middle.inner.parameters())
    apply(model.middle.lin_b, ignored_params=ignored)  # type: ignore[operator]
    apply(model.middle, ignored_params=ignored)  # type: ignore[operator]
    assert isinstance(model.middle, TorchFSDPModule)  # ours is one too (torch's marker)
    fsdp_managed = [
        f"middle.{name}"
        for name, p in model.middle.named_parameters()
        if not any(p is q for q in ignored)
    ]
    assert sorted(fsdp_managed) == [
        "middle.lin_b.bias",
        "middle.lin_b.weight",
        "middle.subtrahend",
    ], fsdp_managed
    DDP._set_params_and_buffers_to_ignore_for_model(model, fsdp_managed)
    return DDP(model, broadcast_buffers=False)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def ignored_params_with_ddp(rank: int, world: int, steps: int) -> None:
    torch.manual_seed(0)
    base = Outer()
    ours, theirs = (
        _compose(copy.deepcopy(base), fully_shard),
        _compose(copy.deepcopy(base), torch_fully_shard),
    )
    sharded = {name for name, p in ours.named_parameters() if isinstance(p, DTensor)}
    # FSDP's ignored params (inner) stay plain tensors, for DDP to synchronize
    assert sharded == {
        "module.middle.lin_b.weight",
        "module.middle.lin_b.bias",
        "module.middle.subtrahend",
    }, sharded
    ref = DDP(copy.deepcopy(base))
    models = (ours, theirs, ref)
    # foreach=False: one optimizer over sharded (DTensor) and replicated (plain) params
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, foreach=False) for m in models]
    for step in range(steps):
        x = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        losses = [m(x) for m in models]
        assert torch.equal(losses[0], losses[1]), f"step {step}: {losses[0]} vs {losses[1]}"
        assert_close(losses[0], losses[2], msg=f"step {step} loss vs DDP")
        for loss in losses:
            loss.backward()
        for what in ("grad", "param"):
            pairs = zip(ours.named_parameters(), theirs.named_parameters(), strict=True)
            for (name, p), (tname, tp) in pairs:
                assert name == tname, (name, tname)
                a, b = (p.grad, tp.grad) if what == "grad" else (p, tp)
                assert a is not None and b is not None, f"step {step} {name}: no {what}"
                assert type(a) is type(b), f"step {step} {name}: {type(a)} vs {type(b)}"
                la = a.to_local() if isinstance(a, DTensor) else a
                lb = b.to_local() if isinstance(b, DTensor) else b
                assert torch.equal(la, lb), f"step {step} {what} {name} differs from torch's"
            for (name, p), (_, rp) in zip(ours.named_parameters(), ref.named_parameters()):
                a, r = (p.grad, rp.grad) if what == "grad" else (p, rp)
                assert a is not None and r is not None, name
                assert_close(_full(a.detach()), r.detach(), msg=f"step {step} {what} {name}")
            if what == "grad":
                for o in opts:
                    o.step()
                    o.zero_grad()


def test_ignored_params_with_ddp(world2: WorkerPool) -> None:
    """Oracles: compatibility (bitwise, sharded and DDP-replicated params alike) and reference
    (plain DDP on the whole model), over several steps."""
    world2.run(ignored_params_with_ddp, 3)
