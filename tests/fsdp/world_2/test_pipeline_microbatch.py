"""Pipeline-style microbatching over fully_shard'ed stages, driven by hand on 2 ranks.

A pipeline schedule drives FSDP through public knobs only: it unshards each stage once up front,
runs every microbatch's forward and backward with gradient sync off (and ``is_last_backward`` /
``reshard_after_backward`` off), turns sync on for the last microbatch, reshards at the end and
steps the optimizer. Each stage here is its own FSDP root and each stage boundary cuts autograd
(the next stage's input is a fresh leaf), as in ``torch.distributed.pipelining``; both stages live
on every rank, so the 2 ranks are the data-parallel dimension.

Oracles are named per test: *reference* (an unsharded copy on the global batch), *compatibility*
(torch's ``fully_shard`` driven by the identical schedule: bitwise) and *closed form* (collective
counts known in advance).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import FSDPModule, fully_shard
from tests._dist import WorkerPool, assert_close
from tests.fsdp._counting import count_collectives
from tests.fsdp._oracle import assert_matches_reference, assert_same_as_torch

N_MICRO = 3
MB_ROWS = 2
GROUPS_PER_STAGE = 2  # the inner fully_shard'ed Linear and the stage root (its other Linear)
# A microbatch schedule sums N_MICRO gradients per rank before the reduce-scatter; the reference
# takes one backward through the summed loss, so the additions happen in another order.
ACCUMULATION_TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-5}


def make_stages(seed: int = 0) -> list[nn.Module]:
    """Two pipeline stages with odd widths (uneven shards at 2 ranks)."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6)),
        nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)),
    ]


def shard_stage(stage: nn.Module, apply: Callable[..., Any], **kwargs: Any) -> None:
    # Under pipelining nothing is resharded after forward (torchtitan does the same): a stage runs
    # several microbatch forwards before the first backward, and resharding would re-all-gather.
    apply(stage[0], reshard_after_forward=False, **kwargs)  # type: ignore[index]
    apply(stage, reshard_after_forward=False, **kwargs)


def microbatches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s microbatches at ``step``; any rank can rebuild every rank's."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return [
        (torch.randn(MB_ROWS, 5, generator=g), torch.randn(MB_ROWS, 3, generator=g))
        for _ in range(N_MICRO)
    ]


def mb_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Divided by the microbatch count, so the accumulated gradient is the microbatch average.
    return F.mse_loss(out, target) / N_MICRO


def fsdp_modules(stages: Sequence[nn.Module]) -> list[Any]:
    """Every FSDP module of the stages (ours or torch's): unshard() and reshard() are per module."""
    return [m for s in stages for m in s.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]


def schedule_order(kind: str) -> list[tuple[str, int]]:
    """("F" | "B", microbatch) actions of one step: GPipe (fill-drain) or 1F1B (one warm-up)."""
    if kind == "gpipe":
        return [("F", i) for i in range(N_MICRO)] + [("B", i) for i in range(N_MICRO)]
    order = [("F", 0)]
    for i in range(1, N_MICRO):
        order += [("F", i), ("B", i - 1)]
    return [*order, ("B", N_MICRO - 1)]


def pipeline_step(
    stages: Sequence[Any],
    mbs: list[tuple[torch.Tensor, torch.Tensor]],
    kind: str,
    on_action: Callable[[str, int], None] = lambda action, i: None,
    pipelined: bool = True,
) -> list[torch.Tensor]:
    """One training step's forwards and backwards; returns the microbatch losses.

    ``pipelined=False`` leaves every knob at its default (sync and reshard on each microbatch):
    the naive schedule, used as the contrast in the collective counts.
    """
    if pipelined:
        for stage in stages:
            stage.set_requires_gradient_sync(False)
            stage.set_reshard_after_backward(False)
            stage.set_is_last_backward(False)
        # Issue every all-gather before the first compute, as pipelining's UNSHARD action does.
        handles = [m.unshard(async_op=True) for m in fsdp_modules(stages)]
        for handle in handles:
            handle.wait()
    saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    losses: list[torch.Tensor] = []
    for action, i in schedule_order(kind):
        if action == "F":
            x, target = mbs[i]
            boundaries = []
            for s, stage in enumerate(stages):
                # a fresh leaf per stage: each stage's backward is its own autograd call
                inp = x.detach().requires_grad_(s > 0)
                x = stage(inp)
                boundaries.append((inp, x))
            loss = mb_loss(x, target)
            losses.append(loss.detach())
            boundaries[-1] = (boundaries[-1][0], loss)
            saved[i] = boundaries
        else:
            if pipelined and i == N_MICRO - 1:
                for stage in stages:
                    stage.set_requires_gradient_sync(True)
                    stage.set_is_last_backward(True)
            grad = None
            for inp, out in reversed(saved.pop(i)):
                out.backward(grad)
                grad = inp.grad
        on_action(action, i)
    if pipelined:
        for module in fsdp_modules(stages):
            module.reshard()  # before the optimizer step, so its state is created sharded
        for stage in stages:
            stage.set_reshard_after_backward(True)
    return losses


def reference_backward(ref: Sequence[nn.Module], step: int, world: int) -> list[list[torch.Tensor]]:
    """One backward over every rank's microbatches; returns each rank's microbatch losses."""
    model = nn.Sequential(*ref)
    per_rank = [[mb_loss(model(x), y) for x, y in microbatches(step, r)] for r in range(world)]
    (sum(sum(losses) for losses in per_rank) / world).backward()  # type: ignore[union-attr]
    return [[loss.detach() for loss in losses] for losses in per_rank]


def assert_full_equal(stage: nn.Module, tstage: nn.Module, tag: str) -> None:
    """``full_tensor()`` of every param and grad equals torch's, bit for bit."""
    for (name, p), (_, tp) in zip(stage.named_parameters(), tstage.named_parameters(), strict=True):
        assert isinstance(p, DTensor) and isinstance(tp, DTensor), f"{tag} {name}"
        assert torch.equal(p.full_tensor(), tp.full_tensor()), f"{tag} {name}: param"
        assert p.grad is not None and tp.grad is not None, f"{tag} {name}: grad missing"
        assert torch.equal(p.grad.full_tensor(), tp.grad.full_tensor()), f"{tag} {name}: grad"  # type: ignore[attr-defined]


def make_opt(kind: str, stages: Sequence[nn.Module]) -> torch.optim.Optimizer:
    params = [p for s in stages for p in s.parameters()]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# --- parity with the reference and with torch's fully_shard -----------------------------------
def microbatch_parity(rank: int, world: int) -> None:
    for kind, optim in (("gpipe", "sgd"), ("1f1b", "adamw")):
        ours = make_stages()
        ref, theirs = copy.deepcopy(ours), copy.deepcopy(ours)
        for stage, tstage in zip(ours, theirs, strict=True):
            shard_stage(stage, fully_shard)
            shard_stage(tstage, torch_fully_shard)
        opts = [make_opt(optim, m) for m in (ours, ref, theirs)]
        for step in range(3):
            tag = f"{kind}/{optim} step {step}"
            mbs = microbatches(step, rank)
            losses = pipeline_step(ours, mbs, kind)
            tlosses = pipeline_step(theirs, mbs, kind)
            ref_losses = reference_backward(ref, step, world)[rank]
            assert torch.equal(torch.stack(losses), torch.stack(tlosses)), f"{tag}: losses"
            if step == 0:  # same weights, same rows: the forward is the reference's, bit for bit
                assert torch.equal(torch.stack(losses), torch.stack(ref_losses)), tag
            assert_close(torch.stack(losses), torch.stack(ref_losses), msg=f"{tag} losses")
            for s, (stage, rstage, tstage) in enumerate(zip(ours, ref, theirs, strict=True)):
                stag = f"{tag} stage {s}"
                assert_same_as_torch(stage, tstage, stag)
                assert_full_equal(stage, tstage, stag)
                assert_matches_reference(
                    stage, rstage, "grad", rank, world, stag, **ACCUMULATION_TOL
                )
                for p in stage.parameters():  # resharded after the step: sharded DTensors again
                    assert isinstance(p, DTensor), stag
            for opt in opts:
                opt.step()
                opt.zero_grad()
            for s, (stage, rstage, tstage) in enumerate(zip(ours, ref, theirs, strict=True)):
                stag = f"{tag} stage {s} after optimizer"
                assert_matches_reference(
                    stage, rstage, "param", rank, world, stag, **ACCUMULATION_TOL
                )
                assert_same_as_torch(stage, tstage, stag)


def test_microbatch_schedule_parity(world2: WorkerPool) -> None:
    """Oracles: reference (an unsharded copy, one backward over every rank's microbatches with
    the loss averaged over microbatches and ranks: same losses, grads and params after 3 steps
    of SGD and AdamW) and compatibility (torch's fully_shard driven by the identical GPipe and
    1F1B schedules: bitwise losses, local shards and full_tensor() of params and grads)."""
    world2.run(microbatch_parity)


# --- communication: one gradient sync per step, no re-all-gather between microbatches ---------
def microbatch_collectives(rank: int, world: int, kind: str) -> dict[str, Any]:
    stages = make_stages()
    naive = copy.deepcopy(stages)
    for stage in stages:
        shard_stage(stage, fully_shard)
    for stage in naive:
        fully_shard(stage[0])  # type: ignore[index]
        fully_shard(stage)
    groups = GROUPS_PER_STAGE * len(stages)
    pipeline_step(stages, microbatches(0, rank), kind)  # warm-up: lazy init
    pipeline_step(naive, microbatches(0, rank), kind, pipelined=False)
    for stage in (*stages, *naive):
        stage.zero_grad()

    trace: list[tuple[str, int, int, int]] = []
    with count_collectives() as counts:

        def record(action: str, i: int) -> None:
            trace.append((action, i, counts["all_gather_single"], counts["reduce_scatter_single"]))

        pipeline_step(stages, microbatches(1, rank), kind, on_action=record)
        pipelined = dict(counts)
    for action, i, ag, rs in trace:
        # every all-gather happened in the up-front unshard, none between microbatches
        assert ag == groups, f"{kind}: {ag} all-gathers by {action}{i}, expected {groups}"
        synced = action == "B" and i == N_MICRO - 1
        assert rs == (groups if synced else 0), f"{kind}: {rs} reduce-scatters by {action}{i}"
    assert pipelined["reduce_scatter_single"] == groups, pipelined
    assert pipelined["all_gather_single"] == groups, pipelined
    assert pipelined.get("all_reduce", 0) == 0, pipelined

    with count_collectives() as counts:
        pipeline_step(naive, microbatches(1, rank), kind, pipelined=False)
        naive_counts = dict(counts)
    # the contrast: default knobs reduce on every microbatch and reshard after each backward
    assert naive_counts["reduce_scatter_single"] == groups * N_MICRO, naive_counts
    # per microbatch, each inner group is gathered in forward and again in backward (it reshards
    # after forward) and each root once (its backward resharded it): groups + one per stage
    assert naive_counts["all_gather_single"] == N_MICRO * (groups + len(stages)), naive_counts
    # both schedules compute the same gradients (up to the order of accumulation)
    for stage, nstage in zip(stages, naive, strict=True):
        for (name, p), (_, q) in zip(stage.named_parameters(), nstage.named_parameters()):
            assert p.grad is not None and q.grad is not None, name
            assert_close(
                p.grad.to_local(),  # type: ignore[attr-defined]
                q.grad.to_local(),  # type: ignore[attr-defined]
                msg=name,
                rtol=ACCUMULATION_TOL["rtol"],
                atol=ACCUMULATION_TOL["atol"],
            )
    return {"pipelined": pipelined, "naive": naive_counts}


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_microbatch_schedule_collectives(world2: WorkerPool, kind: str) -> None:
    """Oracle: closed form. With sync, is_last_backward and reshard_after_backward off for all
    but the last microbatch, a step issues one all-gather per group (the up-front unshard, none
    between microbatches) and one reduce-scatter per group (in the last backward), against
    N_MICRO reduce-scatters per group and all-gathers on every microbatch with the default
    knobs (which give the same gradients)."""
    results = world2.run(microbatch_collectives, kind)
    assert results[0] == results[1]
