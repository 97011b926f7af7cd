"""A sharded model is freed once the user lets go of it, as with torch's ``fully_shard``.

The GPU kit's bench found every model wrapped by our ``fully_shard`` alive after ``del`` and
``gc.collect()`` (the module-to-state map held each state, and each state its modules): on a GPU
each training run in a process kept its parameters. Oracle: *compatibility*, torch's
``fully_shard`` and ``replicate`` on the same model are freed, and ours must be too.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool

try:
    from shardweave.replicate import replicate
except ImportError:  # the isolated(fsdp) session installs the fsdp package alone
    replicate = None

APIS: dict[str, Callable[..., Any] | None] = {
    "torch_fully_shard": torch_fully_shard,
    "fully_shard": fully_shard,
    "torch_replicate": torch_replicate,
    "replicate": replicate,
}


def freed_after_training(rank: int, world: int, api: str) -> tuple[bool, bool]:
    apply = APIS[api]
    assert apply is not None
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    if "fully_shard" in api:
        apply(model[0])
    apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    module, param = weakref.ref(model), weakref.ref(next(model.parameters()))
    del model, opt
    gc.collect()
    return module() is None, param() is None


@pytest.mark.parametrize("api", list(APIS))
def test_a_trained_model_is_freed(world1: WorkerPool, api: str) -> None:
    if APIS[api] is None:
        pytest.skip("shardweave-replicate is not installed (isolated fsdp session)")
    (result,) = world1.run(freed_after_training, api)
    assert result == (True, True), f"{api}: module freed, parameter freed = {result}"
