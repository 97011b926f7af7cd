"""One rank of one torchft replica group: the process side of
``tests/integration/world_2/test_torchft.py`` (the scenario and the harness are described there).

A module of its own so that the harness's forkserver imports it, torch, torchft and both engines
once and forks every rank from that (spawning each rank costs seconds of imports). Imports
torchft: import it only where torchft is installed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist
import torchft
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torchft.process_group import ManagedProcessGroup

from shardweave.fsdp import fully_shard
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.integration._frameworks import engine_of

STEPS: Final = 8
KILL_AT: Final = 3  # group 1 dies after committing step KILL_AT - 1
REJOIN_AT: Final = 5  # a new group 1 joins the quorum of step REJOIN_AT
GROUP_SIZE: Final = 2  # ranks per replica group (fully_shard's mesh)
# the three incarnations of replica groups: name, replica group, seed of its initial weights
# (each its own, so only torchft's checkpoint transfers can make the groups agree)
INCARNATIONS: Final = (("g0", 0, 0), ("g1", 1, 1), ("g1b", 1, 2))


@dataclass(frozen=True)
class Role:
    """One rank of one incarnation of a replica group, as its process sees it."""

    engine: str  # "torch" or "shardweave": whose fully_shard
    incarnation: str  # "g0", "g1" (dies after step KILL_AT - 1), "g1b" (joins at REJOIN_AT)
    group: int
    rank: int  # in the replica group
    seed: int
    control_port: int  # the harness's store: gates, records, errors
    store_port: int  # this incarnation's own store (process group, torchft's manager)
    lighthouse: str

    @property
    def name(self) -> str:
        return f"{self.incarnation}/r{self.rank}"


class _ErrorsToStore(logging.Handler):
    """torchft logs the errors it survives (a failed checkpoint transfer, on both sides) and
    carries on; this hands them to the harness for its failure messages."""

    def __init__(self, store: dist.TCPStore, key: str) -> None:
        super().__init__(logging.ERROR)
        self._store, self._key = store, key
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self._store.append(self._key, self.format(record) + "\n")


def replica_main(role: Role) -> None:
    """The process's target: train, report any failure to the harness, then die with it."""
    control = dist.TCPStore("127.0.0.1", role.control_port, is_master=False)
    logging.getLogger("torchft").addHandler(_ErrorsToStore(control, f"logged/{role.name}"))
    try:
        _train(role, control)
    except BaseException:
        control.set(f"error/{role.name}", traceback.format_exc())
        raise


def _digest(model: nn.Module) -> str:
    """The local parameter shards' bytes, hashed: bitwise equality in 16 characters."""
    h = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        h.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _train(role: Role, control: dist.TCPStore) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    group_store = dist.TCPStore("127.0.0.1", role.store_port, is_master=False)
    # the replica group's own process group: fully_shard shards over it
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("fsdp", group_store), rank=role.rank, world_size=GROUP_SIZE
    )
    model = make_model("gpt", seed=role.seed)
    shard_blocks(model, torch_fully_shard if role.engine == "torch" else fully_shard)
    if engine_of(model) != role.engine:
        raise AssertionError(f"{role.name}: the model is {engine_of(model)}'s, not {role.engine}'s")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # creates the optimizer's state now (a step at lr 0), so the state dict cached below has it
    get_optimizer_state_dict(model, optim)
    if role.incarnation == "g1b":  # forked early; starts its manager when the harness says so
        control.wait([f"start/{role.incarnation}"])

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        rank=role.rank,
        world_size=GROUP_SIZE,
        store_addr="127.0.0.1",
        store_port=role.store_port,
        lighthouse_addr=role.lighthouse,
        replica_id=f"replica_{role.group}",
    )
    # torchtitan's recipe: the replicate dimension is torchft's managed process group, reached
    # from each FSDP module's all-reduce hook (after the group's own reduce-scatter)
    replicate_pg = ManagedProcessGroup(manager)
    replicate_pg.register("dp_replicate")

    def all_reduce_hook(grads: torch.Tensor) -> None:
        dist.all_reduce(grads, group=replicate_pg, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)

    # The manager's quorum thread hands these to a recovering group while this thread trains,
    # so they are taken here, once, and served by reference (torchtitan caches them the same
    # way); the optimizer's again after a load, which replaces its state tensors.
    cache: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
    }

    def load_state_dict(state: dict[str, Any]) -> None:
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        cache["optim"] = get_optimizer_state_dict(model, optim)

    manager.register_state_dict_fn("train", load_state_dict, lambda: dict(cache))
    ft_optim = torchft.Optimizer(manager, optim)

    if role.incarnation != "g1b":  # the first quorum waits until both groups are heard
        control.set(f"ready/{role.name}", "1")
        control.wait(["go/start"])
    records: list[dict[str, object]] = []
    while manager.current_step() < STEPS:
        step = manager.current_step()
        if role.incarnation == "g0" and step == REJOIN_AT:
            control.set(f"gate/{role.name}", "1")
            control.wait(["go/rejoin"])
        ft_optim.zero_grad()  # starts the step's quorum, in the manager's thread
        batch = make_batch("gpt", seed=1000 * step + 10 * role.group + role.rank)
        loss = loss_fn("gpt", model(batch), batch)
        loss.backward()  # the all-reduce hooks wait for the quorum (and a recovery's download)
        ft_optim.step()  # steps only if the step commits; a recovering group loads first
        if manager.current_step() <= step:
            raise RuntimeError(
                f"{role.name}: step {step} did not commit; torchft's error: {manager.errored()}"
            )
        records.append(
            {
                "step": step,
                "committed": manager.current_step(),
                "participants": manager.num_participants(),
                "participating": manager.is_participating(),
                "loss": float(loss.item()).hex(),
                "params": _digest(model),
            }
        )
        control.set(f"records/{role.name}", json.dumps(records))
        if role.incarnation == "g1" and manager.current_step() == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no goodbye
    manager.shutdown(wait=False)
    dist.destroy_process_group()
