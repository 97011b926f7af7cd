"""torch.compile around fully_shard, in the orders users and torchtitan apply them.

Oracle: *compatibility*: torch's fully_shard, compiled the same way on the same seeds and
batches, trains to the same losses, parameters and gradients (bitwise), and dynamo compiles the
same ops into no more graphs (graph breaks add graphs), breaks no more often and recompiles no
more than with torch's. Backend ``aot_eager``: AOT autograd's graphs run eagerly, fast on CPU.

With either engine, compiling the whole model compiles the blocks only: the hooks run eagerly
(behind ``torch.compiler.disable``), a break inside the root's loop over its blocks makes dynamo
run the root's forward eagerly, and each block's forward is compiled when it is called.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool
from tests.fsdp._models import TinyGPT, loss_fn, make_batch, make_model, shard_blocks

STEPS = 3


def _build(setup: str, shard: object, backend: Any) -> tuple[nn.Module, nn.Module]:
    """(the model whose parameters train, the callable to run it) for one setup."""
    model = make_model("gpt")
    assert isinstance(model, TinyGPT)
    if setup.startswith("compile_blocks_then_shard"):  # torchtitan's order
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)
        kwargs: dict[str, Any] = {}
        if setup.endswith("_bf16"):  # torch's policy object: fully_shard accepts it too
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        shard_blocks(model, shard, **kwargs)
        return model, model
    if setup == "compile_blocks_in_place_then_shard":
        for block in model.layers:
            block.compile(backend=backend, fullgraph=True)
        shard_blocks(model, shard)
        return model, model
    shard_blocks(model, shard)
    if setup == "shard_then_compile_blocks":
        for block in model.layers:
            block.compile(backend=backend, fullgraph=False)
        return model, model
    assert setup == "shard_then_compile_model", setup
    return model, torch.compile(model, backend=backend, fullgraph=False)


def _train(setup: str, shard: object, rank: int) -> dict[str, Any]:
    """Train STEPS steps; the losses, the local shards and grads, and what dynamo did."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    model, run = _build(setup, shard, counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses: list[float] = []
    frames_per_step: list[int] = []
    for step in range(STEPS):
        batch = make_batch("gpt", 100 * step + rank)
        loss = loss_fn("gpt", run(batch), batch)
        loss.backward()
        losses.append(loss.item())
        frames_per_step.append(int(counter.frame_count))
        if step < STEPS - 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
    params: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        grad = p.grad.to_local().clone() if p.grad is not None else None  # type: ignore[attr-defined]
        params[name] = (p.to_local().detach().clone(), grad)
    result = {
        "losses": losses,
        "params": params,
        "frames": frames_per_step[-1],
        "ops": counter.op_count,
        # a frame compiled after the first step is compiled again: a recompile
        "recompiles": frames_per_step[-1] - frames_per_step[0],
        "graph_breaks": sum(counters["graph_break"].values()),
        # a break dynamo cannot resume from (e.g. in a loop) runs the whole frame eagerly
        "skipped_frames": counters["frames"]["total"] - counters["frames"]["ok"],
    }
    torch._dynamo.reset()
    return result


def _compare(rank: int, world: int, setup: str) -> dict[str, int]:
    ours = _train(setup, fully_shard, rank)
    theirs = _train(setup, torch_fully_shard, rank)
    assert ours["losses"] == theirs["losses"], (setup, ours["losses"], theirs["losses"])
    assert ours["params"].keys() == theirs["params"].keys()
    for name, (p, g) in ours["params"].items():
        tp, tg = theirs["params"][name]
        assert torch.equal(p, tp), f"{setup} {name}: params differ from torch's FSDP2"
        assert (g is None) == (tg is None), f"{setup} {name}: grad presence differs"
        if g is not None:
            assert torch.equal(g, tg), f"{setup} {name}: grads differ from torch's FSDP2"
    counts = {
        f"{key}_{who}": int(res[key])
        for who, res in (("ours", ours), ("torch", theirs))
        for key in ("frames", "recompiles", "graph_breaks", "skipped_frames")
    }
    for key in ("frames", "recompiles", "graph_breaks", "skipped_frames"):
        assert counts[f"{key}_ours"] <= counts[f"{key}_torch"], (setup, counts)
    assert ours["ops"] == theirs["ops"], (setup, ours["ops"], theirs["ops"])  # same code compiled
    return counts


@pytest.mark.parametrize(
    "setup",
    [
        "compile_blocks_then_shard",
        "compile_blocks_then_shard_bf16",
        "compile_blocks_in_place_then_shard",
        "shard_then_compile_blocks",
        "shard_then_compile_model",
    ],
)
def test_compile_matches_torch(world2: WorkerPool, setup: str) -> None:
    """Oracle: torch's fully_shard compiled the same way (bitwise; dynamo counts no higher)."""
    results = world2.run(_compare, setup)
    assert results[0] == results[1], results  # both ranks compiled the same way
    counts = results[0]
    assert isinstance(counts, dict)
    # The blocks share one code object and their parameters are graph inputs, so both blocks
    # run one graph: no break, no recompile (fullgraph=True would have raised at a break).
    assert counts["frames_ours"] == 1, counts
    assert counts["graph_breaks_ours"] == 0 and counts["recompiles_ours"] == 0, counts
