"""Lightning's ``Trainer`` with ``ModelParallelStrategy``: the LightningModule applies
``fully_shard`` in ``configure_model``, the Trainer clips gradients, saves a sharded (DCP)
checkpoint and resumes from it.

Oracle: *compatibility*. The same body runs with torch's ``fully_shard`` and with ours, on the
same seeds and batches: losses, gradient norms before clipping and final parameter shards are
bitwise equal, and a run stopped at step 2 and resumed from its checkpoint gives the losses and
parameters of the run that did not stop.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests._dist import WorkerPool
from tests.fsdp._models import TinyGPT, shard_blocks
from tests.integration._frameworks import (
    ENGINES,
    assert_same_tensors,
    engine_of,
    local_params,
    make_environment,
    no_torch_engine,
)

STEPS = 4
CLIP = 0.05  # below every step's gradient norm, so every step clips


def _module(engine: str) -> Any:
    import lightning.pytorch as pl

    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT()
            self.losses: list[float] = []
            self.grad_norms: list[float] = []

        def configure_model(self) -> None:
            # what Lightning's docs show for FSDP2: blocks, then the root, on the data-parallel mesh
            shard_blocks(self.model, ENGINES[engine], mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (idx,) = batch
            logits = self.model(idx)
            target = torch.roll(idx, -1, dims=1)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            # called before the Trainer clips: the norm of the reduced (averaged) gradients
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            self.grad_norms.append(float(norm.full_tensor()))  # DTensor grads: a DTensor norm

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return GPTModule()


def _loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 13, (8, 6), generator=g)
    # The Trainer replaces the sampler with a shuffling DistributedSampler (2 replicas) whose
    # epoch it sets: one batch of 4 per rank and epoch, other rows each epoch. One batch per
    # epoch because with two, the resumed fit's second batch of an epoch was not the one the
    # uninterrupted fit used (with either engine; parameters and optimizer state were equal).
    return DataLoader(TensorDataset(tokens), batch_size=4, shuffle=True)


def _trainer(root: Path, max_steps: int) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[make_environment()],
        max_steps=max_steps,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _run(engine: str, root: Path) -> dict[str, Any]:
    with no_torch_engine() if engine == "shardweave" else nullcontext():
        return _fits(engine, root)


def _fits(engine: str, root: Path) -> dict[str, Any]:
    whole = _module(engine)
    _trainer(root / "whole", STEPS).fit(whole, _loader())

    first = _module(engine)
    trainer = _trainer(root / "first", STEPS // 2)
    trainer.fit(first, _loader())
    ckpt = root / f"{engine}.ckpt"
    trainer.save_checkpoint(ckpt)
    assert ckpt.is_dir(), "ModelParallelStrategy saves a sharded (DCP) checkpoint folder"

    resumed = _module(engine)
    _trainer(root / "resumed", STEPS).fit(resumed, _loader(), ckpt_path=str(ckpt))
    assert engine_of(whole.model) == engine == engine_of(resumed.model)
    return {
        "losses": whole.losses,
        "grad_norms": whole.grad_norms,
        "params": local_params(whole.model),
        "resumed_losses": first.losses + resumed.losses,
        "resumed_params": local_params(resumed.model),
    }


def trainer_parity(rank: int, world: int, root: str) -> list[float]:
    results = {name: _run(name, Path(root) / name) for name in ENGINES}
    ours, theirs = results["shardweave"], results["torch"]
    assert len(theirs["losses"]) == STEPS, theirs["losses"]
    assert all(n > CLIP for n in theirs["grad_norms"]), theirs["grad_norms"]  # clipping is active
    for key in ("losses", "grad_norms", "resumed_losses"):
        assert ours[key] == theirs[key], f"rank {rank} {key}: ours {ours[key]} torch {theirs[key]}"
    assert_same_tensors(ours["params"], theirs["params"], f"rank {rank} params")
    assert_same_tensors(ours["resumed_params"], theirs["resumed_params"], f"rank {rank} resumed")
    # resuming from the checkpoint continues the run exactly
    assert ours["resumed_losses"] == ours["losses"], (ours["resumed_losses"], ours["losses"])
    assert_same_tensors(ours["resumed_params"], ours["params"], f"rank {rank} resumed vs whole")
    return list(ours["losses"])


def test_trainer_model_parallel_strategy(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracle: compatibility (torch's fully_shard under the same Trainer, bitwise)."""
    losses = world2.run(trainer_parity, str(tmp_path), timeout=300)
    assert losses[0] != losses[1]  # the ranks trained on different batches
