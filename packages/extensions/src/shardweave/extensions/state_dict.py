"""State-dict helpers for tensor-parallel parameters under data parallelism (FSDP x TP).

The jobs torch's FSDP1 hands to ``torch.distributed.tensor.parallel.fsdp`` (its
``DTensorExtensions``), rewritten for shardweave without importing any FSDP module:

* :func:`chunk_tensor`: this rank's data-parallel chunk of a tensor as a ``ShardedTensor``
  (the legacy sharded-state-dict format), nested inside the TP shard for TP tensors.
* :func:`pre_load_state_dict_transform`: the inverse unwrapping before a load.
* :func:`chunk_dtensor`: a TP DTensor (or a plain tensor) to a DTensor on the whole
  (dp, tp) mesh, the format FSDP2 itself uses for sharded state dicts.
* :func:`all_gather_dtensor`: back from the (dp, tp) DTensor to the TP-only DTensor.
* :class:`DTensorStateDictTransform`: the two DTensor directions as the state-dict part of
  the DTensor ``ParamKind`` (``StateDictTransform`` protocol).

Mesh convention (as torch's): the tensor-parallel dim is the *last* dim of the root mesh and
the data-parallel shard dim is the one before it (HSDP: ``(replicate, shard, tp)``).

Design note: strided sharding (state dicts)
    When TP shards tensor dim 0 (``ColwiseParallel``) and FSDP shards dim 0 of the TP-local
    tensor, rank (dp=i, tp=j) holds chunk i of TP chunk j. :func:`chunk_dtensor` records that
    as ``_StridedShard(0, split_factor=tp)`` on the data-parallel dim, exactly the layout of
    FSDP2's (and shardweave's) sharded parameters, so a chunked state dict loads into a
    model's own ``state_dict()`` entries without a redistribute.

Differences from torch:
    * :func:`chunk_dtensor` on a TP tensor sharded on dim 0 returns
      ``(_StridedShard(0, split_factor=tp), Shard(0))`` where torch returns
      ``(Shard(0), Shard(0))``: both have the same ``full_tensor()``, but torch's local rows
      are not FSDP2's (see Design note: strided sharding (state dicts)). Other placements
      give torch's placements and bitwise-equal local tensors.
    * :func:`chunk_dtensor` passes the global shape to the DTensor it builds, so TP tensors
      that TP shards unevenly work; torch infers the shape from the local tensor, which
      differs across TP ranks there, and its redistribute hangs or aborts.
    * :func:`all_gather_dtensor` returns the TP DTensor; torch returns its local tensor
      (``result.to_local()`` here) and rewraps it later. A mesh mismatch raises
      ``ValueError`` (torch: a bare ``AssertionError``).
    * :func:`chunk_tensor` on a TP DTensor names global ranks in the ``ShardedTensor``
      metadata, each TP shard placed on the rank that holds it, with offsets following
      ``torch.chunk``; torch writes TP-group ranks (so it fails on every TP group but the one
      holding global ranks 0..tp-1) and floor-divided offsets (wrong when uneven).
    * Local ``Shard`` metadata names the global rank; torch writes the ``rank`` argument (the
      rank in ``pg``), which disagrees with its own global metadata.
    * Placement devices come from ``device`` or the tensor's device; torch ignores ``device``
      and asks ``pg`` for its default device (deprecated in c10d).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard as ShardedTensorShard
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = [
    "DTensorStateDictTransform",
    "all_gather_dtensor",
    "chunk_dtensor",
    "chunk_tensor",
    "pre_load_state_dict_transform",
]


def chunk_tensor(
    tensor: torch.Tensor,
    rank: int,
    world_size: int,
    num_devices_per_node: int,
    pg: dist.ProcessGroup,
    device: torch.device | None = None,
) -> ShardedTensor:
    """This rank's dim-0 chunk of ``tensor`` for a ``ShardedTensor`` sharded state dict.

    No communication: every rank already holds ``tensor`` (unsharded over data parallelism)
    and keeps its own ``torch.chunk(tensor, world_size)[rank]``. Ranks past the last
    non-empty chunk hold no local shard.

    * plain tensor: a chunk-sharded ``ShardedTensor`` over ``pg``.
    * ``ShardedTensor`` with one local shard: a ``ShardedTensor`` with the same global
      metadata whose local shard is itself the chunk-sharded ``ShardedTensor`` of that
      shard's data (nested; :func:`pre_load_state_dict_transform` unwraps it).
    * DTensor on a 1-D TP mesh (``Shard`` or ``Replicate``): the same nesting, the outer
      ``ShardedTensor`` over the TP group with one shard per TP rank.

    Args:
        tensor: the unsharded (over ``pg``) tensor, e.g. a gathered parameter.
        rank: this rank's index in ``pg``.
        world_size: ``pg``'s size, the number of chunks.
        num_devices_per_node: accelerators per host, for the ``rank:r/cuda:k`` placement
            strings (``k = r % num_devices_per_node``); unused on CPU.
        pg: the data-parallel process group the chunks are spread over.
        device: the device named in the metadata; by default the tensor's.

    Returns:
        A ``ShardedTensor`` whose local shard is a copy (it never aliases ``tensor``), with
        ``requires_grad=False``.

    Example::

        st = chunk_tensor(full, dp_mesh.get_local_rank(), 2, 1, dp_mesh.get_group())
        st.local_shards()[0].tensor  # full.chunk(2)[dp rank]
    """
    if isinstance(tensor, ShardedTensor):
        return _chunk_sharded_tensor(tensor, rank, world_size, num_devices_per_node, pg, device)
    if isinstance(tensor, DTensor):
        return _chunk_tp_dtensor(tensor, rank, world_size, num_devices_per_node, pg, device)
    device_type = (device or tensor.device).type
    return _chunk_sharded(tensor, rank, world_size, num_devices_per_node, pg, device_type)


def pre_load_state_dict_transform(
    tensor: torch.Tensor,
) -> tuple[torch.Tensor, list[ShardedTensorShard]]:
    """Unwrap a :func:`chunk_tensor` result for loading: ``(tensor, its local shards)``.

    A nested ``ShardedTensor`` (one local shard that is itself a ``ShardedTensor``) gives
    the inner one and *its* local shards, i.e. the data-parallel chunk this rank loads.

    Args:
        tensor: a ``ShardedTensor`` from a sharded state dict.

    Returns:
        The (inner) ``ShardedTensor`` and its local shards (empty when this rank has none).

    Example::

        st, shards = pre_load_state_dict_transform(chunk_tensor(dt, r, 2, 1, dp_pg))
        shards[0].tensor  # this rank's chunk of dt's TP-local tensor
    """
    if not isinstance(tensor, ShardedTensor):
        raise TypeError(
            "pre_load_state_dict_transform: expected a ShardedTensor (from chunk_tensor), "
            f"got {type(tensor).__name__}; DTensor state dicts need no unwrapping"
        )
    shards = tensor.local_shards()
    if len(shards) == 1 and isinstance(inner := shards[0].tensor, ShardedTensor):
        return inner, list(inner.local_shards())
    return tensor, list(shards)


def chunk_dtensor(tensor: torch.Tensor, rank: int, device_mesh: DeviceMesh) -> DTensor:
    """``tensor`` as a DTensor on the (dp, tp) root mesh, chunked on dim 0 over dp.

    No communication: the chunk is cut from the data this rank already holds.

    * TP DTensor (1-D TP mesh = the root's last dim): placements
      ``(Replicate(), ..., dp, tp_placement)`` where ``dp`` is ``Shard(0)``, or
      ``_StridedShard(0, split_factor=tp)`` when TP also shards dim 0 (see Design note:
      strided sharding (state dicts)); the local tensor is chunk ``dp rank`` of the TP-local
      tensor, as in FSDP2's sharded parameters.
    * plain tensor (a layer TP left alone): ``(Shard(0), Replicate(), ...)``.

    Args:
        tensor: the TP DTensor or plain tensor, unsharded over data parallelism.
        rank: unused (the mesh knows this rank's coordinate); kept for torch's signature.
        device_mesh: the data-parallel mesh or the root mesh; the result lives on its root
            mesh, which must have at least 2 dims.

    Returns:
        A detached DTensor with ``full_tensor()`` equal to the input's (global) value.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        w = distribute_tensor(torch.randn(8, 4), mesh["tp"], [Shard(0)])
        sharded = chunk_dtensor(w, rank, mesh["dp"])  # (_StridedShard(0, sf=2), Shard(0))
    """
    del rank  # the mesh coordinate is authoritative
    root = device_mesh._get_root_mesh()
    if root.ndim < 2:
        raise RuntimeError(
            f"chunk_dtensor: the root mesh of {device_mesh} has {root.ndim} dim(s); pass a "
            "data-parallel mesh sliced from a 2-D (dp, tp) or 3-D (replicate, shard, tp) mesh"
        )
    coord = _coordinate(root, "chunk_dtensor")
    placements: list[Placement] = [Replicate()] * root.ndim
    if not isinstance(tensor, DTensor):
        _require_dims(tensor, "chunk_dtensor")
        placements[0] = Shard(0)
        local = _dim_chunk(tensor.detach(), 0, root.size(0), coord[0])
        return _wrap(local, root, placements, tensor)
    tp_placement = _tp_placement(tensor, "chunk_dtensor")
    _require_dims(tensor, "chunk_dtensor")
    _check_tp_is_last_dim(root, coord, tensor.device_mesh)
    dp_dim = root.ndim - 2
    dp_size = root.size(dp_dim)
    if isinstance(tp_placement, Shard) and tp_placement.dim == 0:
        # see Design note: strided sharding (state dicts)
        placements[dp_dim] = _StridedShard(0, split_factor=tensor.device_mesh.size())
    else:
        placements[dp_dim] = Shard(0)
    placements[-1] = tp_placement
    local = _dim_chunk(tensor.to_local().detach(), 0, dp_size, coord[dp_dim])
    return _wrap(local, root, placements, tensor)


def all_gather_dtensor(tensor: DTensor, parent_mesh: DeviceMesh | None) -> DTensor:
    """The TP-only DTensor from a (dp, tp) DTensor: all-gathers every mesh dim but the last.

    A collective over the data-parallel group(s): every rank of ``tensor``'s mesh must call
    it. The inverse of :func:`chunk_dtensor` (bitwise: gathering moves data, never adds).

    Args:
        tensor: a DTensor on the root (dp, tp) mesh, e.g. an FSDP2 ``state_dict()`` value of
            a TP parameter; ``Shard``, ``_StridedShard`` or ``Replicate`` on the dp dims.
        parent_mesh: ``tensor``'s mesh, passed for the check that the caller and the
            tensor agree on it (torch's signature).

    Returns:
        A DTensor on the last mesh dim's 1-D submesh with ``tensor``'s last placement and
        global shape; ``.to_local()`` is what torch's helper returns.

    Example::

        tp_w = all_gather_dtensor(model.state_dict()["w"], mesh)  # placements (Shard(0),)
    """
    mesh = tensor.device_mesh
    if parent_mesh != mesh:
        raise ValueError(
            f"all_gather_dtensor: parent_mesh {parent_mesh} is not the tensor's mesh {mesh}; "
            "pass tensor.device_mesh (the root (dp, tp) mesh)"
        )
    if mesh.ndim < 2:
        raise ValueError(
            f"all_gather_dtensor: expected a DTensor on a (dp, tp) mesh, got a {mesh.ndim}-D "
            "mesh; a 1-D data-parallel DTensor's full_tensor() is already the whole value"
        )
    tp_placement = tensor.placements[-1]
    target = [*([Replicate()] * (mesh.ndim - 1)), tp_placement]
    local = _wait(tensor.redistribute(mesh, target).to_local())
    return DTensor.from_local(
        local,
        _last_dim_submesh(mesh),
        (tp_placement,),
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )


class DTensorStateDictTransform:
    """``StateDictTransform`` for tensor-parallel DTensor parameters (FSDP x TP).

    ``chunk`` cuts this rank's piece of the unsharded TP parameter for the sharded
    parameter's ``mesh`` / ``placements`` (those of ``ParamHandler.sharded_spec``); ``gather``
    is :func:`all_gather_dtensor` on the sharded DTensor's own mesh.

    Not part of the DTensor kind the entry point registers: ``gather`` cannot tell the
    data-parallel mesh dims from the TP ones, and assumes, as torch's helper does, that only
    the last dim is TP. That is wrong for 2-D TP/EP parameters and for ``dp_mesh_dims`` SPMD
    meshes, so register the kind with it yourself
    (``PARAM_KINDS.register("dtensor", dtensor_kind(state_dict=True))``) only for models with
    one TP mesh dim. Registered, it lets ``shardweave.fsdp.set_full_state_dict`` load a
    TP-only checkpoint (TP DTensor values) into FSDP x TP parameters.

    Example::

        transform = DTensorStateDictTransform()
        param = block.w1.weight  # (_StridedShard(dim=0, sf=4), Shard(dim=0)) on (dp, tp)
        sharded = transform.chunk(tp_weight, param.device_mesh, param.placements)  # local
        back = transform.gather(sharded)  # a collective over the (dp, tp) mesh
        assert torch.equal(back.full_tensor(), tp_weight.full_tensor())
    """

    handled_type: type = DTensor

    def chunk(
        self, full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
    ) -> torch.Tensor:
        """This rank's chunk of ``full`` (TP DTensor or plain global tensor) on ``mesh``."""
        if not isinstance(full, DTensor):
            # A plain full tensor: every rank holds it, so cut locally (no scatter).
            return distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
        n_tp = full.device_mesh.ndim
        if mesh.ndim <= n_tp or tuple(placements[-n_tp:]) != tuple(full.placements):
            raise ValueError(
                f"DTensorStateDictTransform.chunk: placements {placements} on a {mesh.ndim}-D "
                f"mesh do not end with the parameter's TP placements {full.placements}; pass "
                "the mesh and placements of its sharded parameter"
            )
        coord = _coordinate(mesh, "DTensorStateDictTransform.chunk")
        local = full.to_local().detach()
        for i, p in enumerate(placements[: mesh.ndim - n_tp]):
            if isinstance(p, (Shard, _StridedShard)):
                # Data-parallel dims shard the TP-local tensor (what _StridedShard encodes).
                local = _dim_chunk(local, p.dim, mesh.size(i), coord[i])
            elif not isinstance(p, Replicate):
                raise NotImplementedError(
                    f"DTensorStateDictTransform.chunk: data-parallel placement {p} on mesh "
                    f"dim {i}; expected Shard, _StridedShard or Replicate"
                )
        return _wrap(local, mesh, placements, full)

    def gather(self, sharded: torch.Tensor) -> torch.Tensor:
        """The TP DTensor from the sharded DTensor (a collective over its mesh)."""
        if not isinstance(sharded, DTensor):
            raise TypeError(
                f"DTensorStateDictTransform.gather: expected a DTensor, got {type(sharded).__name__}"
            )
        return all_gather_dtensor(sharded, sharded.device_mesh)


def _chunk_sharded(
    tensor: torch.Tensor,
    rank: int,
    world_size: int,
    num_devices_per_node: int,
    pg: dist.ProcessGroup,
    device_type: str,
) -> ShardedTensor:
    """A plain tensor as a dim-0 chunk-sharded ``ShardedTensor`` over ``pg``, without comms."""
    _require_dims(tensor, "chunk_tensor")
    chunks = tensor.chunk(world_size, dim=0)  # torch.chunk: ceil-sized, may be fewer
    starts = itertools.accumulate((c.size(0) for c in chunks[:-1]), initial=0)
    trailing = [0] * (tensor.dim() - 1)
    shards_md = [
        ShardMetadata(
            shard_offsets=[start, *trailing],
            shard_sizes=list(chunk.size()),
            placement=_placement_str(
                dist.get_global_rank(pg, r), device_type, num_devices_per_node
            ),
        )
        for r, (start, chunk) in enumerate(zip(starts, chunks, strict=True))
    ]
    local_shards: list[ShardedTensorShard] = []
    if rank < len(chunks):
        local = chunks[rank].detach().clone(memory_format=torch.contiguous_format)
        local_md = ShardMetadata(
            shard_offsets=list(shards_md[rank].shard_offsets),
            shard_sizes=list(local.size()),
            placement=f"rank:{dist.get_global_rank(pg, rank)}/{local.device}",
        )
        local_shards.append(ShardedTensorShard(local, local_md))
    meta = ShardedTensorMetadata(
        shards_metadata=shards_md,
        size=tensor.size(),
        tensor_properties=TensorProperties(
            dtype=tensor.dtype,
            layout=tensor.layout,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=tensor.is_pinned(),
        ),
    )
    return _sharded_tensor(local_shards, meta, pg)


def _chunk_sharded_tensor(
    tensor: ShardedTensor,
    rank: int,
    world_size: int,
    num_devices_per_node: int,
    pg: dist.ProcessGroup,
    device: torch.device | None,
) -> ShardedTensor:
    """Nest the data-parallel chunking inside the single local shard of ``tensor``."""
    outer_shards = tensor.local_shards()
    if len(outer_shards) != 1:
        raise ValueError(
            f"chunk_tensor: a ShardedTensor input must have exactly 1 local shard on each rank, "
            f"this rank has {len(outer_shards)}; reshard it to one shard per rank first"
        )
    outer = outer_shards[0]
    device_type = (device or outer.tensor.device).type
    inner = _chunk_sharded(outer.tensor, rank, world_size, num_devices_per_node, pg, device_type)
    meta = copy.deepcopy(tensor.metadata())
    meta.tensor_properties.requires_grad = False
    shard = ShardedTensorShard(inner, copy.deepcopy(outer.metadata))
    return _sharded_tensor([shard], meta, tensor._process_group)


def _chunk_tp_dtensor(
    tensor: DTensor,
    rank: int,
    world_size: int,
    num_devices_per_node: int,
    pg: dist.ProcessGroup,
    device: torch.device | None,
) -> ShardedTensor:
    """Nest the data-parallel chunking inside this rank's TP shard of a 1-D TP DTensor."""
    tp_mesh = tensor.device_mesh
    if tp_mesh.ndim != 1:
        raise NotImplementedError(
            f"chunk_tensor: DTensors on a {tp_mesh.ndim}-D mesh are not supported; use "
            "chunk_dtensor (DTensor state dicts) for multi-dim TP meshes"
        )
    placement = _tp_placement(tensor, "chunk_tensor")
    local_tp = tensor.to_local()
    device_type = (device or local_tp.device).type
    inner = _chunk_sharded(local_tp, rank, world_size, num_devices_per_node, pg, device_type)
    tp_pg = tp_mesh.get_group()
    tp_rank = tp_mesh.get_local_rank()
    size = list(tensor.size())
    boxes: list[tuple[list[int], list[int]]] = []
    # Each TP shard is placed on the global rank that holds it, so exactly one entry is ours.
    owners = [dist.get_global_rank(tp_pg, i) for i in range(tp_mesh.size())]
    if isinstance(placement, Shard):
        n, parts = size[placement.dim], tp_mesh.size()
        step = math.ceil(n / parts)  # torch.chunk sizes, as DTensor's Shard uses
        for i in range(parts):
            offsets, sizes = [0] * len(size), list(size)
            offsets[placement.dim] = min(i * step, n)
            sizes[placement.dim] = max(0, min(step, n - i * step))
            boxes.append((offsets, sizes))
    else:  # Replicate: every TP rank holds the whole tensor; each lists only its own copy
        boxes.append(([0] * len(size), size))
        owners, tp_rank = [dist.get_rank()], 0
    shards_md = [
        ShardMetadata(
            shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{r}/{local_tp.device}"
        )
        for (offsets, sizes), r in zip(boxes, owners, strict=True)
    ]
    meta = ShardedTensorMetadata(
        shards_metadata=shards_md,
        size=tensor.size(),
        tensor_properties=TensorProperties(
            dtype=tensor.dtype, layout=tensor.layout, requires_grad=False
        ),
    )
    shard = ShardedTensorShard(inner, copy.deepcopy(shards_md[tp_rank]))
    return _sharded_tensor([shard], meta, tp_pg)


def _sharded_tensor(
    local_shards: list[ShardedTensorShard],
    meta: ShardedTensorMetadata,
    pg: dist.ProcessGroup | None,
) -> ShardedTensor:
    # The global metadata is built identically on every rank, so the communication-free
    # constructor is enough; init_from_local_shards would all-gather it only to check.
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=meta, process_group=pg, init_rrefs=False
    )


def _placement_str(global_rank: int, device_type: str, num_devices_per_node: int) -> str:
    if device_type == "cpu":
        return f"rank:{global_rank}/cpu"
    return f"rank:{global_rank}/{device_type}:{global_rank % num_devices_per_node}"


def _dim_chunk(tensor: torch.Tensor, dim: int, num_chunks: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``torch.chunk(tensor, num_chunks, dim)`` as a contiguous copy.

    Ranks past the last chunk get an empty tensor, as DTensor's ``Shard`` gives them.
    """
    chunks = torch.chunk(tensor, num_chunks, dim=dim)
    piece = chunks[index] if index < len(chunks) else tensor.narrow(dim, tensor.size(dim), 0)
    return piece.clone(memory_format=torch.contiguous_format)


def _wrap(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], like: torch.Tensor
) -> DTensor:
    # The global shape comes from the input: inferring it from an unevenly chunked local
    # tensor would give each rank a different shape.
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _tp_placement(tensor: DTensor, api: str) -> Placement:
    if tensor.device_mesh.ndim != 1:
        raise NotImplementedError(
            f"{api}: expected a DTensor on a 1-D tensor-parallel mesh, got placements "
            f"{tensor.placements}; multi-dim TP meshes are not supported"
        )
    placement = tensor.placements[0]
    if isinstance(placement, (_StridedShard, Partial)) or not isinstance(
        placement, (Shard, Replicate)
    ):
        raise NotImplementedError(
            f"{api}: TP placement {placement} is not supported; redistribute the DTensor to "
            "Shard(d) or Replicate() first"
        )
    return placement


def _require_dims(tensor: torch.Tensor, api: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{api}: cannot chunk a 0-dim tensor on dim 0; keep scalars replicated")


def _coordinate(mesh: DeviceMesh, api: str) -> list[int]:
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"{api}: this rank ({dist.get_rank()}) is not part of {mesh}")
    return list(coord)


def _check_tp_is_last_dim(root: DeviceMesh, coord: Sequence[int], tp_mesh: DeviceMesh) -> None:
    row = root.mesh[tuple(coord[:-1])].tolist()
    if row != tp_mesh.mesh.flatten().tolist():
        raise ValueError(
            f"chunk_dtensor: the DTensor's TP mesh {tp_mesh} is not the last dim of the root "
            f"mesh {root} (ranks {row} here); build the TP mesh as root[<last dim name>]"
        )


def _last_dim_submesh(mesh: DeviceMesh) -> DeviceMesh:
    names = mesh.mesh_dim_names
    if names is not None:
        return mesh[names[-1]]
    return DeviceMesh.from_group(mesh.get_group(mesh.ndim - 1), mesh.device_type)


def _wait(local: torch.Tensor) -> torch.Tensor:
    wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor from the redistribute
    if callable(wait):
        waited = wait()
        assert isinstance(waited, torch.Tensor)
        return waited
    return local
