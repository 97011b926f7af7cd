"""Lightning Fabric with ``ModelParallelStrategy``: training with gradient accumulation under
``fabric.no_backward_sync``, ``fabric.clip_gradients``, sharded and full checkpoints.

Oracles: *compatibility* (the same body with torch's ``fully_shard``: losses, gradient norms and
parameter shards bitwise equal; as many reduce-scatters per micro-batch) and *closed form* (no
reduce-scatter on an accumulating micro-batch; a model and optimizer loaded from either
checkpoint continue exactly as the model that saved it).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import WorkerPool
from tests.fsdp._counting import C10dOps
from tests.fsdp._models import TinyGPT, make_batch, shard_blocks
from tests.integration._frameworks import (
    ENGINES,
    assert_same_tensors,
    engine_of,
    local_params,
    make_environment,
    no_torch_engine,
    reduce_scatters,
)

STEPS = 2
MICRO = 2
MAX_NORM = 0.05  # below every step's norm, so clipping is active


def _parallelize(engine: str, model: nn.Module, mesh: Any) -> nn.Module:
    shard_blocks(model, ENGINES[engine], mesh=mesh["data_parallel"])
    return model


def _fabric(engine: str, full_checkpoint: bool) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=partial(_parallelize, engine),
        data_parallel_size=2,
        tensor_parallel_size=1,
        save_distributed_checkpoint=not full_checkpoint,
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[make_environment()])
    fabric.launch()  # no launcher (the processes exist): this only sets up the environment
    return fabric


def _setup(fabric: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return model, opt


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    target = torch.roll(idx, -1, dims=1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _step(fabric: Any, model: Any, opt: Any, step: int, rank: int) -> dict[str, Any]:
    """One optimizer step over MICRO micro-batches; the gradient sync only on the last."""
    losses, rs = [], []
    for micro in range(MICRO):
        idx = make_batch("gpt", 1000 * step + 10 * micro + rank)
        accumulating = micro < MICRO - 1
        with fabric.no_backward_sync(model, enabled=accumulating), C10dOps() as ops:
            loss = _loss(model, idx) / MICRO
            fabric.backward(loss)
        losses.append(loss.item())
        rs.append(reduce_scatters(ops.counts))
    norm = fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
    opt.step()
    opt.zero_grad()
    return {"losses": losses, "reduce_scatters": rs, "norm": float(norm.full_tensor())}


def _run(engine: str, root: Path, rank: int) -> dict[str, Any]:
    with no_torch_engine() if engine == "shardweave" else nullcontext():
        return _train_save_load(engine, root, rank)


def _train_save_load(engine: str, root: Path, rank: int) -> dict[str, Any]:
    fabric = _fabric(engine, full_checkpoint=False)
    model, opt = _setup(fabric)
    assert engine_of(model.module) == engine
    steps = [_step(fabric, model, opt, s, rank) for s in range(STEPS)]
    fabric.save(root / "sharded", {"model": model, "optimizer": opt, "step": STEPS})
    _fabric(engine, full_checkpoint=True).save(root / "full.pt", {"model": model, "optimizer": opt})
    after = _step(fabric, model, opt, STEPS, rank)
    out: dict[str, Any] = {"steps": steps, "after": after, "params": local_params(model)}
    for kind, path in (("sharded", root / "sharded"), ("full", root / "full.pt")):
        other = _fabric(engine, full_checkpoint=kind == "full")
        loaded_model, loaded_opt = _setup(other)
        state = {"model": loaded_model, "optimizer": loaded_opt}
        rest = other.load(path, state)
        if kind == "sharded":
            assert rest == {"step": STEPS}, rest
        out[f"{kind}_after"] = _step(other, loaded_model, loaded_opt, STEPS, rank)
        out[f"{kind}_params"] = local_params(loaded_model)
    return out


def fabric_parity(rank: int, world: int, root: str) -> list[list[int]]:
    results = {name: _run(name, Path(root) / name, rank) for name in ENGINES}
    ours, theirs = results["shardweave"], results["torch"]
    for step, (o, t) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
        assert o == t, f"rank {rank} step {step}: ours {o} torch {t}"
        assert o["norm"] > MAX_NORM, o  # clipping is active
        # no reduce-scatter while accumulating, one per FSDP group (2 blocks, the root) at the last
        assert o["reduce_scatters"] == [0] * (MICRO - 1) + [3], o
    assert ours["after"] == theirs["after"], (ours["after"], theirs["after"])
    assert_same_tensors(ours["params"], theirs["params"], f"rank {rank} params")
    for kind in ("sharded", "full"):
        # a model and optimizer loaded from the checkpoint continue exactly as the saver did
        assert ours[f"{kind}_after"] == ours["after"], (kind, ours[f"{kind}_after"], ours["after"])
        assert_same_tensors(ours[f"{kind}_params"], ours["params"], f"rank {rank} {kind}")
        assert ours[f"{kind}_after"] == theirs[f"{kind}_after"], kind
    return [s["reduce_scatters"] for s in ours["steps"]]


def test_fabric_model_parallel_strategy(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracles: compatibility (torch's fully_shard under the same Fabric loop, bitwise) and
    closed form (no reduce-scatter on accumulating micro-batches)."""
    counts = world2.run(fabric_parity, str(tmp_path), timeout=300)
    assert counts[0] == counts[1], counts
