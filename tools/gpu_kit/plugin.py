"""``plugin``: the test ``COLLECTIVES`` plugin the ``delayed`` and ``mutants`` sections run
through (``DelayedCollectives``: ranks as threads of one process on one device, each
collective late and poisoned on request), and its own check against closed forms."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any

from ._common import run_threads

# About 1 ms on a 1.5-2 GHz SM clock: longer than any collective of these small models takes.
SLEEP_CYCLES = 2_000_000

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
                    poison_tensor(rows[i])

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
            "reduce_scatter", group, input, finish, lambda rank, world: poison_tensor(output)
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


def poison_tensor(tensor: Any) -> None:
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

    run_threads(world, body)
    return {"ok": not failures, "failures": failures, "calls": plugin.calls}
