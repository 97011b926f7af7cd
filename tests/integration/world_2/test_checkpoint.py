"""torch's checkpoint helpers on our modules, and checkpoints moving between torch's engine and
ours: ``torch.distributed.checkpoint.state_dict`` getters and setters (model and optimizer, full
and sharded, ``broadcast_from_rank0``) and DCP ``save`` / ``load``.

Oracle: *compatibility*. torch's ``fully_shard`` trains the same model on the same batches next
to ours: the state dicts the getters return are bitwise equal, and a model and optimizer loaded
from the other engine's checkpoint (DCP, or a full state dict broadcast from rank 0) take the
next step exactly as the model that saved it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from tests._dist import WorkerPool
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.integration._frameworks import ENGINES, assert_same_tensors, local_params

STEPS = 2


def _build(engine: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model("gpt")
    shard_blocks(model, ENGINES[engine])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    batch = make_batch("gpt", 100 * step + rank)
    loss = loss_fn("gpt", model(batch), batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _flatten(sd: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict by dotted key; DTensors as their local shards."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(sd, list | tuple):
        for i, v in enumerate(sd):
            out.update(_flatten(v, f"{prefix}{i}."))
    elif isinstance(sd, DTensor):
        out[prefix] = sd.to_local()
    elif isinstance(sd, torch.Tensor):
        out[prefix] = sd
    elif isinstance(sd, int | float):
        out[prefix] = torch.tensor(sd)
    return out


def getters_match(rank: int, world: int) -> None:
    """Full and sharded, model and optimizer: our state dicts are torch's."""
    trained = {name: _build(name) for name in ENGINES}
    for step in range(STEPS):
        losses = {name: _step(m, o, step, rank) for name, (m, o) in trained.items()}
        assert losses["shardweave"] == losses["torch"], (step, losses)
    for full in (False, True):
        options = StateDictOptions(full_state_dict=full, cpu_offload=full)
        got = {
            name: (
                get_model_state_dict(m, options=options),
                get_optimizer_state_dict(m, o, options=options),
            )
            for name, (m, o) in trained.items()
        }
        ours, theirs = got["shardweave"], got["torch"]
        if full:
            for sd in ours[0].values():
                assert not isinstance(sd, DTensor)
        else:
            assert all(isinstance(v, DTensor) for v in ours[0].values())
        tag = f"rank {rank} full={full}"
        assert_same_tensors(_flatten(ours[0]), _flatten(theirs[0]), f"{tag} model")
        assert_same_tensors(_flatten(ours[1]), _flatten(theirs[1]), f"{tag} optimizer")
        if full and rank != 0:  # cpu_offload: only rank 0 holds the full dict
            assert ours[0] == {} or all(v.numel() == 0 for v in ours[0].values()), tag
        elif full:
            assert len(ours[0]) == len(list(trained["shardweave"][0].state_dict())), tag


def _save_dcp(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def _load_dcp(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _load_full(model: nn.Module, opt: torch.optim.Optimizer, source: tuple[Any, Any]) -> None:
    # rank 0 passes the full dicts, the others nothing: broadcast_from_rank0 sends them
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    model_sd, optim_sd = source if dist.get_rank() == 0 else ({}, {})
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, opt, optim_sd, options=options)


def _save_and_load(how: str, src: str, dst: str, root: Path, rank: int) -> dict[str, Any]:
    """Train ``src`` STEPS steps, move its checkpoint into a fresh ``dst`` model, take two more
    steps with each: their losses, and the loaded model's shards right after loading."""
    saver, saver_opt = _build(src)
    for step in range(STEPS):
        _step(saver, saver_opt, step, rank)
    loaded, loaded_opt = _build(dst)
    if how == "dcp":
        path = root / f"{src}-to-{dst}"
        _save_dcp(saver, saver_opt, path)
        _load_dcp(loaded, loaded_opt, path)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = (
            get_model_state_dict(saver, options=options),
            get_optimizer_state_dict(saver, saver_opt, options=options),
        )
        _load_full(loaded, loaded_opt, full)
    tag = f"rank {rank} {how} {src}->{dst}"
    assert_same_tensors(local_params(loaded), local_params(saver), f"{tag} loaded params")
    steps = range(STEPS, STEPS + 2)
    return {
        "saver": [_step(saver, saver_opt, s, rank) for s in steps],
        "loaded": [_step(loaded, loaded_opt, s, rank) for s in steps],
    }


def checkpoint_crosses_engines(rank: int, world: int, root: str, how: str, src: str) -> None:
    dst = "torch" if src == "shardweave" else "shardweave"
    crossed = _save_and_load(how, src, dst, Path(root), rank)
    tag = f"rank {rank} {how} {src}->{dst}"
    if how == "dcp":
        # the loaded model and optimizer continue exactly as the saver does
        assert crossed["loaded"] == crossed["saver"], (tag, crossed)
        return
    # torch 2.13, either engine: after set_model_state_dict / set_optimizer_state_dict with
    # broadcast_from_rank0 the first step matches the saver's and the second does not (the
    # optimizer state reads back equal). So the oracle is torch's engine loading the same dicts.
    same = _save_and_load(how, src, src, Path(root), rank)
    assert crossed["loaded"][0] == crossed["saver"][0], (tag, crossed)
    assert crossed == same, (tag, crossed, same)


def test_state_dict_getters_match_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility (torch's getters on torch's fully_shard, same training)."""
    world2.run(getters_match)


@pytest.mark.parametrize("how", ["dcp", "full_broadcast_from_rank0"])
@pytest.mark.parametrize("src", ["torch", "shardweave"])
def test_checkpoint_crosses_engines(world2: WorkerPool, tmp_path: Path, how: str, src: str) -> None:
    """Oracle: compatibility (the saving engine's own next steps)."""
    world2.run(checkpoint_crosses_engines, str(tmp_path), how, src)
