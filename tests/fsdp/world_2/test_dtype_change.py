"""A dtype conversion after the first forward (``model.double()`` between steps): the next
step trains in the new dtype, its sharded gradients in it too.

torch 2.15 trains it so with a ``param_dtype``; without one every torch release fails in
backward ('Expected out tensor to have dtype double'), and so did we on every release
('attempting to assign a gradient with dtype float to a tensor with grad_dtype Double').

Oracles: *self-consistency*, on every release: the same model converted before its first
forward, loaded with the converted model's state after step 1, takes the same step 2 bitwise;
*compatibility*, on torch 2.15 with a ``param_dtype``: torch's ``fully_shard``, bitwise.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import MixedPrecisionPolicy, fully_shard
from shardweave.fsdp._torch_compat import TORCH_RELEASE
from tests._dist import WorkerPool
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import assert_same_as_torch, sgd_step


def _step(model: nn.Module, rank: int, dtype: torch.dtype) -> None:
    batch = make_batch("mlp", rank).to(dtype)
    loss_fn("mlp", model(batch), batch).backward()


def converted_after_first_forward(rank: int, world: int, param_dtype: str | None) -> None:
    mp: dict[str, Any] = {} if param_dtype is None else {"param_dtype": torch.bfloat16}
    base = make_model("mlp")
    model, before, tmodel = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    shard_blocks(model, fully_shard, mp_policy=MixedPrecisionPolicy(**mp))
    _step(model, rank, torch.float32)
    sgd_step(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.double()
    _step(model, rank, torch.float64)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float64 and p.grad is not None, name
        assert p.grad.dtype == torch.float64, f"{name}: gradient in {p.grad.dtype}"

    # Converted before its first forward (the path every release supports), then given the
    # converted model's state after step 1: the same step 2, bitwise.
    shard_blocks(before, fully_shard, mp_policy=MixedPrecisionPolicy(**mp))
    before.double()
    before.load_state_dict(state)
    _step(before, rank, torch.float64)
    for (name, p), q in zip(model.named_parameters(), before.parameters(), strict=True):
        assert q.grad is not None, name
        assert torch.equal(p.to_local(), q.to_local()), f"{name}: parameter"  # type: ignore[attr-defined]
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{name}: gradient"  # type: ignore[attr-defined]

    if param_dtype is not None and TORCH_RELEASE >= (2, 15):
        shard_blocks(tmodel, torch_fully_shard, mp_policy=TorchMixedPrecisionPolicy(**mp))
        _step(tmodel, rank, torch.float32)
        sgd_step(tmodel)
        tmodel.double()
        _step(tmodel, rank, torch.float64)
        assert_same_as_torch(model, tmodel, "after model.double()")


@pytest.mark.parametrize("param_dtype", [None, "bf16"])
def test_conversion_after_first_forward_trains_in_the_new_dtype(
    world2: WorkerPool, param_dtype: str | None
) -> None:
    world2.run(converted_after_first_forward, param_dtype)
