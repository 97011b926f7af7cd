"""Fail fast instead of hanging: compare what every rank manages before the first collective.

A rank whose model differs (another layer count, a shape, a dtype, a policy) would otherwise
issue all-gathers of different sizes or in a different order, and the job would hang or abort
inside the backend. At root lazy init every rank hashes a description of its groups and the
ranks of each data-parallel process group compare the digests; only on disagreement are the
full descriptions exchanged to name the first difference, on every rank.

Design note: the exchange goes through the c10d store
    torch's FSDP2 issues no collective at lazy init, and code that counts collectives (torch's
    own tests, schedulers, profilers) expects the first step to issue exactly its number. So
    the digests travel through the cross-rank channel (``_channel``: the default c10d store
    that every rank already shares), never through the model's process groups. Per process
    group (the shard group, then the replicate group) each rank publishes one small key in an
    ``Exchange`` and collects its peers' keys, waiting by the channel's one timeout policy:
    a warning naming the ranks not there yet at the stall threshold, an error naming them at
    the timeout (``SHARDWEAVE_CONSISTENCY_TIMEOUT``, else the idle timeout, else the process
    group's timeout). The exchange's generations keep two models, or two jobs sharing a
    store, apart and the store bounded (see Design note: the channel).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardweave.fsdp.faults import _channel
from shardweave.mesh import DataParallelMeshInfo, DDPMeshInfo, FSDPMeshInfo

__all__ = ["FSDPConsistencyError", "check_ranks_agree", "describe_groups"]

_NONCE_BYTES = 8
SKIP_ENV = "SHARDWEAVE_SKIP_CONSISTENCY_CHECK"
TIMEOUT_ENV = "SHARDWEAVE_CONSISTENCY_TIMEOUT"
_SCOPE = "consistency"
# First character of a rank's key: its digest and nonce follow (hex), or the error that
# stopped it.
_DIGEST = "D"
_FAILED = "F"


class FSDPConsistencyError(RuntimeError):
    """Ranks disagree about the modules, parameters or policies they manage.

    Raised on every rank at the root's first forward, naming the first difference, or the
    ranks that never reached it (after ``SHARDWEAVE_CONSISTENCY_TIMEOUT`` seconds, by default
    the process group's timeout). The check issues no collective: each rank writes one small
    key per data-parallel process group to the c10d store and reads its peers', once;
    ``SHARDWEAVE_SKIP_CONSISTENCY_CHECK=1`` skips it, but then a mismatch hangs instead, and
    peers are no longer told of a rank's failure (``PeerFailureError``).

    Example::

        fully_shard(model)
        try:
            model(batch)  # the first forward compares every rank's groups and policies
        except FSDPConsistencyError as e:
            print(e)  # e.g. "rank 0: param 'w': shape=(8, 4) ... rank 1: ... shape=(8, 5)"
            raise
    """


def describe_groups(group_lines: Sequence[list[str]], mp_repr: str, api: str) -> list[str]:
    """One line per fact every rank must agree on, in a stable order: the root's policy,
    then each group's own lines (``FSDPParamGroup.consistency_lines``)."""
    lines = [f"{api} root policy: {mp_repr}", f"groups: {len(group_lines)}"]
    for per_group in group_lines:
        lines.extend(per_group)
    return lines


def _process_groups(mesh_info: DataParallelMeshInfo) -> list[tuple[str, dist.ProcessGroup]]:
    groups: list[tuple[str, dist.ProcessGroup]] = []
    if isinstance(mesh_info, FSDPMeshInfo) and mesh_info.shard_mesh_size > 1:
        groups.append(("shard", mesh_info.shard_process_group))
    if isinstance(mesh_info, DDPMeshInfo) and mesh_info.replicate_mesh_size > 1:
        groups.append(("replicate", mesh_info.replicate_process_group))
    return groups


def check_ranks_agree(
    lines: list[str],
    mesh_info: DataParallelMeshInfo,
    device: torch.device,
    api: str,
    *,
    timeout: datetime.timedelta | None = None,
) -> int | None:
    """Raise ``FSDPConsistencyError`` on every rank of the mesh if any rank's ``lines`` differ.

    Issues no collective: the digests go through the default c10d store (see Design note:
    the exchange goes through the c10d store). A peer that does not arrive within
    ``timeout`` (default: ``SHARDWEAVE_CONSISTENCY_TIMEOUT`` seconds if set, else the process
    group's timeout, else 5 minutes) is named in an ``FSDPConsistencyError``.

    Returns a nonce every rank of the mesh agrees on (the first rank's random draw, adopted
    group by group), which names this root's failure scope (``_failures``); None when the check
    is skipped or there is no peer.
    """
    if os.environ.get(SKIP_ENV) == "1":
        return None
    groups = _process_groups(mesh_info)
    if not groups:
        return None
    # Draw every group's generation first, so that a rank raising for its first group can
    # still tell the peers of its later groups (they would wait out the timeout otherwise).
    exchanges = [_Check(role, pg, _timeout(timeout, pg, device), api) for role, pg in groups]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    nonce = int.from_bytes(os.urandom(_NONCE_BYTES), "little")
    for index, exchange in enumerate(exchanges):
        try:
            # Each group adopts its first rank's nonce; across the shard then the replicate
            # group that spreads one nonce over the whole mesh.
            nonce = exchange.agree(digest, nonce, lines)
        except FSDPConsistencyError as exc:
            for later in exchanges[index + 1 :]:
                later.publish(_FAILED + str(exc))
            raise
    return nonce


def _timeout(
    explicit: datetime.timedelta | None, pg: dist.ProcessGroup, device: torch.device
) -> datetime.timedelta:
    if explicit is not None:
        return explicit
    seconds = os.environ.get(TIMEOUT_ENV)
    if seconds:
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {seconds!r}")
        return datetime.timedelta(seconds=value)
    return datetime.timedelta(seconds=_channel.TIMEOUTS.idle_for(pg, device))


class _Check:
    """One process group's share of the check: an exchange of this rank's digest (and, on a
    mismatch, its description) with its peers'."""

    def __init__(
        self, role: str, pg: dist.ProcessGroup, timeout: datetime.timedelta, api: str
    ) -> None:
        self._exchange = _channel.Exchange(_SCOPE, role, dist.get_process_group_ranks(pg))
        self.ranks = self._exchange.ranks
        self._timeout, self._api = timeout, api

    def publish(self, payload: str, what: str = "digest") -> None:
        self._exchange.publish(payload, what)

    def collect(self, what: str = "digest") -> list[str]:
        """Every rank's ``what`` payload, in group-rank order; raises naming absent ranks."""
        seconds = self._timeout.total_seconds()
        try:
            return self._exchange.collect(
                seconds, what, waiting_for=f"its peers at the root's first forward ({self._api})"
            )
        except _channel.PeersMissing as exc:
            raise FSDPConsistencyError(
                f"{self._api}: rank(s) {', '.join(map(str, exc.missing))} of the process group "
                f"with ranks {self.ranks} did not reach the root's first forward within "
                f"{exc.waited:.3g} s ({'; '.join(exc.details)}), so the ranks cannot check "
                "that they manage the same model. Run the first forward on every rank (a rank "
                "that raised earlier says why in its own log), or raise the limit with "
                f"{TIMEOUT_ENV}=<seconds> (or set_idle_timeout)."
            ) from exc

    def agree(self, digest: str, nonce: int, lines: list[str]) -> int:
        """Publish ``digest`` and ``nonce``; return the group's first rank's nonce."""
        self.publish(f"{_DIGEST}{digest}:{nonce:x}")
        rows = self.collect()
        for row in rows:
            if row.startswith(_FAILED):  # a peer's earlier group disagreed
                raise FSDPConsistencyError(row[len(_FAILED) :])
        self._exchange.forget_previous(("digest", "lines"))
        digests = [row.partition(":")[0] for row in rows]
        if any(d != digests[0] for d in digests):
            # Someone differs: every rank sees the same digests, so all take this path.
            self.publish("\n".join(lines), "lines")
            everyone = [row.split("\n") for row in self.collect("lines")]
            raise FSDPConsistencyError(_first_difference(everyone, self.ranks, self._api))
        return int(rows[0].partition(":")[2], 16)


def _first_difference(per_rank: list[list[str]], ranks: list[int], api: str) -> str:
    reference = per_rank[0]
    for rank, lines in zip(ranks[1:], per_rank[1:], strict=True):
        for i in range(max(len(reference), len(lines))):
            ours = reference[i] if i < len(reference) else "<nothing>"
            theirs = lines[i] if i < len(lines) else "<nothing>"
            if ours != theirs:
                return (
                    f"{api}: ranks disagree about the model they manage, so their collectives "
                    f"would not match (a hang). First difference, item {i}:\n"
                    f"  rank {ranks[0]}: {ours.strip()}\n  rank {rank}: {theirs.strip()}\n"
                    "Build the same model, with the same fully_shard calls and policies, on every "
                    f"rank (set {SKIP_ENV}=1 to skip this check)."
                )
    return f"{api}: ranks disagree about the model they manage (digest mismatch)"
