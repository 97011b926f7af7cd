"""shardweave.fsdp: fully sharded data parallelism on our own engine, torch's FSDP2 API.

Switching from torch is one import::

    from shardweave.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy
"""

from shardweave.fsdp._consistency import FSDPConsistencyError
from shardweave.fsdp._fsdp_api import (
    AllGather,
    Comm,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReduceScatter,
)
from shardweave.fsdp._fsdp_common import ShardPlacementResult
from shardweave.fsdp._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from shardweave.fsdp._version import __version__
from shardweave.mesh import DataParallelMeshDims

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "DataParallelMeshDims",
    "FSDPConsistencyError",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "ShardPlacementResult",
    "UnshardHandle",
    "__version__",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
