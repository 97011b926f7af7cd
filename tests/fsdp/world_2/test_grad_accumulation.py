"""Gradient accumulation controls on 2 ranks, the combinations torch checks on GPU only
(``test_fully_shard_grad_acc.py`` and the accumulation tests of its training file):
``set_requires_gradient_sync`` on every module, on the root alone or on some blocks alone
(``recurse=False``), with ``set_reshard_after_backward`` / ``set_is_last_backward`` off between
microbatches, under CPU offload and mixed precision, with sharded grads kept as zeros between
steps (``zero_grad(set_to_none=False)``) as well as dropped.

Oracles: *compatibility* (torch's own ``fully_shard`` on a copy in the same processes: after
every microbatch the same registered params, the same collectives with the same bytes, bitwise
equal shards and grads) and *reference* (an unsharded copy on every rank's microbatches, loss
averaged over ranks; fp32 runs only).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests._dist import WorkerPool
from tests.fsdp._counting import count_collectives
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import (
    assert_matches_reference,
    assert_same_as_torch,
    registered_sharded,
)

KIND = "gpt"
MICRO = 3
# Accumulated microbatches sum in another order than the one-backward reference (as in
# tests/fsdp/_training.py, which measured 8e-5 relative on summed losses of this size).
ACCUMULATION_TOL: dict[str, float] = {"rtol": 2e-4, "atol": 2e-4}


def _policies(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    ours: dict[str, Any] = {"reshard_after_forward": cfg.get("reshard_after_forward", True)}
    theirs = dict(ours)
    if cfg.get("mp"):
        # True: bf16 compute, fp32 reduce; "bf16-reduce": fp32 compute, reduced (and, from
        # torch 2.15, accumulated across microbatches) in bf16
        mp: dict[str, torch.dtype] = (
            {"reduce_dtype": torch.bfloat16}
            if cfg["mp"] == "bf16-reduce"
            else {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
        )
        ours["mp_policy"], theirs["mp_policy"] = (
            MixedPrecisionPolicy(**mp),
            TorchMixedPrecisionPolicy(**mp),
        )
    if cfg.get("offload"):
        ours["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        theirs["offload_policy"] = TorchCPUOffloadPolicy(pin_memory=False)
    return ours, theirs


def _configure(m: nn.Module, cfg: dict[str, Any], last: bool) -> None:
    """The same per-microbatch calls on our model and torch's."""
    mode = cfg["mode"]
    if mode == "all":
        m.set_requires_gradient_sync(last)  # type: ignore[operator]
    elif mode == "root_only":
        m.set_requires_gradient_sync(last, recurse=False)  # type: ignore[operator]
    else:  # "some_blocks": only the first block accumulates without communication
        m.layers[0].set_requires_gradient_sync(last, recurse=False)  # type: ignore[index, union-attr]
    if cfg.get("keep_unsharded"):
        m.set_reshard_after_backward(last)  # type: ignore[operator]
        m.set_is_last_backward(last)  # type: ignore[operator]


def grad_accumulation(rank: int, world: int, cfg: dict[str, Any]) -> None:
    model = make_model(KIND)
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    ours, theirs = _policies(cfg)
    shard_blocks(model, fully_shard, **ours)
    shard_blocks(tmodel, torch_fully_shard, **theirs)
    models = (model, tmodel, ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    fp32 = not cfg.get("mp")
    for step in range(2):
        for mb in range(MICRO):
            last = mb == MICRO - 1
            for m in (model, tmodel):
                _configure(m, cfg, last)
            batches = [make_batch(KIND, 1000 * step + 100 * mb + r) for r in range(world)]
            mine = batches[rank]
            with count_collectives() as our_comms:
                loss_fn(KIND, model(mine).float(), mine).backward()
            with count_collectives() as their_comms:
                loss_fn(KIND, tmodel(mine).float(), mine).backward()
            if fp32:
                (sum(loss_fn(KIND, ref(b), b) for b in batches) / world).backward()  # type: ignore[union-attr]
            tag = f"{cfg} step {step} microbatch {mb}"
            assert our_comms == their_comms, f"{tag}: ours {our_comms} vs torch {their_comms}"
            if cfg["mode"] == "all" and not last:
                assert our_comms["reduce_scatter_single"] == 0, f"{tag}: {our_comms}"
            kinds = registered_sharded(model)
            assert kinds == registered_sharded(tmodel), f"{tag}: {kinds}"
            if cfg.get("keep_unsharded") and not last:  # the blocks stay gathered
                assert not any(sharded for name, sharded in kinds if "layers" in name), tag
            if all(sharded for _, sharded in kinds):
                assert_same_as_torch(model, tmodel, tag)
        assert_same_as_torch(model, tmodel, f"{cfg} step {step}")
        if fp32:
            assert_matches_reference(
                model, ref, "grad", rank, world, f"{cfg} step {step}", **ACCUMULATION_TOL
            )
        for o in opts:
            o.step()
            # Kept as zeros on odd steps: the next sync then adds into an existing sharded grad.
            o.zero_grad(set_to_none=step % 2 == 1)
        assert_same_as_torch(model, tmodel, f"{cfg} step {step} after the optimizer step")


CASES: list[dict[str, Any]] = [
    {"mode": "all"},
    {"mode": "all", "reshard_after_forward": False},
    {"mode": "root_only"},
    {"mode": "some_blocks"},
    {"mode": "some_blocks", "keep_unsharded": True},
    {"mode": "all", "keep_unsharded": True},
    {"mode": "all", "offload": True},
    {"mode": "some_blocks", "mp": True},
    {"mode": "all", "mp": True, "keep_unsharded": True},
    {"mode": "all", "mp": "bf16-reduce"},
    {"mode": "some_blocks", "mp": "bf16-reduce"},
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grad_accumulation_matches_torch(world2: WorkerPool, cfg: dict[str, Any]) -> None:
    """Oracles: compatibility (after every microbatch: registered params, collectives and bytes,
    bitwise shards and grads) and reference (fp32), over two steps of three microbatches."""
    world2.run(grad_accumulation, cfg)
