"""Mixed precision and CPU offload, against torch's own fully_shard under the same policy.

Oracles: *compatibility* (bitwise: same placements, shards and gradients as torch's FSDP2),
and *closed form* for the dtypes (sharded params and grads stay in the original dtype).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from tests._dist import WorkerPool
from tests.fsdp._models import TinyGPT, loss_fn, make_batch, make_model
from tests.fsdp._oracle import assert_same_as_torch

# Fields torch added in a later release that our policies offer on every torch.
OFFERED_ON_EVERY_TORCH = {"param_dtype_override_fn"}  # torch 2.15
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}


def _policies(mp: dict[str, Any]) -> tuple[Any, Any]:
    kwargs = {k: DTYPES.get(v, v) if k != "cast_forward_inputs" else v for k, v in mp.items()}
    return MixedPrecisionPolicy(**kwargs), TorchMixedPrecisionPolicy(**kwargs)


def mixed_precision_parity(
    rank: int, world: int, kind: str, mp: dict[str, Any], root_mp: dict[str, Any] | None
) -> None:
    model = make_model(kind)
    tmodel = copy.deepcopy(model)
    ours, theirs = _policies(mp)
    root_ours, root_theirs = _policies(root_mp) if root_mp is not None else (ours, theirs)
    for m, api, pol, root_pol in (
        (model, fully_shard, ours, root_ours),
        (tmodel, torch_fully_shard, theirs, root_theirs),
    ):
        blocks = m.layers if isinstance(m, TinyGPT) else [m.in_proj, m.out_proj]  # type: ignore[union-attr]
        for block in blocks:
            api(block, mp_policy=pol)
        api(m, mp_policy=root_pol)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.05)
    for step in range(3):
        batch = make_batch(kind, 1000 * step + rank)
        outs = []
        for m in (model, tmodel):
            out = m(batch)
            outs.append(out)
            loss_fn(kind, out.float(), batch).backward()
        assert outs[0].dtype == outs[1].dtype, (outs[0].dtype, outs[1].dtype)
        assert torch.equal(outs[0], outs[1]), f"step {step}: outputs differ from torch"
        assert_same_as_torch(model, tmodel, f"{mp} step {step}")
        for p in model.parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32  # type: ignore[union-attr]
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()
        assert_same_as_torch(model, tmodel, f"{mp} after step {step}")


MP_CASES = [
    ("mlp", {"param_dtype": "bf16"}, None),
    ("mlp", {"param_dtype": "bf16", "reduce_dtype": "fp32"}, None),
    ("mlp", {"param_dtype": "fp16", "reduce_dtype": "fp32"}, None),
    ("mlp", {"param_dtype": "fp16"}, None),
    (
        "gpt",
        {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        {"param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "fp32"},
    ),
    ("mlp", {"reduce_dtype": "bf16"}, None),
]


@pytest.mark.parametrize(
    ("kind", "mp", "root_mp"), MP_CASES, ids=[f"{k}-{m}-{r}" for k, m, r in MP_CASES]
)
def test_mixed_precision_matches_torch(
    world2: WorkerPool, kind: str, mp: dict[str, Any], root_mp: dict[str, Any] | None
) -> None:
    """Oracle: compatibility, bitwise, including outputs and nested policies."""
    world2.run(mixed_precision_parity, kind, mp, root_mp)


def no_input_cast(rank: int, world: int) -> None:
    for api, pol_cls in (
        (fully_shard, MixedPrecisionPolicy),
        (torch_fully_shard, TorchMixedPrecisionPolicy),
    ):
        model = make_model("mlp")
        api(model, mp_policy=pol_cls(param_dtype=torch.bfloat16, cast_forward_inputs=False))
        with pytest.raises(RuntimeError):
            model(make_batch("mlp", 0))  # fp32 input into bf16 weights
        if not hasattr(model, "reset_iter_state"):
            # torch 2.11's FSDPModule has no reset_iter_state to recover from the failed
            # forward; the refusal above is what is compared (ours always has it)
            assert api is torch_fully_shard
            continue
        model.reset_iter_state()  # type: ignore[operator]
        out = model(make_batch("mlp", 0).bfloat16())
        assert out.dtype == torch.bfloat16


def test_cast_forward_inputs_false(world2: WorkerPool) -> None:
    """Oracle: compatibility: torch and we both refuse an fp32 input to bf16 weights."""
    world2.run(no_input_cast)


def cpu_offload_parity(rank: int, world: int) -> None:
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    for m, api, pol in (
        (model, fully_shard, CPUOffloadPolicy(pin_memory=False)),
        (tmodel, torch_fully_shard, TorchCPUOffloadPolicy(pin_memory=False)),
    ):
        for block in m.layers:  # type: ignore[union-attr]
            api(block, offload_policy=pol)
        api(m, offload_policy=pol)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-3)
    for step in range(2):
        batch = make_batch("gpt", step * 10 + rank)
        for m in (model, tmodel):
            loss_fn("gpt", m(batch), batch).backward()
        assert_same_as_torch(model, tmodel, f"offload step {step}")
        for p in model.parameters():
            assert p.device.type == "cpu" and p.grad.device.type == "cpu"  # type: ignore[union-attr]
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()


def test_cpu_offload_matches_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility (on a CPU-only machine the copies are trivial; the GPU path
    needs a GPU run)."""
    world2.run(cpu_offload_parity)


def pinned_offload_without_accelerator(rank: int, world: int) -> None:
    if torch.accelerator.is_available():
        return
    errors = []
    for api, pol in (
        (torch_fully_shard, TorchCPUOffloadPolicy()),
        (fully_shard, CPUOffloadPolicy()),
    ):
        model = make_model("mlp")
        with pytest.raises(Exception) as err:
            api(model, offload_policy=pol)
            model(make_batch("mlp", 0))
        errors.append(err.value)
    assert isinstance(errors[1], type(errors[0])), errors


def test_pinned_offload_without_accelerator_raises_like_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility: pin_memory=True needs an accelerator."""
    world2.run(pinned_offload_without_accelerator)


def _shard_gpt(api: Any, model: nn.Module, mp: Any, offload: Any) -> None:
    for block in model.layers:  # type: ignore[union-attr]
        api(block, mp_policy=mp, offload_policy=offload)
    api(model, mp_policy=mp, offload_policy=offload)


def torch_policy_objects(rank: int, world: int) -> None:
    """Our fully_shard given torch's policy objects, given ours, and torch's fully_shard given
    torch's: bf16 compute, fp32 reduction, CPU offload without pinning."""
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    with_theirs, with_ours, oracle = (make_model("gpt") for _ in range(3))
    _shard_gpt(
        fully_shard,
        with_theirs,
        TorchMixedPrecisionPolicy(**mp),
        TorchCPUOffloadPolicy(pin_memory=False),
    )
    _shard_gpt(
        fully_shard, with_ours, MixedPrecisionPolicy(**mp), CPUOffloadPolicy(pin_memory=False)
    )
    _shard_gpt(
        torch_fully_shard,
        oracle,
        TorchMixedPrecisionPolicy(**mp),
        TorchCPUOffloadPolicy(pin_memory=False),
    )
    state = fully_shard.state(with_theirs)
    assert state is not None and isinstance(state._mp_policy, MixedPrecisionPolicy)
    models = (with_theirs, with_ours, oracle)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(2):
        batch = make_batch("gpt", 100 * step + rank)
        outs = [m(batch) for m in models]
        assert all(o.dtype == torch.bfloat16 for o in outs), [o.dtype for o in outs]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), step
        for out in outs:
            loss_fn("gpt", out.float(), batch).backward()
        for p in with_theirs.parameters():  # offloaded, and kept in fp32
            assert p.device.type == "cpu" and p.dtype == torch.float32
            assert p.grad is not None and p.grad.dtype == torch.float32
        assert_same_as_torch(with_theirs, with_ours, f"theirs vs ours step {step}")
        assert_same_as_torch(with_theirs, oracle, f"vs torch's fully_shard step {step}")
        for o in opts:
            o.step()
            o.zero_grad()
        assert_same_as_torch(with_theirs, with_ours, f"theirs vs ours after step {step}")
        assert_same_as_torch(with_theirs, oracle, f"vs torch's fully_shard after step {step}")
    # neither ours nor torch's: a TypeError naming both
    for bad in ({"mp_policy": torch.bfloat16}, {"offload_policy": "cpu"}):
        with pytest.raises(TypeError, match=r"shardweave\.fsdp's or torch\.distributed\.fsdp's"):
            fully_shard(nn.Linear(2, 2), **bad)
    with pytest.raises(TypeError, match="instantiate it"):
        fully_shard(nn.Linear(2, 2), mp_policy=TorchMixedPrecisionPolicy)


def test_torch_policy_objects_accepted(world2: WorkerPool) -> None:
    """Oracles: compatibility, bitwise, two steps: our fully_shard with torch's
    MixedPrecisionPolicy / CPUOffloadPolicy equals it with ours, and equals torch's fully_shard
    with the same objects (outputs, shards, gradients, updated parameters)."""
    world2.run(torch_policy_objects)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (MixedPrecisionPolicy, TorchMixedPrecisionPolicy),
        (OffloadPolicy, TorchOffloadPolicy),
        (CPUOffloadPolicy, TorchCPUOffloadPolicy),
    ],
)
def test_policy_fields_match_torch(ours: type, theirs: type) -> None:
    """Oracle: closed form against torch's dataclasses: the same fields, in the same order, with
    the same defaults and keyword-only flags (so a conversion field by field keeps the meaning);
    ours may end with the fields of a later torch that we offer on every torch."""
    mine = [(f.name, f.default, f.kw_only) for f in dataclasses.fields(ours)]
    torchs = [(f.name, f.default, f.kw_only) for f in dataclasses.fields(theirs)]
    assert mine[: len(torchs)] == torchs
    assert {name for name, _, _ in mine[len(torchs) :]} <= OFFERED_ON_EVERY_TORCH
    assert isinstance(theirs(), theirs)  # constructible with defaults, as ours are
