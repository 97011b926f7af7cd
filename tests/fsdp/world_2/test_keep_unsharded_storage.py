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

from shardweave.fsdp import FSDPModule, fully_shard, trace
from shardweave.fsdp._torch_interop import unimplemented_torch_methods
from tests._dist import WorkerPool
from tests.fsdp._keep_storage import (
    default_frees_case,
    fsdp_modules,
    keep_storage_case,
    storage_bytes,
    storages,
)
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._stream_order import check_watched, sanitized_vs_plain, wrap_scenario


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
            nbytes = [t.untyped_storage().nbytes() for t in storages(module)]
            assert nbytes and all((n > 0) == kept for n in nbytes), (step, type(module), nbytes)
    # keep=False: what was kept is freed at the next reshard
    model.set_keep_unsharded_storage(False)  # type: ignore[operator]
    for m in fsdp_modules(model):
        m.unshard()  # type: ignore[operator]
        m.reshard()  # type: ignore[operator]
    assert all(n == 0 for n in storage_bytes(model)), storage_bytes(model)


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


CASES: dict[str, dict[str, Any]] = {
    "reshard-after-forward": {"reshard_after_forward": True},
    "no-reshard-after-forward": {"reshard_after_forward": False},
    "cpu-offload": {"offload": True},
}


@pytest.mark.parametrize("cfg", list(CASES.values()), ids=list(CASES))
def test_keep_unsharded_storage_keeps_data_pointers(
    world2: WorkerPool, cfg: dict[str, Any]
) -> None:
    """Oracle: torch's fully_shard with the same setting where it has the method (bitwise
    losses, sharded params and grads), else ours with keep=False; closed form for pointers
    (steps, and an explicit unshard()/reshard() of every module before the last step)."""
    world2.run(keep_storage_case, cfg)


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
