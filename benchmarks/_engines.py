"""Engine loading: the implementations ``--impls`` names and the wrapper each engine applies.

Also puts ``demos/`` on ``sys.path`` (the benchmark reuses the demo's model and loader), so
import this module before anything from ``demos/``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demos"))
from train_gpt import load_fully_shard

# Implementation names as reports and ``--impls`` spell them; a workload maps each of its
# implementations to an engine (``shardweave`` means ``fully_shard`` in the FSDP workloads and
# ``replicate`` in the replicate one).
FSDP_IMPLS: Final = {"shardweave": "shardweave", "torch": "torch"}
REPLICATE_IMPLS: Final = {
    "shardweave": "shardweave.replicate",
    "torch-replicate": "torch-replicate",
    "ddp": "ddp",
}
IMPLS: Final = ("shardweave", "torch", "torch-replicate", "ddp")

FullyShard = Callable[..., Any]


def load_engine(engine: str) -> FullyShard:
    """The per-module wrapper an engine applies (``ddp`` returns the DDP class itself)."""
    if engine in ("shardweave", "torch"):
        return load_fully_shard(engine)  # the demo's loader: the two are drop-in replacements
    if engine == "shardweave.replicate":
        from shardweave.replicate import replicate as sw_replicate

        return sw_replicate
    if engine == "torch-replicate":
        from torch.distributed._composable.replicate_with_fsdp import (
            replicate as torch_replicate,
        )

        return torch_replicate
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    raise ValueError(f"unknown engine {engine!r}")


def import_error(engine: str) -> str | None:
    try:
        load_engine(engine)
    except Exception as e:  # any failure, not just ImportError: a half-written package counts
        return f"{type(e).__name__}: {e}"
    return None
