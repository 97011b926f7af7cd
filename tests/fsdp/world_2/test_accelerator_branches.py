"""The engine's accelerator branches, run on CPU by the test accelerator of the stream sanitizer.

Under ``stream_sanitizer(accelerator=True)`` the engine takes the branches it takes on CUDA
(collectives issued with ``async_op=False`` inside their stream context, no host wait on a
Work, every reduction run to its end at once, buffers released by stream order), while every
collective behaves as on a GPU: it lands in its output only when a stream ordered after it
runs. Oracle: the same scenario on the CPU branches without the sanitizer gives bitwise the
same losses, gradients and parameters (and the CPU branches are bitwise equal to torch's
``fully_shard`` in ``test_policies_parity.py`` / ``test_training.py``); torch's stream-race
checker finds no race and the caching-allocator model no unsafe reuse.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import WorkerPool
from tests._dist.stream_sanitizer import stream_sanitizer
from tests.fsdp._models import loss_fn, make_batch, make_model
from tests.fsdp._stream_order import (
    KEEP_ALIVE_MUTATIONS,
    WAIT_MUTATIONS,
    check_watched,
    mutated,
    sanitized_vs_plain,
    torch_lacks,
    wrap_scenario,
)

BF16_REDUCE = {"mp": True, "reduce_dtype": torch.bfloat16}

SCENARIOS: dict[str, dict[str, Any]] = {
    "per-block-and-root": {},
    "mixed-precision-fp32-reduce": {"mp": True},
    "mixed-precision-bf16-reduce": BF16_REDUCE,
    "reshard-after-forward-false": {"reshard_after_forward": False},
    "replicate": {"replicate": True},
    "replicate-bf16-reduce": {"replicate": True, **BF16_REDUCE},
    # Caps of 2000 bytes: both blocks (1506 bf16 bytes each) in one bucket, the root in another.
    "replicate-two-group-bucket": {"replicate": True, **BF16_REDUCE, "bucket_bytes": 2000},
    "hsdp-one-shard-rank-bf16-reduce": {"hsdp": True, **BF16_REDUCE},
    "cpu-offload": {"offload": True},
    "explicit-prefetch": {"prefetch": True},
    "implicit-prefetch": {"implicit_prefetch": True},
    "async-unshard": {"async_unshard": True},
    "grad-accumulation": {"micro": 2},
    "all-reduce-hook-on-user-stream": {"hook": "stream"},
    "post-optim-event": {"post_optim_event": True},
    "two-reduce-scatter-buffers": {"max_rs_buffers": 2},
    "activation-checkpointing": {"checkpoint": True},
}


@pytest.mark.parametrize("cfg", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_accelerator_branches_match_cpu_branches(world2: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracle: the CPU branches' numbers, bitwise; no race, no unsafe reuse (2 steps)."""
    if reason := torch_lacks(cfg):
        pytest.skip(reason)
    check_watched(world2.run(sanitized_vs_plain, cfg, True), cfg)


# Each wait of Design note: stream ordering, and each keep-alive (``_stream_order``).
MUTATIONS = {**WAIT_MUTATIONS, **KEEP_ALIVE_MUTATIONS}


@pytest.mark.parametrize("case", list(MUTATIONS.values()), ids=list(MUTATIONS))
def test_removed_wait_or_keep_alive_is_reported(
    world2: WorkerPool, case: tuple[dict[str, Any], str, tuple[str, ...]]
) -> None:
    """Mutation test on the accelerator branches: each removal surfaces in the report.

    Oracle: the report names the unordered pair (or the unsafe reuse); the same scenario
    with every wait in place is clean (``test_accelerator_branches_match_cpu_branches``).
    """
    cfg, drop, names = case
    for result in world2.run(mutated, cfg, drop, True):
        assert isinstance(result, dict)
        assert result["dropped"], f"{drop} issued no wait: the mutation did nothing"
        races = result["races"]
        assert any(all(n in r for n in names) for r in races), races


def copy_in_order(rank: int, world: int) -> list[tuple[int, int]]:
    """Body: forward with explicit prefetch on the test accelerator; for every all-gather
    copy-in after the first, (how far its stream is ordered after the compute stream, the
    compute stream's position right after the previous group's copy-out)."""
    import shardweave.fsdp.core._param_group as group_module

    copy_in, copy_out = group_module.all_gather_copy_in, group_module.all_gather_copy_out
    seen: list[tuple[int, int]] = []
    last_copy_out = -1
    in_forward = False
    with stream_sanitizer(accelerator=True) as report:
        syncs, device = report.device.handler.syncs, report.device
        compute = device.current_stream().id

        def recording_copy_in(*args: Any, **kwargs: Any) -> Any:
            if in_forward and last_copy_out >= 0:
                ordered = syncs.current_sync_states[device.current_stream().id].get(compute, -1)
                seen.append((ordered, last_copy_out))
            return copy_in(*args, **kwargs)

        def recording_copy_out(*args: Any, **kwargs: Any) -> Any:
            nonlocal last_copy_out
            result = copy_out(*args, **kwargs)
            last_copy_out = syncs.current_sync_states[compute][compute]
            return result

        group_module.all_gather_copy_in = recording_copy_in
        group_module.all_gather_copy_out = recording_copy_out
        try:
            model = make_model("gpt")
            wrap_scenario(model, {"prefetch": True}, world)
            for step in range(2):
                batch = make_batch("gpt", 1000 * step + rank)
                in_forward, last_copy_out = True, -1
                loss = loss_fn("gpt", model(batch), batch)
                in_forward = False
                loss.backward()
        finally:
            group_module.all_gather_copy_in, group_module.all_gather_copy_out = copy_in, copy_out
    return seen


def test_copy_in_overlaps_the_previous_copy_out(world2: WorkerPool) -> None:
    """Each forward copy-in is issued without waiting for the previous group's copy-out, so
    the next layer's copy-in and all-gather overlap it (torch's FSDP2 waits only after its own
    copy-out). Oracle: the stream-race checker's vector clocks; the scenario's numbers and
    race-freedom are checked by ``test_accelerator_branches_match_cpu_branches``."""
    for seen in world2.run(copy_in_order):
        assert isinstance(seen, list) and len(seen) >= 4, seen
        assert all(ordered < copy_out for ordered, copy_out in seen), seen
