"""The watchdog on the test accelerator (``stream_sanitizer(accelerator=True)``): the engine takes
its accelerator branches, collectives land only when a stream ordered after them runs, and the
host runs ahead of them. Oracles: the run without the pause (the same losses, bitwise) and the
contract: a rank whose peer pauses between steps waits in a collective its host has long since
"waited" (a stream wait), which the watchdog still sees pending by its event, warns about,
naming the paused rank, and never calls an error.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from tests._dist import WorkerPool
from tests._dist.stream_sanitizer import stream_sanitizer
from tests.fsdp._faults import _build, _fresh_mesh
from tests.fsdp._watchdog_cases import PAUSE_S, idle_warnings, scaled_thresholds, watchdog_log


def _train(rank: int, pause: bool) -> list[float]:
    losses = []
    with stream_sanitizer(accelerator=True):
        net = _build(_fresh_mesh())
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = net(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if pause and rank == 1 and step == 1:
                time.sleep(PAUSE_S)  # the pause under test: rank 1 writes a checkpoint
    return losses


def accelerator_pause(rank: int, world: int) -> dict[str, Any]:
    with scaled_thresholds():
        plain = _train(rank, pause=False)
        with watchdog_log() as log:
            paused = _train(rank, pause=True)
        dist.barrier()
    return {
        "plain": plain,
        "paused": paused,
        "warnings": [text for _, text in idle_warnings(log, 1)],
        "errors": [text for _, level, text in log if level >= logging.ERROR],
    }


def test_host_running_ahead_is_not_an_error(world2: WorkerPool) -> None:
    """Rank 1 pauses 3 x the stall threshold between steps on the test accelerator: rank 0's
    all-gather stays pending by its event (its host already "waited" it), rank 0 warns naming
    rank 1, nobody errs, and the losses equal the unpaused run's."""
    results = world2.run(accelerator_pause, timeout=90.0)
    for rank, got in enumerate(results):
        assert isinstance(got, dict)
        assert got["paused"] == got["plain"], (rank, got)
        assert not got["errors"], (rank, got["errors"])
    warnings = results[0]["warnings"]  # type: ignore[index]
    assert any("between steps, after step 2's last" in w for w in warnings), warnings
