"""torch 2.15's mixed-precision changes, against torch's own fully_shard on the installed torch.

* ``reduce_dtype=None`` reduces in the parameter's own dtype from torch 2.15
  (``REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE``), in ``param_dtype`` before: the same tests pass on both,
  since the oracle is the installed torch; the reduce-scatter dtype is also checked in closed form.
* ``MixedPrecisionPolicy(param_dtype_override_fn=...)``: offered on every torch; torch's own
  fully_shard is the oracle where torch has the field (2.15), a closed form everywhere (the
  gathered parameters are the full ones, cast or not, and the gradients reduce in fp32).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import record_function

from shardweave.fsdp import MixedPrecisionPolicy, fully_shard
from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE
from shardweave.fsdp.faults._consistency import FSDPConsistencyError
from tests._dist import WorkerPool
from tests._dist.stream_sanitizer import stream_sanitizer
from tests.fsdp._models import TinyGPT, loss_fn, make_batch, make_model
from tests.fsdp._oracle import TORCH_HAS_EXPLICIT_GRAD_DTYPE, assert_same_as_torch
from tests.fsdp._plan_real import grad_storages, held_by, memory_profile

TORCH_HAS_OVERRIDE = "param_dtype_override_fn" in {
    f.name for f in dataclasses.fields(TorchMixedPrecisionPolicy)
}
# With reduce_dtype=None and bf16 compute over fp32 parameters: what the gradients reduce in.
DEFAULT_REDUCE = torch.float32 if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE else torch.bfloat16


def _keep_norms_fp32(model: nn.Module) -> Callable[[nn.Parameter], torch.dtype | None]:
    """An override keeping every LayerNorm parameter in its own dtype (fp32)."""
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    return lambda p: p.dtype if id(p) in norms else None


def _shard(model: nn.Module, api: Any, policy: Any, mesh: Any = None) -> None:
    for block in model.layers:  # type: ignore[union-attr]
        api(block, mp_policy=policy, mesh=mesh)
    api(model, mp_policy=policy, mesh=mesh)


@contextmanager
def _reduce_scatter_dtypes() -> Iterator[list[torch.dtype]]:
    """The dtype of every reduce-scatter input (by either of torch's names) and all-reduce
    tensor issued inside."""
    seen: list[torch.dtype] = []
    names = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def recorder(fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            # all_reduce(tensor, ...) or reduce_scatter(output, input, ...), by position or name
            tensors = [t for t in a if isinstance(t, torch.Tensor)]
            tensor = k.get("input", k.get("tensor", tensors[-1] if tensors else None))
            seen.append(tensor.dtype)
            return fn(*a, **k)

        return wrapped

    for name, fn in saved.items():
        setattr(dist, name, recorder(fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _train_and_compare(
    rank: int,
    model: nn.Module,
    tmodel: nn.Module | None,
    *,
    steps: int = 2,
    microbatches: int = 1,
    expect_reduce: torch.dtype,
) -> None:
    """SGD steps of both models (``tmodel`` None: ours only); bitwise per step when torch's is
    given; the sharded params and grads stay fp32 and the reduce-scatters run in
    ``expect_reduce``."""
    models = [m for m in (model, tmodel) if m is not None]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(steps):
        for micro in range(microbatches):
            last = micro == microbatches - 1
            batch = make_batch("gpt", 1000 * step + 10 * micro + rank)
            losses = []
            for i, m in enumerate(models):
                m.set_requires_gradient_sync(last)  # type: ignore[operator]
                with _reduce_scatter_dtypes() as seen:
                    loss = loss_fn("gpt", m(batch).float(), batch)
                    loss.backward()
                losses.append(loss.detach())
                if i == 0:
                    assert set(seen) <= {expect_reduce}, (seen, expect_reduce)
                    assert bool(seen) == last, (seen, last)
            if tmodel is not None:
                assert torch.equal(losses[0], losses[1]), f"step {step}.{micro}: loss differs"
        if tmodel is not None:
            assert_same_as_torch(model, tmodel, f"step {step}")
        for p in model.parameters():
            assert p.dtype == torch.float32 and p.grad is not None
            assert p.grad.dtype == torch.float32, p.grad.dtype
        for o in opts:
            o.step()
            o.zero_grad()
        if tmodel is not None:
            assert_same_as_torch(model, tmodel, f"after step {step}")


# --- reduce_dtype=None ------------------------------------------------------------------------
def bf16_default_reduce(rank: int, world: int, microbatches: int, hsdp: bool) -> None:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("rep", "shard")) if hsdp else None
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    _shard(model, fully_shard, MixedPrecisionPolicy(param_dtype=torch.bfloat16), mesh)
    _shard(tmodel, torch_fully_shard, TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16), mesh)
    # HSDP over a 1-rank shard group still reduce-scatters (a copy), in the same dtype
    _train_and_compare(rank, model, tmodel, microbatches=microbatches, expect_reduce=DEFAULT_REDUCE)


@pytest.mark.parametrize(
    ("microbatches", "hsdp"), [(1, False), (3, False), (1, True)], ids=["fsdp", "no-sync", "hsdp"]
)
def test_bf16_with_default_reduce_dtype_matches_torch(
    world2: WorkerPool, microbatches: int, hsdp: bool
) -> None:
    """Oracles: compatibility, bitwise (losses, shards, grads and their dtypes vs torch's
    fully_shard on the installed torch, also accumulating two microbatches without sync, and on
    an HSDP mesh); closed form for the reduce-scatter dtype (fp32 from torch 2.15, bf16 before)."""
    world2.run(bf16_default_reduce, microbatches, hsdp)


# --- param_dtype_override_fn ------------------------------------------------------------------
def _gathered_dtypes_and_values(model: nn.Module, full: nn.Module) -> list[str]:
    """Hooks on block 0: in forward its unsharded norm1 weight must be fp32 and equal the full
    model's, its qkv weight bf16 and equal the full one cast; returns what failed."""
    problems: list[str] = []
    block, ref = model.layers[0], full.layers[0]  # type: ignore[index]

    def check(module: nn.Module, args: Any) -> None:
        handle.remove()  # the first forward only: the full model does not train
        for mod, rmod, dtype in ((block.norm1, ref.norm1, torch.float32),
                                 (block.qkv, ref.qkv, torch.bfloat16)):  # fmt: skip
            w, expected = mod.weight, rmod.weight.detach().to(dtype)
            if w.dtype != dtype or not torch.equal(w.detach(), expected):
                problems.append(f"{type(mod).__name__}.weight: {w.dtype}, equal={w.dtype == dtype}")

    handle = block.register_forward_pre_hook(check)
    return problems


def override_keeps_norms(rank: int, world: int, microbatches: int, torch_policy: bool) -> None:
    model = make_model("gpt")
    full = copy.deepcopy(model)
    tmodel = copy.deepcopy(model)
    policy_cls = TorchMixedPrecisionPolicy if torch_policy else MixedPrecisionPolicy
    _shard(model, fully_shard, policy_cls(torch.bfloat16, param_dtype_override_fn=_keep_norms_fp32(model)))  # type: ignore[call-arg]  # fmt: skip
    problems = _gathered_dtypes_and_values(model, full)
    oracle = None
    if TORCH_HAS_OVERRIDE:
        policy = TorchMixedPrecisionPolicy(
            torch.bfloat16,
            param_dtype_override_fn=_keep_norms_fp32(tmodel),  # type: ignore[call-arg]
        )
        _shard(tmodel, torch_fully_shard, policy)
        oracle = tmodel
    # bf16 and fp32 gradients in one group reduce in their promoted dtype, on every torch
    _train_and_compare(
        rank, model, oracle, microbatches=microbatches, expect_reduce=torch.float32, steps=2
    )
    assert not problems, problems
    # norms unconverted, the rest cast: it is not the same model as without the override
    state = fully_shard.state(model.layers[0])  # type: ignore[index]
    assert state is not None
    dtypes = [p.param_dtype for g in state._fsdp_param_groups for p in g.fsdp_params]
    assert dtypes.count(None) == 4 and dtypes.count(torch.bfloat16) == 8, dtypes


@pytest.mark.parametrize(
    ("microbatches", "torch_policy"),
    [(1, False), (3, False), (1, True)],
    ids=["ours", "no-sync", "torch-policy"],
)
def test_param_dtype_override_keeps_norms_fp32(
    world2: WorkerPool, microbatches: int, torch_policy: bool
) -> None:
    """Oracles: compatibility, bitwise, against torch's fully_shard with the same override
    where torch has it (2.15; torch's policy object converted to ours in ``torch-policy``);
    closed form on every torch: the gathered norm weights are the fp32 full ones, the others
    the full ones cast to bf16, the one reduce-scatter runs in fp32, grads stay fp32."""
    if torch_policy and not TORCH_HAS_OVERRIDE:
        pytest.skip("torch's MixedPrecisionPolicy has no param_dtype_override_fn before 2.15")
    world2.run(override_keeps_norms, microbatches, torch_policy)


def bad_override(rank: int, world: int) -> list[str]:
    messages = []
    for answer in (torch.float16, "bf16"):
        fns = [(fully_shard, MixedPrecisionPolicy)]
        if TORCH_HAS_OVERRIDE:
            fns.append((torch_fully_shard, TorchMixedPrecisionPolicy))
        for api, cls in fns:
            policy = cls(torch.bfloat16, param_dtype_override_fn=lambda p, a=answer: a)  # type: ignore[call-arg]
            with pytest.raises(ValueError, match="param_dtype_override_fn must return") as info:
                api(nn.Linear(2, 2), mp_policy=policy)
            messages.append(str(info.value))
    return messages


def test_bad_override_raises_value_error_on_every_rank(world2: WorkerPool) -> None:
    """Oracle: compatibility (torch 2.15 raises ValueError at fully_shard time, for another
    low-precision dtype and for a non-dtype), on every rank."""
    for messages in world2.run(bad_override):
        assert isinstance(messages, list) and len(messages) >= 2, messages


def rank_dependent_override(rank: int, world: int) -> None:
    model = TinyGPT()
    keep = _keep_norms_fp32(model)
    fn = keep if rank == 0 else (lambda p: None)
    _shard(model, fully_shard, MixedPrecisionPolicy(torch.bfloat16, param_dtype_override_fn=fn))
    batch = make_batch("gpt", rank)
    with pytest.raises(FSDPConsistencyError, match=r"(?s)First difference.*param_dtype"):
        model(batch)


def test_rank_dependent_override_is_caught_at_lazy_init(world2: WorkerPool) -> None:
    """Oracle: the cross-rank fingerprint compares the resolved per-parameter dtypes (not the
    callable, whose repr differs by address): a rank-dependent override raises on every rank
    before any collective (torch 2.15 documents a possible hang)."""
    world2.run(rank_dependent_override)


def same_override_on_every_rank(rank: int, world: int) -> None:
    model = TinyGPT()
    # a fresh closure per rank (distinct objects, distinct addresses), the same answers
    fn = _keep_norms_fp32(model)
    _shard(model, fully_shard, MixedPrecisionPolicy(torch.bfloat16, param_dtype_override_fn=fn))
    loss_fn("gpt", model(make_batch("gpt", rank)).float(), make_batch("gpt", rank)).backward()


def test_same_override_on_every_rank_passes_the_fingerprint(world2: WorkerPool) -> None:
    """Oracle: closed form: equal answers on every rank are no mismatch."""
    world2.run(same_override_on_every_rank)


# --- accelerator branches ---------------------------------------------------------------------
def sanitized(rank: int, world: int, variant: str) -> dict[str, Any]:
    with stream_sanitizer(accelerator=True) as report:
        model = make_model("gpt")
        fn = _keep_norms_fp32(model) if variant == "mixed-group" else None
        if variant == "explicit-grad-dtypes":
            _set_grad_dtype(model, "matrices")
        _shard(model, fully_shard, MixedPrecisionPolicy(torch.bfloat16, param_dtype_override_fn=fn))
        for step in range(2):
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]
                batch = make_batch("gpt", 100 * step + 10 * micro + rank)
                loss_fn("gpt", model(batch).float(), batch).backward()
            for p in model.parameters():
                expected = _explicit_or(p, torch.float32)
                assert p.grad is not None and p.grad.dtype == expected, (p.grad, expected)
            model.zero_grad()
    return {"races": report.races, "unsafe": report.unsafe_reuses}


def _explicit_or(p: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """An explicit ``grad_dtype`` if one was set on ``p``, else ``dtype``."""
    return p.grad_dtype if getattr(p, "_has_grad_dtype_override", False) else dtype


@pytest.mark.parametrize("variant", ["default-reduce", "mixed-group", "explicit-grad-dtypes"])
def test_new_reduce_dtypes_are_race_free_on_accelerator_branches(
    world2: WorkerPool, variant: str
) -> None:
    """Oracle: the stream sanitizer (0 races, 0 unsafe reuses) over bf16 compute with the
    default reduce dtype, a mixed bf16/fp32 group (``param_dtype_override_fn``) and, on torch
    2.15, explicit bf16 ``grad_dtype``s on the matrices (cast and copied runs), with
    accumulation without sync."""
    if variant == "explicit-grad-dtypes" and not TORCH_HAS_EXPLICIT_GRAD_DTYPE:
        pytest.skip("parameters have no explicit-grad_dtype flag before torch 2.15")
    for result in world2.run(sanitized, variant):
        assert isinstance(result, dict)
        assert not result["races"] and not result["unsafe"], result


# --- an explicit Parameter.grad_dtype (torch 2.15) ---------------------------------------------
GRAD_DTYPE_CASES: dict[str, dict[str, Any]] = {
    # no mixed precision: fp32 parameters whose gradients are bf16
    "fp32-params-bf16-grads": {"param_dtype": None, "reduce_dtype": None, "on": "all"},
    # bf16 compute, no reduce_dtype: reduced in the explicit bf16, not the parameter's fp32
    "bf16-compute-bf16-grads": {"param_dtype": torch.bfloat16, "reduce_dtype": None, "on": "all"},
    # reduce_dtype wins for the reduction; the sharded gradients are then cast to grad_dtype
    "fp32-reduce-bf16-grads": {
        "param_dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "on": "all",
    },
    # only the LayerNorms' gradients are bf16: one group, two gradient dtypes
    "norms-only": {"param_dtype": torch.bfloat16, "reduce_dtype": None, "on": "norms"},
    # only the matrices' gradients are bf16: most of each group's output is cast, so the
    # few fp32 gradients are copied out of it rather than keeping all of it alive
    "matrices-only": {"param_dtype": None, "reduce_dtype": None, "on": "matrices"},
    # set on the sharded parameters after fully_shard, before the first forward
    "after-fully-shard": {"param_dtype": torch.bfloat16, "reduce_dtype": None, "on": "sharded"},
}


def _set_grad_dtype(model: nn.Module, on: str) -> None:
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    for p in model.parameters():
        if on == "all" or (on == "norms" and id(p) in norms) or (on == "matrices" and p.ndim == 2):
            p.grad_dtype = torch.bfloat16


def explicit_grad_dtype(rank: int, world: int, case: str, microbatches: int) -> None:
    cfg = GRAD_DTYPE_CASES[case]
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(cfg["param_dtype"], cfg["reduce_dtype"])
    tpolicy = TorchMixedPrecisionPolicy(cfg["param_dtype"], cfg["reduce_dtype"])
    if cfg["on"] != "sharded":
        _set_grad_dtype(model, cfg["on"])
        _set_grad_dtype(tmodel, cfg["on"])
    _shard(model, fully_shard, policy)
    _shard(tmodel, torch_fully_shard, tpolicy)
    if cfg["on"] == "sharded":
        _set_grad_dtype(model, "all")
        _set_grad_dtype(tmodel, "all")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, tmodel)]
    for step in range(2):
        with memory_profile() as prof:
            ptrs = _explicit_grad_dtype_step(model, tmodel, opts, case, step, rank, microbatches)
        # What the gradients really held: the allocations holding them when dropped.
        held = held_by(prof, "drop 0", ptrs[0]), held_by(prof, "drop 1", ptrs[1])
        assert held[0] == held[1] > 0, f"{case} step {step}: gradients hold {held} bytes"


def _explicit_grad_dtype_step(  # one step of both engines, then each drops its gradients
    model: nn.Module,
    tmodel: nn.Module,
    opts: list[torch.optim.Optimizer],
    case: str,
    step: int,
    rank: int,
    microbatches: int,
) -> list[list[int]]:
    for micro in range(microbatches):
        batch = make_batch("gpt", 1000 * step + 10 * micro + rank)
        losses = []
        for m in (model, tmodel):
            m.set_requires_gradient_sync(micro == microbatches - 1)  # type: ignore[operator]
            loss = loss_fn("gpt", m(batch).float(), batch)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"{case} step {step}.{micro}: loss"
    grads = [(p.grad.dtype, tp.grad.dtype) for p, tp in  # type: ignore[union-attr]
             zip(model.parameters(), tmodel.parameters(), strict=True)]  # fmt: skip
    assert all(ours == theirs for ours, theirs in grads), (case, grads)
    # closed form: the explicit dtype is the gradients' (bf16 where it was set)
    assert torch.bfloat16 in {ours for ours, _ in grads}, (case, grads)
    assert_same_as_torch(model, tmodel, f"{case} step {step}")
    for o in opts:
        o.step()
    assert_same_as_torch(model, tmodel, f"{case} after step {step}")
    held = [grad_storages(m) for m in (model, tmodel)]
    for i, o in enumerate(opts):
        with record_function(f"drop {i}"):
            o.zero_grad()
            gc.collect()
    return held


@pytest.mark.skipif(
    not TORCH_HAS_EXPLICIT_GRAD_DTYPE,
    reason="parameters have no explicit-grad_dtype flag before torch 2.15",
)
@pytest.mark.parametrize(
    ("case", "microbatches"),
    [*((c, 1) for c in GRAD_DTYPE_CASES), ("bf16-compute-bf16-grads", 3)],
    ids=[*GRAD_DTYPE_CASES, "no-sync"],
)
def test_explicit_grad_dtype_matches_torch(
    world2: WorkerPool, case: str, microbatches: int
) -> None:
    """Oracle: compatibility, bitwise with torch 2.15's fully_shard (losses, shards, grads and
    their dtypes), for a ``Parameter.grad_dtype`` set before or after sharding, on every
    parameter, a group's LayerNorms or its matrices only, with and without ``reduce_dtype``,
    and accumulating microbatches without sync; and the gradients hold as many bytes as
    torch's (a mixed group's fp32 gradients do not keep its whole reduced output alive)."""
    world2.run(explicit_grad_dtype, case, microbatches)


def explicit_none_grad_dtype(rank: int, world: int) -> None:
    model = make_model("gpt")
    model.layers[0].fc1.weight.grad_dtype = None  # type: ignore[index, union-attr]
    with pytest.raises(
        NotImplementedError, match=r"'Linear\.weight' has an explicit grad_dtype=None"
    ):
        _shard(model, fully_shard, MixedPrecisionPolicy(torch.bfloat16))


@pytest.mark.skipif(
    not TORCH_HAS_EXPLICIT_GRAD_DTYPE,
    reason="parameters have no explicit-grad_dtype flag before torch 2.15",
)
def test_explicit_none_grad_dtype_is_a_clear_error(world2: WorkerPool) -> None:
    """Oracle: closed form: not supported yet, so refused at fully_shard on every rank, the
    parameter named as fully_shard knows it then (it failed with an AttributeError at the
    first backward)."""
    world2.run(explicit_none_grad_dtype)
