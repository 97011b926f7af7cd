"""Training scenarios run under the CPU stream sanitizer (``tests/_dist/stream_sanitizer.py``).

Shared by ``world_2/test_stream_order.py`` and ``world_4/test_stream_order.py``. A scenario is a
small config dict; :func:`train` runs it for a few steps, with or without the sanitizer, and
returns every loss, local gradient shard and final local parameter shard, so a test can check
that the fake streams changed nothing numerically.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from shardweave.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from shardweave.fsdp._torch_compat import TORCH_RELEASE
from shardweave.fsdp.comm._streams import device_module
from tests._dist.stream_sanitizer import SanitizerReport, stream_sanitizer
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks

# default + the engine's four side streams (all-gather copy-in, all-gather, reduce-scatter,
# all-reduce) of the one comm context.
MIN_STREAMS = 5


# The waits of Design note: stream ordering (comm/_streams), as mutations: (scenario, engine
# function whose stream waits are removed, the ops the report must name). Shared by the CPU-branch
# and the accelerator-branch mutation tests.
WAIT_MUTATIONS: dict[str, tuple[dict[str, Any], str, tuple[str, ...]]] = {
    # Design note point 2: before the copy-out, the compute stream waits for the all-gather's
    # event (in InFlight.wait, called from FSDPParamGroup.wait_for_unshard). Without it the
    # copy-out reads the gathered buffer while the all-gather may still write it.
    "compute-waits-for-all-gather": (
        {},
        "InFlight.wait",
        ("aten::split_with_sizes_copy", "c10d::_allgather_base_"),
    ),
    # Point 5: the reduce-scatter stream waits for the compute stream, where the gradients were
    # laid out into the reduce-scatter input. Without it the collective reads a half-written input.
    "reduce-scatter-waits-for-compute": (
        {},
        "GradientReduction._run",
        ("c10d::_reduce_scatter_base_", "aten::_chunk_cat"),
    ),
    # Point 1: the root's pre-forward makes the all-gather streams wait for the optimizer step,
    # which wrote the shards on the compute stream. Without it step 2 copies in stale shards.
    "all-gather-waits-for-optimizer": (
        {},
        "FSDPState._root_pre_forward",
        ("aten::cat", "aten::add_"),
    ),
    # Point 2 again: the all-gather stream waits for the copy-in stream, which copies the shards
    # into the output's slot (casting them to bf16 under mixed precision). Without it the
    # all-gather sends a half-written input.
    "all-gather-waits-for-copy-in": (
        {"mp": True},
        "FSDPParamGroup.unshard",
        ("c10d::_allgather_base_", "aten::cat"),
    ),
    # Point 7: at the end of backward the compute stream waits for every post-reduce event.
    # With a bf16 reduction the fp32 gradients are cast on the reduce-scatter stream after the
    # reduce-scatter's event, so without it the optimizer reads gradients still being cast.
    "optimizer-waits-for-post-reduce": (
        {"mp": True, "reduce_dtype": torch.bfloat16},
        "ReductionSchedule.finish",
        ("aten::_to_copy", "aten::add_"),
    ),
}


_BF16_REDUCE: dict[str, Any] = {"mp": True, "reduce_dtype": torch.bfloat16}

# Each keep-alive of Design note: stream ordering, through the wait that ends it: without that
# wait the buffer is released while another stream's use is unordered (reported as an unsafe
# reuse by the allocator model; on a GPU the caching allocator hands the block out again).
# Same shape as WAIT_MUTATIONS; the accelerator-branch tests and the GPU kit's ``mutants``
# section (tools/gpu_kit) run both lists.
KEEP_ALIVE_MUTATIONS: dict[str, tuple[dict[str, Any], str, tuple[str, ...]]] = {
    # Keep-alive of the reduce-scatter input (point 6): released when the current stream
    # waited for the reduce-scatter.
    "keep-reduce-scatter-input": (
        _BF16_REDUCE,
        "ReductionSchedule._retire_reduce_scatter",
        ("unsafe reuse", "c10d::_reduce_scatter_base_"),
    ),
    # The same keep-alive (point 6) for a replicate bucket, the bucketed variant of the one
    # reduction: its input (every group's gradients laid side by side, on the current stream)
    # is read on the reduce-scatter stream (copied into its own block, as with one shard
    # rank), and released only when the current stream waited for that copy.
    "keep-bucket-input": (
        {"replicate": True, **_BF16_REDUCE, "bucket_bytes": 1000},
        "ReductionSchedule._retire_reduce_scatter",
        ("unsafe reuse", "aten::copy_"),
    ),
    # Keep-alive of the all-reduce buffer (point 8): replicate's one-rank reduce-scatter
    # output, all-reduced on its own stream, then cast; released when the reduce-scatter
    # stream waited for the all-reduce. Buckets capped at 1000 bytes, so each block's bucket
    # starts in backward (with DDP's caps the tiny model is one bucket, started at the end).
    "keep-all-reduce-buffer": (
        {"replicate": True, **_BF16_REDUCE, "bucket_bytes": 1000},
        "ReductionSchedule._release_all_reduce_buffers",
        ("unsafe reuse", "c10d::allreduce_"),
    ),
    # Keep-alive of the forward all-gather output (point 3): released when the all-gather
    # streams waited for the copy-out. The output is the copy-in stream's block (the copy-in
    # writes this rank's slot), so its early reuse races with the all-gather writing it.
    "keep-all-gather-output": (
        {},
        "FSDPCommContext.wait_for_previous_all_gather",
        ("unsafe reuse", "c10d::_allgather_base_"),
    ),
}


def _mesh(cfg: dict[str, Any], world: int) -> DeviceMesh:
    if cfg.get("hsdp"):
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def wrap_scenario(model: nn.Module, cfg: dict[str, Any], world: int, engine: str = "ours") -> None:
    """Shard ``model`` as ``cfg`` says, with our engine or (``engine="torch"``) torch's."""
    shard: Any = fully_shard
    mp_cls: Any = MixedPrecisionPolicy
    offload_cls: Any = CPUOffloadPolicy
    if engine == "torch":
        # torch's own policy objects: torch 2.15's fully_shard calls a private method on them
        from torch.distributed.fsdp import CPUOffloadPolicy as offload_cls
        from torch.distributed.fsdp import MixedPrecisionPolicy as mp_cls
        from torch.distributed.fsdp import fully_shard as shard
    kwargs: dict[str, Any] = {"mesh": _mesh(cfg, world)}
    if cfg.get("mp"):
        kwargs["mp_policy"] = mp_cls(
            param_dtype=torch.bfloat16, reduce_dtype=cfg.get("reduce_dtype", torch.float32)
        )
    if cfg.get("offload"):
        kwargs["offload_policy"] = offload_cls(pin_memory=False)
    if cfg.get("replicate"):
        if engine == "torch":
            from torch.distributed._composable.replicate_with_fsdp import (
                replicate,
            )
        else:
            from shardweave.replicate import replicate  # type: ignore[assignment]

        shard_blocks(model, replicate, **kwargs)
        return
    if "reshard_after_forward" in cfg:
        kwargs["reshard_after_forward"] = cfg["reshard_after_forward"]
    shard_blocks(model, shard, **kwargs)
    if cfg.get("prefetch"):
        layers = list(model.layers)  # type: ignore[arg-type]
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
            layer.set_modules_to_backward_prefetch(layers[i - 1 : i] if i > 0 else [])
    if cfg.get("implicit_prefetch") and engine != "torch":
        # Ours only (torch has no implicit forward prefetch); it changes no number.
        model.set_implicit_forward_prefetch()  # type: ignore[operator]
    if cfg.get("checkpoint"):
        model.checkpoint = True  # type: ignore[assignment]
    if cfg.get("keep_unsharded_storage") and hasattr(model, "set_keep_unsharded_storage"):
        # torch's engine has it from 2.15 on; keeping the storage changes no number.
        model.set_keep_unsharded_storage(True)
    if cfg.get("force_sum"):
        model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    if "max_rs_buffers" in cfg:
        model.set_reduce_scatter_max_input_buffers(cfg["max_rs_buffers"])  # type: ignore[operator]
    if cfg.get("hook"):
        # On the root's group: a hook that writes the reduced gradients in place.
        stream = device_module(torch.device("cpu")).Stream() if cfg["hook"] == "stream" else None
        model.set_all_reduce_hook(lambda g: g.mul_(0.5), stream=stream)  # type: ignore[operator]


def torch_lacks(cfg: dict[str, Any]) -> str | None:
    """Why torch's own engine cannot run ``cfg`` as the oracle on this torch, or None.

    A capability, not a version: torch added ``set_reduce_scatter_max_input_buffers`` to its
    ``FSDPModule`` after 2.11, and the oracle run calls it on torch's modules.
    """
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    if "max_rs_buffers" in cfg and not hasattr(
        TorchFSDPModule, "set_reduce_scatter_max_input_buffers"
    ):
        return "this torch's FSDPModule has no set_reduce_scatter_max_input_buffers (the oracle)"
    if cfg.get("partial") == "grows" and TORCH_RELEASE < (2, 15):
        return "torch before 2.15 adds a partial sum to the wrong parameters when they change"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


@contextlib.contextmanager
def _maybe_sanitized(
    sanitize: bool, drop_waits_from: Collection[str], raise_on_race: bool, accelerator: bool
) -> Iterator[SanitizerReport | None]:
    if not sanitize:
        yield None
        return
    with stream_sanitizer(
        raise_on_race=raise_on_race, drop_waits_from=drop_waits_from, accelerator=accelerator
    ) as report:
        yield report


@contextlib.contextmanager
def _bucket_bytes(nbytes: int | None) -> Iterator[None]:
    """Replicate's bucket caps (``_reduction.FIRST_BUCKET_BYTES`` / ``BUCKET_BYTES``) set to
    ``nbytes`` for the scenario, so the tiny models fill buckets in backward."""
    if nbytes is None:
        yield
        return
    from shardweave.fsdp.comm import _reduction

    saved = _reduction.FIRST_BUCKET_BYTES, _reduction.BUCKET_BYTES
    _reduction.FIRST_BUCKET_BYTES = _reduction.BUCKET_BYTES = nbytes
    try:
        yield
    finally:
        _reduction.FIRST_BUCKET_BYTES, _reduction.BUCKET_BYTES = saved


def train(
    rank: int,
    world: int,
    cfg: dict[str, Any],
    *,
    sanitize: bool,
    drop_waits_from: Collection[str] = (),
    raise_on_race: bool = True,
    accelerator: bool = False,
    engine: str = "ours",
) -> tuple[dict[str, list[torch.Tensor]], SanitizerReport | None]:
    """Build, wrap and train the scenario's model; the sanitizer (when asked) covers it all.

    The sanitizer is entered before the model is built, so the engine's streams (made at the
    root's lazy init) are fake and every write to the parameters is on record. With
    ``sanitize`` (and ``raise_on_race``) it raises ``StreamRaceError`` (CSAN's text) on exit
    when it found a race; ``drop_waits_from`` is the sanitizer's mutation switch.
    """
    kind, steps, micro = cfg.get("kind", "gpt"), cfg.get("steps", 2), cfg.get("micro", 1)
    out: dict[str, list[torch.Tensor]] = {"loss": [], "grad": [], "param": []}
    with (
        _bucket_bytes(cfg.get("bucket_bytes")),
        _maybe_sanitized(sanitize, drop_waits_from, raise_on_race, accelerator) as report,
    ):
        model = make_model(kind)
        wrap_scenario(model, cfg, world, engine)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # torch's engine before 2.15 has no manual finalization: its automatic one is the oracle.
        manual = cfg.get("manual_finalization") and hasattr(model, "finalize_backward")
        if manual:
            model.set_manual_backward_finalization(True)  # type: ignore[operator]
        for step in range(steps):
            for mb in range(micro):
                if micro > 1 and cfg.get("partial"):
                    # HSDP: reduce-scatter every microbatch, all-reduce the partial sum once.
                    model.set_requires_all_reduce(mb == micro - 1)  # type: ignore[operator]
                elif micro > 1:
                    model.set_requires_gradient_sync(mb == micro - 1)  # type: ignore[operator]
                if cfg.get("partial") == "grows":
                    # A parameter without a gradient in the first microbatch: the next one
                    # repacks the partial sum to give it a slot.
                    model.layers[0].fc1.weight.requires_grad_(mb > 0)  # type: ignore[index]
                if cfg.get("async_unshard"):
                    handle = model.unshard(async_op=True)  # type: ignore[operator]
                    handle.wait()
                batch = make_batch(kind, 1000 * step + 100 * mb + rank)
                loss = loss_fn(kind, model(batch), batch)
                loss.backward()
                out["loss"].append(loss.detach().clone())
            if manual:
                # The reductions of groups backward did not reach (the root's) stay in flight,
                # their buffers kept by the schedule, until the handle's wait.
                handle = model.finalize_backward(async_op=True)  # type: ignore[operator]
                handle.wait()
            out["grad"] += [_local(p.grad) for p in model.parameters() if p.grad is not None]
            opt.step()
            opt.zero_grad()
            if cfg.get("post_optim_event"):
                # torch.cpu records no event (None: the engine waits for the whole stream).
                event = device_module(torch.device("cpu")).current_stream().record_event()
                model.set_post_optim_event(event)  # type: ignore[operator]
        out["param"] += [_local(p) for p in model.parameters()]
    return out, report


def assert_bitwise_equal(
    got: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]], tag: str
) -> None:
    for key, tensors in want.items():
        assert len(got[key]) == len(tensors), f"{tag}: {key} count"
        for i, (a, b) in enumerate(zip(got[key], tensors)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{tag}: {key}[{i}] differs"


def engine_unordered_frees(report: SanitizerReport) -> list[str]:
    """The blocks the engine itself freed before their owning stream waited for another
    stream's use (its release discipline; frees by user code, e.g. ``zero_grad``, are judged
    only by the allocator model, at reuse)."""
    return [line for line in report.unordered_frees if "(shardweave." in line]


def sanitized_vs_plain(
    rank: int, world: int, cfg: dict[str, Any], accelerator: bool = False, torch_oracle: bool = True
) -> dict[str, int]:
    """Body: the scenario without, then with, the sanitizer; bitwise equal, race-free, no
    unsafe reuse and no engine free before the owning stream waited.

    ``accelerator``: the sanitized run is on the test accelerator (the engine's accelerator
    branches), the plain run on the CPU branches: both give the same numbers, bitwise; and
    (``torch_oracle``) so does torch's ``fully_shard`` (or ``replicate``) on the scenario.
    Returns what the sanitizer saw, so the test can check it really watched the engine.
    """
    plain, _ = train(rank, world, cfg, sanitize=False)
    sanitized, report = train(rank, world, cfg, sanitize=True, accelerator=accelerator)
    assert report is not None
    assert plain["grad"], f"{cfg}: no gradients compared"
    assert_bitwise_equal(sanitized, plain, f"{cfg} rank {rank}")
    if accelerator and torch_oracle:
        oracle, _ = train(rank, world, cfg, sanitize=False, engine="torch")
        assert_bitwise_equal(sanitized, oracle, f"{cfg} rank {rank} vs torch's fully_shard")
    assert engine_unordered_frees(report) == [], engine_unordered_frees(report)
    return {
        "streams": len(report.streams),
        "kernels": report.kernels,
        "collectives": len(report.collectives),
        "side_stream_collectives": sum(1 for _, s in report.collectives if s != 0),
        "waits": report.waits,
        "events": report.events_recorded,
    }


def check_watched(results: list[object], cfg: dict[str, Any]) -> None:
    """The sanitizer saw the engine's streams, its collectives on side streams and its waits."""
    for rank, stats in enumerate(results):
        assert isinstance(stats, dict), stats
        assert stats["streams"] >= MIN_STREAMS, (cfg, rank, stats)
        assert stats["collectives"] > 0 and stats["waits"] > 0, (cfg, rank, stats)
        assert stats["side_stream_collectives"] > 0, (cfg, rank, stats)


def mutated(
    rank: int, world: int, cfg: dict[str, Any], drop: str, accelerator: bool = False
) -> dict[str, list[str]]:
    """Body: the scenario with the stream waits issued by engine function ``drop`` removed."""
    _, report = train(
        rank,
        world,
        cfg,
        sanitize=True,
        drop_waits_from={drop},
        raise_on_race=False,
        accelerator=accelerator,
    )
    assert report is not None
    return {"races": report.races, "dropped": report.dropped_waits}
