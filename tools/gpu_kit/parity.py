"""``parity``: world size 1 on NCCL (gloo on CPU), shardweave against torch's ``fully_shard`` on
the same model and batches, each case of ``PARITY_CASES``: losses, shards and grads bitwise."""

from __future__ import annotations

from typing import Any

from ._common import init_world1
from ._training import apply_engine, compare, make_model, train

# ``cpu_batch``: the loop hands over CPU batches (the root moves them, as torch's does);
# ``offload_hooks`` also compares the full state dict gathered from the offloaded shards.
PARITY_CASES = ("fsdp", "cpu_batch", "bf16", "offload_hooks", "replicate", "hsdp_1x1")


def section_parity(device_type: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    init_world1(device_type)
    device = torch.device(device_type)
    results: dict[str, Any] = {}
    try:
        for case in PARITY_CASES:
            runs = {}
            for engine in ("torch", "shardweave"):
                model = make_model(64, 3, device)
                apply_engine(engine, model, case, device_type)
                runs[engine] = train(model, case, device, steps=3)
            results[case] = compare(runs["shardweave"], runs["torch"])
    finally:
        dist.destroy_process_group()
    return results
