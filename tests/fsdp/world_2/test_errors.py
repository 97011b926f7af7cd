"""Bad input fails fast, on every rank, with torch's exception type; a rank whose model differs
is reported instead of hanging.

Oracle: *compatibility* — the same misuse against torch's fully_shard raises the same type.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import FSDPConsistencyError, fully_shard
from tests._dist import WorkerPool
from tests.fsdp._models import TwoLinear


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.0))


def _double(api: Callable[..., Any]) -> None:
    m = nn.Linear(2, 2)
    api(m)
    api(m, reshard_after_forward=False)


def _prefetch_foreign(api: Callable[..., Any]) -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    api(a)
    a.set_modules_to_forward_prefetch([b])  # type: ignore[operator]


def _backward_prefetch_foreign(api: Callable[..., Any]) -> None:
    a = nn.Linear(2, 2)
    api(a)
    a.set_modules_to_backward_prefetch([nn.ReLU()])  # type: ignore[operator]


CASES: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "double_application": _double,
    "forward_prefetch_non_fsdp": _prefetch_foreign,
    "backward_prefetch_non_fsdp": _backward_prefetch_foreign,
    "int_reshard_not_factor": lambda api: api(nn.Linear(2, 2), reshard_after_forward=3),
    "int_reshard_too_big": lambda api: api(nn.Linear(2, 2), reshard_after_forward=8),
    "reshard_bad_type": lambda api: api(nn.Linear(2, 2), reshard_after_forward="yes"),
    "module_list": lambda api: api(nn.ModuleList([nn.Linear(2, 2)])),
    "scalar_param": lambda api: api(Scalar()),
    "mesh_3d": lambda api: api(
        nn.Linear(2, 2), mesh=init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("a", "b", "c"))
    ),
    "mesh_2d_unnamed": lambda api: api(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 2))),
    "uneven_dim1": lambda api: api(
        nn.Linear(3, 2), shard_placement_fn=lambda p: torch.distributed.tensor.Shard(p.ndim - 1)
    ),
    "shard_dim_out_of_range": lambda api: api(
        nn.Linear(4, 2), shard_placement_fn=lambda p: torch.distributed.tensor.Shard(3)
    ),
    "set_reshard_after_forward_int": lambda api: api(nn.Linear(2, 2)).set_reshard_after_forward(2),
    "non_contiguous": lambda api: api(nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)),
}


def misuse(rank: int, world: int, case: str) -> str:
    build = CASES[case]
    started = time.monotonic()
    with pytest.raises(Exception) as theirs:
        build(torch_fully_shard)
    with pytest.raises(Exception) as ours:
        build(fully_shard)
    assert time.monotonic() - started < 10, "misuse must fail fast"
    assert isinstance(ours.value, type(theirs.value)), (
        f"{case}: torch raises {type(theirs.value).__name__}: {theirs.value}; "
        f"we raise {type(ours.value).__name__}: {ours.value}"
    )
    return str(ours.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_misuse_raises_like_torch(world2: WorkerPool, case: str) -> None:
    """Oracle: compatibility (exception type), on every rank."""
    messages = world2.run(misuse, case)
    assert all(messages), "every rank raises with a message"


# torch 2.13's sentences (copied from its source) that users' and torch's own tests match on;
# our message starts with the sentence, then says more.
TORCH_SENTENCES: dict[str, str] = {
    "mesh_3d": "fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh(",
    "mesh_2d_unnamed": "Please init the 2D mesh for HSDP with mesh_dim_names specified",
    "non_contiguous": "FSDP does not support non-contiguous parameters yet: param.shape=",
    "double_application": (
        "Each distinct composable distributed API can only be applied to a module once."
    ),
}


def torch_sentence(rank: int, world: int, case: str) -> tuple[str, str]:
    build = CASES[case]
    with pytest.raises(Exception) as theirs:
        build(torch_fully_shard)
    with pytest.raises(Exception, match=re.escape(TORCH_SENTENCES[case])) as ours:
        build(fully_shard)
    return str(theirs.value), str(ours.value)


@pytest.mark.parametrize("case", sorted(TORCH_SENTENCES))
def test_message_starts_with_torchs_sentence(world2: WorkerPool, case: str) -> None:
    """Oracle: compatibility. torch's fully_shard raises the sentence (so the table is torch's
    text, not ours), our message starts with it (``pytest.raises(match=...)`` written against
    torch passes), and where torch's whole message is one sentence ours starts with all of it
    (mesh and parameter reprs included)."""
    for theirs, mine in world2.run(torch_sentence, case):  # type: ignore[misc]
        sentence = TORCH_SENTENCES[case]
        assert theirs.startswith(sentence), f"torch now says: {theirs}"
        assert mine.startswith(sentence), mine
        if case == "double_application":
            # torch goes on with "fully_shard has already been applied to the following
            # module:" and the module's repr; we name the class and the remedy instead
            assert mine.startswith(f"{sentence} fully_shard has already been applied to "), mine
            assert "remove the second call" in mine, mine
        else:
            assert mine.startswith(theirs) and len(mine) > len(theirs), (theirs, mine)


def divergent_model(rank: int, world: int, what: str) -> float:
    hidden = 8 if (what == "shape" and rank == world - 1) else 6
    model = TwoLinear(hidden)
    if what == "dtype" and rank == world - 1:
        model.b.double()
    if what == "structure" and rank == world - 1:
        model.c = nn.Linear(2, 2)  # type: ignore[assignment]
    fully_shard(model.a)
    fully_shard(model)
    started = time.monotonic()
    with pytest.raises(FSDPConsistencyError) as err:
        model(torch.randn(2, 4))
    elapsed = time.monotonic() - started
    text = str(err.value)
    assert "First difference" in text and f"rank {world - 1}" in text, text
    # the root's group is described first, so the root-owned b.weight (whose input width
    # is `hidden`) shows the shape difference; an extra module shows its first parameter
    expected = {"shape": "b.weight", "dtype": "b.weight", "structure": "c.weight"}[what]
    assert expected in text, text
    return elapsed


@pytest.mark.parametrize("what", ["shape", "dtype", "structure"])
def test_divergent_rank_is_reported_not_hung(world2: WorkerPool, what: str) -> None:
    """Oracle: closed form. Every rank raises FSDPConsistencyError naming the difference, in
    well under a second, where torch's FSDP2 would hang or abort in the collective."""
    elapsed = world2.run(divergent_model, what, timeout=60)
    assert all(t < 5 for t in elapsed), elapsed  # type: ignore[operator]
