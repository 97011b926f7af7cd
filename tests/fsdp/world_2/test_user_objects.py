"""What users hold of a sharded model, and what they do with it, on 2 ranks.

Oracle: *compatibility*. Every line of the catalogue in ``tests/fsdp/_user_objects.py`` (state
dicts, DCP state dicts, optimizer state, one parameter, its local shard, its gradient, an
optimizer state tensor; times ``torch.save`` / ``torch.load``, ``copy.deepcopy``, pickle,
``load_state_dict``, ``set_model_state_dict``, DCP, storage sizes, a resumed run) runs with
torch's ``fully_shard`` and ours on identically seeded models: same outcome, and where it
works, bitwise the same result and a round trip that gives back the originals. One spawned body
per configuration; the failure lists every broken line.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests._dist import WorkerPool
from tests.fsdp._models import TinyGPT
from tests.fsdp._user_objects import (
    OURS,
    Config,
    Engine,
    Row,
    Subject,
    assert_catalogue,
    fsdp_subject,
    run_catalogue,
)

# torch's replicate on the FSDP engine (the oracle of the replicate configuration).
TORCH_REPLICATE = "torch.distributed._composable.replicate_with_fsdp"
HAS_TORCH_REPLICATE = importlib.util.find_spec(TORCH_REPLICATE) is not None


def _replicate_subject(engine: Engine) -> Subject:
    """``replicate`` on the MLP's projections and root (``shard_blocks``), each engine's."""
    from shardweave.replicate import replicate

    api = replicate if engine is OURS else importlib.import_module(TORCH_REPLICATE).replicate
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return fsdp_subject(engine, "mlp", "out_proj.bias", apply=api, mesh=mesh)


def _one_block_gpt(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(layers=1)


CONFIGS = {
    c.name: c
    for c in (
        # MLP: odd widths, rank 1 holds empty shards of ``head``. The single parameter of each
        # configuration is one that is not first in its group (see GRADS_BEYOND_TORCH).
        Config("fp32", lambda e: fsdp_subject(e, "mlp", "head.bias")),
        # TinyGPT: tied weights (one storage under two keys), 13 and 25 rows (uneven); one block
        # is enough and keeps it fast.
        Config(
            "fp32 tied weights",
            lambda e: fsdp_subject(e, "gpt", "layers.0.fc1.weight", make=_one_block_gpt),
        ),
        Config(
            "bf16 params, fp32 reduce",
            lambda e: fsdp_subject(e, "mlp", "in_proj.bias", mp=True),
        ),
        # On a CPU device the offload's host copy of a gradient is a no-op: torch's gradients
        # stay views into the reduce-scatter output here (with an accelerator they would not).
        Config("CPU offload", lambda e: fsdp_subject(e, "mlp", "out_proj.bias", offload=True)),
        # Whole-model objects are taken after an eval forward that leaves the parameters
        # unsharded: the state-dict hooks must reshard first.
        Config(
            "reshard_after_forward=False",
            lambda e: fsdp_subject(
                e, "mlp", "in_proj.bias", reshard_after_forward=False, eval_forward=True
            ),
        ),
        Config("replicate", _replicate_subject),
    )
}


def catalogue_body(rank: int, world: int, config: str) -> list[Row]:
    return run_catalogue(CONFIGS[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_user_objects_behave_as_torch(world2: WorkerPool, config: str) -> None:
    """Oracle: compatibility (torch's fully_shard / replicate, same seeds; outcomes pinned per
    line; bitwise results)."""
    if config == "replicate" and not HAS_TORCH_REPLICATE:
        pytest.skip(f"this torch has no {TORCH_REPLICATE} (the oracle of replicate)")
    assert_catalogue(config, world2.run(catalogue_body, config))
