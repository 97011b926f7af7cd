"""Helpers for the framework integration tests: Lightning's view of the pool's process group,
the two engines under one name, and small comparisons."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import fully_shard

# The engine each test body runs twice: torch's FSDP2 (the oracle) and ours.
ENGINES: dict[str, Callable[..., Any]] = {"torch": torch_fully_shard, "shardweave": fully_shard}


def make_environment() -> Any:
    """A Lightning ``ClusterEnvironment`` for a process group that already exists.

    The pool's workers joined their gloo group before any test body runs, so Lightning must
    neither launch processes nor initialize a group: ``creates_processes_externally`` keeps its
    launcher away, and its ``_init_dist_connection`` returns early when
    ``torch.distributed.is_initialized()``. Rank and world size come from that group (there is
    one node, so the local rank is the global rank); the address and port are never used.
    Built by a function so that importing this module does not import Lightning.
    """
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class PoolEnvironment(ClusterEnvironment):
        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return dist.is_initialized()

        def world_size(self) -> int:
            return dist.get_world_size()

        def set_world_size(self, size: int) -> None:
            if size != dist.get_world_size():
                raise ValueError(
                    f"Lightning asked for {size} processes, the group has {dist.get_world_size()}"
                )

        def global_rank(self) -> int:
            return dist.get_rank()

        def set_global_rank(self, rank: int) -> None:
            if rank != dist.get_rank():
                raise ValueError(
                    f"Lightning computed rank {rank}, the group says {dist.get_rank()}"
                )

        def local_rank(self) -> int:
            return dist.get_rank()

        def node_rank(self) -> int:
            return 0

    return PoolEnvironment()


def engine_of(model: nn.Module) -> str:
    """Which engine manages ``model``: "shardweave" when it is our ``FSDPModule`` with our state,
    "torch" for torch's (never an instance of ours), "none" otherwise."""
    import shardweave.fsdp

    if isinstance(model, shardweave.fsdp.FSDPModule):
        state = shardweave.fsdp.fully_shard.state(model)
        return "shardweave" if type(state).__module__.startswith("shardweave.") else "none"
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    return "torch" if isinstance(model, TorchFSDPModule) else "none"


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's local shard (a copy), by name."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out[name] = local.detach().clone()
    return out


def assert_same_tensors(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], tag: str
) -> None:
    """Same keys, bitwise equal values."""
    assert list(ours) == list(theirs), f"{tag}: keys {list(ours)} != {list(theirs)}"
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), f"{tag} {key}: differs from torch's FSDP2"


def reduce_scatters(counts: dict[str, int]) -> int:
    """Reduce-scatters among the c10d ops counted by ``tests.fsdp._counting.C10dOps``."""
    return sum(n for name, n in counts.items() if "reduce_scatter" in name)


def no_torch_engine() -> ExitStack:
    """Constructing any of torch's FSDP engine objects raises while the stack is open."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch's FSDP engine was constructed during a shardweave run")

    stack = ExitStack()
    for cls in (_fsdp_state.FSDPState, _fsdp_param_group.FSDPParamGroup, _fsdp_param.FSDPParam):
        stack.enter_context(mock.patch.object(cls, "__init__", refuse))
    return stack
