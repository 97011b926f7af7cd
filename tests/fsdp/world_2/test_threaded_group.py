"""A process group whose ``Work.wait`` takes no timeout: torch's threaded in-process group,
which torch's own FSDP2 tests and many users' unit tests run on.

Oracle: *compatibility*. Two threads train per-block ``fully_shard`` models (ours and torch's,
same seed, same batches) for two steps; the gradients are bitwise torch's. The threads run in a
subprocess: the threaded group replaces the default process group of the process it runs in.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def threaded_body() -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.testing._internal.common_distributed import spawn_threads_and_init_comms

    from shardweave.fsdp import fully_shard

    @spawn_threads_and_init_comms(world_size=2)  # type: ignore[untyped-decorator]
    def run(_: object) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        ref = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        ref.load_state_dict(model.state_dict())
        for ours, theirs in zip(model, ref, strict=True):
            fully_shard(ours)
            torch_fully_shard(theirs)
        fully_shard(model)
        torch_fully_shard(ref)
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            model(x).sum().backward()
            ref(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad.to_local(), q.grad.to_local())  # type: ignore[union-attr]
        print(f"rank {dist.get_rank()} ok", flush=True)

    run(None)


def test_threaded_process_group_trains_like_torch() -> None:
    """Compatibility: the two-thread repro of issue 18 (``RuntimeError: FutureWrappingWork::
    wait() with finite timeout not implemented`` before): trains, gradients bitwise torch's."""
    code = "from tests.fsdp.world_2.test_threaded_group import threaded_body; threaded_body()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "rank 0 ok" in output and "rank 1 ok" in output, output
