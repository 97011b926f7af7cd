"""examples/hsdp.py: HSDP on a 2x2 mesh trains like the unsharded model on the global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from examples import hsdp as ex
from tests._dist import WorkerPool, assert_close

STEPS = 4
TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-6}  # fp32, gradients summed in another order


def body(rank: int, world: int) -> list[float]:
    model, losses = ex.train(steps=STEPS)
    ref = ex.build_model()
    optim = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(STEPS):
        loss = sum(F.cross_entropy(ref(x), y) for x, y in (ex.batch(step, r) for r in range(world)))
        loss = loss / world  # type: ignore[assignment]
        loss.backward()  # type: ignore[union-attr]
        optim.step()
        optim.zero_grad()
        ref_losses.append(loss.item())  # type: ignore[union-attr]
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for (name, p), rp in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.placements == (Replicate(), Shard(0)), (name, p.placements)
        assert p.device_mesh.mesh_dim_names == ("replicate", "shard"), name
        assert_close(p.full_tensor(), rp.detach(), msg=name, **TOL)
    return losses


def test_hsdp(world4: WorkerPool) -> None:
    """Oracle: reference (an unsharded model, SGD with momentum, on all 4 ranks' batches: losses
    and final parameters); placements are ``(Replicate(), Shard(0))``; the loss decreases."""
    losses = world4.run(body)
    assert all(run == losses[0] for run in losses), losses
    assert losses[0][-1] < losses[0][0], losses[0]
