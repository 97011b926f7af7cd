"""What users hold of a sharded model, and what they do with it, on 4 ranks: HSDP and a
post-forward reshard to a smaller world (``reshard_after_forward=2``).

Oracle: *compatibility*, as in ``tests/fsdp/world_2/test_user_objects.py``: every line of the
catalogue in ``tests/fsdp/_user_objects.py`` with torch's ``fully_shard`` and ours on identically
seeded models; same outcome, bitwise results where it works. One spawned body per configuration.
"""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from tests._dist import WorkerPool
from tests.fsdp._user_objects import (
    Config,
    Engine,
    Row,
    Subject,
    assert_catalogue,
    fsdp_subject,
    run_catalogue,
)


def _hsdp(engine: Engine) -> Subject:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return fsdp_subject(engine, "mlp", "head.bias", mesh=mesh)


CONFIGS = {
    c.name: c
    for c in (
        # MLP at 4 ranks: head's shards are empty on ranks 1-3 (HSDP: on shard rank 1).
        Config("HSDP 2x2", _hsdp),
        # Whole-model objects are taken after an eval forward, with the parameters resharded
        # to 2 ranks: the state-dict hooks must reshard to 4 first.
        Config(
            "reshard_after_forward=2",
            lambda e: fsdp_subject(
                e, "mlp", "head.bias", reshard_after_forward=2, eval_forward=True
            ),
        ),
    )
}


def catalogue_body(rank: int, world: int, config: str) -> list[Row]:
    return run_catalogue(CONFIGS[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_user_objects_behave_as_torch(world4: WorkerPool, config: str) -> None:
    """Oracle: compatibility (torch's fully_shard, same seeds; outcomes pinned per line;
    bitwise results)."""
    assert_catalogue(config, world4.run(catalogue_body, config))
