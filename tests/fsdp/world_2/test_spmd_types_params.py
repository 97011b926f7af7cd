"""Plain parameters annotated by the ``spmd_types`` package, sharded with ``dp_mesh_dims``
(torch 2.14+; torchtitan's default backend does this for every model).

Oracle: *compatibility*. torch's ``fully_shard`` on the same annotated model and batches:
placements, local shards, losses and gradients bitwise equal over a few SGD steps, the
unsharded parameters plain tensors on both; an annotation other than ``R`` on the
data-parallel axis is a ``ValueError`` on both.

On torch older than 2.14 both engines reject these parameters (``SPMD_TYPES_PARAMS``). Skips
where ``spmd_types`` is not installed (CI's venv); ``nox -s compat`` runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import DataParallelMeshDims, fully_shard
from shardweave.fsdp._torch_compat import SPMD_TYPES_PARAMS
from tests._dist import WorkerPool
from tests.fsdp._models import loss_fn, make_batch, make_model
from tests.fsdp._oracle import assert_same_as_torch

spmd = pytest.importorskip("spmd_types")
needs_214 = pytest.mark.skipif(
    not SPMD_TYPES_PARAMS,
    reason=f"torch {torch.__version__} rejects spmd_types parameters (accepted from 2.14)",
)


def _annotated(mesh: Any, axis_type: Any) -> nn.Module:
    model = make_model("gpt")
    for p in model.parameters():
        spmd.assert_type(p, {mesh.get_group("dp"): axis_type})
    return model


def _shard(api: Callable[..., Any], model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    dims = DataParallelMeshDims(shard="dp") if api is fully_shard else TorchDims(shard="dp")
    for block in model.layers:  # type: ignore[union-attr]
        api(block, mesh=mesh, dp_mesh_dims=dims)
    api(model, mesh=mesh, dp_mesh_dims=dims)
    return model


def annotated_parity(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ours = _shard(fully_shard, _annotated(mesh, spmd.R), mesh)
    theirs = _shard(torch_fully_shard, _annotated(mesh, spmd.R), mesh)
    assert_same_as_torch(ours, theirs, "init")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        idx = make_batch("gpt", 10 * step + rank)
        losses = []
        for m in (ours, theirs):
            out = m(idx)
            loss = loss_fn("gpt", out, idx)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
        assert_same_as_torch(ours, theirs, f"step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # the module computes on plain tensors, as it was written for (the root's own parameters:
    # unshard() gathers the root's group only)
    for m in (ours, theirs):
        m.unshard()  # type: ignore[operator]
        own = [p for name, p in m.named_parameters() if not name.startswith("layers.")]
        assert own and not any(isinstance(p, DTensor) for p in own), [type(p) for p in own]
        m.reshard()  # type: ignore[operator]


def rejected_before_214(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for api in (fully_shard, torch_fully_shard):
        with pytest.raises(ValueError, match="DTensor"):
            _shard(api, _annotated(mesh, spmd.R), mesh)


def non_replicated_dp_axis(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for api in (fully_shard, torch_fully_shard):
        with pytest.raises(ValueError, match=r"R\b|spmd.R"):
            _shard(api, _annotated(mesh, spmd.S(0)), mesh)


@needs_214
def test_annotated_plain_params_match_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility (torch's fully_shard on the same annotated model, bitwise)."""
    world2.run(annotated_parity)


@needs_214
def test_dp_axis_must_be_annotated_r(world2: WorkerPool) -> None:
    """Oracle: compatibility (torch raises ValueError too)."""
    world2.run(non_replicated_dp_axis)


@pytest.mark.skipif(SPMD_TYPES_PARAMS, reason="this torch accepts spmd_types parameters")
def test_older_torch_rejects_them(world2: WorkerPool) -> None:
    """Oracle: compatibility (torch 2.11-2.13 raise ValueError: parameters must be DTensors)."""
    world2.run(rejected_before_214)
