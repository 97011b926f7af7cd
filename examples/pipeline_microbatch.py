"""Pipeline-style microbatching over ``fully_shard``'ed stages, with a hand-written schedule.

A pipeline schedule drives FSDP through public ``FSDPModule`` knobs only:

* before the first microbatch: ``set_requires_gradient_sync(False)`` (accumulate unsharded
  gradients, no reduce-scatter), ``set_reshard_after_backward(False)`` and
  ``set_is_last_backward(False)``; then ``unshard(async_op=True)`` on every FSDP module and
  wait on the handles, so each stage is all-gathered once per step;
* GPipe order: every microbatch's forward, then every microbatch's backward; each stage
  boundary cuts autograd (the next stage's input is a fresh leaf), as in
  ``torch.distributed.pipelining``;
* before the last microbatch's backward: gradient sync and ``is_last_backward`` back on, so
  that backward reduce-scatters once per FSDP group;
* after it: ``reshard()`` every FSDP module (before the optimizer step, so its state is
  created sharded) and restore ``set_reshard_after_backward(True)``.

Both stages live on every rank here, so the ranks are the data-parallel dimension; with
``torch.distributed.pipelining`` each rank would hold one stage.

Run on 2 CPU processes::

    torchrun --standalone --nproc-per-node 2 examples/pipeline_microbatch.py
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardweave.fsdp import FSDPModule, fully_shard, trace

N_MICRO, MB_ROWS, DIM = 4, 4, 12
_TEACHER = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(1234)) / DIM**0.5


def build_stages(seed: int = 0) -> list[nn.Sequential]:
    """Two pipeline stages; the same ``seed`` gives the same weights on every rank."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)),
        nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, 1)),
    ]


def microbatches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s microbatches at ``step``: a regression on a fixed teacher's outputs."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    out = []
    for _ in range(N_MICRO):
        x = torch.randn(MB_ROWS, DIM, generator=g)
        out.append((x, torch.tanh(x @ _TEACHER)))
    return out


def mb_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Divided by the microbatch count, so the accumulated gradient is the microbatch average.
    return F.mse_loss(out, target) / N_MICRO


def shard_stage(stage: nn.Sequential) -> None:
    # Nothing reshards after forward under pipelining: a stage runs several microbatch forwards
    # before the first backward, and resharding would all-gather again for each one.
    fully_shard(stage[0], reshard_after_forward=False)
    fully_shard(stage, reshard_after_forward=False)


def fsdp_modules(stages: Sequence[nn.Module]) -> list[FSDPModule]:
    return [m for s in stages for m in s.modules() if isinstance(m, FSDPModule)]


def pipeline_step(
    stages: Sequence[nn.Module], mbs: list[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """One step's forwards and backwards (GPipe order); returns this rank's summed loss."""
    roots = [s for s in stages if isinstance(s, FSDPModule)]
    for stage in roots:
        stage.set_requires_gradient_sync(False)
        stage.set_reshard_after_backward(False)
        stage.set_is_last_backward(False)
    for handle in [m.unshard(async_op=True) for m in fsdp_modules(stages)]:
        assert handle is not None
        handle.wait()
    saved = []
    total = 0.0
    for x, target in mbs:  # forwards
        boundaries = []
        for s, stage in enumerate(stages):
            inp = x.detach().requires_grad_(s > 0)  # a fresh leaf per stage, as pipelining does
            x = stage(inp)
            boundaries.append((inp, x))
        loss = mb_loss(x, target)
        total += loss.item()
        boundaries[-1] = (boundaries[-1][0], loss)
        saved.append(boundaries)
    for i, boundaries in enumerate(saved):  # backwards
        if i == len(saved) - 1:
            for stage in roots:
                stage.set_requires_gradient_sync(True)
                stage.set_is_last_backward(True)
        grad = None
        for inp, out in reversed(boundaries):
            out.backward(grad)
            grad = inp.grad
    for module in fsdp_modules(stages):
        module.reshard()  # before the optimizer step, so its state is created sharded
    for stage in roots:
        stage.set_reshard_after_backward(True)
    return total


def train(
    steps: int = 5, lr: float = 0.1
) -> tuple[list[nn.Module], list[float], list[Counter[str]]]:
    """Train the sharded stages; returns them, each step's loss averaged over ranks, and each
    step's collective counts by kind (from ``shardweave.fsdp.trace``).

    Needs an initialized process group (``main`` makes one).
    """
    stages = build_stages()
    for stage in stages:
        shard_stage(stage)
    optim = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=lr)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    with trace() as tracer:
        for step in range(steps):
            loss = torch.tensor(pipeline_step(stages, microbatches(step, rank)))
            optim.step()
            optim.zero_grad()
            tracer.step()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
    counts = [Counter(c.kind for c in tracer.collectives if c.step == s) for s in range(steps)]
    return list(stages), losses, counts


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
        _, losses, counts = train(steps=10)
        if dist.get_rank() == 0:
            print("loss per step:", " ".join(f"{x:.4f}" for x in losses))
            print("collectives in step 0:", dict(counts[0]))


if __name__ == "__main__":
    main()
