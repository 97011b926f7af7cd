"""Faults made for real in spawned groups: every rank gets a clear error, fast, never a hang.

Each case runs on a fresh gloo process group with a 30 s timeout (a case that abandons a
collective leaves that group unusable, as it would in a real job) and asserts the error type,
its text on every rank, and the time to the error. Oracles: the error contract itself, and
for the unused-parameter case the unsharded reference and torch's fully_shard.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardweave.fsdp import (
    CollectiveMismatchError,
    PeerFailureError,
    PeerIdleError,
    failure_guard,
    fully_shard,
    set_idle_timeout,
    set_stall_timeout,
)
from shardweave.fsdp.faults import _failures
from shardweave.fsdp.faults._failures import set_checks
from shardweave.fsdp.faults._watchdog import DEFAULT_STALL_S
from tests._dist import WorkerPool, assert_close
from tests.fsdp._faults import (
    DEADLINE_S,
    _agree_and_check_time,
    _build,
    _expect,
    _fresh_mesh,
    _step,
)
from tests.fsdp._watchdog_cases import idle_warnings, watchdog_log


def peer_raises_in_forward(rank: int, world: int) -> None:
    net = _build(_fresh_mesh())
    _step(net, rank, 0)  # a healthy step first: lazy init, failure scope agreed
    net.blocks[1].fail_on = (1, 2)  # type: ignore[union-attr]

    def body() -> None:
        _step(net, rank, 1)

    elapsed = _expect(
        rank,
        body,
        {
            0: (PeerFailureError, r"rank 1 raised ValueError: boom in block on rank 1.*all-gather"),
            1: (ValueError, "boom in block"),
        },
    )
    _agree_and_check_time(elapsed, "peer raises in forward")


def peer_raises_outside_forward(rank: int, world: int) -> None:
    net = _build(_fresh_mesh())
    _step(net, rank, 0)

    def body() -> None:
        x = torch.randn(4, 16)
        with failure_guard():
            out = net(x)
            if rank == 1:
                raise RuntimeError("bad batch on rank 1 (loss computation)")
            out.sum().backward()

    elapsed = _expect(
        rank,
        body,
        {
            0: (PeerFailureError, r"rank 1 raised RuntimeError: bad batch on rank 1"),
            1: (RuntimeError, "bad batch"),
        },
    )
    _agree_and_check_time(elapsed, "peer raises outside forward")


def rank_skips_a_module(rank: int, world: int) -> None:
    """Checks on: rank 1 skips block 1 (a data-dependent branch); both ranks name it."""
    net = _build(_fresh_mesh())
    _step(net, rank, 0)
    net.skip_on = (1, 1)
    set_checks(True)
    try:
        elapsed = _expect(
            rank,
            lambda: _step(net, rank, 1),
            {
                0: (CollectiveMismatchError, r"(?s)all_gather of group 'blocks\.1'.*rank 1: "),
                1: (CollectiveMismatchError, r"(?s)all_gather of group 'blocks\.2'.*rank 0: "),
            },
        )
    finally:
        set_checks(False)
    _agree_and_check_time(elapsed, "rank skips a module")


def rank_leaves_the_step(rank: int, world: int) -> None:
    """Checks on: rank 1 stops calling the model (an early exit) and waits elsewhere, alive.
    Rank 0, waiting in the collective check, warns naming rank 1 at the stall threshold and
    raises PeerIdleError at the idle timeout (both scaled down together: 1 s and 4 s)."""
    net = _build(_fresh_mesh())
    _step(net, rank, 0)
    set_checks(True)
    set_stall_timeout(1.0)
    set_idle_timeout(4.0)
    store = dist.distributed_c10d._get_default_store()
    try:
        if rank == 1:
            # Not in any collective: the peer must still learn who is missing.
            store.wait(["never_hang/left_done"], datetime.timedelta(seconds=60))
            return
        with watchdog_log() as log:
            elapsed = _expect(
                rank,
                lambda: _step(net, rank, 1),
                {
                    0: (
                        PeerIdleError,
                        r"(?s)collective check before the all_gather.*rank 1 is alive",
                    )
                },
            )
        store.set("never_hang/left_done", "1")
        assert 4.0 - 1.0 <= elapsed < DEADLINE_S, elapsed
        assert idle_warnings(log, 1), log
    finally:
        set_checks(False)
        set_stall_timeout(DEFAULT_STALL_S)
        set_idle_timeout(None)


class Experts(nn.Module):
    """Two experts in one FSDP group; a rank with no tokens for an expert skips it."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            if i in route:
                out = out + expert(x)
        return out


def unused_params(rank: int, world: int) -> None:
    """Rank 1 routes nothing to expert 1. Without set_reduce_scatter_unused_params the ranks'
    reduce-scatters differ in size (torch on gloo aborts the process): with checks on, a
    CollectiveMismatchError on every rank; with the setter, training matches the reference."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    routes = {0: [0, 1], 1: [0]}
    mesh = _fresh_mesh()

    def build(api: Callable[..., Any]) -> nn.Module:
        torch.manual_seed(0)
        model = Experts()
        api(model, mesh=mesh)
        return model

    model = build(fully_shard)
    set_checks(True)
    try:
        with pytest.raises(CollectiveMismatchError, match="reduce_scatter of group"):
            model(torch.randn(2, 8), routes[rank]).sum().backward()
    finally:
        set_checks(False)
    model, tmodel = build(fully_shard), build(torch_fully_shard)
    model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    # torch's engine is an oracle where it has the switch (2.12+); the single process always
    torch_has_it = hasattr(tmodel, "set_reduce_scatter_unused_params")
    if torch_has_it:
        tmodel.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    torch.manual_seed(0)
    ref = Experts()
    for step in range(2):
        xs = [
            torch.randn(2, 8, generator=torch.Generator().manual_seed(step * 10 + r))
            for r in (0, 1)
        ]
        sharded = (model, tmodel) if torch_has_it else (model,)
        for m in sharded:
            m(xs[rank], routes[rank]).sum().backward()
        (sum(ref(xs[r], routes[r]).sum() for r in (0, 1)) / 2).backward()  # type: ignore[union-attr]
        for (name, p), tp, rp in zip(
            model.named_parameters(), tmodel.parameters(), ref.parameters(), strict=True
        ):
            if torch_has_it:
                assert torch.equal(p.grad.to_local(), tp.grad.to_local()), name  # type: ignore[union-attr]
            assert_close(p.grad.full_tensor(), rp.grad, msg=name)  # type: ignore[union-attr, arg-type]
        for m in (*sharded, ref):
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)  # type: ignore[operator]
            m.zero_grad(set_to_none=True)


def every_rank_raises_then_recovers(rank: int, world: int) -> None:
    """Every rank raises its own exception in one step, catches it and goes on: no rank may
    then get a peer's exception raised back (whose record won the publish is a race, here
    forced: rank 0 publishes first, rank 1 raises after and has adopted rank 0's record)."""
    net = _build(_fresh_mesh())
    _step(net, rank, 0)
    for turn in range(world):
        if turn == rank:
            with pytest.raises(ValueError, match="bad batch"), failure_guard():
                raise ValueError(f"bad batch on rank {rank}")
        dist.barrier()
    adopted = _failures.poll_failure()
    assert adopted is not None and adopted.origin == 0, adopted
    _step(net, rank, 1)  # both ranks train on
    for name, p in net.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad.to_local()).all()), name  # type: ignore[attr-defined]


CASES: dict[str, Callable[[int, int], None]] = {
    "peer_raises_in_forward": peer_raises_in_forward,
    "peer_raises_outside_forward": peer_raises_outside_forward,
    "rank_skips_a_module": rank_skips_a_module,
    "rank_leaves_the_step": rank_leaves_the_step,
    "unused_params": unused_params,
    "every_rank_raises_then_recovers": every_rank_raises_then_recovers,
}


def run_case(rank: int, world: int, name: str) -> None:
    CASES[name](rank, world)


@pytest.mark.parametrize("name", list(CASES))
def test_faults_give_errors_not_hangs(world2: WorkerPool, name: str) -> None:
    """Oracle: the error contract (type and text on every rank, under 10 s with a 30 s
    process-group timeout; for the rank that left, PeerIdleError at the scaled idle timeout
    after a warning); unused_params also checks the reference and torch."""
    world2.run(run_case, name, timeout=60)
