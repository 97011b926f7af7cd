"""Fault cases for the watchdog (issues 16 and 27), shared by the world-2 and world-4 tests.

Each case builds a fresh gloo group with a 30 s timeout (a case that abandons a collective
leaves its group unusable, as in a real job), runs one healthy step, then injects a fault on the
last rank. Settings: the defaults with both thresholds scaled down together by 5 so the suite
stays fast (stall threshold 10 s -> 2 s; idle timeout, by default the group's 30 s -> 6 s); one
test keeps the real defaults. Every rank still in the step must raise the named error type
with a text naming the faulty rank and the module: for ranks at different collectives within
the stall threshold plus 5 s; for a rank that left the loop and stays alive, after a warning
within the stall threshold plus 5 s, at the idle timeout.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from shardweave.fsdp import (
    CollectiveMismatchError,
    PeerFailureError,
    PeerIdleError,
    set_idle_timeout,
    set_stall_timeout,
)
from shardweave.fsdp._watchdog import DEFAULT_STALL_S
from tests.fsdp._faults import _build, _fresh_mesh, _step

THRESHOLD_S = 2.0
IDLE_S = 6.0  # the fresh group's 30 s timeout, scaled as the threshold (10 s -> 2 s)
SLACK_S = 5.0  # the target: an error (or warning) within the stall threshold + 5 s


@contextlib.contextmanager
def idle_warnings() -> Iterator[list[tuple[float, str]]]:
    """(time, text) of every warning the watchdog logs inside the block."""
    found: list[tuple[float, str]] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                found.append((time.monotonic(), record.getMessage()))

    handler = Recorder()
    logger = logging.getLogger("shardweave.fsdp")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


# The fault cases every world size runs (functions below, by name).
FAULTS = (
    "raises_in_forward",
    "raises_in_backward",
    "raises_in_optimizer",
    "leaves_the_step",
    "skips_a_module",
)
# The faults where the faulty rank stays alive outside the loop: PeerIdleError at the idle
# timeout (the others are errors within the stall threshold + 5 s).
IDLE_FAULTS = ("raises_in_backward", "raises_in_optimizer", "leaves_the_step")


def _run(
    rank: int,
    world: int,
    fault: Callable[[torch.nn.Module, int], None],
    expect: tuple[type[BaseException], str],
    key: str,
    threshold: float | None = THRESHOLD_S,
    idle: float | None = IDLE_S,
) -> float:
    """Healthy step, then ``fault`` on the last rank (the others run a normal step); rank 0
    sets ``key`` when done, releasing a faulty rank that waits outside the engine.

    ``threshold`` / ``idle``: the stall threshold and idle timeout (None: the defaults). A
    ``PeerIdleError`` must come at the idle timeout, after a warning naming the rank within
    the threshold + 5 s; any other error within the threshold + 5 s."""
    faulty = world - 1
    stall = DEFAULT_STALL_S if threshold is None else threshold
    limit = 30.0 if idle is None else idle  # None: the fresh group's timeout
    set_stall_timeout(stall)
    set_idle_timeout(idle)
    try:
        net = _build(_fresh_mesh())
        _step(net, rank, 0)
        start = time.monotonic()
        if rank == faulty:
            fault(net, rank)
            return 0.0
        exc_type, pattern = expect
        with idle_warnings() as warned, pytest.raises(exc_type, match=pattern) as info:
            _step(net, rank, 1)
            _step(net, rank, 2)
        elapsed = time.monotonic() - start
        assert f"rank {faulty}" in str(info.value), str(info.value)
        if exc_type is PeerIdleError:
            named = [t - start for t, text in warned if f"rank {faulty} has issued no" in text]
            assert named and named[0] < stall + SLACK_S, (named, warned)
            assert limit <= elapsed < limit + SLACK_S, f"{elapsed:.1f} s: {info.value}"
        else:
            assert elapsed < stall + SLACK_S, f"{elapsed:.1f} s: {info.value}"
        return elapsed
    finally:
        set_stall_timeout(DEFAULT_STALL_S)
        set_idle_timeout(None)
        if rank == 0:
            dist.distributed_c10d._get_default_store().set(key, "1")


def _leave_and_wait(key: str) -> Callable[[torch.nn.Module, int], None]:
    """The faulty rank stops training and waits outside the engine until the others are done."""

    def fault(net: torch.nn.Module, rank: int) -> None:
        # Short checks, not store.wait: a store client blocked in wait() would also block
        # this rank's watchdog, which must answer the peers' stall diagnosis.
        store = dist.distributed_c10d._get_default_store()
        deadline = time.monotonic() + 80
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
    """The last rank raises inside backward (a gradient hook), caught by its own code, and
    stays out of the loop: alive and idle, so an error at the idle timeout."""
    key = f"watchdog/backward/{world}"

    def fault(net: torch.nn.Module, r: int) -> None:
        x = torch.randn(4, 16)
        out = net(x)
        out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("boom in backward")))
        with pytest.raises(ValueError, match="boom in backward"):
            out.sum().backward()
        _leave_and_wait(key)(net, r)

    return _run(rank, world, fault, (PeerIdleError, r"rank \d+ has issued no"), key)


def raises_in_optimizer(rank: int, world: int) -> float:
    """The last rank finishes backward, then its optimizer step raises; it leaves the loop
    and stays alive: an error at the idle timeout."""
    key = f"watchdog/optimizer/{world}"

    def fault(net: torch.nn.Module, r: int) -> None:
        _step(net, r, 1)
        with pytest.raises(RuntimeError, match="optimizer"):
            raise RuntimeError("optimizer step failed (a NaN check, say)")
        _leave_and_wait(key)(net, r)

    return _run(rank, world, fault, (PeerIdleError, r"step 2"), key)


def leaves_the_step(rank: int, world: int, defaults: bool = False) -> float:
    """The last rank returns early (before step 1) and waits elsewhere, alive: a warning
    within the stall threshold + 5 s, an error at the idle timeout (``defaults``: 10 s and
    the group's 30 s, else both scaled down)."""
    key = f"watchdog/leave/{world}/{defaults}"
    return _run(
        rank,
        world,
        _leave_and_wait(key),
        (PeerIdleError, r"(?s)group 'blocks\.0'.*rank \d+ has issued no"),
        key,
        None if defaults else THRESHOLD_S,
        None if defaults else IDLE_S,
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


# Healthy pauses (issue 27): where one rank pauses, and which rank. Each pause is 2.5 x the
# stall threshold and below the idle timeout (both scaled down together, as in _run).
PAUSE_S = 2.5 * THRESHOLD_S
PAUSES = {
    "checkpoint-between-steps": "rank 0 writes a checkpoint or evaluates between steps",
    "before-optimizer-step": "host work between backward() and optimizer.step()",
    "between-forward-and-backward": "host work between forward and backward",
    "slow-first-forward": "a slow first compile: the first forward starts late",
    "data-loader-stall": "the data loader stalls before a step",
}


def _pausing_rank(case: str, world: int) -> int:
    return 0 if case == "checkpoint-between-steps" else world - 1


def _train_with_pause(rank: int, world: int, case: str | None) -> list[float]:
    """Three SGD steps on a fresh group; ``case`` (None: no pause) pauses one rank."""
    net = _build(_fresh_mesh())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pauses = rank == (_pausing_rank(case, world) if case else -1)

    def pause(where: str, step: int) -> None:
        at = {
            "checkpoint-between-steps": ("after-step", 1),
            "before-optimizer-step": ("before-optimizer", 1),
            "between-forward-and-backward": ("after-forward", 1),
            "slow-first-forward": ("before-forward", 0),
            "data-loader-stall": ("before-forward", 2),
        }
        if pauses and case is not None and at[case] == (where, step):
            time.sleep(PAUSE_S)  # the pause under test: outside the engine, no collective

    losses = []
    for step in range(3):
        pause("before-forward", step)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = net(x).sum()
        pause("after-forward", step)
        loss.backward()
        pause("before-optimizer", step)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        pause("after-step", step)
    return losses


def healthy_pause(rank: int, world: int, case: str) -> dict[str, object]:
    """Body: the same three steps without, then with, one rank pausing; no error, the same
    losses, and the waiting ranks' warnings (scaled thresholds, see ``_run``)."""
    set_stall_timeout(THRESHOLD_S)
    set_idle_timeout(IDLE_S)
    try:
        want = _train_with_pause(rank, world, None)
        with idle_warnings() as warned:
            got = _train_with_pause(rank, world, case)
    finally:
        set_stall_timeout(DEFAULT_STALL_S)
        set_idle_timeout(None)
    assert got == want, (case, got, want)
    return {"pausing": _pausing_rank(case, world), "warnings": [text for _, text in warned]}


def check_pause(results: list[object], case: str) -> None:
    """Every waiting rank warned, naming the pausing rank (except where the pause ends
    before the watchdog watches: the first forward, see the case)."""
    for rank, result in enumerate(results):
        assert isinstance(result, dict), result
        pausing = result["pausing"]
        warnings = result["warnings"]
        assert isinstance(warnings, list)
        if rank == pausing or case == "slow-first-forward":
            continue
        assert any(f"rank {pausing} has issued no" in w for w in warnings), (rank, warnings)
