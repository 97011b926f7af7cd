"""Full (unsharded) state dicts of a ``fully_shard``-ed model, one tensor at a time.

Design note: one tensor at a time
    A full state dict is as large as the model, so neither direction may build it on the device
    or keep more than one gathered tensor alive besides the kept result. Export walks the
    entries of ``model.state_dict()`` in order and, for each, gathers the full tensor over its
    DTensor mesh, moves it to CPU on the ranks that keep it and drops it everywhere else before
    the next gather. Import fetches one full tensor (from the caller's dict, a broadcast from
    rank 0 or a file), narrows it to this rank's piece as a view and copies that piece into
    the live local shard in place, so the parameters keep their storage (the flat per-group
    buffer) and nothing else is allocated but that one full tensor. Entries tied to the same
    tensor (one parameter under several names) are gathered or loaded once.

Design note: ranks agree before they communicate
    Key and shape checks run before the first tensor moves. Every rank learns every rank's
    verdict (rank 0's, when only rank 0 holds the source) and raises the same error, so no rank
    is left waiting in a collective that the others skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from shardweave.fsdp._fully_shard import FSDPModule
from shardweave.fsdp._torch_compat import all_gather_single
from shardweave.mesh.extension_points import PARAM_KINDS

__all__ = [
    "GatherBuffers",
    "IncompatibleKeys",
    "LoadSource",
    "TensorMeta",
    "gather_full_tensor",
    "get_full_state_dict",
    "load_full_tensors",
    "set_full_state_dict",
    "state_dict_targets",
]


class IncompatibleKeys(NamedTuple):
    """What ``set_full_state_dict(strict=False)`` skipped (the fields of ``load_state_dict``'s).

    Example::

        result = set_full_state_dict(model, full, strict=False)
        if result.missing_keys:  # these entries keep their current values
            print("not in the checkpoint:", result.missing_keys)
        missing, unexpected = result  # a NamedTuple, as load_state_dict returns
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


class TensorMeta(NamedTuple):
    """A source tensor's dtype and global shape, known before its bytes are fetched."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def state_dict_targets(model: nn.Module) -> dict[str, torch.Tensor | Any]:
    """``model.state_dict(keep_vars=True)`` after resharding: the live sharded parameters.

    Resharding first matters both ways: an unsharded parameter (left by
    ``reshard_after_forward=False`` or ``unshard()``) may be in the compute dtype, and a load
    into it would be lost at the next all-gather, which refills it from the shards. Tied entries
    are the same object under several names, which is how both directions find them (see
    Design note: one tensor at a time).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # local: frees the unsharded parameters, no communication
    return dict(model.state_dict(keep_vars=True))


def _is_plain_dim0_shard(placements: Sequence[Placement]) -> int | None:
    """The mesh dim of the only ``Shard(0)`` when all the others replicate, else None."""
    shard_dims = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(shard_dims) != 1:
        return None
    p = placements[shard_dims[0]]
    return shard_dims[0] if type(p) is Shard and p.dim == 0 else None


def _padded_shape(value: DTensor, mesh_dim: int) -> tuple[int, ...]:
    rows_per_rank = -(-value.shape[0] // value.device_mesh.size(mesh_dim))  # torch.chunk's
    return (rows_per_rank * value.device_mesh.size(mesh_dim), *value.shape[1:])


def _comm_device(target: torch.Tensor) -> torch.device:
    """Where a collective can move ``target``'s bytes: its own device, or the accelerator its
    mesh (a plain tensor: the default group) runs on when it lives elsewhere, as CPU-offloaded
    shards of a CUDA mesh do (NCCL moves only device memory)."""
    if isinstance(target, DTensor):
        local, kind = target.to_local(), target.device_mesh.device_type
    else:
        local = target
        kind = "cuda" if dist.get_backend() == "nccl" else local.device.type
    if local.device.type == kind:
        return local.device
    return torch.device(kind, torch.get_device_module(kind).current_device())


class GatherBuffers:
    """One reusable gather output per device, as large as the largest padded full tensor.

    Every gather writes into the same buffer, so a walk over the whole model holds one
    gathered tensor on each device however the backend times its frees (gloo's worker thread
    may still hold the previous output when the next gather starts). A tensor returned from
    it is valid only until the next gather.
    """

    def __init__(self, values: Iterable[object]) -> None:
        self._nbytes: dict[torch.device, int] = {}
        self._buffers: dict[torch.device, torch.Tensor] = {}  # 1D uint8
        for v in values:
            if isinstance(v, DTensor) and (d := _is_plain_dim0_shard(v.placements)) is not None:
                device = _comm_device(v)  # where gather_full_tensor gathers it
                nbytes = math.prod(_padded_shape(v, d)) * v.element_size()
                self._nbytes[device] = max(self._nbytes.get(device, 0), nbytes)

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        buffer = self._buffers.get(device)
        if buffer is None:
            buffer = torch.empty(self._nbytes[device], dtype=torch.uint8, device=device)
            self._buffers[device] = buffer
        nbytes = math.prod(shape) * dtype.itemsize
        return buffer[:nbytes].view(dtype).view(shape)

    def owns(self, t: torch.Tensor) -> bool:
        buffer = self._buffers.get(t.device)
        return buffer is not None and t.untyped_storage().data_ptr() == buffer.data_ptr()


def gather_full_tensor(value: torch.Tensor, buffers: GatherBuffers | None = None) -> torch.Tensor:
    """The full tensor of ``value`` on its device: a collective over its mesh for a DTensor.

    Every rank of the DTensor's mesh must call this for the same tensor. For the FSDP layouts
    (one ``Shard(0)`` mesh dim, the others replicated, as in FSDP and HSDP) this is one
    all-gather of padded shards, in place, into one output (``buffers``' when given, else a new
    one), whose leading rows are returned as a view: that output (the full tensor plus at most
    ``world - 1`` padding rows) is the only allocation. Other layouts (tensor parallel, strided
    shards) use ``DTensor.full_tensor()``, which may hold more temporaries while it
    redistributes.
    """
    if not isinstance(value, DTensor):
        return value.detach()
    with torch.no_grad():
        mesh_dim = _is_plain_dim0_shard(value.placements)
        if mesh_dim is None:
            return value.full_tensor()
        local = value.to_local()
        mesh = value.device_mesh
        n, idx = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        shape = _padded_shape(value, mesh_dim)
        # The mesh's device: CPU-offloaded shards are copied into the slot below.
        device = _comm_device(value)
        if buffers is not None:
            out = buffers.take(shape, local.dtype, device)
        else:
            out = local.new_empty(shape, device=device)
        if out.numel() > 0:
            # In place: this rank's padded shard is written into its own slot of the output,
            # so the output is the only allocation (no padded copy of the shard).
            rows_per_rank = shape[0] // n
            slot = out.narrow(0, idx * rows_per_rank, rows_per_rank)
            slot.narrow(0, 0, local.size(0)).copy_(local)
            slot.narrow(0, local.size(0), rows_per_rank - local.size(0)).zero_()
            all_gather_single(out, slot, group=mesh.get_group(mesh_dim))
        # Rank r's chunk starts at row r * rows_per_rank in both torch.chunk and the padded
        # output, so the full tensor is the leading rows (trailing ranks hold only padding).
        return out.narrow(0, 0, value.shape[0])


def _to_kept(full: torch.Tensor, cpu_offload: bool, borrowed: bool) -> torch.Tensor:
    if cpu_offload and full.device.type != "cpu":
        return full.to("cpu")
    if borrowed or full.untyped_storage().nbytes() > full.numel() * full.element_size():
        # A view into a (reused or padded) gather output: copy the rows out, so the kept tensor
        # neither changes at the next gather nor pins the padding (which torch.save would write).
        return full.clone()
    return full


def get_full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict of a ``fully_shard``-ed model, one tensor at a time.

    Walks ``model.state_dict()`` in order (the FSDP groups in module order); each DTensor entry
    is gathered over its mesh, kept on the ranks that keep the result and dropped at once on
    the others, so no rank holds two full copies of the model and the device holds at most one
    gathered tensor beyond the sharded model (see Design note: one tensor at a time). Tied
    entries (one parameter under two names) are gathered once and share the kept tensor, as in
    ``state_dict()``. Every rank must call this (it communicates).

    Args:
        model: the root module (or any module whose state dict holds sharded DTensors).
        rank0_only: keep the result on rank 0 only; the other ranks take part in the gathers
            and return ``{}``. False gives every rank the whole state dict (world times the
            host memory).
        cpu_offload: move each gathered tensor to CPU before gathering the next, so the device
            never holds more than one; False keeps the result on the device (the whole model
            per keeping rank).

    Returns:
        ``{name: tensor}`` with plain (non-DTensor) tensors of the unsharded shapes and dtypes,
        in ``state_dict()`` order; ``{}`` on ranks that do not keep it. Entries that are whole
        on every rank already (buffers, replicated parameters) and on the requested device are
        returned as-is (aliases, as in ``state_dict()``); entries that are not tensors (extra
        state) are passed through. The model is resharded first.

    Example::

        full = get_full_state_dict(model)  # every rank calls it
        if dist.get_rank() == 0:
            torch.save(full, "model.pt")

    Differences from torch: ``torch.distributed.checkpoint.state_dict.get_model_state_dict``
    with ``full_state_dict=True`` gives the same values; its ``cpu_offload=False`` keeps the
    result on every rank, here ``rank0_only`` chooses that separately.
    """
    rank, _ = _rank_world()
    keep = rank == 0 or not rank0_only
    result: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}  # id(live tensor) -> kept full tensor, for ties
    targets = state_dict_targets(model)
    buffers = GatherBuffers(targets.values())
    for name, value in targets.items():
        if not isinstance(value, torch.Tensor):
            if keep:
                result[name] = value
            continue
        if id(value) in gathered:  # a tie: every rank skips it, so the gathers stay matched
            if keep:
                result[name] = gathered[id(value)]
            continue
        full = gather_full_tensor(value, buffers)
        if not keep:
            gathered[id(value)] = full.new_empty(0)  # only a marker
            del full  # dropped before the next gather: see Design note: one tensor at a time
            continue
        kept = _to_kept(full, cpu_offload, borrowed=buffers.owns(full))
        del full
        gathered[id(value)] = kept
        result[name] = kept
    return result


def _local_piece(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` for ``target``'s layout: a view where the layout allows."""
    if not isinstance(target, DTensor):
        return full
    mesh: DeviceMesh = target.device_mesh
    placements = target.placements
    if type(full) is not torch.Tensor:
        # A full value of another kind, e.g. a tensor-parallel DTensor from a TP-only
        # checkpoint: the state_dict part of its class's parameter kind knows how it maps onto
        # the sharded parameter's mesh (shardweave-extensions has one for TP DTensors).
        kind = PARAM_KINDS.find_for_type(type(full))
        transform = None if kind is None else kind.state_dict
        if transform is not None:
            chunked = transform.chunk(full, mesh, placements)  # a DTensor, per the Protocol
            return chunked.to_local() if isinstance(chunked, DTensor) else chunked
        if isinstance(full, DTensor):
            raise TypeError(
                f"a full state-dict value is a DTensor ({full.placements} on a "
                f"{full.device_mesh.ndim}-D mesh) and no StateDictTransform is registered for "
                "it; register the DTensor kind with one (PARAM_KINDS.register('dtensor', "
                "shardweave.extensions.dtensor_kind(state_dict=True)) for one TP mesh dim) "
                "or pass plain full tensors (DTensor.full_tensor())"
            )
    if all(isinstance(p, Replicate) or type(p) is Shard for p in placements):
        coord = mesh.get_coordinate()
        if coord is None:  # this rank is not in the mesh: it holds nothing
            return full.narrow(0, 0, 0)
        piece = full
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):  # applied left to right, as DTensor nests shards
                chunks = torch.chunk(piece, mesh.size(mesh_dim), dim=p.dim)
                idx = coord[mesh_dim]
                piece = chunks[idx] if idx < len(chunks) else piece.narrow(p.dim, 0, 0)
        return piece
    # Strided and other shard layouts: DTensor's own chunking; src_data_rank=None means no
    # communication, every rank chunks the full tensor it has.
    return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        local = target.to_local() if isinstance(target, DTensor) else target
        piece = _local_piece(full, target)
        if piece.shape != local.shape:
            raise AssertionError(
                f"piece {tuple(piece.shape)} vs local shard {tuple(local.shape)}: the "
                f"placements {getattr(target, 'placements', None)} were not understood"
            )
        local.copy_(piece)


class LoadSource(NamedTuple):
    """What a rank knows about a full state dict before loading it."""

    meta: dict[str, TensorMeta]  # every source entry, in source order
    fetch: Callable[[str], torch.Tensor]  # the full tensor of one entry (on any device)


def _check(
    api: str,
    model: nn.Module,
    targets: Mapping[str, object],
    meta: Mapping[str, TensorMeta],
    strict: bool,
    tied_aliases_optional: bool,
) -> tuple[IncompatibleKeys, str | None]:
    """Missing and unexpected keys, and the error every rank must raise (None when it loads)."""
    aliases: dict[int, list[str]] = {}
    for name, t in targets.items():
        aliases.setdefault(id(t), []).append(name)
    missing = []
    for name, t in targets.items():
        if name in meta or not isinstance(t, torch.Tensor):  # extra state: not loaded here
            continue
        if tied_aliases_optional and any(a in meta for a in aliases[id(t)]):
            continue
        missing.append(name)
    unexpected = [k for k in meta if k not in targets]
    errors = []
    if strict and unexpected:
        errors.append("Unexpected key(s): " + ", ".join(repr(k) for k in unexpected))
    if strict and missing:
        errors.append("Missing key(s): " + ", ".join(repr(k) for k in missing))
    for name, t in targets.items():
        if name in meta and isinstance(t, torch.Tensor):
            if tuple(meta[name].shape) != tuple(t.shape):
                errors.append(
                    f"size mismatch for {name!r}: the source has {tuple(meta[name].shape)}, "
                    f"the model {tuple(t.shape)}"
                )
        elif name in meta:
            errors.append(f"{name!r} is not a tensor in the model (extra state is not loaded)")
    message = None
    if errors:
        message = f"{api}: error(s) loading into {type(model).__name__}: " + "; ".join(errors)
    return IncompatibleKeys(missing, unexpected), message


def load_full_tensors(
    api: str,
    model: nn.Module,
    source: LoadSource | None,
    *,
    strict: bool,
    from_rank0: bool,
    tied_aliases_optional: bool = False,
) -> IncompatibleKeys:
    """Copy full tensors into a sharded model's local shards in place, one at a time.

    ``source`` is needed on every rank, or only on rank 0 when ``from_rank0`` (then every
    tensor is broadcast from rank 0 over the default group). See Design note: ranks agree
    before they communicate.
    """
    rank, world = _rank_world()
    targets = state_dict_targets(model)
    distributed = world > 1
    if from_rank0 and distributed:
        verdict: list[object] = [None]
        if rank == 0:
            if source is None:
                verdict[0] = (None, None, f"{api}: rank 0 passed no state dict to broadcast")
            else:
                keys, message = _check(
                    api, model, targets, source.meta, strict, tied_aliases_optional
                )
                verdict[0] = (source.meta, keys, message)
        dist.broadcast_object_list(verdict, src=0)
        meta, keys, message = verdict[0]  # type: ignore[misc]
        if message is not None:
            raise RuntimeError(message)
    else:
        if source is None:
            keys, message = IncompatibleKeys([], []), f"{api}: rank {rank} passed no state dict"
            meta = {}
        else:
            meta = source.meta
            keys, message = _check(api, model, targets, meta, strict, tied_aliases_optional)
        if distributed:
            messages: list[object] = [None] * world
            dist.all_gather_object(messages, message)
            failed = [(r, m) for r, m in enumerate(messages) if m is not None]
            if failed:
                r, m = failed[0]
                raise RuntimeError(f"{m} (found on rank {r})")
        elif message is not None:
            raise RuntimeError(message)
    assert isinstance(meta, dict)
    names_of: dict[int, list[str]] = {}  # id(live tensor) -> its names, several when tied
    for name, target in targets.items():
        names_of.setdefault(id(target), []).append(name)
    for names in names_of.values():
        target = targets[names[0]]
        present = [a for a in names if a in meta]
        if not isinstance(target, torch.Tensor) or not present:
            continue  # extra state, or missing and allowed (strict=False or a tied alias)
        key = present[0]
        if from_rank0 and distributed:
            device = _comm_device(target)
            if rank == 0:
                assert source is not None
                full = source.fetch(key).to(device).contiguous()
            else:
                full = torch.empty(meta[key].shape, dtype=meta[key].dtype, device=device)
            dist.broadcast(full, src=0)
        else:
            assert source is not None
            full = source.fetch(key)
            local = target.to_local() if isinstance(target, DTensor) else target
            if full.device != local.device:
                full = full.to(local.device)
        _copy_into(target, full)
        del full  # see Design note: one tensor at a time
    return keys


def set_full_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor] | None,
    *,
    broadcast_from_rank0: bool = False,
    strict: bool = True,
) -> IncompatibleKeys:
    """Load a full (unsharded) state dict into a ``fully_shard``-ed model, in place.

    Each rank copies its own piece of each full tensor into the live local shard (the
    parameters keep their storage, so optimizers and earlier ``state_dict()`` results still
    alias them); one full tensor at a time is on the device (see Design note: one tensor at a
    time). Every rank must call this.

    Args:
        model: the sharded model (the root, or any module whose state dict is to be loaded).
        state_dict: unsharded tensors by ``state_dict()`` name, on any device, of any dtype
            (cast on copy, as ``load_state_dict``). Only rank 0's is read when
            ``broadcast_from_rank0``; the other ranks may pass ``{}`` or ``None``.
        broadcast_from_rank0: rank 0 broadcasts each tensor over the default group, one at a
            time, so only rank 0 needs host memory for the state dict (costs one broadcast of
            the model); False reads every rank's own ``state_dict`` (no communication for the
            tensors, but every rank must hold the full dict).
        strict: missing or unexpected keys raise (as ``load_state_dict(strict=True)``); a
            tied entry needs all its names, as there. Shape mismatches always raise.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)`` (rank 0's view when broadcasting).

    Raises:
        RuntimeError: on every rank, before any tensor is sent, naming the missing, unexpected
            or mis-shaped keys (and the rank whose dict was wrong).

    Example::

        full = torch.load("model.pt") if dist.get_rank() == 0 else None
        set_full_state_dict(model, full, broadcast_from_rank0=True)

    Differences from torch: like ``set_model_state_dict(model, sd,
    options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=...))``, but the
    caller's dict is never modified, and the errors are raised on every rank.
    """
    source = None
    if state_dict is not None and (not broadcast_from_rank0 or _rank_world()[0] == 0):
        sd = state_dict
        meta = {
            k: TensorMeta(v.dtype, tuple(v.shape))
            for k, v in sd.items()
            if isinstance(v, torch.Tensor)
        }
        source = LoadSource(meta, lambda k: sd[k])
    return load_full_tensors(
        "set_full_state_dict", model, source, strict=strict, from_rank0=broadcast_from_rank0
    )
