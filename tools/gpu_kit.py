"""The GPU kit: in one command, the checks of the engine that only a CUDA device can make.

    python tools/gpu_kit.py [--out gpu-report.json] [--sections plugin,parity,delayed,...]
    nox -s gpu            (the same with the machine's own python and torch; never run by CI)

It needs nothing but torch (2.11 or newer) and this checkout: the four packages are imported
from ``packages/*/src`` and the mutation list from ``tests/``, so a machine without a package
index runs it as it is (``llama`` also uses transformers when it is there). Each section runs
in a subprocess of its own (the threaded process group and CUDA's sanitizer change the process
they run in) and the report is one JSON file:

* ``parity``: world size 1 on NCCL, shardweave against torch's ``fully_shard`` on the same
  model and batches (per-block FSDP, CPU batches, bf16 compute with fp32 reduction, CPU
  offload with optimizer-in-backward hooks and the full state dict, ``replicate``, HSDP on a
  1x1 mesh): losses, shards and grads bitwise.
* ``plugin``: the test plugin of ``delayed`` checked on its own: its all-gather, reduce-scatter
  (sum, average) and all-reduce at four ranks against closed forms, with the delay.
* ``delayed``: four ranks on the one GPU as threads of one process, through a test
  ``COLLECTIVES`` plugin (``DelayedCollectives``) that moves the right bytes on the stream the
  engine issues on, after an injected ``torch.cuda._sleep`` (a late producer), and with a
  sleep on the current stream before each consumer (``DELAY_POINTS``: the copy-out, the
  copy-in, the reduce-scatter input's layout, the optimizer step). What a delayed writer
  writes is filled with NaN first (the collectives' outputs, the copy-in's slot, the layout's
  output), and each run's buffers sit at other addresses than the previous run's (a spacer),
  so a read that does not wait sees garbage, not the same values a replay left there. Cases:
  FSDP, bf16, HSDP 2x2 with fp32 and bf16 reductions, ``replicate`` with both, CPU offload
  (non-blocking and with optimizer-in-backward hooks). Each must be bitwise equal to the same
  run with no delay and a device synchronization after every collective.
* ``mutants``: the tests' own mutations (``WAIT_MUTATIONS`` and ``KEEP_ALIVE_MUTATIONS`` of
  ``tests/fsdp/_stream_order.py``: every stream wait and keep-alive of the engine's design
  note), one at a time. On CUDA the mutant's waits are removed from ``torch.cuda.Stream``
  and the run, delayed at that mutant's producer only (``MUTANT_DELAYS``: a sleep elsewhere
  can delay the waiter as much and hide the race) and poisoned, must differ from the
  synchronized one (while the control, the same run unmutated, agrees); on CPU each runs at
  two gloo ranks on the test accelerator and the stream sanitizer must report it. Every
  mutant must be caught.
* ``llama``: a transformers ``LlamaForCausalLM`` (tied and untied embeddings, bf16 and fp32,
  with and without CPU offload) at world 1, with torch's engine run twice as the control:
  a difference is reported only where torch's engine agrees with itself.
* ``sync``: ``torch.cuda.set_sync_debug_mode("warn")`` over steady-state steps: every host
  synchronization (torch's sync warnings only; other warnings are listed apart) of our
  engine and of torch's FSDP2 in the same loop; passes iff ours makes no more.
* ``csan``: a few steps under ``TORCH_CUDA_SANITIZER=1`` (torch's CUDA stream sanitizer).
* ``bench``: step time and per-phase allocated/peak memory (after forward, backward, the
  optimizer step, between steps) against torch's FSDP2 at world size 1, on a model of about
  0.54 B parameters with bf16 compute; each of the four rounds in a fresh process, and the
  section fails unless every round starts from the same allocated bytes.

Without a CUDA device (or without torch) it says so in one line and exits 0. ``--device cpu``
runs every section that does not need CUDA on the CPU (``delayed`` without the sleeps,
``parity`` and ``llama`` on gloo, ``mutants`` under the sanitizer, ``bench`` at a tiny size
with live tensor bytes): the test suite proves the kit's own logic that way
(``tests/tools/test_gpu_kit.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_SRCS = [
    str(ROOT / "packages" / p / "src") for p in ("mesh", "fsdp", "replicate", "extensions")
]
SECTIONS = ("plugin", "parity", "delayed", "mutants", "llama", "sync", "csan", "bench")
CUDA_ONLY = ("sync", "csan")
# ``cpu_batch``: the loop hands over CPU batches (the root moves them, as torch's does);
# ``offload_hooks`` also compares the full state dict gathered from the offloaded shards.
PARITY_CASES = ("fsdp", "cpu_batch", "bf16", "offload_hooks", "replicate", "hsdp_1x1")
# At four threaded ranks; the bf16 reductions cast on the comm streams after the collective
# (HSDP: the all-reduce buffer before its cast; replicate: the same through its buckets);
# CPU offload copies the gradients to the host behind it (non-blocking into pinned memory,
# waited at the end of backward; blocking for the optimizer-in-backward hooks).
DELAYED_CASES = (
    "fsdp", "bf16", "hsdp_2x2", "hsdp_2x2_bf16_reduce", "replicate", "replicate_bf16_reduce",
    "offload", "offload_hooks",
)  # fmt: skip
# About 1 ms on a 1.5-2 GHz SM clock: longer than any collective of these small models takes.
SLEEP_CYCLES = 2_000_000


# --- models and engines --------------------------------------------------------------------
def _model(dim: int, blocks: int, device: Any, seed: int = 0) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.out = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    torch.manual_seed(seed)
    return Net().to(device)


# Each case as a scenario of the tests' vocabulary (tests/fsdp/_stream_order.py), so the
# ``mutants`` section can run the tests' own mutation scenarios through the same code.
CASES: dict[str, dict[str, Any]] = {
    "fsdp": {},
    "cpu_batch": {},
    "bf16": {"mp": True},
    "offload": {"offload": True},
    "offload_hooks": {"offload": True},
    "replicate": {"replicate": True},
    "replicate_bf16_reduce": {"replicate": True, "mp": True, "reduce_dtype": "bfloat16"},
    "hsdp_1x1": {"hsdp": True},
    "hsdp_2x2": {"hsdp": True},
    "hsdp_2x2_bf16_reduce": {"hsdp": True, "mp": True, "reduce_dtype": "bfloat16"},
}


def _apply(engine: str, model: Any, case: str | dict[str, Any], device_type: str) -> None:
    """Shard ``model`` per block and at the root with ``engine`` ("torch" or "shardweave"),
    as ``case`` (a name of ``CASES`` or a scenario dict) says."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    cfg = CASES[case] if isinstance(case, str) else case
    if engine == "torch":
        from torch.distributed.fsdp import (  # noqa: TID251 (the oracle)
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )
    else:
        from shardweave.fsdp import (  # type: ignore[assignment]
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )
    kwargs: dict[str, Any] = {}
    if cfg.get("mp"):
        reduce_dtype = cfg.get("reduce_dtype", torch.float32)
        if isinstance(reduce_dtype, str):
            reduce_dtype = getattr(torch, reduce_dtype)
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype
        )
    if cfg.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    if cfg.get("hsdp"):
        import torch.distributed as dist

        world = dist.get_world_size()
        shape = (1, 1) if world == 1 else (2, world // 2)
        kwargs["mesh"] = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    if cfg.get("replicate"):
        if engine == "torch":
            from torch.distributed._composable.replicate_with_fsdp import (  # noqa: TID251
                replicate,
            )
        else:
            from shardweave.replicate import replicate  # type: ignore[assignment]
        for block in model.blocks:
            replicate(block, **kwargs)
        replicate(model, **kwargs)
        return
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _optimizers(model: Any, case: str) -> list[Any]:
    """AdamW over the model; with ``offload_hooks``, one per parameter stepped from its
    post-accumulate-grad hook (optimizer in backward), as users of CPU offload do."""
    import torch

    if case != "offload_hooks":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)]
    opts = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}

    def step(param: Any) -> None:
        opts[param].step()
        opts[param].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    return []


def _train(
    model: Any,
    case: str,
    device: Any,
    steps: int,
    rank: int = 0,
    before_optimizer: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Losses and final local shards (params and grads), as plain Python for comparison.

    The losses are read after the last step: a ``.item()`` per step would make the host wait
    for the compute stream each step and hide what a host running ahead exposes.
    ``before_optimizer`` runs just before each optimizer step (the consumer-side delays).
    """
    import torch
    from torch.distributed.tensor import DTensor

    opts = _optimizers(model, case)
    loss_tensors: list[Any] = []
    dim = model.out.in_features
    for step in range(steps):
        if case != "cpu_batch" and device.type == "cuda":
            # Drawn on the device: a copy from host memory (pageable, or pinned memory newly
            # allocated) makes the host wait for the stream, i.e. for the last step's
            # optimizer, which would hide an all-gather that does not wait for it.
            gen = torch.Generator(device).manual_seed(1000 * step + rank)
            x = torch.randn(4, 8, dim, generator=gen, device=device)
        else:
            x = torch.randn(4, 8, dim, generator=torch.Generator().manual_seed(1000 * step + rank))
            x = x if case == "cpu_batch" else x.to(device)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        loss_tensors.append(loss.detach())
        if before_optimizer is not None and opts:
            before_optimizer()
        for opt in opts:
            opt.step()
            if step < steps - 1:
                opt.zero_grad(set_to_none=True)
    losses = [loss.item() for loss in loss_tensors]
    params = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        grad = p.grad
        grad_local = grad.to_local() if isinstance(grad, DTensor) else grad
        params.append(
            (name, local.detach().cpu(), None if grad_local is None else grad_local.cpu())
        )
    state: list[Any] = []
    if case == "offload_hooks":
        state = sorted((k, v.cpu()) for k, v in _full_state_dict(model).items())
    return {"losses": losses, "params": params, "state": state}


def _full_state_dict(model: Any) -> dict[str, Any]:
    """The full state dict on CPU: torch's helper for torch's engine, ours for ours."""
    from shardweave.fsdp import FSDPModule, get_full_state_dict

    if isinstance(model, FSDPModule):  # ours (torch's modules are not instances of ours)
        return get_full_state_dict(model, cpu_offload=True)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    import torch

    mismatched: list[str] = []
    max_diff = 0.0
    for (name, p, g), (_, q, h) in zip(ours["params"], theirs["params"], strict=True):
        for what, a, b in (("param", p, q), ("grad", g, h)):
            if a is None or b is None:
                if (a is None) != (b is None):
                    mismatched.append(f"{name} {what}: one side has none")
                continue
            if not torch.equal(a, b):
                mismatched.append(f"{name} {what}")
                max_diff = max(max_diff, (a.double() - b.double()).abs().max().item())
    for (name, a), (other, b) in zip(ours["state"], theirs["state"], strict=True):
        if name != other or not torch.equal(a, b):
            mismatched.append(f"full state dict {name}")
    same_losses = ours["losses"] == theirs["losses"]
    return {
        "bitwise": same_losses and not mismatched,
        "losses": {"shardweave": ours["losses"], "oracle": theirs["losses"]},
        "mismatched": mismatched[:10],
        "max_abs_diff": max_diff,
        "state_dict_entries": len(ours["state"]),
    }


# --- sections --------------------------------------------------------------------------------
def _init_world1(device_type: str) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(0)
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def section_parity(device_type: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _init_world1(device_type)
    device = torch.device(device_type)
    results: dict[str, Any] = {}
    try:
        for case in PARITY_CASES:
            runs = {}
            for engine in ("torch", "shardweave"):
                model = _model(64, 3, device)
                _apply(engine, model, case, device_type)
                runs[engine] = _train(model, case, device, steps=3)
            results[case] = _compare(runs["shardweave"], runs["torch"])
    finally:
        dist.destroy_process_group()
    return results


COLLECTIVE_KINDS = frozenset({"all_gather", "reduce_scatter", "all_reduce"})


class DelayedCollectives:
    """A ``COLLECTIVES`` plugin for ranks that are threads of one process on one device.

    Each call meets the same call of the other ranks (by group and call count) on the host,
    then, on the stream current at the call (the one the engine issues on), waits for every
    rank's inputs to be ready, sleeps ``sleep_cycles`` (CUDA; for the kinds in
    ``sleep_kinds`` only: "all_gather", "reduce_scatter", "all_reduce"), moves the bytes, and waits for
    every rank's copy to finish before it counts as done, as a real collective does. Sums run
    in rank order, so the result does not depend on timing. ``synchronize`` makes the host wait
    for the device after each call (the reference run).
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.sleep_cycles = 0
        self.sleep_kinds: Collection[str] = COLLECTIVE_KINDS
        # Fill what a collective will write with NaN (255 for bytes) before the sleep: a
        # consumer that reads too early sees garbage rather than the memory's last contents,
        # which a replay of the same run (same addresses, same values) would make right.
        self.poison = False
        self.synchronize = False
        self._cv = threading.Condition()
        self._slots: dict[tuple[Any, ...], dict[int, Any]] = {}
        self._reads: dict[tuple[Any, ...], int] = {}
        self._counts: dict[tuple[Any, ...], int] = {}
        self.calls = 0

    # host-side meeting of the ranks of one call
    def _exchange(self, key: tuple[Any, ...], rank: int, world: int, value: Any) -> list[Any]:
        with self._cv:
            slot = self._slots.setdefault(key, {})
            slot[rank] = value
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: len(slot) == world, timeout=120):
                raise TimeoutError(
                    f"DelayedCollectives: ranks {sorted(slot)} of {world} met at {key}"
                )
            values = [slot[i] for i in range(world)]
            self._reads[key] = self._reads.get(key, 0) + 1
            if self._reads[key] == world:
                del self._slots[key], self._reads[key]
            return values

    def _event(self) -> Any:
        import torch

        if self.device_type != "cuda":
            return None
        return torch.cuda.current_stream().record_event()

    def _wait(self, events: list[Any]) -> None:
        import torch

        if self.device_type != "cuda":
            return
        stream = torch.cuda.current_stream()
        for event in events:
            # Event.wait, not Stream.wait_event: the ``mutants`` section removes the engine's
            # Stream waits by caller, and the plugin's own waits must stay.
            event.wait(stream)

    def _key(self, kind: str, group: Any) -> tuple[int, int, tuple[Any, ...]]:
        """(rank, world, key): the n-th call of a group meets the n-th call of every peer."""
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(group))
        rank = dist.get_rank(group)
        with self._cv:
            seq = self._counts.get((ranks, rank), 0)
            self._counts[(ranks, rank)] = seq + 1
            self.calls += 1
        return rank, len(ranks), (ranks, seq, kind)

    def _collective(
        self,
        kind: str,
        group: Any,
        mine: Any,
        finish: Callable[..., None],
        poison: Callable[[int, int], None] | None = None,
    ) -> Any:
        import torch

        rank, world, key = self._key(kind, group)
        if poison is not None and self.poison:
            poison(rank, world)  # on this stream, before this rank's ready event
        peers = self._exchange((*key, "ready"), rank, world, (mine, self._event()))
        self._wait([event for _, event in peers])
        if self.sleep_cycles and kind in self.sleep_kinds and self.device_type == "cuda":
            torch.cuda._sleep(self.sleep_cycles)
        finish([value for value, _ in peers], rank, world)
        done = self._exchange((*key, "done"), rank, world, self._event())
        self._wait(done)  # done only when every rank finished reading this rank's input
        if self.synchronize and self.device_type == "cuda":
            torch.cuda.synchronize()
        return _DoneWork()

    def all_gather_into_tensor(
        self, output: Any, input: Any, group: Any, *, async_op: bool = False
    ) -> Any:
        def finish(inputs: list[Any], rank: int, world: int) -> None:
            rows = output.view(world, -1)
            for i, tensor in enumerate(inputs):
                rows[i].copy_(tensor.reshape(-1))

        def poison(rank: int, world: int) -> None:
            rows = output.view(world, -1)
            for i in range(world):
                if i != rank:  # this rank's row may be its input (an in-place all-gather)
                    _poison(rows[i])

        work = self._collective("all_gather", group, input, finish, poison)
        return work if async_op else None

    def reduce_scatter_tensor(
        self, output: Any, input: Any, group: Any, *, op: Any, async_op: bool = False
    ) -> Any:
        def finish(inputs: list[Any], rank: int, world: int) -> None:
            chunks = [t.view(world, -1)[rank] for t in inputs]
            acc = chunks[0].clone()
            for chunk in chunks[1:]:
                acc += chunk
            output.view(-1).copy_(_apply_op(acc, op, world))

        work = self._collective(
            "reduce_scatter", group, input, finish, lambda rank, world: _poison(output)
        )
        return work if async_op else None

    def all_reduce(self, tensor: Any, group: Any, *, op: Any, async_op: bool = False) -> Any:
        # In place: every rank reads every rank's tensor, so the sums go to a scratch buffer
        # first and are written back only after all ranks have read ("done" above).
        scratch: list[Any] = []

        def finish(inputs: list[Any], rank: int, world: int) -> None:
            acc = inputs[0].clone()
            for t in inputs[1:]:
                acc += t
            scratch.append(_apply_op(acc, op, world))

        work = self._collective("all_reduce", group, tensor, finish)
        tensor.copy_(scratch[0])
        return work if async_op else None


def _poison(tensor: Any) -> None:
    """Garbage that no computation produces: NaN, or all bits set for integers."""
    tensor.fill_(float("nan") if tensor.is_floating_point() else -1 if tensor.is_signed() else 255)


def _apply_op(acc: Any, op: Any, world: int) -> Any:
    import torch.distributed as dist

    if op == dist.ReduceOp.SUM:
        return acc
    if op == dist.ReduceOp.AVG:
        return acc / world
    raise NotImplementedError(f"DelayedCollectives: reduce op {op}")


_DONE_WORK: list[type] = []


def _DoneWork() -> Any:  # a class, made once torch is imported
    """A ``dist.Work`` with nothing left for the host: the stream already waited."""
    if not _DONE_WORK:
        import torch.distributed as dist

        class DoneWork(dist.Work):  # type: ignore[misc]
            def wait(self, timeout: Any = None) -> bool:
                return True

            def is_completed(self) -> bool:
                return True

            def is_success(self) -> bool:
                return True

        _DONE_WORK.append(DoneWork)
    return _DONE_WORK[0]()


def _run_threads(world: int, body: Callable[[int], None], timeout: float = 120.0) -> None:
    """``body(rank)`` on ``world`` threads joined in torch's threaded process group (which
    replaces the process's default group while they run)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    # Each thread registers its groups under the same names: c10d keeps them per thread then.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    multi_threaded_pg._install_threaded_pg()
    store = dist.HashStore()
    errors: list[str] = []

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            body(rank)
        except BaseException as exc:
            errors.append(f"rank {rank}:\n{traceback.format_exc()}")
            multi_threaded_pg.ProcessLocalGroup.exception_handle(exc)  # wake the others
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if any(t.is_alive() for t in threads):
            errors.append(f"threads still running after {timeout:.0f} s")
    finally:
        multi_threaded_pg.ProcessLocalGroup.reset()
        multi_threaded_pg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise RuntimeError("\n".join(errors))


def section_plugin(device_type: str, world: int = 4) -> dict[str, Any]:
    """``DelayedCollectives`` against closed forms: rank r contributes ``r + 1`` (times a
    position ramp), so every output element is known exactly."""
    import torch
    import torch.distributed as dist

    from shardweave.mesh.extension_points import COLLECTIVES

    plugin = DelayedCollectives(device_type)
    plugin.sleep_cycles = SLEEP_CYCLES if device_type == "cuda" else 0
    COLLECTIVES.register(device_type, plugin, override=True)
    device = torch.device(device_type)
    failures: list[str] = []
    lock = threading.Lock()
    n = 6  # elements per rank

    def check(rank: int, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.cpu(), want.cpu()):
            with lock:
                failures.append(f"rank {rank} {what}: {got.tolist()} != {want.tolist()}")

    def body(rank: int) -> None:
        if device_type == "cuda":
            torch.cuda.set_device(0)
        group = dist.group.WORLD
        ramp = torch.arange(n, dtype=torch.float32, device=device)
        mine = ramp * (rank + 1)
        out = torch.empty(world * n, device=device)
        plugin.all_gather_into_tensor(out, mine, group)
        want = torch.cat([ramp * (r + 1) for r in range(world)])
        check(rank, "all_gather", out, want)
        total = sum(range(1, world + 1))
        for op, scale in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0 / world)):
            big = torch.cat([ramp * (rank + 1) * (i + 1) for i in range(world)])
            shard = torch.empty(n, device=device)
            work = plugin.reduce_scatter_tensor(shard, big, group, op=op, async_op=True)
            work.wait()
            check(rank, f"reduce_scatter {op}", shard, ramp * total * (rank + 1) * scale)
        summed = mine.clone()
        plugin.all_reduce(summed, group, op=dist.ReduceOp.SUM)
        check(rank, "all_reduce", summed, ramp * total)
        if device_type == "cuda":
            torch.cuda.synchronize()

    _run_threads(world, body)
    return {"ok": not failures, "failures": failures, "calls": plugin.calls}


# --- consumer-side delays and removed waits ------------------------------------------------
# Where a sleep goes on the stream current at the call, besides the one before each collective
# (which makes the *producer* late): each makes a *consumer* (or a writer a comm stream must
# wait for) late, so a stream that runs ahead of it without waiting reads or reuses a buffer
# too early. (module, attribute): the engine looks each up at call time.
DELAY_POINTS: dict[str, tuple[str, str]] = {
    # compute stream, before the gathered buffer is split into the parameters: an all-gather
    # stream that reuses the buffer (next all-gather) without waiting for this overwrites it.
    "before_copy_out": ("shardweave.fsdp._fsdp_param_group", "all_gather_copy_out"),
    # copy-in stream, before the shards are cast/copied into the all-gather input: an
    # all-gather that does not wait for the copy-in sends a half-written input.
    "before_copy_in": ("shardweave.fsdp._fsdp_param_group", "all_gather_copy_in"),
    # compute stream, before the gradients are laid out into the reduce-scatter input: a
    # reduce-scatter stream that does not wait for compute reads a half-written input.
    "before_reduce_scatter_copy_in": ("torch", "_chunk_cat"),
    # before each of a reduction's divides. The pre-divide, on the reduce-scatter stream,
    # starts its reads of the input (with one shard rank the "reduce-scatter" is a copy on
    # that stream, no collective): a current stream that reuses the input too early
    # overwrites it. The post-divide, on the stream that finishes the reduction, comes before
    # the casts into the gradients: an optimizer that does not wait reads them unwritten.
    "before_divide": ("shardweave.fsdp._reduction", "_div_"),
}
# Python frames skipped when naming who asked for a wait: the one-line wait helpers, torch's
# ``Stream.wait_stream`` (it calls ``wait_event``) and this module's own wrappers.
_WAIT_HELPERS = frozenset({"shardweave.fsdp._fsdp_streams", "torch.cuda.streams", __name__})


def _waiter_name() -> str:
    """The qualified name of the function that asked for the current wait (as the tests'
    stream sanitizer names it, so the tests' mutation lists apply unchanged)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_globals.get("__name__") in _WAIT_HELPERS:
        frame = frame.f_back
    code = frame.f_code
    qualname = getattr(code, "co_qualname", None)  # Python >= 3.11
    if qualname is None:
        owner = frame.f_locals.get("self")
        qualname = f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
    return str(qualname)


@contextlib.contextmanager
def dropping_waits(
    stream_cls: Any, drop: Callable[[], Collection[str]], dropped: list[str]
) -> Iterator[None]:
    """``stream_cls.wait_event`` / ``wait_stream`` skip the waits asked for by a function whose
    qualified name is in ``drop()`` (read at each wait, so one patch serves several runs) and
    append that name to ``dropped``: the tests' ``drop_waits_from`` on a real device."""
    wait_event, wait_stream = stream_cls.wait_event, stream_cls.wait_stream

    def patched_wait_event(self: Any, event: Any) -> Any:
        name = _waiter_name()
        if name in drop():
            dropped.append(name)
            return None
        return wait_event(self, event)

    def patched_wait_stream(self: Any, stream: Any) -> Any:
        name = _waiter_name()
        if name in drop():
            dropped.append(name)
            return None
        return wait_stream(self, stream)

    stream_cls.wait_event, stream_cls.wait_stream = patched_wait_event, patched_wait_stream
    try:
        yield
    finally:
        stream_cls.wait_event, stream_cls.wait_stream = wait_event, wait_stream


# Every place a run can sleep: before each collective of a kind (the plugin's, a late
# producer on the issuing stream) and each point of ``DELAY_POINTS`` plus the optimizer step.
ALL_DELAYS = frozenset({*COLLECTIVE_KINDS, *DELAY_POINTS, "before_optimizer"})

# Each mutant's late producer: the one place that sleeps while the waiter runs on at once. A
# sleep anywhere else can hide the race (a sleep before the copy-in delays the all-gather as
# much as one before the optimizer delays the shards it reads; a late all-gather holds back
# the compute stream that would reuse a reduce-scatter's input), so each mutant runs with its
# producer's delay only. tests/tools/test_gpu_kit.py checks that every mutation of the tests
# has one.
MUTANT_DELAYS: dict[str, frozenset[str]] = {
    # the all-gather writes late (and poisoned first); the copy-out runs at once
    "compute-waits-for-all-gather": frozenset({"all_gather"}),
    # the gradients are laid out late (into a poisoned buffer); the reduce-scatter reads at once
    "reduce-scatter-waits-for-compute": frozenset({"before_reduce_scatter_copy_in"}),
    # the optimizer updates the shards late; the next all-gather reads them at once
    "all-gather-waits-for-optimizer": frozenset({"before_optimizer"}),
    # the cast into the all-gather output's slot is late (the slot poisoned first)
    "all-gather-waits-for-copy-in": frozenset({"before_copy_in"}),
    # the casts into the gradients are late (the current stream waited for the reduce-scatter
    # itself, to release its input); the optimizer reads the gradients at once
    "optimizer-waits-for-post-reduce": frozenset({"before_divide"}),
    # a late reduce-scatter still reads its input when the next layout reuses the block
    "keep-reduce-scatter-input": frozenset({"reduce_scatter"}),
    # a late one-rank "reduce-scatter" (a copy, no collective) still reads the bucket input
    "keep-bucket-input": frozenset({"before_divide"}),
    # a late all-reduce still uses its buffer when the next reduce-scatter reuses it
    "keep-all-reduce-buffer": frozenset({"all_reduce"}),
    # a late copy-out still reads the gathered buffer when the next all-gather reuses it
    "keep-all-gather-output": frozenset({"before_copy_out"}),
}
# About 50 ms on an H200 (1.98 GHz): longer than the host needs to issue the next use of a
# buffer from two rank threads (an optimizer step over DTensors alone took more than the
# 10 ms tried first, so the optimizer's late writes were done before the next all-gather
# was issued).
MUTANT_SLEEP_CYCLES = 50 * SLEEP_CYCLES
# A keep-alive mutant is caught only if the block is handed out again while its late user is
# still at it, which the host's timing decides: each mutant runs this many times (each run's
# buffers at other addresses), and one run that differs catches it.
MUTANT_TRIALS = 2


def _sleep_cycles(device_type: str, n: int) -> None:
    if n and device_type == "cuda":
        import torch

        torch.cuda._sleep(n)


@contextlib.contextmanager
def consumer_delays(
    device_type: str,
    cycles: Callable[[str], int],
    counts: dict[str, int],
    poison: Callable[[], bool] = lambda: False,
) -> Iterator[None]:
    """A ``torch.cuda._sleep(cycles(point))`` on the current stream before each point of
    ``DELAY_POINTS`` (none on CPU, where the points are only counted, in ``counts``). With
    ``poison()``, the buffer the delayed op writes is filled with garbage before the sleep
    (the all-gather output's slot the copy-in casts into; the reduce-scatter input the
    layout writes), so a reader that does not wait sees garbage."""
    import importlib

    lock = threading.Lock()
    saved: list[tuple[Any, str, Any]] = []

    def count(point: str) -> int:
        with lock:
            counts[point] = counts.get(point, 0) + 1
        return cycles(point)

    def sleeping(point: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            n = count(point)
            if point == "before_copy_in" and len(args) > 5 and args[5] is not None:
                into = args[5]

                def late_into(numel: int, dtype: Any) -> Any:  # allocate, poison, then sleep
                    slot = into(numel, dtype)
                    if n and poison():
                        _poison(slot)
                    _sleep_cycles(device_type, n)
                    return slot

                return fn(*args[:5], late_into, *args[6:], **kwargs)
            if n and poison() and kwargs.get("out") is not None:
                _poison(kwargs["out"])
            _sleep_cycles(device_type, n)
            return fn(*args, **kwargs)

        return wrapper

    try:
        for point, (module_name, attr) in DELAY_POINTS.items():
            module = importlib.import_module(module_name)
            fn = getattr(module, attr)
            saved.append((module, attr, fn))
            setattr(module, attr, sleeping(point, fn))
        yield
    finally:
        for module, attr, fn in reversed(saved):
            setattr(module, attr, fn)


def _sleep_before_optimizer(
    device_type: str, cycles: Callable[[str], int], counts: dict[str, int]
) -> Callable[[], None]:
    """The last consumer-side delay: the optimizer step (it writes the shards the next
    all-gather reads, and reads the gradients the reduction wrote) starts late."""

    def sleep() -> None:
        counts["before_optimizer"] = counts.get("before_optimizer", 0) + 1
        _sleep_cycles(device_type, cycles("before_optimizer"))

    return sleep


def _run_plans(
    device_type: str, world: int, plans: list[dict[str, Any]]
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """Threads as ranks on one device; each plan (``label``, ``case``: a name or scenario dict,
    ``delays``: where it sleeps (a subset of ``ALL_DELAYS``; none without it), ``cycles``: how
    long (``SLEEP_CYCLES`` by default), ``synchronize``: the host waits after every
    collective, ``drop``: engine functions whose waits are removed, ``bucket_bytes``) trains a
    fresh model for two steps. A delayed run poisons what its delayed writers write. Each run
    starts with a spacer of its own size allocated, so its buffers sit at other addresses
    than the previous run's (a replay at the same addresses would leave the right values
    where a racing read looks). Returns {label: {rank: result}} and what was seen."""
    import torch

    from shardweave.mesh.extension_points import COLLECTIVES

    plugin = DelayedCollectives(device_type)
    COLLECTIVES.register(device_type, plugin, override=True)
    device = torch.device(device_type)
    lock = threading.Lock()
    barrier = threading.Barrier(world)
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    dropped: list[str] = []
    current: dict[str, Any] = {"drop": frozenset(), "delays": frozenset(), "cycles": 0}
    spacer: list[Any] = []

    def cycles(point: str) -> int:
        return int(current["cycles"]) if point in current["delays"] else 0

    before_optimizer = _sleep_before_optimizer(device_type, cycles, counts)

    def body(rank: int) -> None:
        if device_type == "cuda":
            torch.cuda.set_device(0)
        for index, plan in enumerate(plans):
            barrier.wait()  # every rank finished the last run: switch the plugin's mode
            if rank == 0:
                delays = frozenset(plan.get("delays", ()))
                current["delays"] = delays
                current["cycles"] = plan.get("cycles", SLEEP_CYCLES) if delays else 0
                current["drop"] = frozenset(plan.get("drop", ()))
                plugin.sleep_kinds = delays & COLLECTIVE_KINDS
                plugin.sleep_cycles = current["cycles"]
                plugin.poison = bool(delays)
                plugin.synchronize = bool(plan.get("synchronize"))
                spacer[:] = [torch.empty(512 * (1 + 37 * index % 61), dtype=torch.uint8,
                                         device=device)]  # fmt: skip
            barrier.wait()
            with lock:  # the threads share torch's global generator, which seeds the model
                model = _model(32, 2, device)
            _apply("shardweave", model, plan["case"], device_type)
            case = plan["case"] if isinstance(plan["case"], str) else "scenario"
            out = _train(model, case, device, steps=2, rank=rank, before_optimizer=before_optimizer)
            if device_type == "cuda":
                torch.cuda.synchronize()
            with lock:
                runs.setdefault(plan["label"], {})[rank] = out

    # On CPU the engine's waits go to torch.cpu.Stream (no-ops): dropping them changes no
    # number, but ``dropped`` shows the mutation found the engine's waits by name.
    stream_cls = torch.cuda.Stream if device_type == "cuda" else torch.cpu.Stream
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            consumer_delays(device_type, cycles, counts, lambda: bool(current["delays"]))
        )
        stack.enter_context(dropping_waits(stream_cls, lambda: current["drop"], dropped))
        buckets = {plan.get("bucket_bytes") for plan in plans} - {None}
        if buckets:  # one cap for the whole run (the tests' mutations use one)
            stack.enter_context(_bucket_bytes(min(buckets)))
        _run_threads(world, body)
    seen = {"collectives_issued": plugin.calls, "delay_points": counts, "dropped": dropped}
    return runs, seen


@contextlib.contextmanager
def _bucket_bytes(nbytes: int) -> Iterator[None]:
    """Replicate's bucket caps set to ``nbytes`` (as the tests' scenarios do)."""
    from shardweave.fsdp import _reduction

    saved = _reduction.FIRST_BUCKET_BYTES, _reduction.BUCKET_BYTES
    _reduction.FIRST_BUCKET_BYTES = _reduction.BUCKET_BYTES = nbytes
    try:
        yield
    finally:
        _reduction.FIRST_BUCKET_BYTES, _reduction.BUCKET_BYTES = saved


def _same(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], world: int) -> dict[str, Any]:
    ranks = [_compare(a[r], b[r]) for r in range(world)]
    return {"bitwise": all(c["bitwise"] for c in ranks), "ranks": ranks}


def section_delayed(device_type: str, world: int = 4) -> dict[str, Any]:
    """Each case with the delays (before collectives and before consumers) against the
    synchronized run with none."""
    plans = [
        {"label": f"{case}/{mode}", "case": case,
         "delays": ALL_DELAYS if mode == "delayed" else (),
         "synchronize": mode == "synchronized"}
        for case in DELAYED_CASES
        for mode in ("synchronized", "delayed")
    ]  # fmt: skip
    runs, seen = _run_plans(device_type, world, plans)
    results: dict[str, Any] = {
        case: _same(runs[f"{case}/delayed"], runs[f"{case}/synchronized"], world)
        for case in DELAYED_CASES
    }
    results.update(seen)
    results["sleep_cycles"] = SLEEP_CYCLES if device_type == "cuda" else 0
    return results


# --- mutants ---------------------------------------------------------------------------------
def mutations() -> dict[str, tuple[dict[str, Any], str, tuple[str, ...]]]:
    """The tests' own mutation list (every stream wait and every keep-alive of the engine's
    stream-ordering design note), imported from the checkout's tests/."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.fsdp._stream_order import KEEP_ALIVE_MUTATIONS, WAIT_MUTATIONS

    return {**WAIT_MUTATIONS, **KEEP_ALIVE_MUTATIONS}


def _cfg_for_kit(cfg: dict[str, Any]) -> dict[str, Any]:
    """A test scenario as the kit's model runs it (the bucket cap is applied apart)."""
    return {k: v for k, v in cfg.items() if k != "bucket_bytes"}


def section_mutants(device_type: str, world: int = 2) -> dict[str, Any]:
    """Every mutant must be caught. On CUDA: threads as ranks, the mutant's waits removed with
    every delay on, against the synchronized run of the same scenario (an unmutated delayed
    run is the control, which must agree); caught = a number differs. On CPU: the tests' own
    check, each mutant at two gloo ranks on the test accelerator under the stream sanitizer;
    caught = the report names the race or unsafe reuse (``KIT_MUTANTS`` narrows the list)."""
    muts = mutations()
    only = [m for m in os.environ.get("KIT_MUTANTS", "").split(",") if m]
    names = [m for m in muts if not only or m in only]
    if device_type != "cuda":
        results: dict[str, Any] = {name: _mutant_sanitized(name, world) for name in names}
        results["ok"] = all(results[n]["caught"] for n in names) and bool(names)
        return results
    return mutants_threaded(device_type, world, names)


def mutants_threaded(
    device_type: str, world: int, names: list[str], trials: int = MUTANT_TRIALS
) -> dict[str, Any]:
    """The device check of ``section_mutants``: each mutant with its producer's delay only
    (``MUTANT_DELAYS``), poisoned, beside a control run the same way without the mutation,
    ``trials`` times; caught = every control agrees with the synchronized run and a mutant run
    does not (on CPU it runs, but catches nothing: the CPU streams run in program order)."""
    muts = mutations()
    plans: list[dict[str, Any]] = []
    for name in names:
        cfg, drop, _ = muts[name]
        base = {"case": _cfg_for_kit(cfg), "bucket_bytes": cfg.get("bucket_bytes")}
        plans.append({**base, "label": f"{name}/synchronized", "synchronize": True})
        delayed = {**base, "delays": MUTANT_DELAYS[name], "cycles": MUTANT_SLEEP_CYCLES}
        for trial in range(trials):
            plans.append({**delayed, "label": f"{name}/control/{trial}"})
            plans.append({**delayed, "label": f"{name}/mutant/{trial}", "drop": (drop,)})
    runs, seen = _run_plans(device_type, world, plans)
    results: dict[str, Any] = {}
    for name in names:
        ref = runs[f"{name}/synchronized"]
        result: dict[str, Any] = {"delays": sorted(MUTANT_DELAYS[name])}
        for kind in ("control", "mutant"):
            result[f"{kind}_bitwise"] = [
                _same(runs[f"{name}/{kind}/{t}"], ref, world)["bitwise"] for t in range(trials)
            ]
        result["waits_dropped"] = seen["dropped"].count(muts[name][1])
        # A mutant whose waits were never asked for (0 dropped) tested nothing.
        result["caught"] = (
            all(result["control_bitwise"])
            and not all(result["mutant_bitwise"])
            and result["waits_dropped"] > 0
        )
        results[name] = result
    results["delay_points"] = seen["delay_points"]
    results["sleep_cycles"] = MUTANT_SLEEP_CYCLES if device_type == "cuda" else 0
    results["ok"] = all(results[n]["caught"] for n in names) and bool(names)
    return results


def _mutant_sanitized(name: str, world: int, timeout: float = 300.0) -> dict[str, Any]:
    """One mutant through the tests' ``mutated`` body at ``world`` gloo ranks (processes)."""
    _, _, must_name = mutations()[name]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *PACKAGE_SRCS, env.get("PYTHONPATH", "")])
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__)),
                    "--_mutant",
                    name,
                    "--_rank",
                    str(rank),
                    "--_world",
                    str(world),
                    "--_store",
                    str(Path(tmp) / "store"),
                    "--out",
                    str(Path(tmp) / f"rank{rank}.json"),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0] + f"\n(timed out after {timeout:.0f} s)")
        reports = []
        for rank, proc in enumerate(procs):
            out = Path(tmp) / f"rank{rank}.json"
            if proc.returncode != 0 or not out.exists():
                return {"caught": False, "error": f"rank {rank} exit {proc.returncode}",
                        "output_tail": outputs[rank][-3000:]}  # fmt: skip
            reports.append(json.loads(out.read_text()))
    caught = all(
        r["dropped"] and any(all(n in race for n in must_name) for race in r["races"])
        for r in reports
    )
    return {"caught": caught, "dropped": [len(r["dropped"]) for r in reports],
            "races": [r["races"][:3] for r in reports]}  # fmt: skip


def _mutant_rank(name: str, rank: int, world: int, store: str, out: str) -> None:
    """One rank of ``_mutant_sanitized`` (a process of its own)."""
    import torch.distributed as dist

    cfg, drop, _ = mutations()[name]
    from tests.fsdp._stream_order import mutated

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        result = mutated(rank, world, cfg, drop, accelerator=True)
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(result, default=str))


# The text of the warning ``torch.cuda.set_sync_debug_mode("warn")`` raises at a synchronizing
# CUDA call (c10/cuda/CUDAFunctions.cpp, ``warn_or_error_on_sync``; a UserWarning in Python).
# Any other warning in the loop (say, the autograd "returned a view tensor" warning of a
# pre-backward hook) is listed apart, never counted as a synchronization.
SYNC_WARNING = "called a synchronizing CUDA operation"


def is_sync_warning(message: Any) -> bool:
    return SYNC_WARNING in str(message)


def _site(filename: str, lineno: int) -> str:
    """'file:line function' of the innermost engine/optimizer frame of the current stack."""
    frames = [
        f"{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()
        if ("shardweave" in f.filename or "fsdp" in f.filename or "optim" in f.filename)
        and Path(f.filename).name != Path(__file__).name
    ]
    return frames[-1] if frames else f"{Path(filename).name}:{lineno}"


@contextlib.contextmanager
def recording_syncs() -> Iterator[dict[str, list[str]]]:
    """Collects, while active, the site of every synchronization warning (``syncs``, one entry
    per warning) and every other warning's text (``other``)."""
    found: dict[str, list[str]] = {"syncs": [], "other": []}

    def record(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if is_sync_warning(message):
            found["syncs"].append(_site(filename, lineno))
        else:
            name = getattr(category, "__name__", str(category))
            found["other"].append(f"{name}: {str(message)[:160]} ({Path(filename).name}:{lineno})")

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        yield found


def sync_verdict(ours: list[str], theirs: list[str]) -> dict[str, Any]:
    """Ours against torch's FSDP2: every synchronization counted (per site), pass iff ours
    makes no more of them than torch's does in the same loop."""
    from collections import Counter

    return {
        "shardweave": dict(sorted(Counter(ours).items())),
        "torch": dict(sorted(Counter(theirs).items())),
        "counts": {"shardweave": len(ours), "torch": len(theirs)},
        "ok": len(ours) <= len(theirs),
    }


def _sync_warnings(engine: str, steps: int = 3) -> dict[str, list[str]]:
    """The synchronization warnings (and the other warnings) of steady-state steps."""
    import torch

    device = torch.device("cuda")
    model = _model(256, 4, device)
    _apply(engine, model, "fsdp", "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(8, 32, 256, device=device)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # lazy init and the first optimizer step are not steady state
        step()
    torch.cuda.synchronize()
    with recording_syncs() as found:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def section_sync(device_type: str) -> dict[str, Any]:
    import torch.distributed as dist

    _init_world1(device_type)
    try:
        ours, theirs = _sync_warnings("shardweave"), _sync_warnings("torch")
    finally:
        dist.destroy_process_group()
    result = sync_verdict(ours["syncs"], theirs["syncs"])
    result["other_warnings"] = {"shardweave": ours["other"][:20], "torch": theirs["other"][:20]}
    result["note"] = "per site ('file:line function' of the innermost engine/optimizer frame)"
    return result


def section_csan(device_type: str) -> dict[str, Any]:
    # TORCH_CUDA_SANITIZER must be set before torch is imported: a subprocess of our own.
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    path = [str(ROOT / "tools"), *PACKAGE_SRCS]
    code = (
        f"import sys; sys.path[:0] = {path!r}\n"
        "import gpu_kit, torch\n"
        "gpu_kit._init_world1('cuda')\n"
        "m = gpu_kit._model(64, 3, torch.device('cuda'))\n"
        "gpu_kit._apply('shardweave', m, 'fsdp', 'cuda')\n"
        "gpu_kit._train(m, 'fsdp', torch.device('cuda'), steps=3)\n"
        "torch.cuda.synchronize(); print('csan: no race')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    return {"ok": proc.returncode == 0 and "csan: no race" in out, "output_tail": out[-4000:]}


# --- a transformers Llama ------------------------------------------------------------------
# (tied embeddings, bf16 compute, CPU offload): every combination.
LLAMA_VARIANTS = tuple(
    f"{'tied' if tied else 'untied'}-{dtype}{'-offload' if offload else ''}"
    for tied in (True, False)
    for dtype in ("bf16", "fp32")
    for offload in (False, True)
)
# (hidden, layers, heads, kv heads, vocab, batch, sequence)
LLAMA_SIZES = {"cuda": (256, 4, 8, 4, 1024, 4, 128), "cpu": (32, 2, 4, 2, 64, 2, 8)}


def _llama(variant: str, engine: str, device_type: str) -> Any:
    """A small ``LlamaForCausalLM`` sharded per decoder layer and at the root by ``engine``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, vocab, _, seq = LLAMA_SIZES[device_type]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        tie_word_embeddings=variant.startswith("tied"),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device_type)
    cfg: dict[str, Any] = {"offload": variant.endswith("offload")}
    if "-bf16" in variant:
        cfg.update(mp=True)
    model.blocks = model.model.layers  # what ``_apply`` shards one by one
    _apply(engine, model, cfg, device_type)
    del model.blocks
    return model


def _train_llama(model: Any, device_type: str, steps: int = 3) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    _, _, _, _, vocab, batch, seq = LLAMA_SIZES[device_type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device_type)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        if step < steps - 1:
            opt.zero_grad(set_to_none=True)
    params = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        params.append((name, local.detach().cpu(), None if grad is None else grad.cpu()))
    return {"losses": [x.item() for x in losses], "params": params, "state": []}


def llama_verdict(
    torch_a: dict[str, Any], torch_b: dict[str, Any], ours: dict[str, Any]
) -> dict[str, Any]:
    """Ours against torch's engine, judged only where torch's engine agrees with itself (two
    runs, bitwise): elsewhere the variant is nondeterministic on this device and not judged."""
    control = _compare(torch_b, torch_a)
    result = _compare(ours, torch_a)
    result["torch_agrees_with_itself"] = control["bitwise"]
    result["judged"] = control["bitwise"]
    result["ok"] = result["bitwise"] or not control["bitwise"]
    return result


def section_llama(device_type: str) -> dict[str, Any]:
    """A transformers ``LlamaForCausalLM`` at world 1, each variant of ``LLAMA_VARIANTS``: torch's
    engine twice (the control) and ours once, on the same batches. Skipped without
    transformers."""
    import torch.distributed as dist

    try:
        import transformers
    except ModuleNotFoundError:
        return {"skipped": "transformers is not installed"}
    _init_world1(device_type)
    results: dict[str, Any] = {"transformers": transformers.__version__}
    try:
        for variant in LLAMA_VARIANTS:
            runs = [
                _train_llama(_llama(variant, engine, device_type), device_type)
                for engine in ("torch", "torch", "shardweave")
            ]
            results[variant] = llama_verdict(*runs)
    finally:
        dist.destroy_process_group()
    results["ok"] = all(results[v]["ok"] for v in LLAMA_VARIANTS)
    results["differs"] = [v for v in LLAMA_VARIANTS if not results[v]["ok"]]
    results["not_judged"] = [v for v in LLAMA_VARIANTS if not results[v]["judged"]]
    return results


# --- bench ----------------------------------------------------------------------------------
# Rounds in this order, each in a fresh process: in one process a round's model is not freed
# at ``del`` (reference cycles), so each later round would carry the earlier ones' memory.
BENCH_ROUNDS = ("torch", "shardweave", "torch", "shardweave")
BENCH_PHASES = ("forward", "backward", "optimizer", "zero_grad")
# (width, blocks, batch, sequence, warm-up steps, measured steps): ~0.54 B parameters in bf16
# on CUDA; a tiny model on CPU, where only the kit's logic is checked.
BENCH_SIZES = {"cuda": (2048, 16, 8, 1024, 3, 10), "cpu": (32, 2, 2, 8, 1, 2)}


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach (DTensors by their
    local tensor): the CPU stand-in for ``torch.cuda.memory_allocated`` (no allocator stats
    on CPU). A model kept alive by a reference cycle is counted until it is collected."""
    import gc

    import torch

    storages: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        # issubclass(type(...)): isinstance would read ``__class__``, which some lazy module
        # attributes answer with a deprecation warning.
        if not issubclass(type(obj), torch.Tensor):
            continue
        local = getattr(obj, "_local_tensor", obj)
        if local.device.type == "meta" or not isinstance(local, torch.Tensor):
            continue
        with contextlib.suppress(Exception):  # wrapper subclasses without a storage
            storage = local.untyped_storage()
            if storage.data_ptr():
                storages[(local.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


class _Meter:
    """Allocated and peak bytes per phase: CUDA's allocator statistics; on CPU, live tensor
    bytes at the phase's end (the peak inside a phase is not seen there: it is the larger of
    its start and end)."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda"

    def allocated(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return int(torch.cuda.memory_allocated())
        return live_tensor_bytes()

    @contextlib.contextmanager
    def phase(self, into: dict[str, dict[str, int]], name: str) -> Iterator[None]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = self.allocated()
        yield
        end = self.allocated()
        peak = int(torch.cuda.max_memory_allocated()) if self.cuda else max(start, end)
        into[name] = {"allocated": end, "peak": peak}


def bench_round(engine: str, device_type: str) -> dict[str, Any]:
    """One round in this process: baseline (allocated before the model exists), median step
    time, per-phase allocated/peak of one more step after the timed ones, and what is left allocated
    after the round is deleted and collected (``leftover_bytes``, for information)."""
    import gc

    import torch
    import torch.distributed as dist

    dim, blocks, batch, seq, warmup, measured = BENCH_SIZES[device_type]
    _init_world1(device_type)
    device = torch.device(device_type)
    meter = _Meter(device_type)
    try:
        gc.collect()
        baseline = meter.allocated()
        model = _model(dim, blocks, device)
        _apply(engine, model, "bf16", device_type)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        x = torch.randn(batch, seq, dim, device=device)

        def step(model: Any, opt: Any, x: Any) -> None:
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step(model, opt, x)
        # Timed steps run back to back (no host wait inside a step, which would hide
        # overlap); the per-phase memory is measured on one more step after them.
        times: list[float] = []
        for _ in range(measured):
            if device_type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(model, opt, x)
            if device_type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        phases: dict[str, dict[str, int]] = {}
        with meter.phase(phases, "forward"):
            loss = model(x).float().pow(2).mean()
        with meter.phase(phases, "backward"):
            loss.backward()
            del loss
        with meter.phase(phases, "optimizer"):
            opt.step()
        with meter.phase(phases, "zero_grad"):  # between steps
            opt.zero_grad(set_to_none=True)
        del model, opt, x
        gc.collect()
        leftover = meter.allocated() - baseline
    finally:
        dist.destroy_process_group()
    return {"engine": engine, "baseline_bytes": baseline, "phases": phases,
            "step_ms": sorted(times)[len(times) // 2], "leftover_bytes": leftover}  # fmt: skip


def bench_verdict(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios of ours to torch's (best step time; largest per-phase peak) and the baseline
    check: every round must start from the same allocated bytes, or the comparison measures
    leftovers (``ok`` false)."""
    baselines = [r["baseline_bytes"] for r in rounds]
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        by_engine.setdefault(r["engine"], []).append(r)

    def peak(r: dict[str, Any]) -> int:
        return max(p["peak"] for p in r["phases"].values())

    result: dict[str, Any] = {"rounds": rounds, "baselines": baselines}
    result["same_baseline"] = len(set(baselines)) == 1
    if {"torch", "shardweave"} <= by_engine.keys():
        ours, theirs = by_engine["shardweave"], by_engine["torch"]
        result["step_time_ratio"] = min(r["step_ms"] for r in ours) / min(
            r["step_ms"] for r in theirs
        )
        result["peak_memory_ratio"] = max(map(peak, ours)) / max(max(map(peak, theirs)), 1)
    result["ok"] = result["same_baseline"] and len(rounds) == len(BENCH_ROUNDS)
    return result


def section_bench(device_type: str) -> dict[str, Any]:
    """Each round of ``BENCH_ROUNDS`` in a fresh process (``--_bench_round``)."""
    rounds: list[dict[str, Any]] = []
    errors: list[str] = []
    for engine in BENCH_ROUNDS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "round.json"
            cmd = [sys.executable, str(Path(__file__)), "--_bench_round", engine,
                   "--device", device_type, "--out", str(out)]  # fmt: skip
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([*PACKAGE_SRCS, env.get("PYTHONPATH", "")])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0 or not out.exists():
                errors.append(
                    f"{engine}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"
                )
                continue
            rounds.append(json.loads(out.read_text()))
    result = bench_verdict(rounds)
    if device_type == "cuda":
        result["params"] = sum(
            p.numel()
            for p in _model(BENCH_SIZES["cuda"][0], BENCH_SIZES["cuda"][1], "meta").parameters()
        )
    if errors:
        result["errors"] = errors
        result["ok"] = False
    return result


SECTION_FUNCS: dict[str, Callable[[str], dict[str, Any]]] = {
    "mutants": section_mutants,
    "llama": section_llama,
    "plugin": section_plugin,
    "parity": section_parity,
    "delayed": section_delayed,
    "sync": section_sync,
    "csan": section_csan,
    "bench": section_bench,
}


# --- driver ----------------------------------------------------------------------------------
def _run_section_subprocess(name: str, device_type: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "section.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*PACKAGE_SRCS, env.get("PYTHONPATH", "")])
        cmd = [sys.executable, str(Path(__file__)), "--_section", name, "--device", device_type,
               "--out", str(out)]  # fmt: skip
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return {
                "error": f"timed out after {timeout:.0f} s",
                "output_tail": str(exc.output)[-4000:],
            }
        seconds = round(time.monotonic() - start, 1)
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit {proc.returncode}", "seconds": seconds,
                    "output_tail": (proc.stdout + proc.stderr)[-4000:]}  # fmt: skip
        result: dict[str, Any] = json.loads(out.read_text())
        result["seconds"] = seconds
        return result


def _passed(name: str, result: dict[str, Any]) -> bool:
    if "error" in result or "skipped" in result:
        return False
    if name in ("parity", "delayed"):
        cases = [v for k, v in result.items() if k in CASES]
        return bool(cases) and all(v.get("bitwise") for v in cases)
    # bench passes when every round started from the same baseline (its ratios are reported,
    # never judged)
    return bool(result.get("ok"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-report.json", help="where the JSON report goes")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per section")
    parser.add_argument("--_section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_bench_round", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_mutant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--_store", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._section or args._bench_round or args._mutant:  # inside a subprocess of the kit
        sys.path[:0] = PACKAGE_SRCS
        if args._mutant:
            _mutant_rank(args._mutant, args._rank, args._world, args._store, args.out)
            return 0
        if args._bench_round:
            result = bench_round(args._bench_round, args.device)
        else:
            result = SECTION_FUNCS[args._section](args.device)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        return 0

    try:
        import torch
    except ModuleNotFoundError:  # the machine's own python (``nox -s gpu``) may have no torch
        print(
            f"gpu kit: no torch in this python ({sys.executable}); run the kit with a python"
            " that has torch 2.11 or newer: <that python> tools/gpu_kit.py"
        )
        return 0

    device_type = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device_type is None:
        print(f"gpu kit: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 0
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu",
        "sections": {},
    }
    for name in [s for s in args.sections.split(",") if s]:
        if name not in SECTION_FUNCS:
            parser.error(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        if name in CUDA_ONLY and device_type != "cuda":
            report["sections"][name] = {"skipped": "needs CUDA"}
            continue
        result = _run_section_subprocess(name, device_type, args.timeout)
        if "skipped" in result:  # the section found nothing to run here (say, no transformers)
            report["sections"][name] = result
            print(f"gpu kit: {name}: skipped ({result['skipped']})", flush=True)
            continue
        result["passed"] = _passed(name, result)
        report["sections"][name] = result
        print(f"gpu kit: {name}: {'passed' if result['passed'] else 'FAILED'}"
              f" ({result.get('seconds', '?')} s)", flush=True)  # fmt: skip
        # Written after every section: a run cut short (a lent GPU's time is short) still
        # leaves the sections it finished.
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu kit: report written to {args.out}")
    ran = [v for v in report["sections"].values() if "skipped" not in v]
    return 0 if all(v["passed"] for v in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
