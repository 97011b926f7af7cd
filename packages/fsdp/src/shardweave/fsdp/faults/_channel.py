"""The one cross-rank channel: how shardweave's ranks talk to each other outside the model's
process groups, and how long they wait for each other.

Design note: the channel
    Whatever the ranks tell each other besides the model's collectives goes through the default
    c10d store (the one every rank joined the process group with), by the rules of this
    module, so that the consistency check (``_consistency``), the failure channel (``_failures``)
    and the watchdog (``_watchdog``) share one protocol:

    - **Keys** are ``shardweave/<scope>/...`` (``key``). The scopes in use:
      ``consistency/<ranks hash>/<generation>/<rank>/<what>`` (the first-forward check),
      ``fault/<epoch>/failure`` (one root's failure scope: the first failure or verdict),
      ``watch/<epoch>`` (requests for heartbeats), ``live/<rank>`` (one process's heartbeat
      and position) and ``exit/<rank>`` (why a process ended, when it could say).
    - **Exchanges** (``Exchange``): the ranks of one process group publish one payload each per
      generation and collect everybody's. The generation comes from a ticket counter in the
      store (``store.add``): a rank finishes generation ``g`` only after every peer wrote its
      key for ``g``, so every peer drew its ticket for ``g`` before anyone draws one for
      ``g + 1``, and ``(ticket - 1) // group size`` is the same on every rank. Two models, or
      two jobs sharing a store one after the other, never read each other's keys. Once
      generation ``g`` is complete every peer has read ``g - 1``, so each rank then deletes
      its own ``g - 1`` keys: the store holds one counter per group and at most one key per
      rank, group and payload kind.
    - **First write wins** (``publish_once``): a failure scope's record is set with
      ``compare_set``, so every rank reads the same first failure.
    - **Liveness** (``request_beats``, ``publish_beat``, ``Peers``): while a rank waits on a
      stalled collective it bumps a request counter (``watch/<scope>``) every heartbeat
      period; every process's watchdog thread reads that counter once per period and, for a
      few periods after it moved, bumps a counter in its ``live/<rank>`` record with its
      position in the engine. Healthy training thus writes nothing: a ``FileStore`` is an
      append-only log, and a beat every second from every rank would grow it without bound
      over a long job. A reader judges a peer by its own clock: the time since it last saw
      that counter move (clocks of different hosts are never compared); an alive peer answers
      a request within a period or two. A thread keeps beating
      while the training thread sleeps, waits on I/O or computes (torch's ops and
      ``time.sleep`` release the GIL, and a pure-Python loop hands it over every
      ``sys.getswitchinterval()``), so a silent record means the process exited, was killed
      or is frozen as a whole. ``exit/<rank>`` says why when the process could write it (an
      uncaught exception, a normal interpreter exit).
    - **One timeout policy** (``Timeouts``): a wait on peers warns at the *stall threshold*,
      naming each missing peer (alive and where, exited and why, or silent), repeats the
      warning with doubling intervals, and gives up at the *idle timeout*, which defaults to
      the process group's own timeout. A peer known to have exited ends the wait at once.
    - **A client per thread**: the watchdog thread uses its own store client
      (``Store.clone()``, a connection of its own on a TCPStore), so a training thread blocked
      in a store wait (a user's barrier over the store, say) never silences the heartbeat.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "IDLE_ENV",
    "STALL_ENV",
    "TIMEOUTS",
    "Exchange",
    "PeerState",
    "Peers",
    "PeersMissing",
    "Timeouts",
    "beat_requests",
    "exit_record",
    "heartbeat_period",
    "key",
    "lost_after",
    "pg_timeout",
    "publish_beat",
    "publish_once",
    "read",
    "record_exit",
    "request_beats",
    "store",
    "thread_store",
]

logger = logging.getLogger("shardweave.fsdp")

PREFIX: Final = "shardweave"
STALL_ENV: Final = "SHARDWEAVE_STALL_TIMEOUT"
IDLE_ENV: Final = "SHARDWEAVE_IDLE_TIMEOUT"
DEFAULT_STALL_S: Final = 10.0
# When a process group has no readable timeout (a custom backend): torch's default for NCCL.
DEFAULT_IDLE_S: Final = 600.0
# A peer whose heartbeat has not moved for this long (at least; see ``lost_after``) is taken for
# gone. Not shorter: a heavily loaded host can hold a daemon thread back for a second or two.
LOST_FLOOR_S: Final = 2.0


# --- the store -------------------------------------------------------------------------------
def store() -> Store | None:
    """The default c10d store (for the training thread), or None without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


_clone_lock = threading.Lock()
_clone: tuple[object, Store] | None = None  # (the default group it belongs to, client)


def thread_store() -> Store | None:
    """A store client of its own for the watchdog thread (see Design note: the channel)."""
    global _clone
    base = store()
    if base is None:
        return None
    group = dist.distributed_c10d._get_default_group()
    with _clone_lock:
        if _clone is None or _clone[0] is not group:
            try:
                # Store.clone() (torch >= 2.6) is missing from torch's type stubs.
                client = cast("Store", base.clone())  # type: ignore[attr-defined]
            except Exception:  # a store without clone(): share the training thread's client
                client = base
            _clone = (group, client)
        return _clone[1]


def key(*parts: object) -> str:
    return "/".join((PREFIX, *(str(p) for p in parts)))


def publish_once(client: Store, name: str, payload: str) -> None:
    """Set ``name`` unless some rank already did: the first write wins, on every rank."""
    client.compare_set(name, "", payload)


def read(client: Store, name: str) -> str | None:
    """``name``'s value, or None when it is not set (never waits)."""
    try:
        if not client.check([name]):
            return None
        value: bytes = client.get(name)
        return value.decode()
    except Exception:  # a store that went away with its process group
        return None


# --- timeouts ------------------------------------------------------------------------------
def _env_seconds(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in ("0", "off", "none"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive seconds or 'off', got {raw!r}")
    return value


def check_seconds(api: str, seconds: float | None, what: str) -> float | None:
    """``seconds`` as a float, or None; raises naming ``api`` for anything else."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{api}: seconds must be a number or None, got {seconds!r}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{api}: seconds must be positive and finite ({what}), got {seconds!r}")
    return float(seconds)


class Timeouts:
    """The stall threshold and the idle timeout, process-wide (see Design note: the channel).

    ``stall``: how long a wait on peers goes before it is diagnosed and, if a peer is idle,
    warned about (None: never diagnosed). ``idle``: how long a wait on an alive, idle peer goes
    before it is an error (None: the process group's own timeout).
    """

    def __init__(self) -> None:
        self.stall: float | None = _env_seconds(STALL_ENV, DEFAULT_STALL_S)
        # "off" would mean "wait forever"; the process group's timeout bounds the wait anyway.
        self.idle: float | None = _env_seconds(IDLE_ENV, None)

    def idle_for(self, pg: dist.ProcessGroup | None, device: torch.device | None = None) -> float:
        """The idle timeout for a wait in ``pg``: the set value, else ``pg``'s own timeout."""
        if self.idle is not None:
            return self.idle
        found = pg_timeout(pg, device) if pg is not None else None
        return DEFAULT_IDLE_S if found is None else found


TIMEOUTS: Final = Timeouts()


def heartbeat_period() -> float:
    """How often a process publishes its heartbeat: a fifth of the stall threshold, between
    0.1 s and 1 s (one small store write and one read per period)."""
    stall = TIMEOUTS.stall if TIMEOUTS.stall is not None else DEFAULT_STALL_S
    return min(1.0, max(0.1, stall / 5))


def lost_after() -> float:
    """How long a peer's heartbeat may stand still before the peer is taken for gone: the
    stall threshold, at least ``LOST_FLOOR_S`` and five heartbeat periods."""
    stall = TIMEOUTS.stall if TIMEOUTS.stall is not None else DEFAULT_STALL_S
    return max(stall, LOST_FLOOR_S, 5 * heartbeat_period())


def pg_timeout(pg: dist.ProcessGroup, device: torch.device | None = None) -> float | None:
    """``pg``'s own timeout in seconds (torch 2.13 has no public accessor), or None."""
    devices = [device] if device is not None else []
    devices += [torch.device("cpu"), torch.device("cuda")]
    for dev in devices:
        with contextlib.suppress(Exception):  # a backend without options, or not this device
            found = pg._get_backend(dev).options._timeout
            if isinstance(found, datetime.timedelta) and found.total_seconds() > 0:
                return found.total_seconds()
    return None


# --- liveness ------------------------------------------------------------------------------
_beats = 0
_IDENTITY: Final = {"pid": os.getpid(), "host": socket.gethostname()}


def publish_beat(client: Store, position: dict[str, Any]) -> None:
    """Publish this process's heartbeat with its ``position`` (the watchdog thread's job)."""
    global _beats
    _beats += 1
    record = {"n": _beats, **_IDENTITY, "pos": position}
    client.set(key("live", dist.get_rank()), json.dumps(record))


def request_beats(client: Store, scope: object) -> None:
    """Ask every process of ``scope`` to publish heartbeats for the next few periods."""
    client.add(key("watch", scope), 1)


def beat_requests(client: Store, scope: object) -> int:
    """How many heartbeat requests ``scope`` has seen (a read: it never grows the store)."""
    raw = read(client, key("watch", scope))
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0


def record_exit(reason: str) -> None:
    """Tell the peers why this process ends (its heartbeat stops just after)."""
    client = store()
    if client is None:
        return
    with contextlib.suppress(Exception):
        client.set(key("exit", dist.get_rank()), reason)


def exit_record(client: Store, rank: int) -> str | None:
    """What ``rank`` wrote when its process ended (None: nothing, e.g. killed)."""
    return read(client, key("exit", rank))


@dataclass(frozen=True)
class PeerState:
    """What a reader knows about one peer (see ``Peers``)."""

    rank: int
    position: dict[str, Any] | None  # its last published position (None: never seen)
    silent_s: float  # since this reader last saw its heartbeat move (or began to look)
    watched_s: float  # how long this reader has been looking
    exit: str | None  # its exit record

    @property
    def answered(self) -> bool:
        """Its heartbeat moved since this reader began to look: its position is current."""
        return self.silent_s < self.watched_s

    def exited(self, lost_s: float) -> bool:
        """Gone: it said so, or its heartbeat stood still for ``lost_s`` while watched."""
        return self.exit is not None or (self.silent_s >= lost_s and self.watched_s >= lost_s)


class Peers:
    """A reader's view of its peers' heartbeats, judged by the reader's own clock."""

    def __init__(self) -> None:
        # rank -> (counter, when it last moved, when this reader began to look, record)
        self._seen: dict[int, tuple[int, float, float, dict[str, Any] | None]] = {}

    def observe(self, client: Store, ranks: Sequence[int]) -> dict[int, PeerState]:
        now = time.monotonic()
        out: dict[int, PeerState] = {}
        for rank in ranks:
            raw = read(client, key("live", rank))
            record: dict[str, Any] | None = None
            counter = -1
            if raw is not None:
                with contextlib.suppress(ValueError, TypeError):
                    record = json.loads(raw)
                    counter = int(record["n"]) if isinstance(record, dict) else -1
            before = self._seen.get(rank)
            if before is None:
                moved, since = now, now
            else:
                moved, since = (before[1] if before[0] == counter else now), before[2]
            self._seen[rank] = (counter, moved, since, record)
            position = record.get("pos") if isinstance(record, dict) else None
            out[rank] = PeerState(
                rank,
                position if isinstance(position, dict) else None,
                now - moved if before is not None else 0.0,
                now - since,
                # One more read only for a peer that did not just beat.
                None if moved == now and before is not None else exit_record(client, rank),
            )
        return out

    def forget(self) -> None:
        self._seen.clear()


# --- exchanges -----------------------------------------------------------------------------
class PeersMissing(RuntimeError):
    """Peers of an exchange did not publish in time (or are known to have exited)."""

    def __init__(self, missing: list[int], waited: float, details: list[str]) -> None:
        super().__init__("; ".join(details))
        self.missing, self.waited, self.details = missing, waited, details


def describe_absent(client: Store, rank: int) -> str:
    """One phrase on why ``rank`` may be absent: its exit record, or what is known of it."""
    reason = exit_record(client, rank)
    if reason is not None:
        return f"rank {rank} {reason}"
    return f"rank {rank} has not arrived"


class Exchange:
    """One process group's exchange of one payload per rank (see Design note: the channel)."""

    def __init__(
        self, scope: str, tag: str, ranks: Sequence[int], client: Store | None = None
    ) -> None:
        found = client if client is not None else store()
        if found is None:
            raise RuntimeError("shardweave: the cross-rank channel needs a process group")
        self._store = found
        self.ranks = list(ranks)
        self._rank = dist.get_rank()
        # One counter per (scope, tag, ranks): the same group's exchanges share generations.
        digest = hashlib.sha256(f"{tag}:{self.ranks}".encode()).hexdigest()[:16]
        self._scope = key(scope, digest)
        ticket = self._store.add(f"{self._scope}/tickets", 1)
        self.generation = (ticket - 1) // len(self.ranks)

    def _key(self, rank: int, generation: int, what: str) -> str:
        return f"{self._scope}/{generation}/{rank}/{what}"

    def publish(self, payload: str, what: str = "data") -> None:
        self._store.set(self._key(self._rank, self.generation, what), payload)

    def collect(
        self,
        timeout: float,
        what: str = "data",
        waiting_for: str = "the exchange",
        on_warn: Callable[[str], None] | None = None,
    ) -> list[str]:
        """Every rank's ``what`` payload, in group-rank order.

        Waits by the one timeout policy (see Design note: the channel): a warning naming the
        absent ranks at the stall threshold and at doubling intervals after it
        (``on_warn``, default: the package logger), ``PeersMissing`` at ``timeout`` seconds or
        as soon as an absent rank is known to have exited.
        """
        keys = [self._key(r, self.generation, what) for r in self.ranks]
        start = time.monotonic()
        stall = TIMEOUTS.stall
        warn_at = stall if stall is not None and stall < timeout else math.inf
        while True:
            waited = time.monotonic() - start
            slice_s = max(0.01, min(timeout, warn_at, waited + 1.0) - waited)
            try:
                self._store.wait(keys, datetime.timedelta(seconds=slice_s))
                break
            except RuntimeError:  # c10d's DistStoreError: "Wait timeout"
                pass
            missing = [r for r, k in zip(self.ranks, keys, strict=True) if not self._present(k)]
            if not missing:
                break
            waited = time.monotonic() - start
            details = [describe_absent(self._store, r) for r in missing]
            gone = [r for r in missing if exit_record(self._store, r) is not None]
            if gone or waited >= timeout:
                raise PeersMissing(missing, waited, details)
            if waited >= warn_at:
                message = (
                    f"shardweave: rank {self._rank} has waited {waited:.0f} s for {waiting_for}: "
                    + "; ".join(details)
                    + f". Still waiting (an error after {timeout:g} s)."
                )
                (on_warn or logger.warning)(message)
                warn_at *= 2
        return [self._store.get(k).decode() for k in keys]

    def forget_previous(self, whats: Sequence[str] = ("data",)) -> None:
        """Delete this rank's keys of the previous generation (every peer has read them)."""
        if self.generation == 0:
            return
        for what in whats:
            with contextlib.suppress(Exception):  # best effort: a store without delete
                self._store.delete_key(self._key(self._rank, self.generation - 1, what))

    def _present(self, name: str) -> bool:
        try:
            return bool(self._store.check([name]))
        except Exception:  # a broken store: report the rank as missing
            return False
