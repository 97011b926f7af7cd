"""Train a small character-level GPT with ``fully_shard`` on CPU (gloo), two ranks.

Launch::

    torchrun --standalone --nproc-per-node 2 demos/train_gpt.py [--steps 400] [--impl torch]

Every block is ``fully_shard``-ed, then the root model (``reshard_after_forward`` left at its
default: blocks reshard after forward, the root stays unsharded until backward ends). Each rank
trains on its own batches; FSDP averages the gradients. Rank 0 draws a progress bar on stderr
and prints a report at the end: losses, step times, throughput, per-rank memory and a sample of
generated text. ``--impl torch`` runs the same script on torch's own FSDP2, which is how the two
engines are compared (and how this script is checked while shardweave is being written).

With shardweave, rank 0 first prints the planner's prediction for this setup
(``shardweave.fsdp.plan``: per-rank memory and bytes per step, no process group needed), and
steps 1..``--trace-steps`` run under the tracer (``shardweave.fsdp.trace``). After training,
``--trace-dir`` (default ``demo-output/``) holds each rank's Chrome / Perfetto trace
(``trace-rank{N}.json``, open it in ui.perfetto.dev) and memory timeline
(``memory-rank{N}.png``, needs matplotlib: the fsdp package's ``plot`` extra, which
``nox -s demo`` installs), and the report compares the plan with what the tracer measured.
Notices are rank 0's too: one that several ranks raise (say, no matplotlib) is printed once.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import resource
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import GPT, Block, GPTConfig

DEFAULT_DATA: Final = Path(__file__).resolve().parent / "data" / "public_domain.txt"
MIB: Final = 1024 * 1024

FullyShard = Callable[..., Any]


def load_fully_shard(impl: str) -> FullyShard:
    """Return ``fully_shard`` from shardweave or torch; the two are drop-in replacements."""
    if impl == "shardweave":
        from shardweave.fsdp import fully_shard as sw_fully_shard

        return sw_fully_shard
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    raise ValueError(f"--impl: unknown implementation {impl!r}; use shardweave or torch")


# --------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class CharData:
    """A text file as a character vocabulary plus train/val token tensors (90/10 split)."""

    chars: str
    train: torch.Tensor  # 1D, int64 token ids
    val: torch.Tensor  # 1D, int64 token ids

    @classmethod
    def load(cls, path: Path, block_size: int) -> CharData:
        text = path.read_text(encoding="utf-8")
        chars = "".join(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        n = int(0.9 * len(ids))
        data = cls(chars, ids[:n], ids[n:])
        if len(data.val) <= block_size + 1:
            raise ValueError(
                f"--data: {path} has {len(text)} characters; the validation split needs more "
                f"than block_size+1={block_size + 1}, so use a longer text or a smaller --block-size"
            )
        return data

    def encode(self, s: str) -> list[int]:
        # Characters the corpus never uses fall back to id 0 rather than failing the sample.
        return [self.chars.find(c) if c in self.chars else 0 for c in s]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(
        self, split: str, batch_size: int, block_size: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A generator per batch (not the global RNG): any batch is reproducible from its seed
        # alone, whatever else the rank has drawn.
        source = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(source) - block_size - 1, (batch_size,), generator=gen)
        x = torch.stack([source[s : s + block_size] for s in starts.tolist()])
        y = torch.stack([source[s + 1 : s + 1 + block_size] for s in starts.tolist()])
        return x, y


def batch_seed(seed: int, rank: int, step: int, salt: int = 0) -> int:
    # Distinct per (rank, step): ranks see different data, and reruns see the same. A hash,
    # not arithmetic, so no two tuples collide and the result fits manual_seed's int64.
    key = f"{seed}/{salt}/{rank}/{step}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=7).digest(), "little")


# --------------------------------------------------------------------------------------
# Memory accounting


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a tensor: a DTensor's shard, a plain tensor itself."""
    local = getattr(t, "_local_tensor", None)  # DTensor keeps its shard here
    return local if isinstance(local, torch.Tensor) else t


def local_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(local_tensor(t).nbytes for t in tensors)


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in opt.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages, sampled at every op boundary while active.

    Storages are tracked from the first op that reads or writes them (plus the ones passed to
    ``track``) and dropped by a weakref callback when freed. Bytes are re-read on every sample
    because FSDP frees and re-allocates unsharded parameters by resizing their storage in
    place, which no dispatcher op reports; a storage grown inside one op is seen at the next.
    Costs O(live storages) per op, so it is switched on for one step only.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._add(t)
        self._sample()

    def _add(self, obj: object) -> None:
        if not isinstance(obj, torch.Tensor):
            return
        t = local_tensor(obj)
        if t.is_meta or t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self._live:
            # torch keeps one Python object per storage while the storage lives, so its id is
            # a stable key and the weakref fires exactly when the memory is released.
            self._live[key] = weakref.ref(storage, functools.partial(self._forget, key))

    def _forget(self, key: int, _: object) -> None:
        self._live.pop(key, None)

    def _sample(self) -> None:
        total = 0
        for ref in list(self._live.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        self.peak = max(self.peak, total)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        flat_in, _ = torch.utils._pytree.tree_flatten((args, kwargs or {}))
        for a in flat_in:
            self._add(a)
        self._sample()  # inputs at their largest, e.g. before an op frees its workspace
        out = func(*args, **(kwargs or {}))
        flat_out, _ = torch.utils._pytree.tree_flatten(out)
        for o in flat_out:
            self._add(o)
        self._sample()
        return out


@dataclass
class RankMemory:
    rank: int
    peak_rss_bytes: int
    param_bytes: int  # this rank's parameter shards
    grad_bytes: int  # this rank's gradient shards, after the last backward
    optim_state_bytes: int  # AdamW moments (and step counters) for this rank's shards
    peak_live_tensor_bytes: int | None
    # Peak live tensor bytes over one step's forward and backward, counted as the benchmark
    # counts them (``StepPeak``); the planner's "peak with activations" predicts it.
    step_peak_bytes: int | None = None


class StepPeak:
    """Peak live tensor bytes over a forward and backward, as ``benchmarks/run.py`` counts
    them: the profiler's allocation events carry the allocator's running total, so the peak
    of bytes allocated inside the window, plus the storages live when it opened (parameters,
    gradients, optimizer state and the batch), is the step's peak."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, batch: Iterable[Any]):
        from torch.profiler import ProfilerActivity, profile

        held = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
        held += [*model.buffers(), *optimizer_state_tensors(opt), *batch]
        storages = {}
        for t in held:
            s = local_tensor(t).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        storages.pop(0, None)
        self.before = sum(storages.values())
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.peak = 0

    def __enter__(self) -> StepPeak:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(None, None, None)
        from torch._C._profiler import _EventType

        results = self._prof.profiler.kineto_results if self._prof.profiler else None
        events: list[Any] = []
        todo = list(results.experimental_event_tree()) if results is not None else []
        while todo:
            ev = todo.pop()
            events.append(ev)
            todo.extend(ev.children)
        allocs = sorted(
            (e.start_time_ns, e.typed[1].total_allocated, e.typed[1].alloc_size)
            for e in events
            if e.tag == _EventType.Allocation and e.typed[1].device.type == "cpu"
        )
        offset = allocs[0][1] - allocs[0][2] if allocs else 0
        self.peak = self.before + max([0, *(total - offset for _, total, _ in allocs)])


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux and bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# --------------------------------------------------------------------------------------
# Progress bar (rank 0 only)


class Progress:
    """A one-line progress bar on stderr; plain periodic lines when stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self._every = max(1, total // 10)

    def update(self, step: int, loss: float, step_ms: float) -> None:
        if not self.enabled:
            return
        done = step + 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done)
        width = 24
        filled = int(width * done / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"[{bar}] {done:>{len(str(self.total))}}/{self.total} "
            f"loss {loss:6.3f}  step {step_ms:7.1f} ms  eta {eta:5.0f}s"
        )
        if self.tty:
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
        elif done % self._every == 0 or done == self.total:
            sys.stderr.write(line + "\n")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r\x1b[2K")  # clear the bar so the message gets a clean line
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


# --------------------------------------------------------------------------------------
# Training


@dataclass
class Report:
    impl: str
    world_size: int
    steps: int
    seed: int
    config: dict[str, Any]
    num_params: int
    data_chars: int
    tokens_per_step: int  # global, all ranks
    initial_val_loss: float
    final_train_loss: float
    final_val_loss: float
    step_ms_mean: float
    step_ms_median: float
    timed_steps: int
    tokens_per_s: float
    wall_s: float
    memory: list[dict[str, Any]]
    evals: list[dict[str, float]] = field(default_factory=list)
    sample: str = ""
    plan_vs_trace: dict[str, dict[str, int]] = field(default_factory=dict)
    # The planner's peak with activations (rank 0) and the measured StepPeak of rank 0.
    peak_vs_plan: dict[str, int] = field(default_factory=dict)
    trace_files: list[str] = field(default_factory=list)  # every rank's, rank 0's first
    notices: list[str] = field(default_factory=list)  # each printed once, by rank 0


@torch.no_grad()
def estimate_loss(
    model: nn.Module, data: CharData, args: argparse.Namespace, rank: int, world: int
) -> dict[str, float]:
    """Mean loss over ``--eval-iters`` fixed batches per split on every rank, averaged."""
    model.eval()
    out: dict[str, float] = {}
    for salt, split in enumerate(("train", "val"), start=1):
        total = torch.zeros(())
        for i in range(args.eval_iters):
            # Fixed batches (no step in the seed), so successive evals are comparable.
            x, y = data.batch(
                split, args.batch_size, args.block_size, batch_seed(args.seed, rank, i, salt)
            )
            _, loss = model(x, y)
            assert loss is not None
            total += loss
        dist.all_reduce(total)  # SUM: gloo has no AVG
        out[split] = total.item() / (args.eval_iters * world)
    model.train()
    return out


def print_plan(config: GPTConfig, world: int, args: argparse.Namespace) -> Any:
    """Print and return the planner's prediction for exactly this setup (a meta-device model
    and one fake-tensor step on a batch of this shape, no collectives). Rank 0 alone calls it:
    the report, which compares it with the trace and the measured peak, is rank 0's."""
    from shardweave.fsdp.plan import format_table, plan

    shape = (args.batch_size, args.block_size)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)

    def loss_of(out: Any, _batch: Any) -> torch.Tensor:
        return out[1]  # GPT returns (logits, loss)

    predicted = plan(
        lambda: GPT(config),
        mesh=world,
        wrap=Block,
        optimizer="adamw",
        backward_prefetch=1,
        sample_input=batch,
        loss_fn=loss_of,
        backend="gloo",
    )
    print(format_table(predicted), file=sys.stderr, flush=True)
    return predicted


def start_tracer(args: argparse.Namespace) -> Any:
    if args.trace_steps <= 0:
        return None
    from shardweave.fsdp import trace

    return trace().start()


# Planner fields and the tracer's measurement of the same quantity in the last traced step
# (step 0 is the warm-up: lazy init runs there). The tracer's gathered bytes ("all-gathered
# (issue to reshard)" in its plot) count an all-gather from its issue, buffer in flight included,
# so they are not the planner's gathered parameters; memory is compared as the peak with
# activations instead (StepPeak).
PLAN_VS_TRACE: Final = (
    ("all-gather bytes / step", "all_gather", "all_gather"),
    ("reduce-scatter bytes / step", "reduce_scatter", "reduce_scatter"),
)


def compare_plan(predicted: Any, tracer: Any) -> dict[str, dict[str, int]]:
    last = tracer.summary()["steps"][-1]
    out: dict[str, dict[str, int]] = {}
    for label, plan_key, trace_key in PLAN_VS_TRACE:
        if plan_key in predicted.comm_bytes:
            planned, measured = (
                predicted.comm_bytes[plan_key],
                last["collectives"][trace_key]["bytes"],
            )
        else:
            planned, measured = getattr(predicted, plan_key), last[trace_key]
        out[label] = {"plan": int(planned), "trace": int(measured)}
    return out


def write_trace(tracer: Any, directory: Path) -> tuple[list[str], list[str]]:
    """This rank's Chrome trace and, with matplotlib installed, its memory plot.

    Returns the files written and this rank's notices (why a file is missing); rank 0 prints
    the notices of every rank (``merge_notices``), so a missing dependency is reported once.
    """
    directory.mkdir(parents=True, exist_ok=True)
    files = [str(tracer.export_chrome_trace(directory / "trace-rank{rank}.json"))]
    notices: list[str] = []
    try:
        files.append(str(tracer.plot_memory(directory / "memory-rank{rank}.png")))
    except ImportError as e:  # the plot is optional: say why it is missing, keep the trace
        notices.append(f"no memory plot ({e})")
    return files, notices


def merge_notices(per_rank: list[list[str]]) -> list[str]:
    """Each distinct notice once, in first-seen order; one that not every rank raised names
    the ranks that did."""
    ranks: dict[str, list[int]] = {}
    for rank, notices in enumerate(per_rank):
        for notice in notices:
            who = ranks.setdefault(notice, [])
            if rank not in who:
                who.append(rank)
    merged = []
    for notice, who in ranks.items():
        if len(who) < len(per_rank):
            notice = f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}: {notice}"
        merged.append(f"train_gpt.py: {notice}")
    return merged


def train(args: argparse.Namespace) -> Report | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # Ranks share the machine's cores; oversubscribing them makes every step slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    fully_shard = load_fully_shard(args.impl)

    data = CharData.load(args.data, args.block_size)
    config = GPTConfig(
        vocab_size=len(data.chars),
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    predicted = print_plan(config, world, args) if args.impl == "shardweave" and rank == 0 else None
    torch.manual_seed(args.seed)  # same seed on every rank: identical init before sharding
    model = GPT(config)
    num_params = model.num_params()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))

    progress = Progress(args.steps, enabled=rank == 0 and not args.no_progress)
    progress.message(
        f"train_gpt: impl={args.impl} world={world} params={num_params / 1e6:.2f}M "
        f"vocab={config.vocab_size} steps={args.steps} batch={args.batch_size}x{args.block_size}"
    )
    initial = estimate_loss(model, data, args, rank, world)
    evals = [{"step": 0.0, **initial}]
    progress.message(f"step    0: train {initial['train']:.4f}  val {initial['val']:.4f}")

    step_ms: list[float] = []
    live = LiveTensorBytes()
    tracer = start_tracer(args) if args.impl == "shardweave" else None
    param_bytes = grad_bytes = optim_bytes = 0
    # The last step runs under the live-bytes tracker (its own cost would skew the timing).
    instrumented = args.steps - 1 if args.track_live_bytes else -1
    # The step before it measures the forward-and-backward peak the planner predicted.
    peak_step = args.steps - 2 if args.impl == "shardweave" else -1
    step_peak: StepPeak | None = None
    t_start = time.perf_counter()
    for step in range(args.steps):
        x, y = data.batch(
            "train", args.batch_size, args.block_size, batch_seed(args.seed, rank, step)
        )
        if step == instrumented:
            live.track(model.parameters())
            live.track(optimizer_state_tensors(opt))
            live.__enter__()
        if step == peak_step:
            step_peak = StepPeak(model, opt, (x, y)).__enter__()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        if step == peak_step:
            assert step_peak is not None
            step_peak.__exit__(None, None, None)
        opt.step()
        if step == args.steps - 1:
            # Measured here, where every group is sharded: the root (reshard_after_forward
            # left at its default) is unsharded again after any later forward (eval, sampling).
            param_bytes = local_nbytes(model.parameters())
            grad_bytes = local_nbytes(p.grad for p in model.parameters() if p.grad is not None)
            optim_bytes = local_nbytes(optimizer_state_tensors(opt))
        opt.zero_grad(set_to_none=True)
        dt_ms = (time.perf_counter() - t0) * 1e3
        traced = tracer is not None and tracer.active
        if traced:
            assert tracer is not None
            if step == args.trace_steps:
                tracer.stop()  # steps 0..trace_steps: the warm-up step and the traced ones
            else:
                tracer.step()
        if step == instrumented:
            live.__exit__(None, None, None)
        # Step 0 pays for lazy init and optimizer-state allocation, and tracing costs time:
        # neither is a steady-state step.
        elif step > 0 and not traced and step != peak_step:
            step_ms.append(dt_ms)
        progress.update(step, loss.item(), dt_ms)
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            losses = estimate_loss(model, data, args, rank, world)
            evals.append({"step": float(step + 1), **losses})
            progress.message(
                f"step {step + 1:4d}: train {losses['train']:.4f}  val {losses['val']:.4f}"
            )
    wall_s = time.perf_counter() - t_start
    progress.close()
    trace_files: list[str] = []
    notices: list[str] = []
    plan_vs_trace: dict[str, dict[str, int]] = {}
    if tracer is not None:
        tracer.stop()  # a no-op unless training ended inside the traced steps
        trace_files, notices = write_trace(tracer, args.trace_dir)
        if predicted is not None:
            plan_vs_trace = compare_plan(predicted, tracer)

    mem = RankMemory(
        rank=rank,
        peak_rss_bytes=peak_rss_bytes(),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optim_state_bytes=optim_bytes,
        peak_live_tensor_bytes=live.peak if args.track_live_bytes else None,
        step_peak_bytes=step_peak.peak if step_peak is not None else None,
    )
    # Memory, files and notices of every rank, for rank 0's report.
    gathered: list[tuple[RankMemory, list[str], list[str]] | None] = [None] * world
    dist.all_gather_object(gathered, (mem, trace_files, notices))
    per_rank = [g for g in gathered if g is not None]
    merged_notices = merge_notices([n for _, _, n in per_rank])
    if rank == 0:
        for notice in merged_notices:
            print(notice, file=sys.stderr, flush=True)

    # Every rank generates in lockstep: each forward all-gathers parameters, so a rank that
    # sat out would hang the others. Same seed everywhere -> the same sampled text.
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.tensor([data.encode(args.prompt)], dtype=torch.long)
    model.eval()
    out_ids = model.generate(prompt, args.sample_chars, generator=gen)
    sample = data.decode(out_ids[0].tolist())

    if rank != 0:
        return None
    tokens_per_step = args.batch_size * args.block_size * world
    mean_ms = statistics.fmean(step_ms) if step_ms else math.nan
    return Report(
        impl=args.impl,
        world_size=world,
        steps=args.steps,
        seed=args.seed,
        config=asdict(config),
        num_params=num_params,
        data_chars=len(data.train) + len(data.val),
        tokens_per_step=tokens_per_step,
        initial_val_loss=initial["val"],
        final_train_loss=evals[-1]["train"],
        final_val_loss=evals[-1]["val"],
        step_ms_mean=mean_ms,
        step_ms_median=statistics.median(step_ms) if step_ms else math.nan,
        timed_steps=len(step_ms),
        tokens_per_s=tokens_per_step / (mean_ms / 1e3) if step_ms else math.nan,
        wall_s=wall_s,
        memory=[asdict(m) for m, _, _ in per_rank],
        evals=evals,
        sample=sample,
        plan_vs_trace=plan_vs_trace,
        peak_vs_plan=(
            {"plan": predicted.activations.peak_bytes, "measured": mem.step_peak_bytes}
            if predicted is not None and mem.step_peak_bytes is not None
            else {}
        ),
        trace_files=[f for _, files, _ in per_rank for f in files],
        notices=merged_notices,
    )


def format_report(r: Report) -> str:
    c = r.config
    lines = [
        "",
        f"== train_gpt report: impl={r.impl}, world_size={r.world_size}, gloo on CPU ==",
        f"model       {r.num_params:,} parameters: {c['n_layer']} blocks, n_embd {c['n_embd']}, "
        f"{c['n_head']} heads, context {c['block_size']}, vocab {c['vocab_size']}",
        f"data        {r.data_chars:,} characters (90% train / 10% val)",
        f"training    {r.steps} steps x {r.tokens_per_step:,} tokens (all ranks), "
        f"wall {r.wall_s:.1f} s (evals included)",
        f"loss        val {r.initial_val_loss:.4f} -> {r.final_val_loss:.4f}   "
        f"final train {r.final_train_loss:.4f}",
        f"step time   mean {r.step_ms_mean:.1f} ms, median {r.step_ms_median:.1f} ms "
        f"({r.timed_steps} steps: first and instrumented steps excluded)",
        f"throughput  {r.tokens_per_s:,.0f} tokens/s (all ranks)",
        "memory per rank (MiB): peak RSS, and this rank's shards of params / grads / AdamW "
        "state; live peak = peak bytes of live tensors in one instrumented step",
        f"  {'rank':>4} {'peak RSS':>9} {'params':>8} {'grads':>8} {'optim':>8} {'live peak':>10}",
    ]
    for m in r.memory:
        live = m["peak_live_tensor_bytes"]
        lines.append(
            f"  {m['rank']:>4} {m['peak_rss_bytes'] / MIB:>9.1f} {m['param_bytes'] / MIB:>8.3f} "
            f"{m['grad_bytes'] / MIB:>8.3f} {m['optim_state_bytes'] / MIB:>8.3f} "
            + (f"{live / MIB:>10.3f}" if live is not None else f"{'n/a':>10}")
        )
    full = r.num_params * 4 / MIB
    lines.append(f"  (unsharded fp32 parameters: {full:.3f} MiB)")
    if r.plan_vs_trace:
        lines.append("plan vs trace (rank 0, last traced step; MiB)")
        for label, v in r.plan_vs_trace.items():
            mark = "exact" if v["plan"] == v["trace"] else "differs"
            lines.append(
                f"  {label:<28} plan {v['plan'] / MIB:>8.3f}   trace {v['trace'] / MIB:>8.3f}  {mark}"
            )
    if r.peak_vs_plan:
        plan_b, measured = r.peak_vs_plan["plan"], r.peak_vs_plan["measured"]
        lines.append(
            f"peak with activations (rank 0, forward + backward; MiB)  plan {plan_b / MIB:.3f}"
            f"   measured {measured / MIB:.3f}   error {(plan_b - measured) / measured:+.1%}"
        )
    if r.trace_files:
        lines.append("trace files: " + ", ".join(r.trace_files))
    lines += ["sample (temperature 0.8):", "-" * 72, r.sample, "-" * 72]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", choices=("shardweave", "torch"), default="shardweave")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64, help="context length")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--sample-chars", type=int, default=300)
    p.add_argument("--prompt", default="\n")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--no-track-live-bytes",
        dest="track_live_bytes",
        action="store_false",
        help="skip the instrumented step that measures peak live tensor bytes",
    )
    p.add_argument(
        "--trace-steps",
        type=int,
        default=3,
        help="shardweave only: trace steps 1..N (plus the warm-up step 0); 0 turns tracing off",
    )
    p.add_argument(
        "--trace-dir",
        type=Path,
        default=Path("demo-output"),
        help="where each rank writes trace-rank{N}.json and memory-rank{N}.png",
    )
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is a warm-up)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "train_gpt.py: run under torchrun, e.g.\n"
            "  torchrun --standalone --nproc-per-node 2 demos/train_gpt.py",
            file=sys.stderr,
        )
        return 2
    try:
        load_fully_shard(args.impl)
    except ImportError as e:
        # Before init_process_group, so every rank exits at once instead of one waiting. A
        # node's ranks share its environment, so its first (LOCAL_RANK 0) alone says why.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(
                f"train_gpt.py: --impl {args.impl}: cannot import fully_shard ({e}); install "
                "the shardweave packages (nox -s demo does) or pass --impl torch",
                file=sys.stderr,
            )
        return 1
    dist.init_process_group("gloo")
    try:
        report = train(args)
        if report is not None:
            print(format_report(report), flush=True)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(asdict(report), indent=2) + "\n")
                print(f"report written to {args.out}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
