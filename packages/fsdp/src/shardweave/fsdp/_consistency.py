"""Fail fast instead of hanging: compare what every rank manages before the first collective.

A rank whose model differs (another layer count, a shape, a dtype, a policy) would otherwise
issue all-gathers of different sizes or in a different order, and the job would hang or abort
inside the backend. At root lazy init every rank hashes a description of its groups; one tiny
all-gather of the digests per data-parallel process group tells whether they agree, and only on
disagreement are the full descriptions exchanged to name the first difference, on every rank.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardweave.mesh import DataParallelMeshInfo, DDPMeshInfo, FSDPMeshInfo

if TYPE_CHECKING:
    from shardweave.fsdp._fsdp_param_group import FSDPParamGroup

__all__ = ["FSDPConsistencyError", "check_ranks_agree", "describe_groups"]

_DIGEST_BYTES = 32
_NONCE_BYTES = 8
SKIP_ENV = "SHARDWEAVE_SKIP_CONSISTENCY_CHECK"


class FSDPConsistencyError(RuntimeError):
    """Ranks disagree about the modules, parameters or policies they manage.

    Raised on every rank at the root's first forward, naming the first difference. The
    check costs one small all-gather per data-parallel process group, once;
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


def describe_groups(groups: Sequence[FSDPParamGroup], mp_repr: str, api: str) -> list[str]:
    """One line per fact every rank must agree on, in a stable order."""
    lines = [f"{api} root policy: {mp_repr}", f"groups: {len(groups)}"]
    for index, group in enumerate(groups):
        info = group.mesh_info
        post = group.post_forward_mesh_info
        post_desc = (
            "none" if post is None else ("same" if post is info else str(post.shard_mesh_size))
        )
        lines.append(
            f"group {index} '{group._module_fqn}': {type(info).__name__} "
            f"shard={getattr(info, 'shard_mesh_size', 1)} "
            f"replicate={getattr(info, 'replicate_mesh_size', 1)} "
            f"reshard_after_forward={post_desc} mp={group.mp_policy} "
            f"offload={type(group.offload_policy).__name__}"
        )
        for p in group.fsdp_params:
            lines.append(
                f"  param '{p.param_fqn}': shape={tuple(p.orig_size)} dtype={p.orig_dtype} "
                f"requires_grad={p.sharded_param.requires_grad} shard_dim={p.shard_dim}"
            )
    return lines


def _process_groups(mesh_info: DataParallelMeshInfo) -> list[dist.ProcessGroup]:
    groups: list[dist.ProcessGroup] = []
    if isinstance(mesh_info, FSDPMeshInfo) and mesh_info.shard_mesh_size > 1:
        groups.append(mesh_info.shard_process_group)
    if isinstance(mesh_info, DDPMeshInfo) and mesh_info.replicate_mesh_size > 1:
        groups.append(mesh_info.replicate_process_group)
    return groups


def check_ranks_agree(
    lines: list[str], mesh_info: DataParallelMeshInfo, device: torch.device, api: str
) -> int | None:
    """Raise ``FSDPConsistencyError`` on every rank of the mesh if any rank's ``lines`` differ.

    Returns a nonce every rank of the mesh agrees on (the first rank's random draw, carried by
    the same all-gather), which names this root's failure scope (``_fault``); None when the
    check is skipped or there is no peer.
    """
    if os.environ.get(SKIP_ENV) == "1":
        return None
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    nonce = int.from_bytes(os.urandom(_NONCE_BYTES), "little")
    agreed: int | None = None
    width = _DIGEST_BYTES + _NONCE_BYTES
    for pg in _process_groups(mesh_info):
        # Each group adopts its first rank's nonce; across the shard then the replicate group
        # that spreads one nonce over the whole mesh.
        payload = bytearray(digest + nonce.to_bytes(_NONCE_BYTES, "little"))
        local = torch.frombuffer(payload, dtype=torch.uint8).to(device)
        world = pg.size()
        gathered = torch.empty(world * width, dtype=torch.uint8, device=device)
        dist.all_gather_single(gathered, local, group=pg)
        rows = gathered.view(world, width)
        nonce = agreed = int.from_bytes(bytes(rows[0, _DIGEST_BYTES:].cpu().tolist()), "little")
        digests = rows[:, :_DIGEST_BYTES]
        if bool((digests == digests[0]).all()):
            continue
        # Someone differs: every rank sees the same digests, so all take this path together.
        everyone = _all_gather_lines(lines, pg, device)
        ranks = dist.get_process_group_ranks(pg)
        raise FSDPConsistencyError(_first_difference(everyone, ranks, api))
    return agreed


def _all_gather_lines(
    lines: list[str], pg: dist.ProcessGroup, device: torch.device
) -> list[list[str]]:
    """Every rank's lines, as utf-8 bytes in padded tensors.

    Not ``all_gather_object``: in torch 2.13 it needs NumPy, which shardweave does not require.
    """
    world = pg.size()
    payload = torch.frombuffer(bytearray("\n".join(lines).encode() or b"\n"), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_single(sizes, size, group=pg)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload.to(device)
    gathered = torch.empty(world * longest, dtype=torch.uint8, device=device)
    dist.all_gather_single(gathered, padded, group=pg)
    rows = gathered.view(world, longest).cpu()
    return [bytes(rows[r, : int(sizes[r])].tolist()).decode().split("\n") for r in range(world)]


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
