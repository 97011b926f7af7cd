"""What users hold of an FSDP x tensor-parallel model, and what they do with it: the user-objects
catalogue (``tests/fsdp/_user_objects.py``) on a 2x2 (dp, tp) mesh.

Oracle: *compatibility*: torch's ``fully_shard`` on the same ``parallelize_module``'d copy (its
parameters are DTensors on the 2-D mesh, some with ``_StridedShard``); same outcome per line,
bitwise results where it works. One spawned body.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardweave.extensions import dtensor_kind
from shardweave.mesh.extension_points import PARAM_KINDS
from tests._dist import WorkerPool
from tests.extensions._tp_models import build_tp_stack
from tests.fsdp._user_objects import Config, Engine, Row, Subject, assert_catalogue, run_catalogue


def _tp_subject(engine: Engine) -> Subject:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    def build(seed: int) -> nn.Module:
        model = build_tp_stack(engine.fully_shard, mesh)  # seeds 0 itself
        if seed:
            # Other values, the same on every rank for the same shapes, so replicated shards
            # (the head on tp) stay replicated.
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    local = p.to_local()  # type: ignore[attr-defined]
                    local.copy_(torch.randn_like(local))
        return model

    def loss(model: nn.Module, i: int) -> torch.Tensor:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + dp_rank))
        out: torch.Tensor = model(x)
        return out.float().sum()

    # Not first in block 0's group; placements (Shard(0), Shard(1)) on (dp, tp).
    return Subject(build, loss, "blocks.0.out_proj.weight")


CONFIG = Config("FSDP x TP 2x2", _tp_subject)


def catalogue_body(rank: int, world: int) -> list[Row]:
    # Installed, shardweave-extensions registers the DTensor kind as an entry point; from a
    # source checkout (PYTHONPATH) nothing declares it, so register it the same way.
    if PARAM_KINDS.find_for_type(DTensor) is None:
        PARAM_KINDS.register("dtensor", dtensor_kind())
    return run_catalogue(CONFIG)


def test_user_objects_behave_as_torch(world4: WorkerPool) -> None:
    """Oracle: compatibility (torch's fully_shard on the same TP model, same seeds; outcomes
    pinned per line; bitwise results)."""
    assert_catalogue(CONFIG.name, world4.run(catalogue_body))
