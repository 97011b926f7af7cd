"""examples/meta_init_checkpoint.py: meta-device init, then a full checkpoint loaded into shards."""

from __future__ import annotations

from pathlib import Path

import torch

from examples import meta_init_checkpoint as ex
from tests._dist import WorkerPool
from tests._dist.sync import barrier


def body(rank: int, world: int, path: str) -> None:
    ex.save_pretrained(path)
    model = ex.load_sharded(path)
    ref = ex.Model()  # the oracle: an unsharded model loading the same file
    ref.load_state_dict(torch.load(path, weights_only=True))
    x = torch.randn(3, ex.DIM, generator=torch.Generator().manual_seed(rank))
    assert torch.equal(model(x), ref(x))
    assert torch.equal(model.freqs, ref.freqs)  # type: ignore[arg-type]
    full = ex.get_full_state_dict(model)
    if rank == 0:
        saved = torch.load(path, weights_only=True)
        assert list(full) == list(saved)
        for key, value in saved.items():
            assert torch.equal(full[key], value), key
    else:
        assert full == {}
    barrier()


def test_meta_init_checkpoint(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracle: reference (an unsharded model loading the same file: bitwise equal outputs and
    recomputed non-persistent buffers); the full state dict gathered back equals the file."""
    world2.run(body, str(tmp_path / "pretrained.pt"))
