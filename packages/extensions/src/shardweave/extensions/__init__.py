"""shardweave.extensions: plugins that extend the shardweave FSDP engine.

Installed, this package registers (through entry points, see its ``pyproject.toml``):

* ``shardweave.param_kinds`` / ``dtensor``: :func:`dtensor_kind`, the DTensor parameter kind
  whose handler, :class:`DTensorParamHandler`, lets ``fully_shard`` and ``replicate`` accept
  DTensor parameters from ``parallelize_module`` (FSDP x TP on a ``(dp, tp)`` mesh,
  ``_StridedShard`` where both shard one dim).

and, as an example of torch's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` protocol (which
the engine supports on any tensor that defines it), :func:`all_gather_in_dtype`: all-gather
parameters in a lower precision and restore the compute dtype.

State-dict helpers for tensor-parallel tensors under data parallelism (the jobs of torch's
``torch.distributed.tensor.parallel.fsdp``): :func:`chunk_dtensor` / :func:`all_gather_dtensor`
between TP-only DTensors and (dp, tp) DTensors, :func:`chunk_tensor` /
:func:`pre_load_state_dict_transform` for ``ShardedTensor`` state dicts, and
:class:`DTensorStateDictTransform`, a ``StateDictTransform`` you may add to the DTensor kind
yourself (``dtensor_kind(state_dict=True)``).

Still to come: ``dp_mesh_dims`` SPMD meshes.
"""

from shardweave.extensions._version import __version__
from shardweave.extensions.all_gather import all_gather_in_dtype
from shardweave.extensions.state_dict import (
    DTensorStateDictTransform,
    all_gather_dtensor,
    chunk_dtensor,
    chunk_tensor,
    pre_load_state_dict_transform,
)
from shardweave.extensions.tensor_parallel import DTensorParamHandler, dtensor_kind

__all__ = [
    "DTensorParamHandler",
    "DTensorStateDictTransform",
    "__version__",
    "all_gather_dtensor",
    "all_gather_in_dtype",
    "chunk_dtensor",
    "chunk_tensor",
    "dtensor_kind",
    "pre_load_state_dict_transform",
]
