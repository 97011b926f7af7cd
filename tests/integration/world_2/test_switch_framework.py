"""Switching a framework that calls ``torch.distributed.fsdp.fully_shard`` itself: the
documented patch (docs/use_it_with.md, "Frameworks that call torch's fully_shard") on Hugging
Face accelerate's FSDP2 wrapping, which imports ``fully_shard`` from ``torch.distributed.fsdp``
each time it prepares a model.

Oracle: *compatibility*. The same accelerate loop without the patch (torch's engine): losses,
gradient norms and parameter shards bitwise equal. With the patch the modules accelerate wrapped
are ours (``fully_shard.state`` is shardweave's) and torch's engine objects are never built.
"""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed.fsdp
import torch.nn.functional as F
from torch import nn

import shardweave.fsdp
from tests._dist import WorkerPool
from tests.fsdp._models import TinyGPT, make_batch
from tests.integration._frameworks import (
    assert_same_tensors,
    engine_of,
    local_params,
    no_torch_engine,
)

STEPS = 3


def _prepare_with_accelerate(model: nn.Module, rank: int) -> nn.Module:
    """accelerate's own FSDP2 wrapping (``fsdp2_prepare_model``: blocks by class name, the final
    norm group, the root), which calls ``torch.distributed.fsdp.fully_shard`` itself.

    Called with a stand-in for the ``Accelerator``: accelerate turns FSDP on only for
    accelerator devices (on CPU its ``Accelerator`` ignores the FSDP plugin), and this function
    reads only the plugin, the mixed-precision setting, the device and the main-process flag.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        mixed_precision="no",
        device=torch.device("cpu"),
        is_main_process=rank == 0,
    )
    prepared: nn.Module = fsdp2_prepare_model(accelerator, model)
    return prepared


def _train(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _prepare_with_accelerate(TinyGPT(), rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for step in range(STEPS):
        idx = make_batch("gpt", 100 * step + rank)
        logits = model(idx)
        target = torch.roll(idx, -1, dims=1)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(norm.full_tensor()))  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # which engine manages each module accelerate wrapped
    fsdp_modules = {
        name: engine_of(m) for name, m in model.named_modules() if engine_of(m) != "none"
    }
    return {"losses": losses, "norms": norms, "params": local_params(model), "states": fsdp_modules}


def accelerate_switch(rank: int, world: int) -> list[str]:
    theirs = _train(rank)
    with ExitStack() as stack:
        # the documented switch: torch's name points at ours while the framework wraps
        stack.enter_context(
            mock.patch.object(torch.distributed.fsdp, "fully_shard", shardweave.fsdp.fully_shard)
        )
        stack.enter_context(no_torch_engine())
        ours = _train(rank)
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    assert ours["norms"] == theirs["norms"], (ours["norms"], theirs["norms"])
    assert_same_tensors(ours["params"], theirs["params"], f"rank {rank}")
    # the same modules wrapped, each by the engine the name pointed at
    assert len(theirs["states"]) >= 3 and set(theirs["states"].values()) == {"torch"}, theirs
    assert ours["states"] == dict.fromkeys(theirs["states"], "shardweave"), ours["states"]
    return sorted(ours["states"])


def test_patch_switches_accelerate(world2: WorkerPool) -> None:
    """Oracle: compatibility (the same accelerate loop on torch's fully_shard, bitwise)."""
    wrapped = world2.run(accelerate_switch)
    assert wrapped[0] == wrapped[1], wrapped
