"""The planner against real runs: one rank's measurements of a ``fully_shard`` training step
and the plan's predictions for that rank (bodies for ``tests/fsdp/world_*/test_plan_vs_real``).

Peak live tensor bytes are counted much as the benchmark counts them (``benchmarks/run.py``,
"Peak live tensor bytes"): ``torch.profiler`` with ``profile_memory=True`` runs from before the
model is built, and the peak is the most bytes live inside the measured step's window (forward
and backward, after a warm-up step so optimizer state exists). Live bytes are summed from the
profile's allocation events matched by address, not read from the allocator's running total,
which also moves when memory from before the profile is freed and when gloo lets go of an
earlier step's staging (``_peak_in_window``). Unlike the benchmark, the process group's own staging (what gloo
allocates inside a collective call) is counted here, since the planner's gloo schedule
models it. Gathered parameters are sampled at every operator of the step (what
modules compute with is only ever read by operators).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from shardweave.fsdp import MixedPrecisionPolicy, fully_shard
from shardweave.fsdp.comm._streams import use_device_module
from shardweave.fsdp.core._state import get_fsdp_state
from shardweave.fsdp.plan import Plan, plan
from tests.fsdp._models import TinyGPT

WINDOW = "shardweave_test::plan_step"
DROP_GRADS = "shardweave_test::drop_grads"  # where held_by reads the gradients' bytes
# Activations well above a few groups' gathered bytes: gloo frees its staging copies on its own
# threads' schedule, which moves the measured peak by a group's all-gather size or more on a
# loaded machine (86 KB, 6% of the peak, with gpt_ac at world 4 and a batch of 8 in one CI run).
GPT_INPUT = (16, 32)
MLP_INPUT = (256, 24)


def gpt(checkpoint: bool = False) -> TinyGPT:
    model = TinyGPT(vocab=67, dim=32, layers=8, seq=32)
    model.checkpoint = checkpoint
    # read by ``keep_tagged_dtype``: the position embedding's output is added to the token
    # embedding's, and the blocks' inputs are cast to param_dtype, so it may stay in fp32
    model.pos.weight.keep_own_dtype = True  # type: ignore[attr-defined]
    return model


def gpt_ac() -> TinyGPT:
    return gpt(checkpoint=True)


def mlp_stack() -> nn.Sequential:
    """Odd widths: padded shards at 2 and 4 ranks."""
    return nn.Sequential(
        nn.Linear(24, 67), nn.ReLU(), nn.Linear(67, 45), nn.ReLU(), nn.Linear(45, 3)
    )


FACTORIES = {"gpt": gpt, "gpt_ac": gpt_ac, "mlp": mlp_stack}


def factory_of(cfg: dict[str, Any]) -> Callable[[], nn.Module]:
    """The case's model; with ``grad_dtype``, every matrix gets that explicit
    ``Parameter.grad_dtype`` (torch 2.15), so its groups mix gradient dtypes."""
    base = FACTORIES[cfg["kind"]]
    if not cfg.get("grad_dtype"):
        return base

    def build() -> nn.Module:
        model = base()
        for p in model.parameters():
            if p.ndim == 2:
                p.grad_dtype = {"bf16": torch.bfloat16}[cfg["grad_dtype"]]
        return model

    return build


def dim1_where_even(param: nn.Parameter) -> Shard | None:
    """``shard_placement_fn``: matrices whose dim 1 is a multiple of 4 shard on dim 1."""
    return Shard(1) if param.ndim == 2 and param.shape[1] % 4 == 0 else None


def make_input(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return torch.randn(*MLP_INPUT, generator=g)
    return torch.randint(0, 67, GPT_INPUT, generator=g)


def loss_of(kind: str) -> Any:
    def mlp_loss(out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        return out.pow(2).sum()

    def gpt_loss(out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        target = torch.roll(inp, -1, dims=1)
        return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1), reduction="sum")

    return mlp_loss if kind == "mlp" else gpt_loss


def keep_tagged_dtype(param: nn.Parameter) -> torch.dtype | None:
    """``param_dtype_override_fn``: a parameter tagged ``keep_own_dtype`` keeps its dtype."""
    return param.dtype if getattr(param, "keep_own_dtype", False) else None


def mp_policy_of(cfg: dict[str, Any]) -> MixedPrecisionPolicy | None:
    """``mp``: bf16 compute, fp32 reduce; with ``override``, the gpt's position embedding
    computed in fp32 (torch 2.15's ``param_dtype_override_fn``)."""
    if not cfg.get("mp"):
        return None
    override = keep_tagged_dtype if cfg.get("override") else None
    return MixedPrecisionPolicy(torch.bfloat16, torch.float32, param_dtype_override_fn=override)


def plan_for(cfg: dict[str, Any], world: int) -> Plan:
    kind = cfg["kind"]
    return plan(
        factory_of(cfg),
        mesh=cfg.get("mesh", world),
        wrap="Linear" if kind == "mlp" else "Block",
        mp_policy=mp_policy_of(cfg),
        reduce_dtype=None if cfg.get("mp") else cfg.get("reduce"),
        reshard_after_forward=cfg.get("reshard", True),
        optimizer=cfg.get("optim", "adamw"),
        sample_input=(MLP_INPUT, torch.float32) if kind == "mlp" else (GPT_INPUT, torch.long),
        loss_fn=loss_of(kind),
        # The test accelerator's run is planned as an accelerator's (NCCL: no staging copies;
        # gloo's, for its fp32 and one-rank collectives here, are gone before the peak).
        backend="nccl" if cfg.get("accelerator") else "gloo",
        shard_placement_fn=dim1_where_even if cfg.get("placement") else None,
    )


class _GatheredSampler(TorchDispatchMode):
    """Peak bytes of unsharded parameters allocated (not aliasing shards), and of unsharded
    gradients (on the unsharded parameters, or the inputs of a reduction's copy into its
    reduce-scatter input), at every op."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.params = [
            p
            for m in model.modules()
            if (s := get_fsdp_state(m)) is not None
            for g in s._fsdp_param_groups
            for p in g.fsdp_params
        ]
        self.peak = 0
        self.grad_peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        live = 0
        grads: dict[int, int] = {}
        for p in self.params:
            out = getattr(p, "all_gather_output", None)
            if out is not None and not p._aliases_shard:
                live += out.untyped_storage().nbytes()
            unsharded = p._unsharded_param
            if unsharded is not None and unsharded.grad is not None:
                storage = unsharded.grad.untyped_storage()
                grads[storage.data_ptr()] = storage.nbytes()
        if func.overloadpacket is torch.ops.aten._chunk_cat:  # a reduction copying grads in
            for g in args[0]:
                grads[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
        self.peak = max(self.peak, live)
        self.grad_peak = max(self.grad_peak, sum(grads.values()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def memory_profile() -> Iterator[Any]:
    """``torch.profiler`` with allocation events, from a collected heap."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


@contextlib.contextmanager
def measured_window() -> Iterator[None]:
    """One measured window, the garbage so far collected just before it.

    Sharded models are collectable cycles: one left from an earlier test and collected inside
    the window would drop its running total by bytes allocated long before it (a peak measured
    low). The collector stays on inside: objects that hold the step's own buffers in cycles
    are freed there as in a real step."""
    gc.collect()
    with record_function(WINDOW):
        yield


def warm_then_measure(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Any
) -> None:
    """A training step to warm up (optimizer state exists after it), then one forward and
    backward inside the measured window, then their optimizer step: inside ``memory_profile``."""
    loss_fn(model(batch), batch).backward()
    opt.step()
    opt.zero_grad()
    with measured_window():
        loss = loss_fn(model(batch), batch)
        loss.backward()
        del loss
    opt.step()
    opt.zero_grad()


def _is_backend_staging(ev: Any, main_tid: int) -> bool:
    """An allocation the process group made for a collective: on one of its own threads, or
    on the training thread inside a ``c10d::`` op (gloo clones a reduce-scatter's input
    there)."""
    if ev.start_tid != main_tid:
        return True
    parent = ev.parent
    while parent is not None:
        if parent.name.startswith(("c10d::", "gloo:")):
            return True
        parent = parent.parent
    return False


def _profile_events(prof: Any) -> list[Any]:
    """Every event of a profile's event tree, children included."""
    events: list[Any] = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        events.append(event)
        todo.extend(event.children)
    return events


def _cpu_allocations(events: list[Any]) -> list[Any]:
    """The profile's CPU allocation events (a free is one with a negative size)."""
    from torch._C._profiler import _EventType

    return [e for e in events if e.tag == _EventType.Allocation and e.typed[1].device.type == "cpu"]


def _peak_in_window(prof: Any, host: frozenset[int] = frozenset()) -> tuple[int, int]:
    """(peak, total before the window) of live CPU tensor bytes; see the module docstring.
    With several windows (identical steps), the smallest peak and its window's total before:
    what a backend's threads free late only ever adds to a window's peak.

    Live bytes are the profile's own allocations not yet freed, matched by address: a free of
    memory allocated before the profile started moves nothing (the allocator's running total
    would drop by it, at a time the test does not control). Not counted either: backend
    staging made before the window and still held at its start. gloo holds some
    reduce-scatter input clones of an earlier step in C++ after the engine and Python
    dropped the Work, a varying number (none to four 43 KB clones on the world-2 and world-4
    gpt_ac, up to 7% of its peak): the backend's retention, not the step's memory, and not a
    fixed amount any plan could name. Staging made inside the window counts.

    ``host``: addresses of storages that are host memory on the test accelerator (CPU offload:
    sharded parameters, gradients, optimizer state, all CPU tensors there as the "device"'s
    are); the last allocation at each, still alive at the end, is not counted."""
    events = _profile_events(prof)
    windows = [e for e in events if e.name == WINDOW]
    assert windows, "no measured window"
    main_tid = windows[0].start_tid
    # (time, size: negative for a free, address, backend staging), in the order they happened
    allocs = sorted(
        (
            e.start_time_ns,
            e.typed[1].alloc_size,
            e.typed[1].ptr,
            e.typed[1].alloc_size > 0 and _is_backend_staging(e, main_tid),
        )
        for e in _cpu_allocations(events)
    )
    if host:
        last = {ptr: i for i, (_, size, ptr, _) in enumerate(allocs) if size > 0 and ptr in host}
        allocs = [a for i, a in enumerate(allocs) if last.get(a[2]) != i]
    found = []
    for window in windows:
        live: dict[int, tuple[int, bool]] = {}  # address -> (bytes, backend staging)
        held: set[int] = set()  # staging from before the window, not counted
        counted = 0
        before: int | None = None
        peak = 0
        for t, size, ptr, staging in allocs:
            if t > window.end_time_ns:
                break
            if before is None and t >= window.start_time_ns:  # the window opens
                held = {a for a, (_, s) in live.items() if s}
                counted -= sum(live[a][0] for a in held)
                before = peak = counted
            if ptr in live:  # a free, or one where the profiler does not see (a thread)
                nbytes, _ = live.pop(ptr)
                counted -= 0 if ptr in held else nbytes
                held.discard(ptr)
            if size > 0:
                live[ptr] = (size, staging)
                counted += size
            if before is not None:
                peak = max(peak, counted)
        if before is None:  # nothing allocated inside
            before = peak = counted - sum(n for n, s in live.values() if s)
        found.append((peak, before))
    return min(found)


def grad_storages(model: nn.Module) -> list[int]:
    """Where each gradient's (local) storage starts: what ``held_by`` looks up. The storage, not
    the data: a gradient with no local elements may still hold a padded slot."""
    return [
        ptr
        for p in model.parameters()
        if p.grad is not None
        and (ptr := getattr(p.grad, "_local_tensor", p.grad).untyped_storage().data_ptr())
    ]


def held_by(prof: Any, name: str, ptrs: list[int]) -> int:
    """Bytes of the CPU allocations live when the ``record_function(name)`` window of a
    ``memory_profile`` opens that hold one of ``ptrs`` (data pointers): what those tensors
    really hold, whatever storage objects they reach it through (a view keeps its whole base
    alive; the engine's sharded gradients are DLPack aliases of slots of one buffer,
    ``own_storage``). Read from the allocations, not from the frees inside the window: gloo's
    Work of an all-reduce can keep the reduced buffer until gloo's own thread drops it, after
    the window on a loaded machine (one CI run measured 7252 of 19492 bytes that way)."""
    events = _profile_events(prof)
    (window,) = [e for e in events if e.name == name]
    live: dict[int, int] = {}  # address -> bytes
    for _, size, ptr in sorted(
        (e.start_time_ns, e.typed[1].alloc_size, e.typed[1].ptr)
        for e in _cpu_allocations(events)
        if e.start_time_ns < window.start_time_ns
    ):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    found = {p: [a for a, n in live.items() if a <= p < a + n] for p in ptrs}
    assert all(found.values()), f"no live allocation holds {[p for p, a in found.items() if not a]}"
    return sum(live[a] for a in {a for blocks in found.values() for a in blocks})


def _mesh(cfg: dict[str, Any], world: int) -> DeviceMesh:
    shape = cfg.get("mesh", world)
    if isinstance(shape, tuple):
        return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def never_below(cfg: dict[str, Any]) -> bool:
    """HSDP with one rank per shard group (R x 1) computing in fp32: the plan's peak must
    never be below the measured one. Not checked, the 5% band only: with bf16 compute, CPU
    matmuls allocate fp32 temporaries inside the kernel, about 1% of the gpt's peak and 17% of
    the mlp's, that a fake-tensor run cannot see (an activations matter); on the test
    accelerator with a bf16 reduce, gloo's Work of an all-reduce issued with
    ``async_op=False`` keeps the reduced tensor (one group's reduce output) after the engine
    released it, until gloo's thread drops the Work (NCCL's does not)."""
    mesh = cfg.get("mesh")
    one_rank = isinstance(mesh, tuple) and mesh[-1] == 1
    return one_rank and not cfg.get("mp") and not (cfg.get("accelerator") and cfg.get("reduce"))


def windows(cfg: dict[str, Any]) -> int:
    """Measured steps: the smallest peak of three where the plan must not be below it (gloo's
    threads drop their references to an earlier collective's tensors late on a loaded
    machine: 12 and 552 bytes above the step's own peak were seen on the R x 1 mlp)."""
    return 3 if never_below(cfg) else 1


def measure(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """This rank's measured lines and peak, with the plan's predictions for this rank."""
    kind = cfg["kind"]
    mesh = _mesh(cfg, world)
    shard_mesh = mesh["shard"] if mesh.ndim == 2 else mesh
    last = shard_mesh.get_local_rank() == shard_mesh.size() - 1
    kwargs: dict[str, Any] = {"mesh": mesh}
    if cfg.get("mp"):
        kwargs["mp_policy"] = mp_policy_of(cfg)
    elif cfg.get("reduce"):  # fp32 compute, gradients reduced in a lower precision
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            reduce_dtype={"bf16": torch.bfloat16}[cfg["reduce"]]
        )
    if cfg.get("placement"):
        kwargs["shard_placement_fn"] = dim1_where_even
    # "accelerator": the engine's accelerator branches on CPU tensors (each reduction run to
    # its end when started, buffers released by reference once the owning stream waited).
    branches = (
        use_device_module(torch.cpu, stream_ordered=True)
        if cfg.get("accelerator")
        else contextlib.nullcontext()
    )
    with memory_profile() as prof, branches:
        torch.manual_seed(0)
        model = factory_of(cfg)()
        blocks = (
            [m for m in model.modules() if isinstance(m, nn.Linear)]
            if kind == "mlp"
            else list(model.layers)  # type: ignore[union-attr]
        )
        for block in blocks:
            fully_shard(block, reshard_after_forward=cfg.get("reshard", True), **kwargs)
        fully_shard(model, **kwargs)
        opt: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if cfg.get("optim") == "sgd_momentum"
            else torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
        batch = make_input(kind, rank)
        loss_fn = loss_of(kind)
        loss_fn(model(batch), batch).backward()
        opt.step()
        opt.zero_grad()
        sampler = _GatheredSampler(model)
        for window in range(windows(cfg)):
            if window:
                opt.step()
                opt.zero_grad()
            with measured_window(), sampler:
                loss = loss_fn(model(batch), batch)
                loss.backward()
                del loss
        groups = [
            g for m in model.modules() if (s := get_fsdp_state(m)) for g in s._fsdp_param_groups
        ]
        sharded = sum(
            p.sharded_param_data.numel() * p.sharded_param_data.element_size()
            for g in groups
            for p in g.fsdp_params
        )
        opt_bytes = sum(
            v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        grad_ptrs = grad_storages(model)
        with record_function(DROP_GRADS):
            opt.zero_grad()
            gc.collect()
    peak, before = _peak_in_window(prof)
    grads = held_by(prof, DROP_GRADS, grad_ptrs)  # what the sharded gradients really hold
    predicted = plan_for(cfg, world)
    act = predicted.activations
    assert act is not None
    who = "last_shard_rank" if last else "rank0"
    return {
        "measured": {
            "sharded_params": sharded,
            "sharded_grads": grads,
            "optimizer_state": opt_bytes,
            "peak_gathered_params": sampler.peak,
            "peak_unsharded_grads": sampler.grad_peak,
            "peak": peak,
            "before": before,
        },
        "predicted": {
            "sharded_params": predicted.sharded_param_bytes,
            "sharded_grads": predicted.grad_bytes,
            "optimizer_state": predicted.ranks[who]["optimizer_state_bytes"],
            "peak_gathered_params": predicted.peak_gathered_param_bytes,
            "peak_unsharded_grads": act.peaks["unsharded_grads"],
            "peak": act.last_shard_rank_peak_bytes if last else act.peak_bytes,
            "peak_at": f"{act.peak_phase} {act.peak_group} {act.peak_event}",
        },
    }


# The lines a plan must predict exactly (the engine is deterministic there).
EXACT_LINES = (
    "sharded_params",
    "sharded_grads",
    "optimizer_state",
    "peak_gathered_params",
    "peak_unsharded_grads",
)


def case_id(case: dict[str, Any]) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


def assert_plan_matches(results: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """Every rank: the exact lines equal, the peak with activations within 5% of the measured
    and, on R x 1 meshes in fp32, not below it (``never_below``)."""
    for rank, r in enumerate(results):
        m, p = r["measured"], r["predicted"]
        for line in EXACT_LINES:
            assert m[line] == p[line], (case, rank, line, m[line], p[line])
        assert abs(m["peak"] - p["peak"]) <= 0.05 * m["peak"], (case, rank, m, p)
        if never_below(case):
            assert p["peak"] >= m["peak"], ("plan below the measured peak", case, rank, m, p)
