"""``FSDPModule.set_keep_unsharded_storage`` (torch 2.15's API, offered on every torch).

Oracles: *compatibility* where torch's ``FSDPModule`` has the method (torch's ``fully_shard``
with the same setting: losses, sharded parameters and sharded gradients bitwise equal, and its
unsharded data pointers as stable as ours); elsewhere our own engine with ``keep=False``
(keeping the storage must change no number). *Closed form* for the memory: with keep, every
unsharded parameter has one data pointer for the whole run and its storage is allocated after
each reshard; without, its storage is 0 bytes after a reshard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from shardweave.fsdp import FSDPModule, fully_shard, trace
from shardweave.fsdp._torch_interop import unimplemented_torch_methods
from tests._dist import WorkerPool
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._stream_order import check_watched, sanitized_vs_plain, wrap_scenario

TORCH_HAS_IT = hasattr(TorchFSDPModule, "set_keep_unsharded_storage")


def _groups(module: nn.Module) -> list[Any]:
    # Both engines' FSDPModule: the state's groups (torch's internals, read by the test only).
    return list(module._get_fsdp_state()._fsdp_param_groups)  # type: ignore[operator]


def _storages(module: nn.Module) -> list[torch.Tensor]:
    """Each of ``module``'s own parameters' unsharded storage tensors (both engines)."""
    out: list[torch.Tensor] = []
    for group in _groups(module):
        for p in group.fsdp_params:
            outs = getattr(p, "all_gather_outputs", None)  # torch's FSDPParam
            out += list(outs) if outs is not None else [p.all_gather_output]
    return out


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, TorchFSDPModule)]


def _unsharded_ptrs(model: nn.Module) -> list[int]:
    return [t.data_ptr() for m in _fsdp_modules(model) for t in _storages(m)]


def _storage_bytes(model: nn.Module) -> list[int]:
    return [t.untyped_storage().nbytes() for m in _fsdp_modules(model) for t in _storages(m)]


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    # A block's parameters, or the root's outside its wrapped blocks.
    return [p for n, p in module.named_parameters() if not n.startswith("layers.")]


def _train(rank: int, world: int, engine: str, keep: bool | None, rsf: Any) -> dict[str, Any]:
    """Three steps of TinyGPT, an explicit unshard/reshard of every module, a fourth step.

    Records the data pointers of the unsharded parameters as the forward sees them (a pre-hook
    registered after fully_shard's), the unsharded storage after each step, and the numbers.
    """
    model = make_model("gpt")
    wrap_scenario(model, {"reshard_after_forward": rsf}, world, engine)
    if keep is not None:
        model.set_keep_unsharded_storage(keep)  # type: ignore[operator]
    seen: list[list[int]] = []
    for m in _fsdp_modules(model):
        m.register_forward_pre_hook(
            lambda mod, args: seen[-1].extend(p.data_ptr() for p in _own_params(mod))
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"loss": [], "grad": [], "param": [], "fwd": [], "after": []}
    out["bytes"] = []
    for step in range(4):
        if step == 3:
            # explicit unshard()/reshard() (not recursive) of every FSDP module
            for m in _fsdp_modules(model):
                m.unshard()  # type: ignore[operator]
            out["explicit"] = _unsharded_ptrs(model)
            for m in _fsdp_modules(model):
                m.reshard()  # type: ignore[operator]
        seen.append([])
        batch = make_batch("gpt", 1000 * step + rank)
        loss = loss_fn("gpt", model(batch), batch)
        loss.backward()
        out["loss"].append(loss.detach().clone())
        out["grad"] += [p.grad.to_local().clone() for p in model.parameters()]  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        out["fwd"].append(seen[-1])
        out["after"].append(_unsharded_ptrs(model))
        out["bytes"].append(_storage_bytes(model))
    out["param"] = [p.to_local().clone() for p in model.parameters()]  # type: ignore[operator]
    return out


def _same_numbers(got: dict[str, Any], want: dict[str, Any], tag: str) -> None:
    for key in ("loss", "grad", "param"):
        assert len(got[key]) == len(want[key]), f"{tag}: {key} count"
        for i, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{tag}: {key}[{i}] differs"


def _assert_kept(run: dict[str, Any], tag: str) -> None:
    fwd, after = run["fwd"], run["after"]
    assert fwd[0], f"{tag}: the forward saw no parameters"
    moved = [i for i, ptrs in enumerate(fwd) if ptrs != fwd[0]]
    assert not moved, f"{tag}: the forward's data pointers moved at steps {moved}"
    moved = [i for i, ptrs in enumerate(after) if ptrs != after[0]]
    assert not moved, f"{tag}: the unsharded storage moved at steps {moved}"
    assert run["explicit"] == after[0], f"{tag}: unshard() moved the storage"
    for nbytes in run["bytes"]:
        assert all(n > 0 for n in nbytes), f"{tag}: kept storage was freed: {nbytes}"


def keep_storage_case(rank: int, world: int, rsf: Any) -> None:
    ours = _train(rank, world, "ours", True, rsf)
    _assert_kept(ours, f"ours rsf={rsf}")
    if TORCH_HAS_IT:
        theirs = _train(rank, world, "torch", True, rsf)
        _assert_kept(theirs, f"torch rsf={rsf}")  # the oracle keeps its pointers too
    else:
        theirs = _train(rank, world, "ours", False, rsf)
    _same_numbers(ours, theirs, f"rank {rank} rsf={rsf}")


def default_frees_case(rank: int, world: int) -> None:
    runs = [("ours", None), ("ours", False)]
    if TORCH_HAS_IT:
        runs.append(("torch", None))
    results = [_train(rank, world, engine, keep, True) for engine, keep in runs]
    for (engine, keep), run in zip(runs, results, strict=True):
        for nbytes in run["bytes"]:
            assert nbytes and all(n == 0 for n in nbytes), (engine, keep, nbytes)
    _same_numbers(results[0], results[-1], f"rank {rank} default")


def recurse_false_case(rank: int, world: int) -> None:
    model = make_model("gpt")
    wrap_scenario(model, {}, world)
    layers = list(model.layers)  # type: ignore[arg-type]
    layers[0].set_keep_unsharded_storage(True, recurse=False)
    model.set_keep_unsharded_storage(True, recurse=False)  # type: ignore[operator]
    for step in range(2):
        batch = make_batch("gpt", 1000 * step + rank)
        loss_fn("gpt", model(batch), batch).backward()
        for module, kept in ((model, True), (layers[0], True), (layers[1], False)):
            nbytes = [t.untyped_storage().nbytes() for t in _storages(module)]
            assert nbytes and all((n > 0) == kept for n in nbytes), (step, type(module), nbytes)
    # keep=False: what was kept is freed at the next reshard
    model.set_keep_unsharded_storage(False)  # type: ignore[operator]
    for m in _fsdp_modules(model):
        m.unshard()  # type: ignore[operator]
        m.reshard()  # type: ignore[operator]
    assert all(n == 0 for n in _storage_bytes(model)), _storage_bytes(model)


def traced_case(rank: int, world: int) -> list[dict[str, Any]]:
    """Two traced steps of TinyGPT per setting: the tracer's summary of each."""
    out = []
    for keep in (False, True):
        model = make_model("gpt")
        wrap_scenario(model, {}, world)
        model.set_keep_unsharded_storage(keep)  # type: ignore[operator]
        with trace() as tracer:
            for step in range(2):
                batch = make_batch("gpt", 1000 * step + rank)
                loss_fn("gpt", model(batch), batch).backward()
                tracer.step()
        out.append(tracer.summary())
    default, kept = out
    for step in range(2):
        d, k = default["steps"][step], kept["steps"][step]
        assert d["end_gathered_bytes"] == 0, d
        # Every group's gathered bytes stay alive once gathered: the end of each step holds
        # all of them, which is also the peak.
        every = sum(g["peak_gathered_bytes"] for g in d["groups"].values())
        assert k["end_gathered_bytes"] == every == k["peak_gathered_bytes"], (
            step,
            every,
            k["end_gathered_bytes"],
            k["peak_gathered_bytes"],
        )
        for key, g in d["groups"].items():
            assert (k["groups"][key]["unshard"], k["groups"][key]["reshard"]) == (
                g["unshard"],
                g["reshard"],
            ), key
    return out


def ours_and_bad_flag_case(rank: int, world: int) -> None:
    model = make_model("gpt")
    shard_blocks(model, fully_shard)
    assert isinstance(model, FSDPModule)
    # ours on every torch: never the marker guard's stand-in (torch 2.15 added the method)
    assert "set_keep_unsharded_storage" not in unimplemented_torch_methods(type(model))
    assert "set_keep_unsharded_storage" in vars(FSDPModule)
    with pytest.raises(TypeError, match="set_keep_unsharded_storage: keep must be a bool"):
        model.set_keep_unsharded_storage("yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("rsf", [True, False], ids=["reshard-after-forward", "no-reshard"])
def test_keep_unsharded_storage_keeps_data_pointers(world2: WorkerPool, rsf: bool) -> None:
    """Oracle: torch's fully_shard with the same setting where it has the method (bitwise
    losses, sharded params and grads), else ours with keep=False; closed form for pointers."""
    world2.run(keep_storage_case, rsf)


def test_default_frees_unsharded_storage(world2: WorkerPool) -> None:
    """Closed form: 0 bytes after every reshard by default and with keep=False (torch too)."""
    world2.run(default_frees_case)


def test_recurse_false_touches_only_that_module(world2: WorkerPool) -> None:
    """Closed form: only the modules set keep; keep=False frees at the next reshard."""
    world2.run(recurse_false_case)


def test_tracer_keeps_kept_bytes_alive(world2: WorkerPool) -> None:
    """Closed form: with keep, each step ends (and peaks) with every group's gathered bytes;
    the unshard and reshard counts are the default's."""
    world2.run(traced_case)


def test_keep_is_ours_and_requires_a_bool(world2: WorkerPool) -> None:
    """Closed form: our method answers (not the guard); a non-bool raises TypeError."""
    world2.run(ours_and_bad_flag_case)


def test_keep_unsharded_storage_is_race_free_on_the_test_accelerator(world2: WorkerPool) -> None:
    """Oracle: the CPU branches' numbers and torch's fully_shard, bitwise; no race, no
    unsafe reuse under stream_sanitizer(accelerator=True)."""
    cfg: dict[str, Any] = {"keep_unsharded_storage": True}
    check_watched(world2.run(sanitized_vs_plain, cfg, True), cfg)
    # Mixed precision: the kept storage is the bf16 unsharded parameters. The CPU branches
    # are the oracle here (passing our MixedPrecisionPolicy to torch 2.15's fully_shard
    # fails inside torch, whatever the storage setting).
    cfg = {"keep_unsharded_storage": True, "mp": True}
    check_watched(world2.run(sanitized_vs_plain, cfg, True, False), cfg)
