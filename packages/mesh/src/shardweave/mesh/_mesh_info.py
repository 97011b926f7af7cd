"""Which mesh dims a data-parallel engine shards and replicates over, with their process groups,
and ``DataParallelMeshDims``, the names of those dims in a full SPMD mesh.

Design note: mesh info vocabulary
    *shard* dim: parameters are split across its ranks (FSDP); gradients are reduce-scattered
    over its process group. *replicate* dim: every rank holds the same values (DDP);
    gradients are all-reduced over it. HSDP has both, replicate first: ``(replicate, shard)``.
    ``dp_mesh_dims`` is set when ``mesh`` is the data-parallel part of a larger SPMD mesh
    (``spmd_mesh``) whose other dims (tensor parallel, ...) the engine leaves to DTensor.

The field names and meanings follow torch's FSDP2 so that code written against its mesh infos
reads the same here. Construction errors are ``AssertionError`` (internal invariants, as torch);
user-facing validation with ``ValueError`` lives in ``resolve_mesh_info``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DDPMeshInfo",
    "DataParallelMeshDims",
    "DataParallelMeshInfo",
    "FSDPMeshInfo",
    "HSDPMeshInfo",
]


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Names the data-parallel dims of a full SPMD mesh whose parameters are already DTensors.

    Args:
        shard: mesh dim name(s) that parameters are sharded over; several names are flattened
            into one shard dim (one process group over their product).
        replicate: mesh dim name(s) that parameters are replicated over (HSDP's outer dim, or
            DDP when ``shard`` is None); several names are flattened likewise.

    At least one must be set. Example::

        mesh = init_device_mesh("cuda", (2, 4, 8), mesh_dim_names=("dp_rep", "dp_shard", "tp"))
        DataParallelMeshDims(shard="dp_shard", replicate="dp_rep")
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims: set at least one of shard= or replicate= "
                "(e.g. DataParallelMeshDims(shard='dp'))"
            )
        for role in ("shard", "replicate"):
            value = getattr(self, role)
            if value is None or isinstance(value, str):
                continue
            if not isinstance(value, (tuple, list)) or not all(isinstance(n, str) for n in value):
                raise TypeError(
                    f"DataParallelMeshDims: {role}= takes a mesh dim name (str) or a tuple of "
                    f"names, got {value!r}; use the names from the mesh's mesh_dim_names, e.g. "
                    f"DataParallelMeshDims({role}='dp')"
                )
            if not value:
                raise ValueError(
                    f"DataParallelMeshDims: {role}=() names no dim; give at least one mesh dim "
                    f"name, or leave {role}=None"
                )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass
class DataParallelMeshInfo:
    """The data-parallel view of a mesh: which of its dims shard and which replicate.

    The engine and the ``ParamHandler`` plugins receive one of the three subclasses below;
    test which with ``isinstance`` (an ``HSDPMeshInfo`` is both an ``FSDPMeshInfo`` and a
    ``DDPMeshInfo``).

    Example::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))
        info = resolve_mesh_info(mesh)  # an HSDPMeshInfo
        info.shard_mesh_dim, info.replicate_mesh_dim  # (1, 0)
        info.is_spmd_mesh  # False: no dp_mesh_dims, so `mesh` is all data parallel
    """

    mesh: DeviceMesh
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None
    dp_mesh_dims: DataParallelMeshDims | None = None
    # The full SPMD mesh (data-parallel and, say, tensor-parallel dims) that parameters are
    # distributed on; None when ``mesh`` is a plain data-parallel mesh.
    spmd_mesh: DeviceMesh | None = field(default=None, repr=False)
    is_spmd_mesh: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.shard_mesh_dim is None and self.replicate_mesh_dim is None:
            raise AssertionError(
                "DataParallelMeshInfo needs shard_mesh_dim or replicate_mesh_dim (got neither)"
            )
        self.is_spmd_mesh = self.dp_mesh_dims is not None


@dataclass
class FSDPMeshInfo(DataParallelMeshInfo):
    """Parameters sharded over ``mesh[shard_mesh_dim]``.

    Each rank keeps ``1/shard_mesh_size`` of every parameter (the least memory of the three
    layouts) and pays an all-gather per unshard and a reduce-scatter per backward over
    ``shard_process_group``. ``resolve_mesh_info`` builds it for a 1-D mesh; build one
    yourself to put some parameters on another mesh (``ShardPlacementResult``).

    Example::

        info = FSDPMeshInfo(init_device_mesh("cuda", (8,)), shard_mesh_dim=0)
        info.shard_mesh_size, info.shard_mesh_rank  # (8, this rank's index in the mesh)
        info.shard_process_group  # the group of its all-gathers and reduce-scatters
    """

    shard_mesh_size: int = field(default=0, init=False)
    shard_mesh_rank: int = field(default=0, init=False)
    shard_process_group: dist.ProcessGroup = field(init=False, repr=False)
    # Reduce-scatter shares the shard group unless a separate group is requested
    # (FSDPModule.set_separate_reduce_scatter_group), so it can overlap the all-gather.
    reduce_scatter_process_group: dist.ProcessGroup | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shard_mesh_dim is None:
            raise AssertionError("FSDPMeshInfo needs a shard_mesh_dim")
        self.shard_mesh_size = self.mesh.size(self.shard_mesh_dim)
        self.shard_process_group = self.mesh.get_group(self.shard_mesh_dim)
        self.shard_mesh_rank = self.mesh.get_local_rank(self.shard_mesh_dim)


@dataclass
class DDPMeshInfo(DataParallelMeshInfo):
    """Parameters replicated over ``mesh[replicate_mesh_dim]``.

    Every rank holds whole parameters (the most memory) and gradients are all-reduced over
    ``replicate_process_group``; no all-gathers run. ``replicate()`` uses this layout.

    Example::

        info = DDPMeshInfo(init_device_mesh("cuda", (8,)), replicate_mesh_dim=0)
        info.replicate_mesh_size, info.replicate_mesh_rank  # (8, this rank's index)
        dist.all_reduce(grad, group=info.replicate_process_group)
    """

    replicate_mesh_size: int = field(default=0, init=False)
    replicate_mesh_rank: int = field(default=0, init=False)
    replicate_process_group: dist.ProcessGroup = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.replicate_mesh_dim is None:
            raise AssertionError("DDPMeshInfo needs a replicate_mesh_dim")
        self.replicate_mesh_size = self.mesh.size(self.replicate_mesh_dim)
        self.replicate_process_group = self.mesh.get_group(self.replicate_mesh_dim)
        self.replicate_mesh_rank = self.mesh.get_local_rank(self.replicate_mesh_dim)


@dataclass
class HSDPMeshInfo(FSDPMeshInfo, DDPMeshInfo):
    """Sharded over the shard dim and replicated over the replicate dim (hybrid sharding).

    All-gathers and reduce-scatters stay within a shard group (e.g. one node), at the cost of
    ``replicate_mesh_size`` times the parameter memory of plain FSDP over every rank, plus an
    all-reduce of the sharded gradients across replicas.

    Example::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))
        info = resolve_mesh_info(mesh)  # HSDPMeshInfo(shard_mesh_dim=1, replicate_mesh_dim=0)
        info.shard_mesh_size, info.replicate_mesh_size  # (4, 2)
        assert isinstance(info, FSDPMeshInfo) and isinstance(info, DDPMeshInfo)
    """

    def __post_init__(self) -> None:
        # MRO: FSDPMeshInfo -> DDPMeshInfo -> DataParallelMeshInfo, each runs once.
        super().__post_init__()
