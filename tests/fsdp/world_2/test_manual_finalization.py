"""Manual backward finalization (torch 2.15's ``set_manual_backward_finalization`` /
``finalize_backward`` / ``GradientReductionHandle``), which shardweave offers on every torch.

Oracles: *compatibility*. Where torch's ``FSDPModule`` has ``finalize_backward`` (2.15), torch's
own ``fully_shard`` driven by the same calls: bitwise the same losses, sharded params and sharded
grads after every finalization and optimizer step, and the same exception types (or results) for
each misuse. Where it does not (2.11-2.14), torch's automatic finalization of the same schedule
(a plain backward; for microbatches, gradient sync on for the last backward only), which must
give the same numbers. And the accelerator branches under the stream sanitizer: the CPU
branches' numbers, no race, no unsafe reuse, with the reductions waited on through the handle.
"""

from __future__ import annotations

import copy
import datetime
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardweave.fsdp
from shardweave.fsdp import (
    FSDPModule,
    GradientReductionHandle,
    PeerIdleError,
    fully_shard,
    set_idle_timeout,
    set_stall_timeout,
)
from shardweave.fsdp.faults import _failures, _watchdog
from shardweave.fsdp.faults._failures import set_checks
from shardweave.fsdp.faults._watchdog import DEFAULT_STALL_S
from tests._dist import WorkerPool
from tests.fsdp._counting import count_collectives
from tests.fsdp._faults import DEADLINE_S, _build, _expect, _fresh_mesh, _step
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import assert_same_as_torch
from tests.fsdp._stream_order import check_watched, sanitized_vs_plain

KIND = "gpt"
TORCH_HAS_MANUAL = hasattr(TorchFSDPModule, "finalize_backward")
_TORCH_HANDLE: tuple[type, ...] = tuple(
    getattr(torch.distributed.fsdp, name)
    for name in ("GradientReductionHandle",)
    if hasattr(torch.distributed.fsdp, name)
)


def _loss(model: nn.Module, step: int, mb: int, rank: int) -> torch.Tensor:
    batch = make_batch(KIND, 1000 * step + 100 * mb + rank)
    return loss_fn(KIND, model(batch), batch)


def _run_steps(
    model: nn.Module,
    rank: int,
    mode: str,
    manual: bool,
    on_step: Callable[[int], None],
    comms: list[Counter[str]],
) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro = 3 if mode == "micro" else 1
    losses: list[torch.Tensor] = []
    if manual:
        model.set_manual_backward_finalization(True)  # type: ignore[operator]
    for step in range(2):
        with count_collectives() as counts:
            for mb in range(micro):
                if micro > 1:
                    # Manual: every backward without sync, sync back on for the finalization.
                    # Automatic: sync on for the last backward only (torch's usual accumulation).
                    model.set_requires_gradient_sync(  # type: ignore[operator]
                        not manual and mb == micro - 1
                    )
                loss = _loss(model, step, mb, rank)
                loss.backward()
                losses.append(loss.detach().clone())
            if manual:
                if micro > 1:
                    model.set_requires_gradient_sync(True)  # type: ignore[operator]
                if mode == "async":
                    handle = model.finalize_backward(async_op=True)  # type: ignore[operator]
                    kinds = (GradientReductionHandle, *_TORCH_HANDLE)
                    assert isinstance(handle, kinds), type(handle)
                    handle.wait()
                    handle.wait()  # a second wait does nothing
                else:
                    assert model.finalize_backward() is None  # type: ignore[operator]
        comms.append(counts)
        on_step(step)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        on_step(step + 100)
    return losses


def _apply_layout(model: nn.Module, tmodel: nn.Module, layout: str, world: int) -> None:
    """Ours and torch's engine on the same layout: per-block FSDP, HSDP over a 1-rank shard
    dim (the all-reduce does the reduction), or ``replicate`` (torch's FSDP-based one)."""
    if layout == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import (
            replicate as torch_replicate,
        )

        from shardweave.replicate import replicate

        shard_blocks(model, replicate)
        shard_blocks(tmodel, torch_replicate)
        return
    kwargs: dict[str, Any] = {}
    if layout == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    shard_blocks(model, fully_shard, **kwargs)
    shard_blocks(tmodel, torch_fully_shard, **kwargs)


def manual_parity(rank: int, world: int, mode: str, layout: str = "fsdp") -> None:
    model = make_model(KIND)
    tmodel = copy.deepcopy(model)
    _apply_layout(model, tmodel, layout, world)
    # torch drives its own engine manually where its module has the API (2.15), else runs the
    # same schedule with its automatic finalization.
    torch_manual = hasattr(tmodel, "finalize_backward")
    # The oracle runs first; ours then replays the same schedule and compares at each point.
    snapshots: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}

    def snap(m: nn.Module) -> Callable[[int], None]:
        def record(point: int) -> None:
            snapshots[point] = [
                (
                    p.to_local().detach().clone(),  # type: ignore[attr-defined]
                    None if p.grad is None else p.grad.to_local().detach().clone(),  # type: ignore[attr-defined]
                )
                for p in m.parameters()
            ]

        return record

    def compare(m: nn.Module) -> Callable[[int], None]:
        def check(point: int) -> None:
            want = snapshots[point]
            got = list(m.parameters())
            assert len(got) == len(want)
            for i, (p, (wp, wg)) in enumerate(zip(got, want)):
                tag = f"{mode} rank {rank} point {point} param {i}"
                assert torch.equal(p.to_local(), wp), f"{tag}: params differ"  # type: ignore[attr-defined]
                if wg is None:
                    assert p.grad is None, f"{tag}: oracle has no grad"
                else:
                    assert p.grad is not None, f"{tag}: missing grad"
                    g = p.grad.to_local()  # type: ignore[attr-defined]
                    assert g.dtype == wg.dtype and torch.equal(g, wg), f"{tag}: grads differ"

        return check

    their_comms: list[Counter[str]] = []
    our_comms: list[Counter[str]] = []
    want = _run_steps(tmodel, rank, mode, torch_manual, snap(tmodel), their_comms)
    got = _run_steps(model, rank, mode, True, compare(model), our_comms)
    # The same collectives with the same bytes per step (one reduction per group per step,
    # also for the microbatches, whose reductions all wait for the finalization).
    if layout == "replicate":
        # replicate buckets its groups' all-reduces as DDP does (torch's issues one per group):
        # the same bytes in fewer calls
        ours_b, theirs_b = ([c["all_reduce_bytes"] for c in cs] for cs in (our_comms, their_comms))
        assert ours_b == theirs_b, f"{mode} rank {rank}: ours {our_comms} vs {their_comms}"
    else:
        assert our_comms == their_comms, f"{mode} rank {rank}: ours {our_comms} vs {their_comms}"
    if layout == "fsdp":
        assert all(c["reduce_scatter_single"] == 3 for c in our_comms), our_comms
    else:  # the all-reduce over the replicas carries the reduction
        assert all(c["all_reduce"] >= 1 for c in our_comms), our_comms
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b), f"{mode} rank {rank}: losses differ {a} vs {b}"
    assert_same_as_torch(model, tmodel, f"{mode} rank {rank} end")


@pytest.mark.parametrize("layout", ["hsdp", "replicate"])
@pytest.mark.parametrize("mode", ["async", "micro"])
def test_manual_finalization_with_all_reduce_matches_torch(
    world2: WorkerPool, mode: str, layout: str
) -> None:
    """Oracle: compatibility, as above, where the reduction ends in an all-reduce (HSDP over a
    1-rank shard dim; ``replicate``): the handle's wait covers it, and the numbers and the
    collectives are torch's (its engine finalizing manually on 2.15, automatically before)."""
    world2.run(manual_parity, mode, layout)


@pytest.mark.parametrize("mode", ["sync", "async", "micro"])
def test_manual_finalization_matches_torch(world2: WorkerPool, mode: str) -> None:
    """Oracle: compatibility (torch 2.15's manual finalization, else torch's automatic one):
    losses, sharded params and grads bitwise after every finalization and optimizer step."""
    world2.run(manual_parity, mode)


# --- misuse -----------------------------------------------------------------------------------
def _outcome(fn: Callable[[], Any]) -> str:
    """What a call did: the exception type's name, or the kind of its result."""
    try:
        result = fn()
    except Exception as exc:
        return type(exc).__name__
    return "None" if result is None else ("handle" if hasattr(result, "wait") else repr(result))


def _sharded_layout(engine: str, layout: str = "fsdp") -> nn.Module:
    model = make_model(KIND)
    if layout == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

        from shardweave.replicate import replicate

        shard_blocks(model, replicate if engine == "ours" else torch_replicate)
        return model
    shard_blocks(model, fully_shard if engine == "ours" else torch_fully_shard)
    return model


def _fwd_bwd(model: nn.Module, rank: int, step: int = 0) -> None:
    _loss(model, step, 0, rank).backward()


def _misuse_cases(rank: int, layout: str) -> dict[str, Callable[[str], list[str]]]:
    """Each case builds fresh models (so one case's error leaves no state behind) and returns
    the outcomes of its steps."""

    def _sharded(engine: str) -> nn.Module:
        return _sharded_layout(engine, layout)

    def non_root_after_init(engine: str) -> list[str]:
        m = _sharded(engine)
        _fwd_bwd(m, rank)
        return [_outcome(lambda: m.layers[0].set_manual_backward_finalization(True))]  # type: ignore[index, union-attr]

    def non_root_before_init(engine: str) -> list[str]:
        m = _sharded(engine)
        first = _outcome(lambda: m.layers[0].set_manual_backward_finalization(True))  # type: ignore[index, union-attr]
        return [first, _outcome(lambda: _fwd_bwd(m, rank))]

    def change_during_backward(engine: str) -> list[str]:
        m = _sharded(engine)
        seen: list[str] = []
        loss = _loss(m, 0, 0, rank)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            seen.append(_outcome(lambda: m.set_manual_backward_finalization(True)))  # type: ignore[operator]
            return grad

        loss.register_hook(hook)
        loss.backward()
        return [*seen, _outcome(lambda: m.set_manual_backward_finalization(False))]  # type: ignore[operator]

    def change_after_backward_started(engine: str) -> list[str]:
        m = _sharded(engine)
        m.set_manual_backward_finalization(True)  # type: ignore[operator]
        _fwd_bwd(m, rank)
        changed = _outcome(lambda: m.set_manual_backward_finalization(False))  # type: ignore[operator]
        same = _outcome(lambda: m.set_manual_backward_finalization(True))  # type: ignore[operator]
        done = _outcome(lambda: m.finalize_backward())  # type: ignore[operator]
        return [changed, same, done, _outcome(lambda: m.set_manual_backward_finalization(False))]  # type: ignore[operator]

    def auto_mode_finalize(engine: str) -> list[str]:
        m = _sharded(engine)
        _fwd_bwd(m, rank)
        return [
            _outcome(lambda: m.finalize_backward()),  # type: ignore[operator]
            _outcome(lambda: m.finalize_backward(async_op=True)),  # type: ignore[operator]
        ]

    def before_first_forward(engine: str) -> list[str]:
        m = _sharded(engine)
        m.set_manual_backward_finalization(True)  # type: ignore[operator]
        sync = _outcome(lambda: m.finalize_backward())  # type: ignore[operator]
        handle = m.finalize_backward(async_op=True)  # type: ignore[operator]
        return [sync, _outcome(handle.wait), _outcome(handle.wait)]

    def finalize_twice_pending(engine: str) -> list[str]:
        m = _sharded(engine)
        m.set_manual_backward_finalization(True)  # type: ignore[operator]
        _fwd_bwd(m, rank)
        handle = m.finalize_backward(async_op=True)  # type: ignore[operator]
        again = _outcome(lambda: m.finalize_backward())  # type: ignore[operator]
        again_async = _outcome(lambda: m.finalize_backward(async_op=True))  # type: ignore[operator]
        forward = _outcome(lambda: _fwd_bwd(m, rank, 1))
        out = [again, again_async, forward, _outcome(handle.wait), _outcome(handle.wait)]
        # After the wait the next iteration runs normally.
        _fwd_bwd(m, rank, 1)
        return [*out, _outcome(lambda: m.finalize_backward())]  # type: ignore[operator]

    def handle_after_reset(engine: str) -> list[str]:
        m = _sharded(engine)
        m.set_manual_backward_finalization(True)  # type: ignore[operator]
        _fwd_bwd(m, rank)
        handle = m.finalize_backward(async_op=True)  # type: ignore[operator]
        m.reset_iter_state()  # type: ignore[operator]
        waited = _outcome(handle.wait)
        _fwd_bwd(m, rank, 1)
        return [waited, _outcome(lambda: m.finalize_backward())]  # type: ignore[operator]

    def finalize_on_non_root(engine: str) -> list[str]:
        m = _sharded(engine)
        m.set_manual_backward_finalization(True)  # type: ignore[operator]
        _fwd_bwd(m, rank)
        out = _outcome(lambda: m.layers[0].finalize_backward())  # type: ignore[index, union-attr]
        return [out, _outcome(lambda: m.finalize_backward())]  # type: ignore[operator]

    return {
        "non_root_after_init": non_root_after_init,
        "non_root_before_init": non_root_before_init,
        "change_during_backward": change_during_backward,
        "change_after_backward_started": change_after_backward_started,
        "auto_mode_finalize": auto_mode_finalize,
        "before_first_forward": before_first_forward,
        "finalize_twice_pending": finalize_twice_pending,
        "handle_after_reset": handle_after_reset,
        "finalize_on_non_root": finalize_on_non_root,
    }


# What torch 2.15 does, step by step (checked against torch where it has the API).
EXPECTED: dict[str, list[str]] = {
    "non_root_after_init": ["RuntimeError"],
    "non_root_before_init": ["None", "RuntimeError"],
    "change_during_backward": ["RuntimeError", "None"],
    "change_after_backward_started": ["RuntimeError", "None", "None", "None"],
    "auto_mode_finalize": ["RuntimeError", "RuntimeError"],
    "before_first_forward": ["None", "None", "None"],
    "finalize_twice_pending": [
        "RuntimeError",
        "RuntimeError",
        "RuntimeError",
        "None",
        "None",
        "None",
    ],
    "handle_after_reset": ["RuntimeError", "None"],
    "finalize_on_non_root": ["RuntimeError", "None"],
}


def misuse(rank: int, world: int, case: str, layout: str) -> None:
    run = _misuse_cases(rank, layout)[case]
    ours = run("ours")
    assert ours == EXPECTED[case], f"{layout} {case} rank {rank}: ours {ours}"
    if TORCH_HAS_MANUAL:
        theirs = run("torch")
        assert ours == theirs, f"{layout} {case} rank {rank}: ours {ours} vs torch {theirs}"


@pytest.mark.parametrize("layout", ["fsdp", "replicate"])
@pytest.mark.parametrize("case", list(EXPECTED))
def test_manual_finalization_misuse_matches_torch(
    world2: WorkerPool, case: str, layout: str
) -> None:
    """Oracle: compatibility (torch 2.15's exception types and results for the same calls, where
    torch has the API; the table of torch 2.15's outcomes otherwise), on every rank, for
    ``fully_shard`` and ``replicate`` modules."""
    world2.run(misuse, case, layout)


# --- accelerator branches ---------------------------------------------------------------------
def test_manual_finalization_accelerator_branches(world2: WorkerPool) -> None:
    """Oracle: the CPU branches' numbers bitwise (and torch's fully_shard: manual where it has it,
    automatic otherwise); no race, no unsafe reuse, with the async handle holding the buffers."""
    cfg = {"manual_finalization": True, "micro": 2}
    check_watched(world2.run(sanitized_vs_plain, cfg, True), cfg)


def test_gradient_reduction_handle_is_exported() -> None:
    """Closed form: the public name, as torch 2.15 exports it."""
    assert "GradientReductionHandle" in shardweave.fsdp.__all__
    assert shardweave.fsdp.GradientReductionHandle is GradientReductionHandle
    assert hasattr(FSDPModule, "finalize_backward")
    assert GradientReductionHandle().wait() is None


# --- never hang -------------------------------------------------------------------------------
def peer_never_finalizes(rank: int, world: int) -> None:
    """Checks on: both ranks run a manual backward; rank 1 never calls finalize_backward (it
    waits elsewhere, alive). Rank 0's finalization issues the root's deferred reduce-scatter,
    which rank 1 never joins: rank 0 must raise PeerIdleError naming rank 1 at the (scaled)
    idle timeout instead of hanging."""
    net = _build(_fresh_mesh())
    net.set_manual_backward_finalization(True)  # type: ignore[operator]
    _step(net, rank, 0)
    set_checks(True)
    set_stall_timeout(1.0)
    set_idle_timeout(4.0)
    store = dist.distributed_c10d._get_default_store()
    try:
        if rank == 1:
            store.wait(["manual_finalization/done"], datetime.timedelta(seconds=60))
            return
        elapsed = _expect(
            rank,
            lambda: net.finalize_backward(),  # type: ignore[operator]
            {0: (PeerIdleError, r"(?s)rank 1 is alive")},
        )
        store.set("manual_finalization/done", "1")
        assert elapsed < DEADLINE_S, elapsed
    finally:
        set_checks(False)
        set_stall_timeout(DEFAULT_STALL_S)
        set_idle_timeout(None)
        # This failure scope ends with the test, as a restarted job's would: a later test's
        # first engine call before a root's lazy init (FSDPModule.unshard) would otherwise
        # adopt its verdict (the misuse catalogue did, on both ranks).
        _failures.new_epoch(None)
        _watchdog.new_epoch()


def test_peer_that_never_finalizes_is_named(world2: WorkerPool) -> None:
    """Oracle: the never-hang contract (an error naming the missing rank, within the deadline)."""
    world2.run(peer_never_finalizes)
