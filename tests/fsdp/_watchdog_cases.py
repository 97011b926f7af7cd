"""Fault cases for the watchdog (issue 16), shared by the world-2 and world-4 tests.

Each case builds a fresh gloo group with a 30 s timeout (a case that abandons a collective
leaves its group unusable, as in a real job), runs one healthy step, then injects a fault on the
last rank with the *default* settings except the stall threshold (2 s here, so the suite stays
fast; one test keeps the real default of 10 s). Every rank still in the step must raise the
named error type with a text naming the faulty rank and the module, within the threshold plus
a few seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from shardweave.fsdp import CollectiveMismatchError, PeerFailureError, set_stall_timeout
from shardweave.fsdp._watchdog import DEFAULT_STALL_S
from tests.fsdp._faults import _build, _fresh_mesh, _step

THRESHOLD_S = 2.0
SLACK_S = 5.0  # the target: an error within the stall threshold + 5 s
# The fault cases every world size runs (functions below, by name).
FAULTS = (
    "raises_in_forward",
    "raises_in_backward",
    "raises_in_optimizer",
    "leaves_the_step",
    "skips_a_module",
)


def _run(
    rank: int,
    world: int,
    fault: Callable[[torch.nn.Module, int], None],
    expect: tuple[type[BaseException], str],
    key: str,
    threshold: float = THRESHOLD_S,
) -> float:
    """Healthy step, then ``fault`` on the last rank (the others run a normal step); rank 0
    sets ``key`` when done, releasing a faulty rank that waits outside the engine."""
    faulty = world - 1
    set_stall_timeout(threshold)
    try:
        net = _build(_fresh_mesh())
        _step(net, rank, 0)
        start = time.monotonic()
        if rank == faulty:
            fault(net, rank)
            return 0.0
        exc_type, pattern = expect
        with pytest.raises(exc_type, match=pattern) as info:
            _step(net, rank, 1)
            _step(net, rank, 2)
        elapsed = time.monotonic() - start
        assert f"rank {faulty}" in str(info.value), str(info.value)
        assert elapsed < threshold + SLACK_S, f"{elapsed:.1f} s: {info.value}"
        return elapsed
    finally:
        set_stall_timeout(DEFAULT_STALL_S)
        if rank == 0:
            dist.distributed_c10d._get_default_store().set(key, "1")


def _leave_and_wait(key: str) -> Callable[[torch.nn.Module, int], None]:
    """The faulty rank stops training and waits outside the engine until the others are done."""

    def fault(net: torch.nn.Module, rank: int) -> None:
        # Short checks, not store.wait: a store client blocked in wait() would also block
        # this rank's watchdog, which must answer the peers' stall diagnosis.
        store = dist.distributed_c10d._get_default_store()
        deadline = time.monotonic() + 60
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.05)

    return fault


def raises_in_forward(rank: int, world: int) -> float:
    """The last rank raises in block 1's forward: published by the engine's forward hook, so
    the others raise PeerFailureError at once (no stall threshold needed)."""
    key = f"watchdog/forward/{world}"

    def fault(net: torch.nn.Module, r: int) -> None:
        net.blocks[1].fail_on = (r, 2)  # type: ignore[index,union-attr]
        with pytest.raises(ValueError, match="boom in block"):
            _step(net, r, 1)
        _leave_and_wait(key)(net, r)

    return _run(rank, world, fault, (PeerFailureError, r"raised ValueError: boom in block"), key)


def raises_in_backward(rank: int, world: int) -> float:
    """The last rank raises inside backward (a gradient hook), caught by its own code."""
    key = f"watchdog/backward/{world}"

    def fault(net: torch.nn.Module, r: int) -> None:
        x = torch.randn(4, 16)
        out = net(x)
        out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("boom in backward")))
        with pytest.raises(ValueError, match="boom in backward"):
            out.sum().backward()
        _leave_and_wait(key)(net, r)

    return _run(rank, world, fault, (CollectiveMismatchError, r"rank \d+ has issued no"), key)


def raises_in_optimizer(rank: int, world: int) -> float:
    """The last rank finishes backward, then its optimizer step raises; it leaves the loop."""
    key = f"watchdog/optimizer/{world}"

    def fault(net: torch.nn.Module, r: int) -> None:
        _step(net, r, 1)
        with pytest.raises(RuntimeError, match="optimizer"):
            raise RuntimeError("optimizer step failed (a NaN check, say)")
        _leave_and_wait(key)(net, r)

    return _run(rank, world, fault, (CollectiveMismatchError, r"step 2"), key)


def leaves_the_step(rank: int, world: int, threshold: float = THRESHOLD_S) -> float:
    """The last rank returns early (before step 1) and waits elsewhere."""
    key = f"watchdog/leave/{world}/{threshold}"
    return _run(
        rank,
        world,
        _leave_and_wait(key),
        (CollectiveMismatchError, r"(?s)group 'blocks\.0'.*rank \d+ has issued no"),
        key,
        threshold,
    )


def skips_a_module(rank: int, world: int) -> float:
    """The last rank skips block 1 (a data-dependent branch) in step 1, then waits."""
    key = f"watchdog/skip/{world}"

    def fault(net: torch.nn.Module, r: int) -> None:
        net.skip_on = (r, 1)  # type: ignore[assignment]
        # It may learn of the mismatch itself; either way it then leaves.
        with contextlib.suppress(CollectiveMismatchError, PeerFailureError, RuntimeError):
            _step(net, r, 1)
        _leave_and_wait(key)(net, r)

    return _run(rank, world, fault, (CollectiveMismatchError, r"blocks\.\d"), key)


def slow_rank(rank: int, world: int) -> float:
    """The last rank is 3 s late to step 1 (a data-loader stall): default settings, no error."""
    set_stall_timeout(DEFAULT_STALL_S)
    net = _build(_fresh_mesh())
    _step(net, rank, 0)
    if rank == world - 1:
        time.sleep(3.0)  # the fault under test: a slow rank, not a synchronization
    start = time.monotonic()
    _step(net, rank, 1)
    return time.monotonic() - start
