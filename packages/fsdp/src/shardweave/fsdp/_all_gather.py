"""A group's all-gather copy-in (the 1D input) and copy-out (the gathered buffer split into
each parameter's unsharded tensor). See Design note: tensor vocabulary (``_fsdp_common``)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardweave.fsdp._fsdp_param import FSDPParam
from shardweave.fsdp._seam import InFlight

__all__ = ["AllGatherResult", "CopyOutViews", "all_gather_copy_in", "all_gather_copy_out"]


@dataclass
class AllGatherResult:
    """An issued all-gather whose copy-out has not run yet."""

    output: torch.Tensor  # 1D, world_size * input numel, rank-major
    in_flight: InFlight | None  # None when nothing was gathered (one rank per shard)
    world_size: int
    split_sizes: list[int]  # each param's numel per rank, in units of ``output``'s dtype
    as_bytes: bool  # output is uint8 because the inputs' dtypes differed
    post_forward: bool  # gathered from the post-forward shards (already in final layout)
    # The all-gather input when it is neither the sharded storage itself nor a slot of the
    # output (a single cast input, a copy to the device with one rank per shard): read on
    # another stream than its own, so kept as long as the output.
    input: torch.Tensor | None = None


def all_gather_copy_in(
    fsdp_params: Sequence[FSDPParam],
    flat_sharded: torch.Tensor | None,
    param_dtype: torch.dtype | None,
    device: torch.device,
    post_forward: bool,
    into: Callable[[int, torch.dtype], torch.Tensor] | None,
) -> tuple[torch.Tensor, list[int], bool]:
    """The 1D all-gather input, each param's numel in it, and whether it is a byte view.

    With the group's flat sharded storage (see Design note: flat storage in
    ``_fsdp_param_group``) the input *is* the storage: no per-parameter copy. An input that
    must be built (a cast, a copy to the device, a concatenation) is written by one op into
    ``into(numel, dtype)``, this rank's slot of the all-gather output, as torch's FSDP2 does:
    no buffer beside the output. ``into`` is None when nothing is gathered (one rank per
    shard): then the flat storage is not cast here, as the copy-out casts while it copies
    (one buffer fewer for the whole group, the bench's world-1 peak).
    """
    if flat_sharded is not None and not post_forward:
        data = flat_sharded
        sizes = [p.padded_sharded_numel for p in fsdp_params]
        dtype = param_dtype if param_dtype is not None and into is not None else data.dtype
        if data.device == device and data.dtype == dtype:
            return data, sizes, False
        if into is None:
            return data.to(device, non_blocking=True), sizes, False
        if data.device != device and data.dtype != dtype:
            # Cast on the device: a host-side cast of the whole shard would stall the host.
            data = data.to(device, non_blocking=True)
        slot = into(data.numel(), dtype)
        slot.copy_(data, non_blocking=True)
        return slot, sizes, False
    inputs = [t for p in fsdp_params for t in p.all_gather_inputs()]
    dtypes = {t.dtype for t in inputs}
    as_bytes = len(dtypes) > 1
    if as_bytes:
        # Mixed dtypes (e.g. frozen bf16 beside fp32) travel as one byte buffer.
        inputs = [t.contiguous().view(torch.uint8) for t in inputs]
    sizes = [t.numel() for t in inputs]
    if len(inputs) == 1:
        return inputs[0], sizes, as_bytes
    if into is None:
        return torch.cat(inputs), sizes, as_bytes
    slot = into(sum(sizes), inputs[0].dtype)
    torch.cat(inputs, out=slot)
    return slot, sizes, as_bytes


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
    fsdp_params: Sequence[FSDPParam],
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
    fixups: list[tuple[FSDPParam, torch.Tensor]] = []
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
    gathered = result.output.view(world, -1)
    if len(outs) == 1:
        outs[0].copy_(gathered)
    elif gathered.dtype != outs[0].dtype:  # one rank per shard: the copy-out casts
        torch._foreach_copy_(outs, torch.split_with_sizes(gathered, result.split_sizes, dim=1))
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
