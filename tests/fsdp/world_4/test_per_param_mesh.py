"""``shard_placement_fn`` returning ``ShardPlacementResult``: some parameters (mixture-of-experts
experts) sharded on another mesh than the rest of their module.

Oracle: *compatibility* (torch's fully_shard with the same per-parameter meshes: same groups,
placements, meshes, local shards, losses and grads, bitwise, over a few SGD steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo as TorchMeshInfo

try:  # the oracle: torch's own ShardPlacementResult, which torch 2.11 and 2.12 do not have
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as TorchResult
except ImportError:
    pytest.skip(
        f"torch {torch.__version__} has no ShardPlacementResult to compare with",
        allow_module_level=True,
    )
from torch.distributed.tensor import Shard

from shardweave.fsdp import ShardPlacementResult, fully_shard
from shardweave.fsdp.core._state import get_fsdp_state
from shardweave.mesh import FSDPMeshInfo
from tests._dist import WorkerPool
from tests.fsdp._oracle import assert_same_as_torch


class MoELayer(nn.Module):
    """A dense projection and two "experts" (their weights stacked on dim 0)."""

    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dense(x))
        return h + torch.einsum("bd,edf->bf", h, self.experts)


def _build(api: Callable[..., Any], placement_fn: Callable[[nn.Parameter], Any]) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(MoELayer(), MoELayer())
    for layer in model:
        api(layer, shard_placement_fn=placement_fn)
    api(model)
    return model


def per_param_mesh(rank: int, world: int, torch_objects: bool = False) -> None:
    # Experts are sharded 2-way inside each half of the ranks (an expert-parallel FSDP mesh);
    # everything else 4-way over the default mesh.
    ep_mesh: DeviceMesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
    ours_info = FSDPMeshInfo(ep_mesh["efsdp"], shard_mesh_dim=0)
    torch_info = TorchMeshInfo(ep_mesh["efsdp"], shard_mesh_dim=0)

    def ours_fn(p: nn.Parameter) -> Any:
        return ShardPlacementResult(Shard(1), ours_info) if p.ndim == 3 else None

    def torch_fn(p: nn.Parameter) -> Any:
        return TorchResult(Shard(1), torch_info) if p.ndim == 3 else None

    # torch_objects: our fully_shard is handed torch's ShardPlacementResult and FSDPMeshInfo
    # (torchtitan's expert parallelism does this), and converts them to its own
    model = _build(fully_shard, torch_fn if torch_objects else ours_fn)
    tmodel = _build(torch_fully_shard, torch_fn)
    state = get_fsdp_state(model[0])
    assert state is not None and len(state._fsdp_param_groups) == 2, state
    experts = model[0].experts
    assert experts.placements == (Shard(1),) and experts.device_mesh.size() == 2  # type: ignore[attr-defined]
    assert model[0].dense.weight.device_mesh.size() == 4  # type: ignore[attr-defined]
    assert_same_as_torch(model, tmodel, "init")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, tmodel)]
    for step in range(3):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        losses = []
        for m in (model, tmodel):
            loss = m(x).pow(2).sum()
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
        assert_same_as_torch(model, tmodel, f"step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_same_as_torch(model, tmodel, "end")


def test_experts_on_their_own_mesh_match_torch(world4: WorkerPool) -> None:
    """Oracle: compatibility (torch's fully_shard with the same ShardPlacementResult meshes)."""
    world4.run(per_param_mesh)


def test_torch_placement_results_are_accepted(world4: WorkerPool) -> None:
    """Oracle: compatibility. torch's own ``ShardPlacementResult`` and ``FSDPMeshInfo`` (as
    torchtitan's expert parallelism passes them) given to our fully_shard: converted field by
    field, one group per mesh, the same as torch's fully_shard with them."""
    world4.run(per_param_mesh, True)
