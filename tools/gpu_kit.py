"""The GPU kit: in one command, the checks of the engine that only a CUDA device can make.

    python tools/gpu_kit.py [--out gpu-report.json] [--sections parity,delayed,sync,csan,bench]
    nox -s gpu            (the same with the machine's own python and torch; never run by CI)

It needs nothing but torch (2.11 or newer) and this checkout: the four packages are imported
from ``packages/*/src``, so a machine without a package index runs it as it is. Each section
runs in a subprocess of its own (the threaded process group and CUDA's sanitizer change the
process they run in) and the report is one JSON file:

* ``parity``: world size 1 on NCCL, shardweave against torch's ``fully_shard`` on the same
  model and batches (per-block FSDP, bf16 compute with fp32 reduction, CPU offload with
  optimizer-in-backward hooks, ``replicate``, HSDP on a 1x1 mesh): losses, shards and grads
  bitwise.
* ``plugin``: the test plugin of ``delayed`` checked on its own: its all-gather, reduce-scatter
  (sum, average) and all-reduce at four ranks against closed forms, with the delay.
* ``delayed``: four ranks on the one GPU as threads of one process, through a test
  ``COLLECTIVES`` plugin (``DelayedCollectives``) that moves the right bytes on the stream the
  engine issues on, after an injected ``torch.cuda._sleep``. A consumer that does not wait for
  the collective, or a buffer the allocator hands out again while the collective still reads
  it, changes the numbers: each case must be bitwise equal to the same run with no delay and
  a device synchronization after every collective.
* ``sync``: ``torch.cuda.set_sync_debug_mode`` over steady-state steps: every host
  synchronization our engine makes, beside the ones torch's FSDP2 makes in the same loop.
* ``csan``: a few steps under ``TORCH_CUDA_SANITIZER=1`` (torch's CUDA stream sanitizer).
* ``bench``: step time and peak memory against torch's FSDP2 at world size 1, on a model of
  about 0.54 B parameters with bf16 compute (ratios).

Without a CUDA device it says so in one line and exits 0. ``--device cpu`` runs the sections
that do not need CUDA (``plugin`` and ``delayed`` without the sleep, ``parity`` on gloo) on the CPU: the test
suite proves the kit's own logic that way (``tests/tools/test_gpu_kit.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_SRCS = [
    str(ROOT / "packages" / p / "src") for p in ("mesh", "fsdp", "replicate", "extensions")
]
SECTIONS = ("plugin", "parity", "delayed", "sync", "csan", "bench")
CUDA_ONLY = ("sync", "csan", "bench")
# ``cpu_batch``: the loop hands over CPU batches (the root moves them, as torch's does);
# ``offload_hooks`` also compares the full state dict gathered from the offloaded shards.
PARITY_CASES = ("fsdp", "cpu_batch", "bf16", "offload_hooks", "replicate", "hsdp_1x1")
DELAYED_CASES = ("fsdp", "bf16", "hsdp_2x2", "replicate")
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


def _apply(engine: str, model: Any, case: str, device_type: str) -> None:
    """Shard ``model`` per block and at the root with ``engine`` ("torch" or "shardweave")."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

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
    if case == "replicate":
        if engine == "torch":
            from torch.distributed._composable.replicate_with_fsdp import (  # noqa: TID251
                replicate,
            )
        else:
            from shardweave.replicate import replicate  # type: ignore[assignment]
        for block in model.blocks:
            replicate(block)
        replicate(model)
        return
    kwargs: dict[str, Any] = {}
    if case == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if case == "offload_hooks":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    if case.startswith("hsdp"):
        import torch.distributed as dist

        world = dist.get_world_size()
        shape = (1, 1) if world == 1 else (2, world // 2)
        kwargs["mesh"] = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
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


def _train(model: Any, case: str, device: Any, steps: int, rank: int = 0) -> dict[str, Any]:
    """Losses and final local shards (params and grads), as plain Python for comparison."""
    import torch
    from torch.distributed.tensor import DTensor

    opts = _optimizers(model, case)
    losses: list[float] = []
    dim = model.out.in_features
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 8, dim, generator=gen)
        if case != "cpu_batch":
            x = x.to(device)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        for opt in opts:
            opt.step()
            if step < steps - 1:
                opt.zero_grad(set_to_none=True)
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


class DelayedCollectives:
    """A ``COLLECTIVES`` plugin for ranks that are threads of one process on one device.

    Each call meets the same call of the other ranks (by group and call count) on the host,
    then, on the stream current at the call (the one the engine issues on), waits for every
    rank's inputs to be ready, sleeps ``sleep_cycles`` (CUDA), moves the bytes, and waits for
    every rank's copy to finish before it counts as done, as a real collective does. Sums run
    in rank order, so the result does not depend on timing. ``synchronize`` makes the host wait
    for the device after each call (the reference run).
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.sleep_cycles = 0
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
            stream.wait_event(event)

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

    def _collective(self, kind: str, group: Any, mine: Any, finish: Callable[..., None]) -> Any:
        import torch

        rank, world, key = self._key(kind, group)
        peers = self._exchange((*key, "ready"), rank, world, (mine, self._event()))
        self._wait([event for _, event in peers])
        if self.sleep_cycles and self.device_type == "cuda":
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

        work = self._collective("all_gather", group, input, finish)
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

        work = self._collective("reduce_scatter", group, input, finish)
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


def section_delayed(device_type: str, world: int = 4) -> dict[str, Any]:
    """Threads as ranks on one device; each case with the delay against the synchronized run."""
    import torch

    from shardweave.mesh.extension_points import COLLECTIVES

    plugin = DelayedCollectives(device_type)
    COLLECTIVES.register(device_type, plugin, override=True)
    device = torch.device(device_type)
    results: dict[str, Any] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(world)
    runs: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    modes = ("synchronized", "delayed")

    def body(rank: int) -> None:
        if device_type == "cuda":
            torch.cuda.set_device(0)
        for case in DELAYED_CASES:
            for mode in modes:
                barrier.wait()  # every rank finished the last run: switch the plugin's mode
                if rank == 0:
                    plugin.sleep_cycles = SLEEP_CYCLES if mode == "delayed" else 0
                    plugin.synchronize = mode == "synchronized"
                barrier.wait()
                with lock:  # the threads share torch's global generator, which seeds the model
                    model = _model(32, 2, device)
                _apply("shardweave", model, case, device_type)
                out = _train(model, case, device, steps=2, rank=rank)
                if device_type == "cuda":
                    torch.cuda.synchronize()
                with lock:
                    runs.setdefault((case, mode), {})[rank] = out

    _run_threads(world, body)
    for case in DELAYED_CASES:
        ranks = [
            _compare(runs[(case, "delayed")][r], runs[(case, "synchronized")][r])
            for r in range(world)
        ]
        results[case] = {"bitwise": all(c["bitwise"] for c in ranks), "ranks": ranks}
    results["collectives_issued"] = plugin.calls
    results["sleep_cycles"] = SLEEP_CYCLES if device_type == "cuda" else 0
    return results


def _sync_sites(engine: str, steps: int = 3) -> list[str]:
    """Where the host synchronizes with the device in steady-state steps of ``engine``."""
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
    sites: set[str] = set()

    def record(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()
            if "shardweave" in f.filename or "fsdp" in f.filename or "optim" in f.filename
        ]
        sites.add(frames[-1] if frames else f"{filename}:{lineno}")

    old = warnings.showwarning
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(steps):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return sorted(sites)


def section_sync(device_type: str) -> dict[str, Any]:
    import torch.distributed as dist

    _init_world1(device_type)
    try:
        ours, theirs = _sync_sites("shardweave"), _sync_sites("torch")
    finally:
        dist.destroy_process_group()
    return {
        "shardweave": ours,
        "torch": theirs,
        "ok": len(ours) <= len(theirs),
        "note": "sites are 'file:line function' of the innermost engine/optimizer frame",
    }


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


def section_bench(device_type: str) -> dict[str, Any]:
    """World size 1, ~0.54 B parameters (16 blocks of width 2048), bf16 compute."""
    import torch
    import torch.distributed as dist

    _init_world1(device_type)
    device = torch.device("cuda")
    results: dict[str, Any] = {}
    try:
        for engine in ("torch", "shardweave", "torch", "shardweave"):  # two alternating rounds
            model = _model(2048, 16, device)
            _apply(engine, model, "bf16", "cuda")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            x = torch.randn(8, 1024, 2048, device=device)
            times: list[float] = []
            for i in range(13):
                if i == 3:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                model(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                end.record()
                if i >= 3:
                    end.synchronize()
                    times.append(start.elapsed_time(end))
            entry = results.setdefault(engine, {"step_ms": [], "peak_bytes": []})
            entry["step_ms"].append(sorted(times)[len(times) // 2])
            entry["peak_bytes"].append(torch.cuda.max_memory_allocated())
            del model, opt, x
            torch.cuda.empty_cache()
        ours, theirs = results["shardweave"], results["torch"]
        results["params"] = sum(p.numel() for p in _model(2048, 16, "meta").parameters())
        results["step_time_ratio"] = min(ours["step_ms"]) / min(theirs["step_ms"])
        results["peak_memory_ratio"] = max(ours["peak_bytes"]) / max(theirs["peak_bytes"])
    finally:
        dist.destroy_process_group()
    return results


SECTION_FUNCS: dict[str, Callable[[str], dict[str, Any]]] = {
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
        return all(v.get("bitwise") for v in result.values() if isinstance(v, dict))
    if name in ("plugin", "sync", "csan"):
        return bool(result.get("ok"))
    return True  # bench reports ratios; it does not pass or fail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-report.json", help="where the JSON report goes")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per section")
    parser.add_argument("--_section", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._section:  # inside the subprocess of one section
        sys.path[:0] = PACKAGE_SRCS
        result = SECTION_FUNCS[args._section](args.device)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        return 0

    import torch

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
        result["passed"] = _passed(name, result)
        report["sections"][name] = result
        print(f"gpu kit: {name}: {'passed' if result['passed'] else 'FAILED'}"
              f" ({result.get('seconds', '?')} s)", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu kit: report written to {args.out}")
    ran = [v for v in report["sections"].values() if "skipped" not in v]
    return 0 if all(v["passed"] for v in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
