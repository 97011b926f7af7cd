"""A group's all-gather copy-in (the 1D input) and copy-out (the gathered buffer split into
each parameter's unsharded tensor). See Design note: tensor vocabulary (``_fsdp_common``).

A parameter is known here only through ``AllGatherParam``, what the copy-in and copy-out read
of it; the engine's ``FSDPParam`` is one, and passes itself down.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from shardweave.fsdp.comm._seam import InFlight

__all__ = [
    "AllGatherParam",
    "AllGatherResult",
    "CopyIn",
    "CopyOutViews",
    "all_gather_copy_in",
    "all_gather_copy_out",
    "copy_in_dtype",
]


class AllGatherParam(Protocol):
    """What the copy-in and copy-out read of one parameter; ``FSDPParam`` is one. (Declared
    here, where it is read: the engine core imports this module, not the other way round.)"""

    @property
    def unsharded_dtype(self) -> torch.dtype: ...  # the dtype it is gathered in
    @property
    def gathers_padded_shard(self) -> bool: ...  # its input is its padded shard, cast at most
    @property
    def shard_dim(self) -> int: ...
    @property
    def padded_sharded_size(self) -> torch.Size: ...
    @property
    def orig_size(self) -> torch.Size: ...  # unsharded, as gathered
    @property
    def all_gather_output(self) -> torch.Tensor: ...  # 1D: the unsharded data, filled here

    def all_gather_source(self) -> torch.Tensor: ...  # 1D padded shard, as stored

    def all_gather_inputs(self) -> list[torch.Tensor]: ...  # 1D, as its kind makes them

    def gathers_rows_of_shard_dim(self, post_forward: bool) -> bool: ...


@dataclass
class AllGatherResult:
    """An issued all-gather whose copy-out has not run yet."""

    # 1D, world_size * input numel, rank-major; None when nothing was gathered or staged (one
    # rank per shard): then the copy-out reads ``sources``.
    output: torch.Tensor | None
    in_flight: InFlight | None  # None when nothing was gathered (one rank per shard)
    world_size: int
    split_sizes: list[int]  # each param's numel per rank, in units of ``output``'s dtype
    as_bytes: bool  # output is uint8 because the inputs' dtypes differed
    post_forward: bool  # gathered from the post-forward shards (already in final layout)
    # The all-gather input when it is neither a shard itself nor a slot of the output (one
    # parameter's cast): read on another stream than its own, so kept as long as the output.
    input: torch.Tensor | None = None
    # One rank per shard, shards on the device: each parameter's own shard, which the
    # copy-out copies (and casts) straight into its unsharded storage.
    sources: list[torch.Tensor] | None = None


class CopyIn(NamedTuple):
    """What ``all_gather_copy_in`` built: the 1D input, each parameter's numel in it (in the
    input's dtype), whether it is a byte view, and the dtype the parameters are gathered in."""

    input: torch.Tensor
    split_sizes: list[int]
    as_bytes: bool
    gathered_dtype: torch.dtype


def copy_in_dtype(fsdp_params: Sequence[AllGatherParam]) -> torch.dtype | None:
    """The one dtype every parameter is gathered in, when each contributes its own padded
    shard (the one-op copy-in applies); None otherwise. Fixed between lazy inits: the group
    keeps it."""
    dtypes = {p.unsharded_dtype for p in fsdp_params}
    if len(dtypes) != 1 or not all(p.gathers_padded_shard for p in fsdp_params):
        return None
    return next(iter(dtypes))


def all_gather_copy_in(
    fsdp_params: Sequence[AllGatherParam],
    dtype: torch.dtype | None,
    device: torch.device,
    into: Callable[[int, torch.dtype], torch.Tensor] | None,
) -> CopyIn:
    """Build this rank's 1D all-gather input.

    When every parameter contributes its own padded shard in one dtype (``dtype``, from
    ``copy_in_dtype``; the common case), the shards are copied by one op into ``into(numel,
    dtype)``, this rank's slot of the all-gather output, casting (and moving to the device)
    as they are copied, as torch's FSDP2 copies them in (it casts each shard first). A group
    of one parameter already on the device in its dtype is gathered from its shard itself,
    with no copy. ``into`` is None when nothing is gathered (one rank per shard, here only
    for shards off the device or of a kind with its own all-gather): the shards are then
    staged uncast, as the copy-out casts while it copies (one buffer fewer for the whole
    group, the bench's world-1 peak).
    """
    if dtype is not None:
        sources = [p.all_gather_source() for p in fsdp_params]
        sizes = [t.numel() for t in sources]
        first = sources[0]
        if len(sources) == 1 and first.device == device and first.dtype == dtype:
            return CopyIn(first, sizes, False, dtype)
        if into is None:
            staged = torch.empty(sum(sizes), dtype=first.dtype, device=device)
        else:
            staged = into(sum(sizes), dtype)
        if first.device == device:
            torch.cat(sources, out=staged)  # one op, the cast included
        else:  # CPU offload: host-to-device copies, behind the host from pinned memory
            pieces = list(torch.split_with_sizes(staged, sizes))
            torch._foreach_copy_(pieces, sources, non_blocking=True)
        return CopyIn(staged, sizes, False, dtype)
    inputs = [t for p in fsdp_params for t in p.all_gather_inputs()]
    dtypes = {t.dtype for t in inputs}
    as_bytes = len(dtypes) > 1
    if as_bytes:
        # Mixed dtypes (e.g. frozen bf16 beside fp32) travel as one byte buffer.
        inputs = [t.contiguous().view(torch.uint8) for t in inputs]
    sizes = [t.numel() for t in inputs]
    gathered = torch.uint8 if as_bytes else inputs[0].dtype
    if len(inputs) == 1:
        return CopyIn(inputs[0], sizes, as_bytes, gathered)
    if into is None:
        return CopyIn(torch.cat(inputs), sizes, as_bytes, gathered)
    slot = into(sum(sizes), inputs[0].dtype)
    torch.cat(inputs, out=slot)
    return CopyIn(slot, sizes, as_bytes, gathered)


class CopyOutViews:
    """A group's copy-out destinations (2D views of its all-gather outputs), kept between
    unshards. The outputs are the same tensors at every unshard, their storage refilled in
    place (see Design note: storage resize, ``FSDPParam``), so views of them stay valid; they
    are rebuilt when any output is another tensor, or the world size, the byte view or the
    post-forward flag differs. Never kept when a parameter needs a scratch buffer."""

    __slots__ = ("key", "targets", "views")

    def __init__(self) -> None:
        self.key: tuple[int, bool, bool] | None = None
        self.targets: tuple[torch.Tensor, ...] = ()
        self.views: list[torch.Tensor] = []


def all_gather_copy_out(
    result: AllGatherResult,
    fsdp_params: Sequence[AllGatherParam],
    outputs: Sequence[list[torch.Tensor]],
    flat_outputs: tuple[torch.Tensor, ...],
    views: CopyOutViews,
) -> None:
    """Split the gathered buffer into each parameter's all-gather output in one pass.

    ``outputs``: each parameter's ``alloc_all_gather_outputs()``, allocated by the caller;
    ``flat_outputs`` the same tensors in one tuple; ``views`` the group's kept destinations.
    """
    world = result.world_size
    key = (world, result.as_bytes, result.post_forward)
    kept = views.targets
    fixups: list[tuple[AllGatherParam, torch.Tensor]] = []
    if (
        views.key == key
        and len(kept) == len(flat_outputs)
        and all(map(operator.is_, kept, flat_outputs))
    ):
        outs = views.views
    else:
        outs = []
        for fsdp_param, targets in zip(fsdp_params, outputs, strict=True):
            if fsdp_param.gathers_rows_of_shard_dim(result.post_forward):
                # Rows of a dim-d shard are chunks along d: gather into a scratch buffer, then
                # concatenate along d into the real layout.
                scratch = torch.empty_like(targets[0])
                fixups.append((fsdp_param, scratch))
                targets = [scratch]
            for target in targets:
                if result.as_bytes:
                    target = target.view(torch.uint8)
                outs.append(target.view(world, -1))
        if fixups:
            views.key, views.targets, views.views = None, (), []
        else:
            views.key, views.targets, views.views = key, flat_outputs, outs
    if result.output is None:
        # One rank per shard, nothing staged: straight from each shard, cast as it is copied.
        assert result.sources is not None
        torch._foreach_copy_(outs, [source.view(1, -1) for source in result.sources])
    else:
        gathered = result.output.view(world, -1)
        if len(outs) == 1:
            outs[0].copy_(gathered)
        elif gathered.dtype != outs[0].dtype:  # one rank per shard: the copy-out casts
            splits = torch.split_with_sizes(gathered, result.split_sizes, dim=1)
            torch._foreach_copy_(outs, splits)
        else:
            torch.split_with_sizes_copy(gathered, result.split_sizes, dim=1, out=outs)
    for fsdp_param, scratch in fixups:
        shards = scratch.view(world * fsdp_param.padded_sharded_size[0], -1)
        pieces = [c.view(fsdp_param.padded_sharded_size) for c in torch.chunk(shards, world, dim=0)]
        torch.cat(
            pieces,
            dim=fsdp_param.shard_dim,
            out=fsdp_param.all_gather_output.view(fsdp_param.orig_size),
        )
