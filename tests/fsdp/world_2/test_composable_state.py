"""``fully_shard.state(module)``: the state ``fully_shard`` attached to a module, None for any
other module, as torch's composable ``contract`` decorator gives its ``fully_shard``.

Oracle: *compatibility* (torch's ``fully_shard.state`` on the same modules: a state exactly
where torch returns one, None where torch returns None).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState as TorchFSDPState

from shardweave.fsdp import fully_shard
from shardweave.fsdp.core._state import FSDPState, get_fsdp_state
from tests._dist import WorkerPool


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.x = nn.Linear(4, 4)
        self.y = nn.Linear(4, 4)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.y(self.x(self.b(self.a(t))))


def _states(api: Any) -> tuple[Net, dict[str, object]]:
    """Which modules have a state, and which share one, after per-module, list and root calls."""
    torch.manual_seed(0)
    net = Net()
    api(net.a)
    api([net.x, net.y])  # one state for the two roots of a list
    api(net)
    states = {name: api.state(m) for name, m in [("", net), *net.named_children()]}
    states["plain"] = api.state(nn.Linear(2, 2))
    return net, states


def composable_state(rank: int, world: int) -> None:
    net, ours = _states(fully_shard)
    _, theirs = _states(torch_fully_shard)
    for name, state in ours.items():
        assert (state is None) == (theirs[name] is None), (name, state, theirs[name])
    assert all(isinstance(s, TorchFSDPState) for s in theirs.values() if s is not None)
    assert all(isinstance(s, FSDPState) for s in ours.values() if s is not None)
    assert ours["b"] is None and ours["plain"] is None  # managed by the root's call, not applied
    assert ours["x"] is ours["y"] and ours["x"] is not ours[""] and ours["a"] is not ours[""]
    assert ours[""] is get_fsdp_state(net)  # the state the engine itself runs on
    net(torch.randn(2, 4)).sum().backward()
    assert fully_shard.state(net) is ours[""]  # unchanged by lazy init


def test_fully_shard_state_like_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility. A state for each module passed (the list's roots sharing one),
    None for a managed submodule and a plain module, exactly where torch's fully_shard.state
    returns one or None."""
    world2.run(composable_state)


def test_fully_shard_is_still_the_function() -> None:
    """Oracle: closed form. ``fully_shard`` keeps its name, docstring and identity through
    pickling (the worker pool and frameworks pickle it by reference)."""
    assert fully_shard.__name__ == "fully_shard" and fully_shard.__doc__
    assert callable(fully_shard.state)
    assert pickle.loads(pickle.dumps(fully_shard)) is fully_shard
