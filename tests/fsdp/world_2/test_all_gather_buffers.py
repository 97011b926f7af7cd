"""The all-gather's buffers under mixed precision: no cast buffer beside the output.

With a collective, the cast shards are written straight into this rank's slot of the all-gather
output (as torch's FSDP2 writes them), so nothing but the output is kept until the copy-out.
With one rank per shard, nothing is gathered or staged: the copy-out reads each fp32 shard
itself and casts while it copies, as torch's FSDP2 casts parameter by parameter there. In
both cases the gathered parameters are the bf16 cast of the shards (closed form), and
training stays bitwise equal to torch's ``fully_shard`` (oracle).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from tests._dist import WorkerPool
from tests.fsdp._models import make_model, shard_blocks
from tests.fsdp._oracle import train_both_as_torch

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
TORCH_BF16 = TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _mesh(one_rank: bool, world: int) -> DeviceMesh:
    if one_rank:
        return init_device_mesh("cpu", (world, 1), mesh_dim_names=("other", "shard"))["shard"]
    return init_device_mesh("cpu", (world,))


def buffers_body(rank: int, world: int, one_rank: bool) -> dict[str, object]:
    mesh = _mesh(one_rank, world)
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    shard_blocks(model, fully_shard, mesh=mesh, mp_policy=BF16)
    shard_blocks(tmodel, torch_fully_shard, mesh=mesh, mp_policy=TORCH_BF16)
    block = model.layers[0]  # type: ignore[index]
    assert isinstance(block, FSDPModule)
    (group,) = block._get_fsdp_state()._fsdp_param_groups
    shards = {n: p.to_local().clone() for n, p in block.named_parameters()}

    handle = block.unshard(async_op=True)
    result = group._all_gather_result
    assert result is not None
    sources = result.sources or []
    shard_storages = [p.sharded_param_data for p in group.fsdp_params]
    seen = {
        "kept_input": result.input is not None,
        "output_dtype": None if result.output is None else str(result.output.dtype),
        "reads_the_shards": len(sources) == len(shard_storages)
        and all(s is d for s, d in zip(sources, shard_storages, strict=True)),
    }
    if handle is not None:
        handle.wait()
    for name, p in block.named_parameters():
        assert not isinstance(p, DTensor), name
        assert p.dtype == torch.bfloat16, name
        # This rank's rows of the gathered parameter are its shard, cast (dim-0 chunks).
        mine = p if one_rank else torch.chunk(p, world, dim=0)[rank]
        assert torch.equal(mine, shards[name].to(torch.bfloat16)), name
    block.reshard()

    train_both_as_torch(model, tmodel, "gpt", rank, steps=2)
    return seen


def test_cast_goes_into_the_output_slot(world2: WorkerPool) -> None:
    for seen in world2.run(buffers_body, False):
        assert seen == {
            "kept_input": False,
            "output_dtype": "torch.bfloat16",
            "reads_the_shards": False,
        }


def test_one_rank_shard_casts_in_the_copy_out(world2: WorkerPool) -> None:
    for seen in world2.run(buffers_body, True):
        assert seen == {"kept_input": False, "output_dtype": None, "reads_the_shards": True}
