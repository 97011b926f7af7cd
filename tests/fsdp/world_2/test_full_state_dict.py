"""Full state dicts one tensor at a time: export (with a measured memory bound), loading with
and without a rank-0 broadcast, key errors raised on every rank, and safetensors files.

Oracles: *reference* (the unsharded model's ``state_dict()``), *compatibility* (torch's
``get_model_state_dict`` / ``set_model_state_dict`` with ``full_state_dict=True`` on torch's
``fully_shard``-ed copy: same values, same local shards), and the real ``safetensors`` package
(reads our files; writes files we read).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from shardweave.fsdp import (
    MixedPrecisionPolicy,
    fully_shard,
    get_full_state_dict,
    load_safetensors,
    save_safetensors,
    set_full_state_dict,
)
from shardweave.fsdp._torch_compat import all_gather_single
from tests._dist import WorkerPool, seed_everything
from tests._dist.sync import barrier
from tests.fsdp._full_state_dicts import (
    assert_equal_sd,
    assert_same_local_shards,
    check_broadcast_load,
    check_export,
    cleanup,
    local_shards,
    sharded_pair,
    shared_tmpdir,
)
from tests.fsdp._models import loss_fn, make_batch, make_model

# ---------------------------------------------------------------- export


def export_bodies(rank: int, world: int) -> None:
    seed_everything(0)
    for kind, dtype in (("gpt", torch.float32), ("mlp", torch.bfloat16)):
        model, tmodel, ref = sharded_pair(kind, dtype=dtype)
        check_export(model, tmodel, ref, f"{kind}/{dtype}")
    # tied weights: one gathered tensor under both names, as state_dict() shares it
    model, _, _ = sharded_pair("gpt")
    full = get_full_state_dict(model, rank0_only=False)
    assert full["tok.weight"] is full["head.weight"]
    assert full["tok.weight"].untyped_storage().nbytes() == 13 * 8 * 4, "padding kept"
    # left unsharded in the compute dtype (reshard_after_forward=False, bf16 params): export
    # and load reshard first, so values are the fp32 shards and a load is not lost
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    mlp, _, mlp_ref = sharded_pair("mlp", reshard_after_forward=False, mp_policy=mp)
    batch = make_batch("mlp", rank)
    mlp(batch)
    assert not isinstance(mlp.head.weight, DTensor), "expected unsharded parameters"
    assert_equal_sd(get_full_state_dict(mlp, rank0_only=False), mlp_ref.state_dict(), "unsharded")
    mlp(batch)
    other = make_model("mlp", seed=3).state_dict()
    set_full_state_dict(mlp, other)
    for key, value in mlp.state_dict().items():
        assert torch.equal(value.full_tensor(), other[key]), key
    # after training steps the export follows the live shards
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        batch = make_batch("gpt", 100 * step + rank)
        loss_fn("gpt", model(batch), batch).backward()
        opt.step()
        opt.zero_grad()
    full = get_full_state_dict(model, rank0_only=False)
    for key, value in model.state_dict().items():
        assert torch.equal(full[key], value.full_tensor()), key


def test_full_state_dict_export(world2: WorkerPool) -> None:
    """Oracles: reference and compatibility (torch's get_model_state_dict, full + cpu_offload)."""
    world2.run(export_bodies)


# ---------------------------------------------------------------- memory bound


class Wide(nn.Module):
    """Large uneven layers, so the tensors dominate any bookkeeping allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(96, 131), nn.Linear(131, 77), nn.Linear(77, 203), nn.Linear(203, 5)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def peak_live_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak of the bytes allocated (and not yet freed) while ``fn`` runs, from the profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, out


def memory_bound(rank: int, world: int) -> dict[str, int]:
    seed_everything(0)
    torch.manual_seed(0)
    model = Wide()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    sd = model.state_dict()
    model_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    # the largest gather buffer: full rows rounded up to a multiple of the world size
    largest = max(-(-v.shape[0] // world) * world * v[0].numel() * 4 for v in sd.values())
    slack = 4096  # profiler and collective bookkeeping; a few small tensors
    # gloo's all-gather stages its output in a buffer of its own (NCCL writes in place): measure
    # that scratch on a bare all-gather of the largest buffer, and allow it on top of ours.
    bufs = [torch.empty(largest // 4), torch.zeros(largest // 4 // world)]  # outside the profile
    scratch, _ = peak_live_bytes(lambda: all_gather_single(bufs[0], bufs[1]))
    bufs.clear()
    assert scratch <= largest + slack, scratch
    peak, full = peak_live_bytes(lambda: get_full_state_dict(model))
    assert isinstance(full, dict)
    kept = sum(v.untyped_storage().nbytes() for v in full.values())
    del full
    naive_peak, naive = peak_live_bytes(lambda: {k: v.full_tensor() for k, v in sd.items()})
    del naive
    if rank == 0:
        assert kept == model_bytes, (kept, model_bytes)
        assert peak <= model_bytes + largest + scratch + slack, (peak, model_bytes, largest)
    else:
        assert kept == 0
        assert peak <= largest + scratch + slack, (peak, largest, scratch)
        # the naive dict holds every full tensor on every rank
        assert naive_peak >= model_bytes, (naive_peak, model_bytes)
    # rank0_only=False keeps the whole model here too, plus one gather buffer at most
    everywhere_peak, everywhere = peak_live_bytes(
        lambda: get_full_state_dict(model, rank0_only=False)
    )
    del everywhere
    assert everywhere_peak <= model_bytes + largest + scratch + slack, everywhere_peak
    return {
        "model_bytes": model_bytes,
        "largest_gather": largest,
        "backend_scratch": scratch,
        "peak": peak,
        "naive_peak": naive_peak,
        "rank0_only_false_peak": everywhere_peak,
    }


def test_full_state_dict_memory_bound(world2: WorkerPool) -> None:
    """Closed form: the peak live bytes during export stay within the result plus one gathered
    parameter (rank 0) or one gathered parameter (rank 1), where the naive dict holds them all.
    """
    world2.run(memory_bound)


# ---------------------------------------------------------------- loading


def load_bodies(rank: int, world: int) -> None:
    seed_everything(0)
    check_broadcast_load("gpt", "gpt")
    check_broadcast_load("mlp", "mlp", reshard_after_forward=False)
    # training continues identically: loaded seed-1 model vs a model born from seed 0
    model, _, _ = sharded_pair("gpt", seed=1)
    set_full_state_dict(
        model,
        make_model("gpt", seed=0).state_dict() if rank == 0 else {},
        broadcast_from_rank0=True,
    )
    born, _, _ = sharded_pair("gpt", seed=0)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, born)]
    for step in range(2):
        batch = make_batch("gpt", 100 * step + rank)
        for m, opt in zip((model, born), opts, strict=True):
            loss_fn("gpt", m(batch), batch).backward()
            opt.step()
            opt.zero_grad()
    assert_same_local_shards(model, born, "trained after load")


def test_set_full_state_dict_matches_torch(world2: WorkerPool) -> None:
    """Oracles: compatibility (torch's set_model_state_dict with broadcast_from_rank0 gives the
    same local shards) and reference (training after the load equals training the source).
    """
    world2.run(load_bodies)


def _raises(fn: Callable[[], object], *words: str) -> None:
    with pytest.raises(RuntimeError) as info:
        fn()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def error_bodies(rank: int, world: int) -> None:
    seed_everything(0)
    src = make_model("gpt", seed=0).state_dict()
    model, _, _ = sharded_pair("gpt", seed=1)
    before = local_shards(model)
    missing = {k: v for k, v in src.items() if k != "norm.bias"}
    extra = {**src, "bogus.weight": torch.zeros(2)}
    bad_shape = {**src, "pos.weight": torch.zeros(5, 8)}
    # only rank 0 holds the dict, and every rank raises (no rank left in a broadcast)
    _raises(
        lambda: set_full_state_dict(
            model, missing if rank == 0 else None, broadcast_from_rank0=True
        ),
        "Missing key(s)",
        "'norm.bias'",
    )
    _raises(
        lambda: set_full_state_dict(model, extra if rank == 0 else {}, broadcast_from_rank0=True),
        "Unexpected key(s)",
        "'bogus.weight'",
    )
    _raises(lambda: set_full_state_dict(model, bad_shape), "size mismatch", "'pos.weight'")
    # only rank 1's dict is wrong: rank 0 raises too, naming rank 1
    _raises(
        lambda: set_full_state_dict(model, missing if rank == 1 else src), "'norm.bias'", "rank 1"
    )
    # a tied entry needs both names, as load_state_dict(strict=True)
    untied = {k: v for k, v in src.items() if k != "head.weight"}
    _raises(lambda: set_full_state_dict(model, untied), "'head.weight'")
    assert_same_local_shards_dict(local_shards(model), before, "nothing loaded after errors")
    # strict=False loads the rest and reports
    keys = set_full_state_dict(model, {**missing, "bogus.weight": torch.zeros(2)}, strict=False)
    assert keys.missing_keys == ["norm.bias"] and keys.unexpected_keys == ["bogus.weight"], keys
    assert torch.equal(model.state_dict()["norm.weight"].full_tensor(), src["norm.weight"])
    # the pool and the process group still work
    set_full_state_dict(model, src if rank == 0 else None, broadcast_from_rank0=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), src[key]), key


def assert_same_local_shards_dict(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tag: str
) -> None:
    for key, value in got.items():
        assert torch.equal(value, want[key]), f"{tag} {key}"


def test_set_full_state_dict_errors_on_every_rank(world2: WorkerPool) -> None:
    """Closed form: the errors name the keys (and rank), and every rank raises them."""
    world2.run(error_bodies)


# ---------------------------------------------------------------- safetensors


def safetensors_roundtrip(rank: int, world: int) -> None:
    """Our writer and reader alone (no safetensors package needed)."""
    seed_everything(0)
    tmp = shared_tmpdir()
    for kind, dtype in (("gpt", torch.float32), ("mlp", torch.bfloat16)):
        model, _, ref = sharded_pair(kind, dtype=dtype)
        path = os.path.join(tmp, f"{kind}.safetensors")
        save_safetensors(model, path, metadata={"format": "pt"})
        fresh, _, _ = sharded_pair(kind, seed=5, dtype=dtype)
        load_safetensors(fresh, path)
        assert_same_local_shards(fresh, model, f"{kind} round trip")
        for key, value in fresh.state_dict().items():
            assert torch.equal(value.full_tensor(), ref.state_dict()[key]), key
    # a file in which rank 0 cannot write: every rank raises OSError
    with pytest.raises(OSError, match="could not write"):
        save_safetensors(model, os.path.join(tmp, "missing-dir", "x.safetensors"))
    with pytest.raises(RuntimeError, match="could not read"):
        load_safetensors(model, os.path.join(tmp, "nope.safetensors"))
    cleanup(tmp)


def test_safetensors_roundtrip(world2: WorkerPool) -> None:
    """Oracle: reference (sharded -> file -> sharded is bitwise; fp32 and bf16; tied)."""
    world2.run(safetensors_roundtrip)


def safetensors_compat(rank: int, world: int) -> None:
    from safetensors.torch import load_file, save_file, save_model

    seed_everything(0)
    tmp = shared_tmpdir()
    for kind, dtype in (("gpt", torch.float32), ("mlp", torch.bfloat16)):
        model, _, ref = sharded_pair(kind, dtype=dtype)
        ours = os.path.join(tmp, f"ours-{kind}.safetensors")
        save_safetensors(model, ours)
        if rank == 0:  # the real package reads our file as the reference state dict
            got = load_file(ours)
            want = ref.state_dict()
            assert set(got) == set(want)
            assert_equal_sd({k: got[k] for k in want}, want, f"{kind} load_file")
        # files from the real package load into the sharded model
        theirs = os.path.join(tmp, f"theirs-{kind}.safetensors")
        if rank == 0:
            save_file({k: v.clone() for k, v in ref.state_dict().items()}, theirs)
        barrier()
        fresh, _, _ = sharded_pair(kind, seed=9, dtype=dtype)
        load_safetensors(fresh, theirs)
        assert_same_local_shards(fresh, model, f"{kind} from save_file")
    # save_model keeps one name of the tied pair; either name loads the tie
    ref = make_model("gpt", seed=0)
    theirs = os.path.join(tmp, "save_model.safetensors")
    if rank == 0:
        save_model(ref, theirs)
    barrier()
    fresh, _, _ = sharded_pair("gpt", seed=9)
    keys = load_safetensors(fresh, theirs)
    assert keys.missing_keys == [], keys
    for key, value in fresh.state_dict().items():
        assert torch.equal(value.full_tensor(), ref.state_dict()[key]), key
    cleanup(tmp)


def test_safetensors_package_compat(world2: WorkerPool) -> None:
    """Oracle: the safetensors package (load_file reads our file as the reference state dict;
    files from save_file / save_model load bitwise).
    """
    pytest.importorskip("safetensors")
    world2.run(safetensors_compat)
