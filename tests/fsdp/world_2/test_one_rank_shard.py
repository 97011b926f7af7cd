"""Groups whose shard dim has one rank: the two places where we differ from torch on purpose.

Each rank takes the size-1 ``shard`` dim of a ``(2, 1)`` mesh, so every collective of the group
is skipped (the all-gather because one rank holds the whole parameter, the reduce-scatter
because there is nothing to scatter). docs/migration.md lists both differences.

Oracles: torch's ``fully_shard`` on the same mesh (bitwise, where we agree) and the closed form
``local gradient / divide factor`` (where torch divides twice).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import FSDPModule, fully_shard
from tests._dist import WorkerPool, assert_close
from tests.fsdp._models import make_model, shard_blocks
from tests.fsdp._oracle import train_both_as_torch


def _one_rank_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 1), mesh_dim_names=("other", "shard"))["shard"]


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def _views_shard(param: nn.Parameter, shard: torch.Tensor) -> bool:
    lo, hi = _storage_span(shard)
    return lo <= param.data_ptr() < hi


def aliasing_body(rank: int, world: int) -> dict[str, int]:
    mesh = _one_rank_mesh()
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    shard_blocks(model, fully_shard, mesh=mesh)
    shard_blocks(tmodel, torch_fully_shard, mesh=mesh)
    shards = {n: p.to_local() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    tshards = {n: p.to_local() for n, p in tmodel.named_parameters() if isinstance(p, DTensor)}
    assert len(shards) == len(list(model.parameters()))

    counts = {"ours_alias": 0, "torch_alias": 0, "params": len(shards)}
    for m, local, key, cls in (
        (model, shards, "ours_alias", FSDPModule),
        (tmodel, tshards, "torch_alias", TorchFSDPModule),
    ):
        fsdp_modules = [sub for sub in m.modules() if isinstance(sub, cls)]
        assert len(fsdp_modules) == 3, key  # two blocks and the root
        for sub in fsdp_modules:
            sub.unshard()
        for name, p in m.named_parameters():
            assert not isinstance(p, DTensor), f"{name} is still sharded after unshard()"
            counts[key] += _views_shard(p, local[name])
        for sub in fsdp_modules:
            sub.reshard()

    # Aliasing is invisible to training: three AdamW steps stay bitwise those of torch.
    train_both_as_torch(model, tmodel, "gpt", rank, steps=3)
    # And the unsharded parameters still view (and equal) the shards the optimizer updated.
    fsdp_modules = [sub for sub in model.modules() if isinstance(sub, FSDPModule)]
    for sub in fsdp_modules:
        sub.unshard()
    for name, p in model.named_parameters():
        assert _views_shard(p, shards[name]) and torch.equal(p, shards[name]), name
    for sub in fsdp_modules:
        sub.reshard()
    return counts


def test_unsharded_param_aliases_the_shard(world2: WorkerPool) -> None:
    """Ours: every unsharded parameter is a view of its shard's storage (no copy); torch: none
    is. Training stays bitwise equal to torch's."""
    for counts in world2.run(aliasing_body):
        assert counts["ours_alias"] == counts["params"], counts
        assert counts["torch_alias"] == 0, counts


FACTOR = 4.0


def _linear_grads(module: nn.Module, force_sum: bool, impl: str) -> torch.Tensor:
    mesh = _one_rank_mesh()
    (torch_fully_shard if impl == "torch" else fully_shard)(module, mesh=mesh)
    assert hasattr(module, "set_gradient_divide_factor")
    module.set_gradient_divide_factor(FACTOR)
    if force_sum:
        module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    module(x).pow(2).sum().backward()
    grad = module.weight.grad  # type: ignore[union-attr]
    assert isinstance(grad, DTensor)
    return grad.to_local().clone()


def divide_body(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    plain = nn.Linear(4, 3, bias=False)
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    plain(x).pow(2).sum().backward()
    expected = plain.weight.grad / FACTOR  # type: ignore[operator]
    ratios: dict[str, float] = {}
    for force_sum in (False, True):
        ours = _linear_grads(copy.deepcopy(plain), force_sum, "ours")
        theirs = _linear_grads(copy.deepcopy(plain), force_sum, "torch")
        assert_close(ours, expected, msg=f"ours, force_sum={force_sum}")
        ratios[f"torch_force_sum={force_sum}"] = float((expected / theirs).mean())
    return ratios


def test_divide_factor_applied_once_with_one_rank(world2: WorkerPool) -> None:
    """``set_gradient_divide_factor(4)`` with one rank per shard: our gradient is the local
    gradient / 4 with and without ``set_force_sum_reduction_for_comms``. torch agrees without
    force-sum and divides a second time with it (documented as a deliberate difference; if a
    torch release fixes it, this test says so)."""
    for ratios in world2.run(divide_body):
        assert abs(ratios["torch_force_sum=False"] - 1.0) < 1e-6, ratios
        assert ratios["torch_force_sum=True"] > 1.5, ratios


def division_count_body(rank: int, world: int) -> dict[str, list[int]]:
    """How many out-of-place divisions the backward dispatches, per divide factor, for ours and
    torch's engine (torch's own test, ``test_singleton_copy_division``, counts them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordDivisions(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.divisions = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.divisions += func == torch.ops.aten.div.Tensor
            return func(*args, **(kwargs or {}))

    counts: dict[str, list[int]] = {"ours": [], "torch": []}
    for engine, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        for factor in (None, 1.0, 2.0):
            model = nn.Linear(8, 4, bias=False)
            shard(model, mesh=_one_rank_mesh())
            if factor is not None:
                model.set_gradient_divide_factor(factor)  # type: ignore[operator]
            loss = model(torch.ones(3, 8)).sum()
            with RecordDivisions() as recorder:
                loss.backward()
            grad = model.weight.grad.to_local()  # type: ignore[union-attr]
            assert torch.equal(grad, torch.full((4, 8), 3 / (factor or 1))), (engine, factor)
            counts[engine].append(recorder.divisions)
    return counts


def test_one_rank_reduction_divides_once(world2: WorkerPool) -> None:
    """Closed form: with one rank per shard the gradient is the local one divided by the
    factor, in one division (none for no factor or a factor of 1), as torch 2.15's own
    ``test_singleton_copy_division`` counts; torch's engine as the oracle where it agrees
    (2.15; 2.13 still divides by 1)."""
    for counts in world2.run(division_count_body):
        assert counts["ours"] == [0, 0, 1], counts
        assert counts["torch"][0] == 0 and counts["torch"][2] == 1, counts
