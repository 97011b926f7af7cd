"""Self-tests of the CPU stream sanitizer (tests/_dist/stream_sanitizer.py) on toy code.

Each race test has a twin that differs only by the wait that orders the two streams, so a
checker that reports nothing, or everything, fails one of the two.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.cuda._sanitizer import CUDASanitizerErrors, UnsynchronizedAccessError

from shardweave.fsdp._torch_compat import all_gather_single, reduce_scatter_single
from tests._dist import WorkerPool
from tests._dist.stream_sanitizer import (
    FakeDeviceModule,
    FakeStream,
    SanitizerReport,
    StreamRaceError,
    UnsafeReuseError,
    stream_sanitizer,
)

# How stream B is ordered after stream A's work, if at all.
Sync = Callable[[FakeDeviceModule, FakeStream, FakeStream], None]


def _no_sync(dev: FakeDeviceModule, a: FakeStream, b: FakeStream) -> None:
    pass


def _wait_event(dev: FakeDeviceModule, a: FakeStream, b: FakeStream) -> None:
    b.wait_event(a.record_event())


def _event_wait(dev: FakeDeviceModule, a: FakeStream, b: FakeStream) -> None:
    event = dev.Event()
    event.record(a)
    event.wait(b)


def _wait_stream(dev: FakeDeviceModule, a: FakeStream, b: FakeStream) -> None:
    b.wait_stream(a)


def _event_synchronize(dev: FakeDeviceModule, a: FakeStream, b: FakeStream) -> None:
    a.record_event().synchronize()  # the host waits; later work on any stream is ordered


def _stream_synchronize(dev: FakeDeviceModule, a: FakeStream, b: FakeStream) -> None:
    a.synchronize()


def _device_synchronize(dev: FakeDeviceModule, a: FakeStream, b: FakeStream) -> None:
    dev.synchronize()


ORDERING_SYNCS = [
    _wait_event,
    _event_wait,
    _wait_stream,
    _event_synchronize,
    _stream_synchronize,
    _device_synchronize,
]


def _write_then_read(sync: Sync) -> SanitizerReport:
    with stream_sanitizer(install=False, raise_on_race=False) as report:
        dev = report.device
        a, b = dev.Stream(), dev.Stream(priority=-1)
        with dev.stream(a):
            x = torch.arange(16.0)
            y = x * 2  # written on A
        sync(dev, a, b)
        with dev.stream(b):
            y.sum()  # read on B
    return report


def test_write_then_read_without_wait_is_a_race() -> None:
    report = _write_then_read(_no_sync)
    assert len(report.errors) == 1, report.races
    error = report.errors[0]
    assert isinstance(error, UnsynchronizedAccessError)
    a, b = report.streams[1], report.streams[2]
    assert (error.previous_access.stream, error.current_access.stream) == (a.id, b.id)
    assert "aten::mul.Tensor" in error.previous_access.operator
    assert "aten::sum" in error.current_access.operator
    assert "CSAN detected a possible data race" in str(error)


@pytest.mark.parametrize("sync", ORDERING_SYNCS, ids=lambda f: f.__name__.strip("_"))
def test_ordered_write_then_read_is_clean(sync: Sync) -> None:
    report = _write_then_read(sync)
    assert report.errors == []
    assert report.kernels == 3  # arange, mul, sum: the ops really were observed


def test_read_then_write_without_wait_is_a_race() -> None:
    """Write-after-read: B overwrites what A may still be reading."""
    with stream_sanitizer(install=False, raise_on_race=False) as report:
        dev = report.device
        a, b = dev.Stream(), dev.Stream()
        x = torch.ones(8)
        a.wait_stream(dev.current_stream())
        b.wait_stream(dev.current_stream())
        with dev.stream(a):
            x.sum()
        with dev.stream(b):
            x.zero_()
    assert [str(e.current_access.type) for e in _races(report)] == ["writing to"]


def test_reads_on_two_streams_do_not_conflict() -> None:
    with stream_sanitizer(install=False) as report:
        dev = report.device
        a, b = dev.Stream(), dev.Stream()
        x = torch.ones(8)
        a.wait_stream(dev.current_stream())
        b.wait_stream(dev.current_stream())
        with dev.stream(a):
            x.sum()
        with dev.stream(b):
            x.sum()
    assert report.kernels == 3


def test_views_share_their_storage() -> None:
    """A read through an offset view conflicts with a write of the base (storage granularity)."""
    with stream_sanitizer(install=False, raise_on_race=False) as report:
        dev = report.device
        a, b = dev.Stream(), dev.Stream()
        with dev.stream(a):
            x = torch.zeros(8)
            x.add_(1)
        with dev.stream(b):
            x[4:].sum()
    assert len(report.errors) == 1, report.races


@pytest.mark.parametrize("sync", [_no_sync, _wait_stream], ids=["no-wait", "wait"])
def test_storage_over_part_of_a_block_is_that_block(sync: Sync) -> None:
    """A storage of its own over part of a block's memory (a DLPack alias, as the engine hands
    out sharded gradients: ``own_storage``) is keyed by the block, so a read of it on another
    stream races with the block's writer unless ordered (as the block's own views do)."""
    with stream_sanitizer(install=False, raise_on_race=False) as report:
        dev = report.device
        a, b = dev.Stream(), dev.Stream()
        with dev.stream(a):
            x = torch.arange(64.0) * 2  # a fresh block, written on A
        alias = torch._C._from_dlpack(torch._C._to_dlpack(x[16:32]))
        assert alias.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        sync(dev, a, b)
        with dev.stream(b):
            alias.sum()
    assert len(report.errors) == (1 if sync is _no_sync else 0), report.races


def test_stream_contexts_nest() -> None:
    dev = FakeDeviceModule()
    default = dev.current_stream()
    a, b = dev.Stream(), dev.Stream()
    assert len({default.id, a.id, b.id}) == 3
    with dev.stream(a):
        with dev.stream(b):
            assert dev.current_stream() is b
        assert dev.current_stream() is a
        with dev.stream(None):
            assert dev.current_stream() is a
    assert dev.current_stream() is default
    e1, e2 = a.record_event(), dev.Event()
    assert e1.id != e2.id and e1.query() and a.query()


def test_raises_on_exit_with_csan_text() -> None:
    with pytest.raises(StreamRaceError) as info, stream_sanitizer(install=False) as report:
        dev = report.device
        a, b = dev.Stream(), dev.Stream()
        with dev.stream(a):
            y = torch.ones(4)
        with dev.stream(b):
            y.add_(1)
    assert isinstance(info.value, CUDASanitizerErrors)
    text = str(info.value)
    assert "1 possible data race(s)" in text
    assert "CSAN detected a possible data race" in text
    assert "aten::add_.Tensor" in text and "aten::ones" in text


def _toy_wait(a: FakeStream, b: FakeStream) -> None:
    b.wait_event(a.record_event())


@pytest.mark.parametrize("drop", [False, True])
def test_drop_waits_from_removes_only_the_named_callers_wait(drop: bool) -> None:
    names = {_toy_wait.__qualname__} if drop else set()
    with stream_sanitizer(install=False, raise_on_race=False, drop_waits_from=names) as report:
        dev = report.device
        a, b = dev.Stream(), dev.Stream()
        with dev.stream(a):
            y = torch.ones(4)
        b.wait_stream(dev.current_stream())  # another caller: kept
        _toy_wait(a, b)
        with dev.stream(b):
            y.sum()
    assert report.dropped_waits == (["_toy_wait"] if drop else [])
    assert len(report.errors) == (1 if drop else 0), report.races


# 16 KiB: large enough that the small objects the checker allocates between the free and the
# next allocation (stack summaries) do not take the freed block first.
_REUSE_NUMEL = 4096


def _reuse(refill: bool, track: bool, attempts: int = 50) -> tuple[SanitizerReport, bool]:
    """Write a tensor on A, free it, then write a new tensor on B at that address.

    The new tensor comes from ``torch.empty`` or (``refill``) is a storage resized to 0 bytes
    earlier and resized back now, as the engine frees and refills unsharded parameters.
    Allocators hand addresses out on their own schedule (with torch's 64-byte alignment glibc
    gives a freed block back only a few allocations later), so this repeats until a tensor
    written on B sits at an address some tensor written on A had before it was freed.
    ``track=False`` disables the sanitizer's allocation tracking: the control that shows the
    sequence really looks like a race without it.
    """
    with stream_sanitizer(install=False, raise_on_race=False) as report:
        if not track:
            report.device.handler._handle_memory_allocation = lambda data_ptr: None  # type: ignore[method-assign]
        dev = report.device
        a, b = dev.Stream(), dev.Stream()
        freed_after_a: set[int] = set()
        for _ in range(attempts):
            spares = [torch.empty(_REUSE_NUMEL) for _ in range(4 if refill else 0)]
            for spare in spares:  # freed before A's tensors are made, refilled after
                spare.untyped_storage().resize_(0)
            with dev.stream(a):  # several freed blocks: one of them is soon handed out again
                olds = [torch.empty(_REUSE_NUMEL).fill_(1.0) for _ in range(4)]
            freed_after_a.update(t.untyped_storage().data_ptr() for t in olds)
            del olds
            with dev.stream(b):
                if refill:
                    news = spares
                    for spare in spares:
                        spare.untyped_storage().resize_(_REUSE_NUMEL * 4)
                else:
                    news = [torch.empty(_REUSE_NUMEL) for _ in range(4)]
                for new in news:
                    new.fill_(2.0)
            if any(t.untyped_storage().data_ptr() in freed_after_a for t in news):
                return report, True
    return report, False


@pytest.mark.parametrize("refill", [False, True], ids=["empty", "storage-resize"])
def test_reused_address_is_not_a_race(refill: bool) -> None:
    report, reused = _reuse(refill, track=True)
    if not reused:
        pytest.skip("the allocator never handed the freed address out again")
    assert report.errors == []
    control, reused = _reuse(refill, track=False)
    if not reused:
        pytest.skip("the allocator never handed the freed address out again (control)")
    assert len(control.errors) >= 1, "control: untracked, the reuse should look like a race"


def test_storage_resize_is_tracked_and_restored() -> None:
    """Deterministic twin of the reuse test: the checker's own records, whatever the allocator."""
    original = torch.UntypedStorage.resize_
    with stream_sanitizer(install=False) as report:
        dev = report.device
        accesses = report.device.handler.tensors_accessed.accesses
        a, b = dev.Stream(), dev.Stream()
        with dev.stream(a):
            t = torch.ones(64)
        first = t.untyped_storage().data_ptr()
        write = accesses[first].write
        assert write is not None and write.stream == a.id
        t.untyped_storage().resize_(0)  # freed: A's write is forgotten
        assert first not in accesses
        t.untyped_storage().resize_(64 * 4)
        second = t.untyped_storage().data_ptr()
        assert accesses[second].write is None and accesses[second].reads == []
        with dev.stream(b):
            t.fill_(3.0)
    assert torch.UntypedStorage.resize_ is original


def _races(report: SanitizerReport) -> list[UnsynchronizedAccessError]:
    assert all(isinstance(e, UnsynchronizedAccessError) for e in report.errors)
    return [e for e in report.errors if isinstance(e, UnsynchronizedAccessError)]


# ----------------------------------------------------------------------------- collectives


def _collective(rank: int, world_size: int, kind: str, wait: bool) -> dict[str, object]:
    """Issue one collective on stream A, read its output on stream B (waiting or not)."""
    with stream_sanitizer(install=False, raise_on_race=False) as report:
        dev = report.device
        a, b = dev.Stream(), dev.Stream()
        inp = torch.full((4,), float(rank + 1))
        if kind == "all_gather":
            out = torch.empty(4 * world_size)
        elif kind == "reduce_scatter":
            out = torch.empty(4 // world_size)
        else:
            out = inp
        a.wait_stream(dev.current_stream())  # A may read what the default stream wrote
        with dev.stream(a):
            if kind == "all_gather":
                work = all_gather_single(out, inp, async_op=True)
            elif kind == "reduce_scatter":
                work = reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, async_op=True)
            else:
                work = dist.all_reduce(inp, async_op=True)
        assert work is not None
        work.wait()  # host-side only: orders no stream
        if wait:
            b.wait_event(a.record_event())
        with dev.stream(b):
            total = out.sum().item()
    return {
        "races": report.races,
        "collectives": report.collectives,
        "a": a.id,
        "total": total,
    }


COLLECTIVE_OPS = {
    "all_gather": "c10d::_allgather_base_",
    "reduce_scatter": "c10d::_reduce_scatter_base_",
    "all_reduce": "c10d::allreduce_",
}


@pytest.mark.parametrize("wait", [False, True], ids=["no-wait", "wait"])
@pytest.mark.parametrize("kind", list(COLLECTIVE_OPS))
def test_collective_output_read_on_another_stream(
    world2: WorkerPool, kind: str, wait: bool
) -> None:
    """c10d ops reach the dispatch mode as one kernel on the issuing stream.

    Oracle: closed form for the values (ranks fill 1 and 2): all-gather sums to 4*1 + 4*2,
    reduce-scatter gives two elements of 1+2, all-reduce four.
    """
    expected_total = {"all_gather": 12.0, "reduce_scatter": 6.0, "all_reduce": 12.0}[kind]
    for result in world2.run(_collective, kind, wait):
        assert isinstance(result, dict)
        assert result["collectives"] == [(COLLECTIVE_OPS[kind], result["a"])]
        assert result["total"] == expected_total
        races = result["races"]
        assert isinstance(races, list)
        if wait:
            assert races == []
        else:
            assert len(races) == 1, races
            assert f"by stream {result['a']} in {COLLECTIVE_OPS[kind]}" in races[0]


# ----------------------------------------------------------------- the caching allocator model


def _free_then_reallocate(
    wait: str, realloc_stream: str = "owner", realloc_numel: int = 1024, free: str = "del"
) -> SanitizerReport:
    """A block of the default stream, read on a side stream, freed, then a new allocation.

    ``wait``: where the default stream waits for the side stream's read: ``"none"``,
    ``"before-free"`` or ``"after-free"`` (before the reallocation: still safe on CUDA).
    ``realloc_stream``: the stream current at the new allocation (``"owner"``: the default
    stream, whose pool the block went back to; ``"side"``: another pool).
    ``free``: ``"del"`` drops the last reference, ``"resize"`` resizes the storage to 0 bytes.
    """
    with stream_sanitizer(install=False, raise_on_race=False) as report:
        dev = report.device
        default, side = dev.current_stream(), dev.Stream()
        x = torch.ones(1024)  # 4 KiB, allocated on the default stream
        side.wait_stream(default)
        with dev.stream(side):
            x.sum()  # read on the side stream
        if wait == "before-free":
            default.wait_stream(side)
        if free == "del":
            del x
        else:
            x.untyped_storage().resize_(0)
        if wait == "after-free":
            default.wait_stream(side)
        with dev.stream(side if realloc_stream == "side" else None):
            torch.empty(realloc_numel).fill_(2.0)
    return report


@pytest.mark.parametrize("free", ["del", "resize"])
def test_unsafe_reuse_is_reported_with_both_stacks(free: str) -> None:
    report = _free_then_reallocate("none", free=free)
    assert len(report.errors) == 1, report.races
    error = report.errors[0]
    assert isinstance(error, UnsafeReuseError)
    side = report.streams[1].id
    assert (error.owner_stream, error.use.stream) == (0, side)
    assert "aten::sum" in error.use.operator and "aten::empty" in error.reuse_operator
    assert report.unsafe_reuses == report.races
    assert report.frees >= 1 and report.pending_frees == 1
    text = str(error)
    assert "Unsafe reuse of a freed block" in text
    # Both stacks lead back to this test's helper: where the side stream read, and where the
    # default stream took the block again.
    assert text.count("_free_then_reallocate") >= 2, text


@pytest.mark.parametrize("wait", ["before-free", "after-free"])
def test_reuse_after_the_owner_waited_is_clean(wait: str) -> None:
    report = _free_then_reallocate(wait)
    assert report.errors == [], report.races
    assert report.pending_frees == (1 if wait == "after-free" else 0)


def test_allocation_on_another_stream_does_not_take_the_block() -> None:
    """The freed block went back to the default stream's pool, not the side stream's."""
    report = _free_then_reallocate("none", realloc_stream="side")
    assert report.errors == [], report.races


def test_allocation_the_block_cannot_serve_does_not_take_it() -> None:
    """Larger than the block (8 KiB > 4 KiB): the allocator serves it from elsewhere."""
    report = _free_then_reallocate("none", realloc_numel=2048)
    assert report.errors == [], report.races


def test_unsafe_reuse_raises_on_exit() -> None:
    with pytest.raises(StreamRaceError) as info, stream_sanitizer(install=False) as report:
        dev = report.device
        side = dev.Stream()
        x = torch.ones(256)
        side.wait_stream(dev.current_stream())
        with dev.stream(side):
            x.add_(1)  # written on the side stream
        del x
        torch.zeros(256)
    assert "Unsafe reuse of a freed block" in str(info.value)
