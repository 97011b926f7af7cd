"""Training parity at 4 ranks: more padding, empty shards, and an int reshard_after_forward
(and the process groups it builds)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import fully_shard
from shardweave.fsdp.core._state import get_fsdp_state
from tests._dist import WorkerPool
from tests.fsdp._training import train_parity

CONFIGS: list[dict[str, Any]] = [
    {"kind": "mlp", "optim": "adamw"},
    {"kind": "gpt"},
    {"kind": "gpt", "reshard_after_forward": 2},
    {"kind": "gpt", "micro": 2, "reshard_after_forward": False},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_train_parity(world4: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracles: reference and compatibility (torch's fully_shard)."""
    world4.run(train_parity, cfg)


def post_forward_groups(rank: int, world: int) -> None:
    def post_forward_group(module: nn.Module) -> dist.ProcessGroup:
        state = get_fsdp_state(module)
        assert state is not None
        info = state._fsdp_param_groups[0].post_forward_mesh_info
        assert info is not None
        return info.shard_process_group

    def built(shard: Any, mesh: Any, k: int, layers: int = 3) -> tuple[nn.Module, int]:
        before = len(dist.distributed_c10d._world.pg_map)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
        for layer in model:
            shard(layer, mesh=mesh, reshard_after_forward=k)
        return model, len(dist.distributed_c10d._world.pg_map) - before

    mesh = init_device_mesh("cpu", (world,))
    _, theirs = built(torch_fully_shard, mesh, 2)
    model, ours = built(fully_shard, mesh, 2)
    # torch: a (2, 2) mesh's two dims per layer; ours: one post-forward mesh for the whole model
    assert theirs == 3 * ours > 0, (theirs, ours)
    a, b, c = (post_forward_group(layer) for layer in model)
    assert a is b is c
    assert dist.get_process_group_ranks(a) == [rank // 2 * 2, rank // 2 * 2 + 1]
    # The same mesh and factor later: the same groups; another mesh object: its own.
    again, more = built(fully_shard, mesh, 2, layers=1)
    assert more == 0 and post_forward_group(again[0]) is a
    other, more = built(fully_shard, init_device_mesh("cpu", (world,)), 2, layers=1)
    assert more == ours and post_forward_group(other[0]) is not a
    x = torch.randn(2, 8)
    model(x).sum().backward()  # the shared groups work: forward reshards to them, backward
    assert all(p.grad is not None for p in model.parameters())  # all-gathers from them


def test_one_post_forward_mesh_per_mesh_and_factor(world4: WorkerPool) -> None:
    """Oracle: torch's fully_shard builds new process groups at every call with an int
    reshard_after_forward; ours builds them once per mesh and factor (fewer communicators,
    the training the same: test_train_parity's reshard_after_forward=2 case)."""
    world4.run(post_forward_groups)
