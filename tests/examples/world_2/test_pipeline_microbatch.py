"""examples/pipeline_microbatch.py: a hand-written GPipe schedule over fully_shard'ed stages."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from examples import pipeline_microbatch as ex
from tests._dist import WorkerPool, assert_close

STEPS = 4
GROUPS = 4  # two stages, each with a fully_shard'ed first Linear and the stage root
# Each rank sums N_MICRO microbatch gradients before the reduce-scatter; the reference takes
# one backward through the summed loss, so the additions happen in another order.
TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-5}


def body(rank: int, world: int) -> tuple[list[float], list[dict[str, int]]]:
    stages, losses, counts = ex.train(steps=STEPS)
    ref = nn.Sequential(*ex.build_stages())
    optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for step in range(STEPS):
        per_rank = [
            sum(ex.mb_loss(ref(x), y) for x, y in ex.microbatches(step, r)) for r in range(world)
        ]
        loss = sum(per_rank) / world
        loss.backward()  # type: ignore[union-attr]
        optim.step()
        optim.zero_grad()
        ref_losses.append(loss.item())  # type: ignore[union-attr]
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    params = [p for s in stages for p in s.parameters()]
    for p, rp in zip(params, ref.parameters(), strict=True):
        assert_close(p.full_tensor(), rp.detach(), **TOL)
    return losses, [dict(c) for c in counts]


def test_pipeline_microbatch(world2: WorkerPool) -> None:
    """Oracles: reference (the unsharded two-stage model on every rank's microbatches: losses
    and final parameters); closed form (per step, one all-gather and one reduce-scatter per
    FSDP group, whatever the microbatch count, as counted by the tracer); the loss decreases."""
    results = world2.run(body)
    losses, counts = results[0]
    assert all(r[0] == losses for r in results), results
    assert losses[-1] < losses[0], losses
    expected = Counter({"all_gather": GROUPS, "reduce_scatter": GROUPS})
    for step, count in enumerate(counts):
        assert Counter(count) == expected, (step, count)
