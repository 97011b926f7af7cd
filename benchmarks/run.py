"""Benchmark shardweave's ``fully_shard`` and ``replicate`` against torch's on the same models.

Run::

    python benchmarks/run.py [--world-size 2] [--steps N] [--json bench-results/fsdp.json]

Workloads (each builds one model per implementation from the same seed, trained on the same
per-rank batches with the same optimizer):

* ``mlp48``: 48 x (Linear(64, 64) + ReLU), each pair ``fully_shard``-ed, then the root; SGD
  (issue #8's "many small modules"; it replaced the earlier 16-module ``mlp16``).
* ``gpt``: the demo's GPT (``demos/model.py``), each block ``fully_shard``-ed, then the root; AdamW.
* ``replicate``: the same GPT and AdamW under data parallelism, three ways: ``shardweave``
  (``shardweave.replicate.replicate`` per block, then the root), ``torch-replicate`` (torch's
  FSDP-engine ``replicate_with_fsdp.replicate``, the same way) and ``ddp``
  (``DistributedDataParallel`` on the plain model). The minimum traffic is one all-reduce of
  every gradient byte per step.

Process layout. Every implementation of a workload runs in its own set of ``--world-size``
spawned CPU processes with its own gloo process group (its own ``FileStore`` in a temporary
directory, so no port is ever bound and no implementation can disturb another's collectives).
The parent drives the sets in turns over pipes: round 1 runs A, B, C; round 2 runs C, B, A;
and so on, each turn being ``--steps-per-turn`` timed steps. Only one set computes at a time;
the others sit blocked in a pipe read (one intra-op thread per rank, so no OpenMP spin-wait),
so the implementations never share the CPU cores, and alternating the order cancels slow drift
(thermal, other load on the machine) to first order. A step's time is the slowest rank's, with
a barrier before each step. Every pipe read has a timeout (``--timeout``): an implementation
that raises, dies or hangs is reported with its error, its processes are killed, and the
others still produce numbers.

Collectives. One extra step per implementation runs under a dispatch mode that records every
c10d collective, so the report gives collectives and bytes per step by kind, next to the
theoretical minimum for the sharding layout.

Peak live tensor bytes. Each rank runs ``torch.profiler.profile(profile_memory=True)`` from
before the model is built until after one measured training step (forward, backward, optimizer
step, ``zero_grad``) that follows the warm-up steps, so optimizer state exists. With memory
profiling on, c10's CPU allocator reports every allocation and free (from any thread: gloo's
worker threads included) as an allocation event carrying a signed size and the allocator's
running total of the bytes it tracks, updated under its lock (so exact whatever the order of
equal timestamps). That total, less its value when the profiler started, is the bytes live in
tensor storages allocated since then: the model, its sharded/unsharded parameters, gradients,
optimizer state, activations, collective buffers, and anything an engine keeps in C++ (DDP's
gradient buckets) that a Python-side walk would miss. Tensors made before the profiler
started (process-group internals) are common to all implementations and not counted; CPU has
no allocator cache, so freed bytes never count. The peak is the largest total inside the
measured step's ``record_function`` window, and the report takes the max over ranks.
``live_before`` is the total when the step starts (steady-state memory; it can include a
buffer a finished gloo collective has not released yet) and ``state_bytes`` the part of it that is parameters, gradients,
optimizer state and buffers (distinct storages), so ``live_before - state_bytes`` is what an
engine keeps besides them. Validation: every rank first measures a small step with a real
all-reduce twice, once also holding a 1 MiB tensor through the window; the two peaks must
differ by exactly 1 MiB (the report's ``memory_self_check``), else the peak figures are
marked unvalidated.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demos"))
from model import GPT, GPTConfig
from train_gpt import load_fully_shard

# Implementation names as reports and ``--impls`` spell them; a workload maps each of its
# implementations to an engine (``shardweave`` means ``fully_shard`` in the FSDP workloads and
# ``replicate`` in the replicate one).
FSDP_IMPLS: Final = {"shardweave": "shardweave", "torch": "torch"}
REPLICATE_IMPLS: Final = {
    "shardweave": "shardweave.replicate",
    "torch-replicate": "torch-replicate",
    "ddp": "ddp",
}
IMPLS: Final = ("shardweave", "torch", "torch-replicate", "ddp")
KINDS: Final = ("all_gather", "reduce_scatter", "all_reduce", "other")
# A hung collective (say one rank raised mid-step) becomes an error inside the set; the
# parent's pipe timeout catches what this does not (a rank that died or spins).
COLLECTIVE_TIMEOUT: Final = datetime.timedelta(seconds=120)
MEMORY_STEP: Final = "shardweave_bench::memory_step"
MIB: Final = 1 << 20

FullyShard = Callable[..., Any]


def load_engine(engine: str) -> FullyShard:
    """The per-module wrapper an engine applies (``ddp`` returns the DDP class itself)."""
    if engine in ("shardweave", "torch"):
        return load_fully_shard(engine)  # the demo's loader: the two are drop-in replacements
    if engine == "shardweave.replicate":
        from shardweave.replicate import replicate as sw_replicate

        return sw_replicate
    if engine == "torch-replicate":
        from torch.distributed._composable.replicate_with_fsdp import (
            replicate as torch_replicate,
        )

        return torch_replicate
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    raise ValueError(f"unknown engine {engine!r}")


def import_error(engine: str) -> str | None:
    try:
        load_engine(engine)
    except Exception as e:  # any failure, not just ImportError: a half-written package counts
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------------------
# Peak live tensor bytes (see the module docstring)


@dataclass
class MemoryStats:
    peak: int  # the largest running total of live bytes inside the window
    live_before: int  # the running total when the window opened
    live_after: int  # ... and when it closed


class LiveBytesRecorder:
    """Profiles CPU allocations; ``window()`` marks the span whose peak ``stats()`` returns."""

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> LiveBytesRecorder:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(None, None, None)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        with record_function(MEMORY_STEP):
            yield

    def stats(self) -> MemoryStats:
        from torch._C._profiler import _EventType

        kineto = self._prof.profiler.kineto_results if self._prof.profiler else None
        if kineto is None:
            raise RuntimeError("LiveBytesRecorder.stats: the profiler has not run")
        events: list[Any] = []
        todo = list(kineto.experimental_event_tree())
        while todo:
            ev = todo.pop()
            events.append(ev)
            todo.extend(ev.children)
        windows = [e for e in events if e.name == MEMORY_STEP]
        if len(windows) != 1:
            raise RuntimeError(f"LiveBytesRecorder.stats: {len(windows)} windows, expected 1")
        start, end = windows[0].start_time_ns, windows[0].end_time_ns
        # Each allocation event carries the allocator's running total right after it
        # (``total_allocated``, updated under the allocator's lock, so exact across threads
        # and independent of how equal timestamps sort). It counts every allocation made
        # while a profiler ran that is still live, so an earlier session's leftovers give a
        # constant offset, removed with the first event's total before its own size.
        allocs = sorted(
            (e.start_time_ns, e.typed[1].total_allocated, e.typed[1].alloc_size)
            for e in events
            if e.tag == _EventType.Allocation and e.typed[1].device.type == "cpu"
        )
        if not allocs:
            return MemoryStats(peak=0, live_before=0, live_after=0)
        offset = allocs[0][1] - allocs[0][2]
        before_events = [total for t, total, _ in allocs if t < start]
        before = before_events[-1] - offset if before_events else 0
        in_window = [total - offset for t, total, _ in allocs if start <= t <= end]
        after = [total for t, total, _ in allocs if t <= end][-1] - offset
        return MemoryStats(peak=max([before, *in_window]), live_before=before, live_after=after)


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind parameters, gradients, buffers and optimizer
    state (DTensors by their local shard)."""
    storages: dict[int, int] = {}

    def add(t: object) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        with contextlib.suppress(Exception):  # wrapper subclasses without a storage
            s = local.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    storages.pop(0, None)  # empty storages share address 0
    return sum(storages.values())


def memory_self_check() -> int:
    """The peak increase a 1 MiB tensor held through the window causes; must be exactly 1 MiB.

    The window holds a small forward, backward and a real all-reduce (so gloo's threads are
    exercised); run twice, identical but for the extra tensor.
    """

    def measure(extra: bool) -> int:
        gen = torch.Generator().manual_seed(0)
        # Everything is freed before the profiler stops, so no allocation it tracked is
        # left behind for a later session to see freed (see LiveBytesRecorder.stats).
        with LiveBytesRecorder() as rec:
            w = torch.randn(256, 256, generator=gen, requires_grad=True)
            x = torch.randn(32, 256, generator=gen)
            with rec.window():
                held = torch.empty(MIB, dtype=torch.uint8) if extra else None
                (x @ w).relu().sum().backward()
                assert w.grad is not None
                dist.all_reduce(w.grad)
                w.grad = None
            del held, w, x
        return rec.stats().peak

    return measure(True) - measure(False)


# --------------------------------------------------------------------------------------
# Collective accounting


def collective_kind(op_name: str) -> str | None:
    """Map a dispatcher op name to a collective kind, or None if it is not a collective."""
    namespace = op_name.split(".", 1)[0]
    if namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
        return None
    name = op_name.replace("_", "")
    if "waittensor" in name or "barrier" in name or "monitored" in name:
        return None
    if "allgather" in name:
        return "all_gather"
    if "reducescatter" in name:
        return "reduce_scatter"
    if "allreduce" in name:
        return "all_reduce"
    return "other"


def tensor_bytes(obj: object) -> int:
    flat, _ = tree_flatten(obj)
    return sum(t.nbytes for t in flat if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives and their bytes as seen by the dispatcher.

    Works below whatever Python API an engine calls (``all_gather_into_tensor``,
    ``all_gather_single``, ``ProcessGroup`` methods, functional collectives), since all of
    them reach a ``c10d``/``_c10d_functional`` op. Bytes are counted the way the theoretical
    minimum is: an all-gather by its gathered (output) size, a reduce-scatter by its
    unreduced (input) size, an all-reduce by its tensor size. In-place c10d ops take
    ``(outputs, inputs, ...)`` while functional ones take the input and return the output,
    so the larger side of the first two arguments (and the result) is the full-size one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.bytes: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = collective_kind(str(func))
        if kind is not None:
            sides = [tensor_bytes(a) for a in args[:2]] + [tensor_bytes(out)]
            nbytes = sides[0] if kind == "all_reduce" else max(sides)
            self.counts[kind] += 1
            self.bytes[kind] += nbytes
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return out


# --------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    # Modules to fully_shard, in order (children before the root, which comes last).
    shard_units: Callable[[nn.Module], list[nn.Module]]
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    make_batch: Callable[[int], tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    # Implementation name -> engine (see ``load_engine``); the first is the one under test,
    # the others are the baselines its median step time is divided by.
    impls: dict[str, str] = field(default_factory=lambda: dict(FSDP_IMPLS))
    # Timed steps per implementation when ``--steps`` is not given (the whole default run
    # takes about 3 minutes on 2 cores).
    default_steps: int = 100
    # "fsdp": fully_shard every unit; "replicate": replicate every unit (``ddp``: wrap the root).
    mode: str = "fsdp"

    @property
    def baselines(self) -> list[str]:
        return [impl for impl in self.impls if impl != "shardweave"]

    def wrap(self, engine: str, model: nn.Module) -> nn.Module:
        apply = load_engine(engine)
        if engine == "ddp":
            return apply(model)  # type: ignore[no-any-return]
        for unit in self.shard_units(model):
            apply(unit)
        return model


MLP_LAYERS: Final = 48


def _mlp() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(MLP_LAYERS)))


def _mlp_batch(rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)


def _mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out: torch.Tensor = model(batch[0])
    return (out - batch[1]).square().mean()


GPT_CONFIG: Final = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _gpt_batch(rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(2000 + rank)
    tokens = torch.randint(GPT_CONFIG.vocab_size, (8, GPT_CONFIG.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    _, loss = model(batch[0], batch[1])
    assert loss is not None
    return loss  # type: ignore[no-any-return]


def _gpt_units(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, GPT)
    return [*model.blocks, model]


WORKLOADS: Final = (
    Workload(
        name=f"mlp{MLP_LAYERS}",
        description=(
            f"{MLP_LAYERS} x (Linear(64,64)+ReLU), each fully_shard-ed + root; SGD; batch 32x64"
        ),
        build=_mlp,
        shard_units=lambda m: [*m.children(), m],
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        make_batch=_mlp_batch,
        loss=_mlp_loss,
    ),
    Workload(
        name="gpt",
        description=(
            f"GPT {GPT_CONFIG.n_layer} blocks, n_embd {GPT_CONFIG.n_embd}, vocab "
            f"{GPT_CONFIG.vocab_size}: per-block fully_shard + root; AdamW; batch 8x"
            f"{GPT_CONFIG.block_size} tokens"
        ),
        build=lambda: GPT(GPT_CONFIG),
        shard_units=_gpt_units,
        make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        make_batch=_gpt_batch,
        loss=_gpt_loss,
    ),
    Workload(
        name="replicate",
        description=(
            f"GPT {GPT_CONFIG.n_layer} blocks, n_embd {GPT_CONFIG.n_embd}, vocab "
            f"{GPT_CONFIG.vocab_size}: per-block replicate + root (ddp: DistributedDataParallel"
            f" on the plain model); AdamW; batch 8x{GPT_CONFIG.block_size} tokens"
        ),
        build=lambda: GPT(GPT_CONFIG),
        shard_units=_gpt_units,
        make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        make_batch=_gpt_batch,
        loss=_gpt_loss,
        impls=dict(REPLICATE_IMPLS),
        default_steps=60,
        mode="replicate",
    ),
)


def theoretical_min(model: nn.Module, units: list[nn.Module], world_size: int) -> dict[str, int]:
    """Bytes per training step that the sharding layout cannot avoid.

    Every group is all-gathered once in forward; groups that reshard after forward (all but
    the root, whose ``reshard_after_forward=None`` keeps it unsharded) are all-gathered again
    in backward; every group's gradients are reduce-scattered once. ``*_padded`` adds FSDP's
    padding of each parameter's dim 0 to a multiple of the world size.
    """
    claimed: set[nn.Parameter] = set()
    fwd = bwd = rs = fwd_pad = bwd_pad = rs_pad = groups_with_params = 0
    for unit in units:  # children first, so the root is left with what no child claimed
        params = [p for p in unit.parameters() if p not in claimed]
        claimed.update(params)
        groups_with_params += bool(params)
        full = sum(p.nbytes for p in params)
        padded = sum(
            math.ceil(p.shape[0] / world_size) * world_size * p[0].nbytes if p.dim() else p.nbytes
            for p in params
        )
        grad_full = sum(p.nbytes for p in params if p.requires_grad)
        grad_padded = sum(
            math.ceil(p.shape[0] / world_size) * world_size * p[0].nbytes if p.dim() else p.nbytes
            for p in params
            if p.requires_grad
        )
        is_root = unit is model
        fwd, fwd_pad = fwd + full, fwd_pad + padded
        if not is_root:
            bwd, bwd_pad = bwd + full, bwd_pad + padded
        rs, rs_pad = rs + grad_full, rs_pad + grad_padded
    return {
        "all_gather_bytes": fwd + bwd,
        "all_gather_bytes_padded": fwd_pad + bwd_pad,
        "reduce_scatter_bytes": rs,
        "reduce_scatter_bytes_padded": rs_pad,
        "all_reduce_bytes": 0,
        "groups": len(units),
        "groups_with_own_params": groups_with_params,
    }


def theoretical_min_replicate(model: nn.Module, units: list[nn.Module]) -> dict[str, int]:
    """Bytes per training step data parallelism cannot avoid: every gradient all-reduced once
    (the parameters are already whole on every rank, so nothing is gathered)."""
    claimed: set[nn.Parameter] = set()
    grads = groups_with_params = 0
    for unit in units:
        params = [p for p in unit.parameters() if p not in claimed]
        claimed.update(params)
        groups_with_params += bool(params)
        grads += sum(p.nbytes for p in params if p.requires_grad)
    return {
        "all_gather_bytes": 0,
        "all_gather_bytes_padded": 0,
        "reduce_scatter_bytes": 0,
        "reduce_scatter_bytes_padded": 0,
        "all_reduce_bytes": grads,
        "groups": len(units),
        "groups_with_own_params": groups_with_params,
    }


# --------------------------------------------------------------------------------------
# One implementation's process set: the rank side


class _Runner:
    """One implementation's model + optimizer for one workload, on this rank."""

    def __init__(self, impl: str, workload: Workload, rank: int) -> None:
        torch.manual_seed(0)  # same init for every implementation and every rank
        self.model = workload.wrap(workload.impls[impl], workload.build())
        self.opt = workload.make_optimizer(self.model.parameters())
        self.batch = workload.make_batch(rank)
        self.loss_fn = workload.loss
        self.losses: list[float] = []

    def step(self) -> None:
        loss = self.loss_fn(self.model, self.batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.item())


def _workload(name: str) -> Workload:
    return next(w for w in WORKLOADS if w.name == name)


def _set_worker(
    rank: int,
    world: int,
    store_path: str,
    workload_name: str,
    impl: str,
    warmup: int,
    conn: Connection,
) -> None:
    """A rank of one implementation's set: set up, then serve the parent's commands.

    Replies ``("ok", payload)`` to each command or ``("error", traceback)`` once and exits;
    the parent then kills the set (a peer may be stuck in a collective with this rank).
    """
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, world),
            rank=rank,
            world_size=world,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self_check = memory_self_check()
        workload = _workload(workload_name)
        with LiveBytesRecorder() as rec:
            runner = _Runner(impl, workload, rank)
            for _ in range(warmup):
                runner.step()
            before_state = state_bytes(runner.model, runner.opt)
            dist.barrier()
            with rec.window():
                runner.step()
        mem = rec.stats()
        conn.send(
            (
                "ok",
                {
                    "self_check": self_check,
                    "peak": mem.peak,
                    "live_before": mem.live_before,
                    "live_after": mem.live_after,
                    "state_bytes": before_state,
                },
            )
        )
        while True:
            command, arg = conn.recv()
            if command == "steps":
                times = []
                for _ in range(arg):
                    # Common start: a step's time then includes waiting for the slowest rank.
                    dist.barrier()
                    t0 = time.perf_counter()
                    runner.step()
                    times.append((time.perf_counter() - t0) * 1e3)
                conn.send(("ok", times))
            elif command == "count":
                counter = CollectiveCounter()
                with counter:
                    runner.step()
                conn.send(("ok", (counter.counts, counter.bytes, counter.ops)))
            elif command == "finish":
                conn.send(("ok", runner.losses))
                break
            else:
                raise ValueError(f"unknown command {command!r}")
        dist.destroy_process_group()
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))


# --------------------------------------------------------------------------------------
# One implementation's process set: the parent side


class SetFailed(RuntimeError):
    pass


class ImplSet:
    """The ``world`` processes running one implementation of one workload."""

    def __init__(
        self,
        ctx: Any,
        workload: Workload,
        impl: str,
        args: argparse.Namespace,
        tmp: str,
    ) -> None:
        self.impl = impl
        self.timeout: float = args.timeout
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        store = os.path.join(tmp, f"store-{workload.name}-{impl}")
        for rank in range(args.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_set_worker,
                args=(rank, args.world_size, store, workload.name, impl, args.warmup, child_end),
                daemon=True,
            )
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def receive(self) -> list[Any]:
        """Every rank's reply to the last command, in rank order; raises ``SetFailed``."""
        replies: dict[Connection, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(replies) < len(self.conns):
            pending = [c for c in self.conns if c not in replies]
            ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise SetFailed(f"no reply within {self.timeout:.0f} s (hung?)")
            for c in ready:
                assert isinstance(c, Connection)
                try:
                    status, payload = c.recv()
                except EOFError:
                    rank = self.conns.index(c)
                    raise SetFailed(
                        f"rank {rank} exited (code {self.procs[rank].exitcode})"
                    ) from None
                if status == "error":
                    raise SetFailed(str(payload).strip())
                replies[c] = payload
        return [replies[c] for c in self.conns]

    def request(self, command: str, arg: object = None) -> list[Any]:
        for c in self.conns:
            c.send((command, arg))
        return self.receive()

    def close(self, kill: bool = False) -> None:
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(timeout=None if kill else 30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for c in self.conns:
            c.close()


@dataclass
class ImplResult:
    error: str | None = None
    step_ms: list[float] = field(default_factory=list)  # slowest rank's time, per timed step
    memory: dict[str, Any] = field(default_factory=dict)
    comm_counts: dict[str, int] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_ops: dict[str, int] = field(default_factory=dict)
    loss_first: float | None = None
    loss_last: float | None = None


def _run_sets(workload: Workload, impls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps if args.steps is not None else workload.default_steps
    results = {impl: ImplResult() for impl in impls}
    sets: dict[str, ImplSet] = {}

    def fail(impl: str, e: Exception) -> None:
        results[impl].error = str(e)
        print(f"benchmark: {workload.name}/{impl} failed: {e}", file=sys.stderr)
        sets.pop(impl).close(kill=True)

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="shardweave-bench-") as tmp:
        try:
            # Set-up and warm-up overlap (nothing is timed yet); every set then blocks in a
            # pipe read until its first turn.
            for impl in impls:
                sets[impl] = ImplSet(ctx, workload, impl, args, tmp)
            for impl in impls:
                try:
                    mems = sets[impl].receive()
                except SetFailed as e:
                    fail(impl, e)
                    continue
                checks = sorted({m["self_check"] for m in mems})
                results[impl].memory = {
                    "peak_bytes": max(m["peak"] for m in mems),
                    "live_before_bytes": max(m["live_before"] for m in mems),
                    "state_bytes": max(m["state_bytes"] for m in mems),
                    "per_rank": mems,
                    "self_check_ok": checks == [MIB],
                }
            # Turns: A B C, C B A, A B C, ... until every set has its timed steps.
            rounds = math.ceil(steps / args.steps_per_turn)
            for r in range(rounds):
                order = list(sets) if r % 2 == 0 else list(sets)[::-1]
                k = min(args.steps_per_turn, steps - r * args.steps_per_turn)
                for impl in order:
                    try:
                        per_rank = sets[impl].request("steps", k)
                    except SetFailed as e:
                        fail(impl, e)
                        continue
                    results[impl].step_ms += [max(ms) for ms in zip(*per_rank, strict=True)]
            for impl in list(sets):
                try:
                    counts, nbytes, ops = sets[impl].request("count")[0]
                    losses = sets[impl].request("finish")[0]
                except SetFailed as e:
                    fail(impl, e)
                    continue
                res = results[impl]
                res.comm_counts, res.comm_bytes, res.comm_ops = counts, nbytes, ops
                res.loss_first, res.loss_last = losses[0], losses[-1]
                sets.pop(impl).close()
        finally:
            for s in sets.values():
                s.close(kill=True)
    return _workload_report(workload, results, steps, args.world_size)


def _workload_report(
    workload: Workload, results: dict[str, ImplResult], steps: int, world: int
) -> dict[str, Any]:
    ok = {impl: r for impl, r in results.items() if r.error is None}
    medians = {impl: statistics.median(r.step_ms) for impl, r in ok.items()}
    peaks = {impl: r.memory["peak_bytes"] for impl, r in ok.items()}
    ratios: dict[str, float | None] = {}
    for base in workload.baselines:
        both = "shardweave" in ok and base in ok
        ratios[f"median_ratio_shardweave_over_{base}"] = (
            medians["shardweave"] / medians[base] if both else None
        )
        ratios[f"peak_bytes_ratio_shardweave_over_{base}"] = (
            peaks["shardweave"] / peaks[base] if both else None
        )
    finals = {impl: r.loss_last for impl, r in ok.items() if r.loss_last is not None}
    # Same init, same batches, same number of steps: a drop-in engine should land on (nearly)
    # the same loss; a large gap here means the timings compare different computations.
    names = list(workload.impls)
    loss_diffs = {
        f"{a} - {b}": abs(finals[a] - finals[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if a in finals and b in finals
    }
    reference = workload.build()
    units = workload.shard_units(reference)
    return {
        "description": workload.description,
        "num_params": sum(p.numel() for p in reference.parameters()),
        "timed_steps": steps,
        "theoretical_min": (
            theoretical_min_replicate(reference, units)
            if workload.mode == "replicate"
            else theoretical_min(reference, units, world)
        ),
        **ratios,
        # The largest gap between any two implementations (for two, just their gap).
        "loss_last_abs_diff": max(loss_diffs.values()) if loss_diffs else None,
        "loss_last_abs_diffs": loss_diffs,
        "results": {
            impl: {
                "error": r.error,
                "step_ms": {
                    "min": min(r.step_ms),
                    "median": statistics.median(r.step_ms),
                    "max": max(r.step_ms),
                    "samples": r.step_ms,
                }
                if r.step_ms and r.error is None
                else None,
                "memory": r.memory or None,
                "comm_counts": r.comm_counts,
                "comm_bytes": r.comm_bytes,
                "comm_ops": r.comm_ops,
                "loss_first": r.loss_first,
                "loss_last": r.loss_last,
            }
            for impl, r in results.items()
        },
    }


# --------------------------------------------------------------------------------------
# Report


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_report(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"fully_shard/replicate benchmark: world_size {meta['world_size']}, gloo on CPU, torch "
        f"{meta['torch_version']}, one process set per implementation, turns of "
        f"{meta['steps_per_turn']} step(s) in alternating order, {meta['warmup_steps']} warm-up",
        f"peak memory self-check (1 MiB held through the window): {meta['memory_self_check']}",
    ]
    for impl, info in report["impls"].items():
        status = "ok" if info["error"] is None else f"UNAVAILABLE ({info['error']})"
        lines.append(f"  {impl:<20} {status}")
    for name, w in report["workloads"].items():
        lines += [
            "",
            f"[{name}] {w['description']}; {w['num_params']:,} parameters; "
            f"{w['timed_steps']} timed steps per impl",
        ]
        width = max([11, *(len(impl) for impl in w["results"])])
        lines.append(
            f"  {'impl':<{width}} {'min ms':>8} {'median':>8} {'max ms':>8} {'peak live':>10}   "
            f"{'all-gather':>19} {'reduce-scatter':>19} {'all-reduce':>14}  "
            f"{'loss first->last':>17}"
        )
        for impl, r in w["results"].items():
            if r["error"] is not None:
                # The last line of a traceback; the JSON keeps all of it.
                lines.append(f"  {impl:<{width}} FAILED: {r['error'].strip().splitlines()[-1]}")
                continue
            t, c, b = r["step_ms"], r["comm_counts"], r["comm_bytes"]
            lines.append(
                f"  {impl:<{width}} {t['min']:>8.2f} {t['median']:>8.2f} {t['max']:>8.2f} "
                f"{_fmt_bytes(r['memory']['peak_bytes']):>10}   "
                f"{c['all_gather']:>4} x {_fmt_bytes(b['all_gather']):>10}    "
                f"{c['reduce_scatter']:>4} x {_fmt_bytes(b['reduce_scatter']):>10}    "
                f"{c['all_reduce']:>3} x {_fmt_bytes(b['all_reduce']):>7}  "
                f"{r['loss_first']:>8.4f}->{r['loss_last']:.4f}"
                + (f"   (+{c['other']} other collectives)" if c["other"] else "")
            )
        tm = w["theoretical_min"]
        if tm["all_reduce_bytes"]:  # replicate: one all-reduce of every gradient byte
            note = f"({tm['groups_with_own_params']} groups with parameters)"
        else:
            note = (
                f"({tm['groups_with_own_params']} groups with parameters; with dim-0 padding: "
                f"AG {_fmt_bytes(tm['all_gather_bytes_padded'])}, "
                f"RS {_fmt_bytes(tm['reduce_scatter_bytes_padded'])})"
            )
        lines.append(
            f"  {'minimum':<{width}} {'':>8} {'':>8} {'':>8} {'':>10}   "
            f"{'':>4}   {_fmt_bytes(tm['all_gather_bytes']):>10}    "
            f"{'':>4}   {_fmt_bytes(tm['reduce_scatter_bytes']):>10}    "
            f"{'':>3}   {_fmt_bytes(tm['all_reduce_bytes']):>7}  {note}"
        )
        for impl, r in w["results"].items():
            if r["error"] is None:
                b = r["comm_bytes"]
                parts = [
                    f"{label} {_ratio(b[kind], tm[f'{kind}_bytes'])}"
                    for kind, label in (
                        ("all_gather", "all-gather"),
                        ("reduce_scatter", "reduce-scatter"),
                        ("all_reduce", "all-reduce"),
                    )
                    if tm[f"{kind}_bytes"]
                ]
                m = r["memory"]
                lines.append(
                    f"  {impl}: bytes / minimum: " + ", ".join(parts) + "; live before step "
                    f"{_fmt_bytes(m['live_before_bytes'])} (params/grads/optimizer/buffers "
                    f"{_fmt_bytes(m['state_bytes'])}), peak {_fmt_bytes(m['peak_bytes'])}"
                )
        for pair, diff in w.get("loss_last_abs_diffs", {}).items():
            lines.append(f"  last loss |{pair}|: {diff:.3g}")
        for key, ratio in w.items():
            for prefix, what in (
                ("median_ratio_shardweave_over_", "median step time"),
                ("peak_bytes_ratio_shardweave_over_", "peak live bytes"),
            ):
                if key.startswith(prefix):
                    lines.append(
                        f"  {what} shardweave / {key.removeprefix(prefix)}: "
                        + (f"{ratio:.3f}" if ratio is not None else "n/a (needs both)")
                    )
    return "\n".join(lines)


def _ratio(actual: int, minimum: int) -> str:
    return f"{actual / minimum:.4f}" if minimum else "n/a"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per implementation (default: "
        + ", ".join(f"{w.name} {w.default_steps}" for w in WORKLOADS)
        + ")",
    )
    p.add_argument(
        "--steps-per-turn",
        type=int,
        default=1,
        help="timed steps a set runs before handing over to the next (default %(default)s)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a set's reply before declaring it hung (default %(default)s)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=Path("bench-results/fsdp.json"),
        help="write the full report here (default %(default)s; git-ignored)",
    )
    p.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help="comma-separated subset of: " + ",".join(IMPLS) + " (default all; shardweave is "
        "fully_shard in the FSDP workloads and replicate in the replicate one)",
    )
    p.add_argument(
        "--workloads",
        default=",".join(w.name for w in WORKLOADS),
        help="comma-separated subset of: " + ",".join(w.name for w in WORKLOADS),
    )
    args = p.parse_args(argv)
    args.impls = [s for s in args.impls.split(",") if s]
    args.workloads = [s for s in args.workloads.split(",") if s]
    if unknown := set(args.impls) - set(IMPLS):
        p.error(f"--impls: unknown {sorted(unknown)}; choose from {list(IMPLS)}")
    if unknown := set(args.workloads) - {w.name for w in WORKLOADS}:
        p.error(f"--workloads: unknown {sorted(unknown)}")
    if min(args.steps or 1, args.steps_per_turn, args.warmup, args.world_size) < 1:
        p.error("--steps, --steps-per-turn, --warmup and --world-size must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Engines the selected workloads and implementations need, in first-use order.
    engines = list(
        dict.fromkeys(
            engine
            for w in WORKLOADS
            if w.name in args.workloads
            for impl, engine in w.impls.items()
            if impl in args.impls
        )
    )
    impl_info: dict[str, dict[str, Any]] = {
        engine: {"error": import_error(engine)} for engine in engines
    }
    for engine, info in impl_info.items():
        if info["error"] is not None:
            print(f"benchmark: {engine} unavailable: {info['error']}", file=sys.stderr)
    if all(info["error"] is not None for info in impl_info.values()):
        print("benchmark: no implementation to run", file=sys.stderr)
        return 1

    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    workloads: dict[str, Any] = {}
    for w in WORKLOADS:
        if w.name in args.workloads:
            impls = [
                impl
                for impl, engine in w.impls.items()
                if impl in args.impls and impl_info[engine]["error"] is None
            ]
            workloads[w.name] = _run_sets(w, impls, args)

    checks = [
        r["memory"]["self_check_ok"]
        for w in workloads.values()
        for r in w["results"].values()
        if r["memory"]
    ]
    report = {
        "meta": {
            "world_size": args.world_size,
            "warmup_steps": args.warmup,
            "steps_per_turn": args.steps_per_turn,
            "backend": "gloo",
            "device": "cpu",
            "torch_version": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "wall_s": round(time.perf_counter() - t0, 2),
            "step_time": "slowest rank, barrier before each step; one process set per "
            "implementation, driven in turns, order alternating A B C / C B A",
            "bytes": "all-gather: gathered output; reduce-scatter: unreduced input; "
            "all-reduce: tensor size",
            "peak_bytes": "max over ranks of the peak bytes in live CPU tensor storages during "
            "one training step after warm-up (torch.profiler allocation events)",
            "memory_self_check": (
                "ok (exactly +1 MiB on every rank of every set)"
                if checks and all(checks)
                else "FAILED: peak figures unvalidated"
                if checks
                else "not run"
            ),
        },
        "impls": impl_info,
        "workloads": workloads,
    }
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nreport written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
