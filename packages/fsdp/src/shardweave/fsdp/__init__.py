"""shardweave.fsdp: fully sharded data parallelism on our own engine, torch's FSDP2 API.

Switching from torch is one import::

    from shardweave.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy
"""

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
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from shardweave.fsdp._version import __version__
from shardweave.fsdp.checkpoint._full_state_dict import (
    IncompatibleKeys,
    get_full_state_dict,
    set_full_state_dict,
)
from shardweave.fsdp.checkpoint._safetensors import load_safetensors, save_safetensors
from shardweave.fsdp.faults._consistency import FSDPConsistencyError
from shardweave.fsdp.faults._failures import (
    CollectiveMismatchError,
    PeerExitedError,
    PeerFailureError,
    PeerIdleError,
    failure_guard,
)
from shardweave.fsdp.faults._watchdog import set_idle_timeout, set_stall_timeout
from shardweave.fsdp.tracing._recorder import CollectiveRecord, MemoryRecord, SpanRecord, StepRecord
from shardweave.fsdp.tracing._report import FSDPTracer, trace
from shardweave.mesh import DataParallelMeshDims

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "CollectiveMismatchError",
    "CollectiveRecord",
    "Comm",
    "DataParallelMeshDims",
    "FSDPConsistencyError",
    "FSDPModule",
    "FSDPTracer",
    "GradientReductionHandle",
    "IncompatibleKeys",
    "MemoryRecord",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "PeerExitedError",
    "PeerFailureError",
    "PeerIdleError",
    "ReduceScatter",
    "ShardPlacementResult",
    "SpanRecord",
    "StepRecord",
    "UnshardHandle",
    "__version__",
    "failure_guard",
    "fully_shard",
    "get_full_state_dict",
    "load_safetensors",
    "register_fsdp_forward_method",
    "save_safetensors",
    "set_full_state_dict",
    "set_idle_timeout",
    "set_stall_timeout",
    "share_comm_ctx",
    "trace",
]
