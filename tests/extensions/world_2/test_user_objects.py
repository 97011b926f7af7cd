"""What users hold of a model whose weights are a tensor subclass with the all-gather protocol
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), and what they do with it: the
user-objects catalogue (``tests/fsdp/_user_objects.py``) on 2 ranks.

Oracle: *compatibility*: torch's ``fully_shard`` runs the same ``BF16Gather`` model (uneven
shards, plain biases in the same group); same outcome per line, bitwise results where it works.
One spawned body.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests._dist import WorkerPool
from tests.extensions._subclass_gather import BF16Gather, WideMLP
from tests.fsdp._user_objects import (
    Config,
    Engine,
    Row,
    Subject,
    assert_catalogue,
    run_catalogue,
)


def _subclass_subject(engine: Engine) -> Subject:
    rank = dist.get_rank()

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = WideMLP()
        engine.fully_shard(model)
        return model

    def loss(model: nn.Module, i: int) -> torch.Tensor:
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(100 * i + rank))
        out: torch.Tensor = model(x)
        return out.sum()

    # A BF16Gather weight (9 x 3 rows: 5 + 4) that is not first in the group.
    return Subject(build, loss, "out_proj.weight")


# A full state dict holds BF16Gather tensors around DTensor's pending all-gather (an
# AsyncCollectiveTensor) on both engines; the catalogue's full-state-dict holders wait it first
# (``_waited`` in tests/fsdp/_user_objects.py says why), and then every line works on both.
CONFIG = Config("BF16Gather subclass", _subclass_subject)


def catalogue_body(rank: int, world: int) -> list[Row]:
    # A subclass's users allow it in weights-only loads (torch.load and DCP's reader use them).
    with torch.serialization.safe_globals([BF16Gather]):
        return run_catalogue(CONFIG)


def test_user_objects_behave_as_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility (torch's fully_shard on the same subclass model, same seeds;
    outcomes pinned per line; bitwise results)."""
    assert_catalogue(CONFIG.name, world2.run(catalogue_body))
