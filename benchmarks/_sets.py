"""One process set per implementation: the rank side (a spawned worker serving commands
over a pipe) and the parent side (starting sets, driving them in turns, collecting results).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Final

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _collectives import CollectiveCounter
from _memory import MIB, LiveBytesRecorder, memory_self_check, state_bytes
from _workloads import WORKLOADS, Workload, theoretical_min, theoretical_min_replicate

# A hung collective (say one rank raised mid-step) becomes an error inside the set; the
# parent's pipe timeout catches what this does not (a rank that died or spins).
COLLECTIVE_TIMEOUT: Final = datetime.timedelta(seconds=120)


# --------------------------------------------------------------------------------------
# One implementation's process set: the rank side


class _Runner:
    """One implementation's model + optimizer for one workload, on this rank."""

    def __init__(
        self,
        impl: str,
        workload: Workload,
        rank: int,
        foreach: bool | None,
        forward_prefetch: bool = False,
    ) -> None:
        torch.manual_seed(0)  # same init for every implementation and every rank
        self.model = workload.wrap(workload.impls[impl], workload.build())
        if forward_prefetch and impl == "shardweave" and workload.mode == "fsdp":
            self.model.set_implicit_forward_prefetch()  # type: ignore[operator]
        opt_kwargs = {} if foreach is None else {"foreach": foreach}
        self.opt = workload.make_optimizer(self.model.parameters(), **opt_kwargs)
        self.batch = workload.make_batch(rank)
        self.loss_fn = workload.loss
        self.losses: list[float] = []

    def step(self) -> float:
        """One training step; returns the seconds spent in ``opt.step()`` + ``zero_grad``.

        The optimizer runs no collective, so its time is this rank's own: it tells the engine's
        share of a step (forward, backward, communication) from the optimizer's, which depends
        on the parameters' type (plain tensors or DTensors) and not on the engine.
        """
        loss = self.loss_fn(self.model, self.batch)
        loss.backward()
        t0 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        opt_s = time.perf_counter() - t0
        self.losses.append(loss.item())
        return opt_s


def _workload(name: str) -> Workload:
    return next(w for w in WORKLOADS if w.name == name)


def _set_worker(
    rank: int,
    world: int,
    store_path: str,
    workload_name: str,
    impl: str,
    warmup: int,
    foreach: bool | None,
    forward_prefetch: bool,
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
            runner = _Runner(impl, workload, rank, foreach, forward_prefetch)
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
                    opt_s = runner.step()
                    times.append(((time.perf_counter() - t0) * 1e3, opt_s * 1e3))
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
                args=(
                    rank,
                    args.world_size,
                    store,
                    workload.name,
                    impl,
                    args.warmup,
                    args.foreach,
                    args.implicit_forward_prefetch,
                    child_end,
                ),
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
    # The optimizer's part of each timed step (slowest rank's ``opt.step()`` + ``zero_grad``).
    opt_ms: list[float] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    comm_counts: dict[str, int] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_ops: dict[str, int] = field(default_factory=dict)
    loss_first: float | None = None
    loss_last: float | None = None


def run_sets(workload: Workload, impls: list[str], args: argparse.Namespace) -> dict[str, Any]:
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
                    for ranks in zip(*per_rank, strict=True):
                        results[impl].step_ms.append(max(total for total, _ in ranks))
                        results[impl].opt_ms.append(max(opt for _, opt in ranks))
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
    # Step time less the optimizer's, per step: the engine's own share of the step.
    engine_medians = {
        impl: statistics.median(t - o for t, o in zip(r.step_ms, r.opt_ms, strict=True))
        for impl, r in ok.items()
    }
    peaks = {impl: r.memory["peak_bytes"] for impl, r in ok.items()}
    ratios: dict[str, float | None] = {}
    for base in workload.baselines:
        both = "shardweave" in ok and base in ok
        ratios[f"median_ratio_shardweave_over_{base}"] = (
            medians["shardweave"] / medians[base] if both else None
        )
        ratios[f"median_ratio_without_optimizer_shardweave_over_{base}"] = (
            engine_medians["shardweave"] / engine_medians[base] if both else None
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
                "opt_ms": {
                    "median": statistics.median(r.opt_ms),
                    "samples": r.opt_ms,
                }
                if r.opt_ms and r.error is None
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
