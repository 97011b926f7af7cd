"""``delayed``: four ranks as threads through ``DelayedCollectives``, every producer and
consumer made late, each case bitwise equal to the synchronized run. Its runner
(``run_plans``: plans of delays, removed waits and bucket caps) also runs the mutants."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

from ._common import run_threads
from ._training import apply_engine, compare, make_model, train
from .plugin import COLLECTIVE_KINDS, SLEEP_CYCLES, DelayedCollectives, poison_tensor

# At four threaded ranks; the bf16 reductions cast on the comm streams after the collective
# (HSDP: the all-reduce buffer before its cast; replicate: the same through its buckets);
# CPU offload copies the gradients to the host behind it (non-blocking into pinned memory,
# waited at the end of backward; blocking for the optimizer-in-backward hooks).
DELAYED_CASES = (
    "fsdp", "bf16", "hsdp_2x2", "hsdp_2x2_bf16_reduce", "replicate", "replicate_bf16_reduce",
    "offload", "offload_hooks",
)  # fmt: skip


# --- consumer-side delays and removed waits ------------------------------------------------
# Where a sleep goes on the stream current at the call, besides the one before each collective
# (which makes the *producer* late): each makes a *consumer* (or a writer a comm stream must
# wait for) late, so a stream that runs ahead of it without waiting reads or reuses a buffer
# too early. (module, attribute): the engine looks each up at call time.
DELAY_POINTS: dict[str, tuple[str, str]] = {
    # compute stream, before the gathered buffer is split into the parameters: an all-gather
    # stream that reuses the buffer (next all-gather) without waiting for this overwrites it.
    "before_copy_out": ("shardweave.fsdp.core._param_group", "all_gather_copy_out"),
    # copy-in stream, before the shards are cast/copied into the all-gather input: an
    # all-gather that does not wait for the copy-in sends a half-written input.
    "before_copy_in": ("shardweave.fsdp.core._param_group", "all_gather_copy_in"),
    # compute stream, before the gradients are laid out into the reduce-scatter input: a
    # reduce-scatter stream that does not wait for compute reads a half-written input.
    "before_reduce_scatter_copy_in": ("torch", "_chunk_cat"),
    # before each of a reduction's divides. The pre-divide, on the reduce-scatter stream,
    # starts its reads of the input (with one shard rank the "reduce-scatter" is a copy on
    # that stream, no collective): a current stream that reuses the input too early
    # overwrites it. The post-divide, on the stream that finishes the reduction, comes before
    # the casts into the gradients: an optimizer that does not wait reads them unwritten.
    "before_divide": ("shardweave.fsdp.comm._reduction", "_div_"),
}
# Python frames skipped when naming who asked for a wait: the one-line wait helpers, torch's
# ``Stream.wait_stream`` (it calls ``wait_event``) and this module's own wrappers.
_WAIT_HELPERS = frozenset({"shardweave.fsdp.comm._streams", "torch.cuda.streams", __name__})


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
                        poison_tensor(slot)
                    _sleep_cycles(device_type, n)
                    return slot

                return fn(*args[:5], late_into, *args[6:], **kwargs)
            if n and poison() and kwargs.get("out") is not None:
                poison_tensor(kwargs["out"])
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


def _switch_to(
    plan: dict[str, Any],
    index: int,
    plugin: DelayedCollectives,
    current: dict[str, Any],
    spacer: list[Any],
    device: Any,
) -> None:
    """Between two runs of ``run_plans`` (rank 0, while every rank waits at the barrier): the
    plugin's mode and the delays, cycles and dropped waits of ``plan``, and a spacer of a
    size of the run's own."""
    import torch

    delays = frozenset(plan.get("delays", ()))
    current["delays"] = delays
    current["cycles"] = plan.get("cycles", SLEEP_CYCLES) if delays else 0
    current["drop"] = frozenset(plan.get("drop", ()))
    plugin.sleep_kinds = delays & COLLECTIVE_KINDS
    plugin.sleep_cycles = current["cycles"]
    plugin.poison = bool(delays)
    plugin.synchronize = bool(plan.get("synchronize"))
    spacer[:] = [torch.empty(512 * (1 + 37 * index % 61), dtype=torch.uint8, device=device)]


def run_plans(
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
                _switch_to(plan, index, plugin, current, spacer, device)
            barrier.wait()
            with lock:  # the threads share torch's global generator, which seeds the model
                model = make_model(32, 2, device)
            apply_engine("shardweave", model, plan["case"], device_type)
            case = plan["case"] if isinstance(plan["case"], str) else "scenario"
            out = train(model, case, device, steps=2, rank=rank, before_optimizer=before_optimizer)
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
        run_threads(world, body)
    seen = {"collectives_issued": plugin.calls, "delay_points": counts, "dropped": dropped}
    return runs, seen


@contextlib.contextmanager
def _bucket_bytes(nbytes: int) -> Iterator[None]:
    """Replicate's bucket caps set to ``nbytes`` (as the tests' scenarios do)."""
    from shardweave.fsdp.comm import _reduction

    saved = _reduction.FIRST_BUCKET_BYTES, _reduction.BUCKET_BYTES
    _reduction.FIRST_BUCKET_BYTES = _reduction.BUCKET_BYTES = nbytes
    try:
        yield
    finally:
        _reduction.FIRST_BUCKET_BYTES, _reduction.BUCKET_BYTES = saved


def compare_ranks(
    a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], world: int
) -> dict[str, Any]:
    """Each rank's result in ``a`` against the same rank's in ``b``: bitwise only if all are."""
    ranks = [compare(a[r], b[r]) for r in range(world)]
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
    runs, seen = run_plans(device_type, world, plans)
    results: dict[str, Any] = {
        case: compare_ranks(runs[f"{case}/delayed"], runs[f"{case}/synchronized"], world)
        for case in DELAYED_CASES
    }
    results.update(seen)
    results["sleep_cycles"] = SLEEP_CYCLES if device_type == "cuda" else 0
    return results
