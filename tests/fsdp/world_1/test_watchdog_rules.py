"""The watchdog's rules, one at a time, without processes.

Oracles: *closed form*. The decision table (a peer's heartbeat position against the stalled
collective gives exited / mismatched / raised / busy / idle), the words of a position, device-side
completion (a collective waited on a stream-ordered device stays pending until its event
completes, one waited on the CPU host is done), the knobs (environment, setters, the deprecated
alias) and the abort policy for the NCCL error-handling modes.
"""

from __future__ import annotations

import datetime
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardweave.fsdp.faults import _channel, _failures, _watchdog
from shardweave.fsdp.faults._failures import Phase
from shardweave.fsdp.faults._watchdog import Tracked, Watchdog, abort_if_supported, describe
from tests._dist import WorkerPool

EPOCH = 7


def _entry(
    step: int = 3,
    seq: int = 2,
    kind: str = "all_gather",
    group: str = "blocks.1",
    phase: Phase = Phase.BACKWARD,
) -> Tracked:
    return Tracked(step, seq, kind, group, None, "cpu", None, epoch=EPOCH, phase=phase)  # type: ignore[arg-type]


def _pos(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "epoch": EPOCH,
        "step": 3,
        "seq": 1,
        "phase": Phase.FORWARD.name,
        "last": [3, 1, "all_gather", "blocks.0", False],
        "pending": [],
        "waiting": None,
        "idle_s": 0.0,
        "abandoned": False,
    }
    base.update(kw)
    return base


def _state(
    pos: dict[str, Any] | None, silent: float = 0.0, watched: float = 5.0, exit: str | None = None
) -> _channel.PeerState:
    return _channel.PeerState(1, pos, silent, watched, exit)


def _category(pos: dict[str, Any] | None, mine: Phase = Phase.BACKWARD, **state: Any) -> str:
    entry = _entry(phase=mine)
    judged = Watchdog()._judge(entry, {1: _state(pos, **state)}, stall=1.0, lost=2.0)
    found = [
        name
        for name in ("exited", "mismatched", "raised", "busy", "idle", "unheard")
        if getattr(judged, name)
    ]
    assert len(found) == 1, (found, judged)
    return found[0]


RULES: dict[str, tuple[dict[str, Any] | None, dict[str, Any], str]] = {
    # (its position, its liveness, the verdict) for a rank waiting in step 3's #2
    "exit record": (_pos(), {"exit": "exited with an uncaught ValueError"}, "exited"),
    "heartbeat stood still": (_pos(), {"silent": 3.0, "watched": 3.0}, "exited"),
    "heartbeat still, not watched long enough": (
        _pos(),
        {"silent": 1.0, "watched": 1.0},
        "unheard",
    ),
    "behind, idle between steps": (
        _pos(
            step=2,
            phase=Phase.AFTER_BACKWARD.name,
            last=[2, 9, "reduce_scatter", "blocks.0", False],
            idle_s=5.0,
        ),
        {},
        "idle",
    ),
    "behind in the same step, computing": (_pos(idle_s=0.5), {}, "idle"),
    "at the same collective": (
        _pos(seq=2, pending=[[3, 2, "all_gather", "blocks.1", False]]),
        {},
        "busy",
    ),
    "host ran ahead, device still at it": (
        _pos(
            seq=6,
            last=[3, 6, "all_gather", "blocks.3", False],
            pending=[
                [3, 2, "all_gather", "blocks.1", False],
                [3, 3, "all_gather", "blocks.2", False],
            ],
        ),
        {},
        "busy",
    ),
    "another collective with the same number": (
        _pos(seq=2, pending=[[3, 2, "all_gather", "blocks.2", False]]),
        {},
        "mismatched",
    ),
    "already past it": (
        _pos(seq=4, last=[3, 4, "all_gather", "blocks.3", False]),
        {},
        "mismatched",
    ),
    "finished the step's backward with fewer collectives": (
        _pos(phase=Phase.AFTER_BACKWARD.name, idle_s=2.0),
        {},
        "mismatched",
    ),
    "finished the step's backward, this rank unshards between steps": (
        _pos(phase=Phase.AFTER_BACKWARD.name, idle_s=2.0),
        {"mine": Phase.AFTER_BACKWARD},
        "idle",
    ),
    "its backward stopped half-way": (
        _pos(phase=Phase.BACKWARD.name, abandoned=True),
        {},
        "raised",
    ),
    "waiting in an earlier collective of another group": (
        _pos(
            pending=[[3, 1, "all_reduce", "blocks.0", False]],
            waiting=[3, 1, "all_reduce", "blocks.0", False],
        ),
        {},
        "busy",
    ),
    "another model's failure scope": (_pos(epoch=EPOCH + 1), {}, "idle"),
}


@pytest.mark.parametrize("name", list(RULES))
def test_decision_table(name: str) -> None:
    pos, state, expected = RULES[name]
    assert _category(pos, **state) == expected


def test_verdicts_by_category() -> None:
    """Exited beats everything; a mismatch beats a raise; idle and busy are no verdict."""
    w = Watchdog()
    states = {
        1: _state(_pos(seq=4, last=[3, 4, "all_gather", "blocks.3", False])),
        2: _state(_pos(), silent=9.0, watched=9.0),
    }
    judged = w._judge(_entry(), states, stall=1.0, lost=2.0)
    assert judged.verdict("x")[0] == "PeerExitedError"  # type: ignore[index]
    judged.exited.clear()
    assert judged.verdict("x")[0] == "CollectiveMismatchError"  # type: ignore[index]
    only_idle = w._judge(_entry(), {1: _state(_pos(idle_s=9.0))}, stall=1.0, lost=2.0)
    assert only_idle.verdict("x") is None and only_idle.idle


def test_position_words() -> None:
    after = _pos(
        step=2,
        phase=Phase.AFTER_BACKWARD.name,
        last=[2, 9, "reduce_scatter", "blocks.0", False],
        idle_s=12.0,
    )
    assert describe(after) == (
        "between steps, after step 2's last reduce-scatter (group 'blocks.0', #9); "
        "engine idle for 12 s"
    )
    assert describe(_pos(phase=Phase.AFTER_FORWARD.name)).startswith(
        "between the forward and the backward of step 3, after its all-gather of group 'blocks.0'"
    )
    assert describe(_pos(last=None)) == "in the forward of step 3, before its first collective"
    waiting = _pos(waiting=[3, 1, "all_gather", "blocks.0", True])
    assert describe(waiting) == (
        "waiting in the collective check before the all-gather of group 'blocks.0' (step 3, #1)"
    )


def test_a_peer_past_the_collective_is_confirmed_a_period_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closed form: "already past it" alone is a verdict only when seen twice while ours is
    still pending (gloo can finish a collective on one rank a moment before another, and that
    rank's heartbeat then shows its next collective); any other mismatch is one at once."""
    monkeypatch.setattr(_failures, "current_epoch", lambda: EPOCH)
    failed: list[str] = []
    w = Watchdog()
    monkeypatch.setattr(w, "_fail", lambda entry, kind, message: failed.append(kind))
    work = _Completion()
    entry = Tracked(3, 2, "all_gather", "blocks.1", None, "cpu", work, epoch=EPOCH)  # type: ignore[arg-type]
    monkeypatch.setattr(_watchdog.dist, "get_rank", lambda: 0)
    past = {1: _state(_pos(seq=4, last=[3, 4, "all_gather", "blocks.3", False]))}
    w._diagnose(entry, 12.0, past, stall=1.0)
    assert failed == []  # first look: ours may be finishing too
    w._diagnose(entry, 13.0, past, stall=1.0)
    assert failed == ["CollectiveMismatchError"]  # still pending a period later: a skip
    # Ours finished between the looks: no verdict.
    failed.clear()
    entry = Tracked(3, 2, "all_gather", "blocks.1", None, "cpu", work, epoch=EPOCH)  # type: ignore[arg-type]
    w._diagnose(entry, 12.0, past, stall=1.0)
    work.done = True
    w._diagnose(entry, 13.0, past, stall=1.0)
    assert failed == []
    # A peer at another collective with the same number: at once.
    work.done = False
    entry = Tracked(3, 2, "all_gather", "blocks.1", None, "cpu", work, epoch=EPOCH)  # type: ignore[arg-type]
    other = {1: _state(_pos(seq=2, pending=[[3, 2, "all_gather", "blocks.2", False]]))}
    w._diagnose(entry, 12.0, other, stall=1.0)
    assert failed == ["CollectiveMismatchError"]


class _Completion:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_device_side_entry_is_done_only_when_its_event_completes() -> None:
    """Closed form: a stream-ordered entry is pending until its completion reports done, and
    is timed from its issue; a CPU entry is timed from the host's wait."""
    event = _Completion()
    device = Tracked(1, 1, "all_gather", "g", None, "cuda", event, device_side=True)  # type: ignore[arg-type]
    assert device.pending() and device.stalled_since() == device.issued
    event.done = True
    assert not device.pending() and device.finished and device.work is None
    host = Tracked(1, 2, "all_gather", "g", None, "cpu", _Completion())  # type: ignore[arg-type]
    assert host.pending() and host.stalled_since() is None  # not blocked on yet: no stall
    host.host_waits()
    assert host.stalled_since() == host.waiting_since


class _RecordingLock:
    """A lock that records which threads took it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.takers: list[int] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        self.takers.append(threading.get_ident())

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_tracking_before_the_thread_starts_is_what_the_thread_sees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closed form: before the watchdog thread starts, ``track`` records without the lock
    (every collective passes there); once it runs, ``track`` takes the lock, and the thread's
    view holds every pending entry, recorded before or after, oldest first."""
    monkeypatch.setattr(_channel.TIMEOUTS, "stall", 10.0)
    w = Watchdog()
    lock = _RecordingLock()
    w._lock = lock  # type: ignore[assignment]
    w._epoch = EPOCH
    done = Tracked(3, 1, "all_gather", "g", None, "cpu", _Completion(), epoch=EPOCH)  # type: ignore[arg-type]
    waiting = Tracked(3, 2, "all_gather", "g", None, "cpu", _Completion(), epoch=EPOCH)  # type: ignore[arg-type]
    w.track(done)
    done.finish()
    w.track(waiting)
    waiting.host_waits()
    assert lock.takers == []  # no thread yet: no lock
    assert w._last is waiting and list(w._tracked) == [waiting]  # the finished one dropped
    w._ensure_started()
    try:
        assert w.running()
        later = Tracked(3, 3, "reduce_scatter", "g", None, "cpu", _Completion(), epoch=EPOCH)  # type: ignore[arg-type]
        later.host_waits()
        w.track(later)
        assert threading.get_ident() in lock.takers  # the thread runs: track took the lock
        assert w._last is later and list(w._tracked) == [waiting, later]
        assert w._stalled() == (waiting, waiting.waiting_since)
    finally:
        w.stop()
    assert not w.running()


class _FakeEvent:
    def __init__(self) -> None:
        self.completed = False

    def query(self) -> bool:
        return self.completed


class _FakeStream:
    def record_event(self) -> _FakeEvent:
        return _FakeEvent()

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass


class _FakeDevice:
    def __init__(self) -> None:
        self._current = _FakeStream()

    def Stream(self, priority: int = 0) -> _FakeStream:
        return _FakeStream()

    def current_stream(self) -> _FakeStream:
        return self._current

    def stream(self, stream: Any) -> Any:
        import contextlib

        return contextlib.nullcontext(stream)


class _DoneWork:
    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def seam_completion(rank: int, world: int) -> dict[str, bool]:
    """Through the seam: after ``InFlight.wait`` a stream-ordered collective whose event has not
    completed is still pending (the host only ordered streams); once the event completes it is
    done. On CPU the host's wait finishes it."""
    from shardweave.fsdp._fsdp_common import CollectiveKind
    from shardweave.fsdp.comm._seam import issue
    from shardweave.fsdp.comm._streams import CommStreams, use_device_module

    seen: dict[str, bool] = {}
    for ordered in (True, False):
        with use_device_module(_FakeDevice(), stream_ordered=ordered):
            streams = CommStreams(torch.device("cpu"))
            in_flight = issue(
                CollectiveKind.ALL_GATHER,
                lambda async_op: _DoneWork(),  # type: ignore[arg-type,return-value]
                group=dist.group.WORLD,  # type: ignore[arg-type]
                tensor=torch.empty(4),
                name="blocks.0",
                trace_key="t",
                streams=streams,
                stream=streams.all_gather,
                what="a test collective",
            )
            assert in_flight.tracked is not None
            in_flight.wait(streams, streams.current())
            seen[f"pending after wait, ordered={ordered}"] = in_flight.tracked.pending()
            if ordered:
                in_flight.event.completed = True
                seen["pending after the event, ordered=True"] = in_flight.tracked.pending()
    return seen


def test_seam_judges_completion_on_the_device(world1: WorkerPool) -> None:
    [seen] = world1.run(seam_completion)
    assert seen == {
        "pending after wait, ordered=True": True,
        "pending after the event, ordered=True": False,
        "pending after wait, ordered=False": False,
    }


def test_knobs_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_channel.STALL_ENV, "2.5")
    monkeypatch.setenv(_channel.IDLE_ENV, "60")
    t = _channel.Timeouts()
    assert (t.stall, t.idle) == (2.5, 60.0)
    monkeypatch.setenv(_channel.STALL_ENV, "off")
    monkeypatch.delenv(_channel.IDLE_ENV)
    t = _channel.Timeouts()
    assert (t.stall, t.idle) == (None, None)
    monkeypatch.delenv(_channel.STALL_ENV)
    assert _channel.Timeouts().stall == _channel.DEFAULT_STALL_S
    monkeypatch.setenv(_channel.IDLE_ENV, "-3")
    with pytest.raises(ValueError, match=_channel.IDLE_ENV):
        _channel.Timeouts()


def test_setters_validate_and_derive() -> None:
    saved = (_channel.TIMEOUTS.stall, _channel.TIMEOUTS.idle)
    try:
        _watchdog.set_stall_timeout(4.0)
        _watchdog.set_idle_timeout(120)
        assert (_channel.TIMEOUTS.stall, _channel.TIMEOUTS.idle) == (4.0, 120.0)
        assert _channel.heartbeat_period() == pytest.approx(0.8)
        assert _channel.lost_after() == 4.0
        assert _channel.TIMEOUTS.idle_for(None) == 120.0
        for bad in (0, -1.0, float("inf")):
            with pytest.raises(ValueError, match="set_idle_timeout"):
                _watchdog.set_idle_timeout(bad)
        with pytest.raises(TypeError, match="set_stall_timeout"):
            _watchdog.set_stall_timeout("10")  # type: ignore[arg-type]
    finally:
        _channel.TIMEOUTS.stall, _channel.TIMEOUTS.idle = saved


def deprecated_alias(rank: int, world: int) -> tuple[float | None, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardweave.fsdp import fully_shard

    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_collective_checks(False, stall_timeout=3.0)  # type: ignore[operator]
    stall = _channel.TIMEOUTS.stall
    _watchdog.set_stall_timeout(_channel.DEFAULT_STALL_S)
    return stall, [f"{w.category.__name__}: {w.message}" for w in caught]


def test_collective_checks_stall_timeout_is_the_one_knob(world1: WorkerPool) -> None:
    """The old check-only threshold still works: it sets the one stall threshold, warning."""
    [(stall, caught)] = world1.run(deprecated_alias)  # type: ignore[misc]
    assert stall == 3.0
    assert any(c.startswith("FutureWarning") and "set_stall_timeout" in c for c in caught), caught


class _PG:
    def __init__(self, backend: str) -> None:
        self.backend, self.aborted = backend, 0

    def _get_backend_name(self) -> str:
        return self.backend

    def abort(self) -> None:
        self.aborted += 1


@pytest.mark.parametrize(
    ("mode", "backend", "aborts"),
    [
        (None, "nccl", False),
        ("3", "nccl", False),
        ("1", "nccl", False),
        ("0", "nccl", True),
        ("0", "gloo", False),
    ],
)
def test_abort_only_where_torch_documents_it(
    monkeypatch: pytest.MonkeyPatch, mode: str | None, backend: str, aborts: bool
) -> None:
    """Closed form: the stalled group alone is aborted, and only under
    TORCH_NCCL_ASYNC_ERROR_HANDLING=0 on NCCL (torch's documented mode for a user abort)."""
    if mode is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", mode)
    pg = _PG(backend)
    assert abort_if_supported(pg) is aborts  # type: ignore[arg-type]
    assert pg.aborted == int(aborts)


def test_collective_kinds_keep_their_names_and_codes() -> None:
    """The kinds are one enum (``CollectiveKind``); its names are what traces, summaries and
    JSON show, and its codes travel in the collective check's signatures, so both are a wire
    format: new kinds are appended. Oracle: the strings the tracer has always reported."""
    import json

    from shardweave.fsdp._fsdp_common import CollectiveKind

    kinds = list(CollectiveKind)
    assert [str(k) for k in kinds] == ["all_gather", "reduce_scatter", "all_reduce"]
    assert [k.code for k in kinds] == [0, 1, 2]
    assert [k.words for k in kinds] == ["all-gather", "reduce-scatter", "all-reduce"]
    assert [k.abbrev for k in kinds] == ["AG", "RS", "AR"]
    assert json.dumps({k: k for k in kinds}) == json.dumps({k.value: k.value for k in kinds})
    assert f"{CollectiveKind.ALL_GATHER:<12}|" == "all_gather  |"
    assert (
        CollectiveKind.ALL_REDUCE == "all_reduce" and {"all_reduce": 1}[CollectiveKind.ALL_REDUCE]
    )
