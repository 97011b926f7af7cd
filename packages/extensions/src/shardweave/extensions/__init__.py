"""shardweave.extensions: plugins that extend the shardweave FSDP engine.

Installed, this package registers (through entry points, see its ``pyproject.toml``):

* ``shardweave.param_handling`` / ``dtensor``: :class:`DTensorParamHandler`, so ``fully_shard``
  and ``replicate`` accept DTensor parameters from ``parallelize_module`` (FSDP x TP on a
  ``(dp, tp)`` mesh, ``_StridedShard`` where both shard one dim).

and, as an example of torch's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` protocol (which
the engine supports on any tensor that defines it), :func:`all_gather_in_dtype`: all-gather
parameters in a lower precision and restore the compute dtype.

Still to come: TP-aware state-dict helpers and ``dp_mesh_dims`` SPMD meshes.
"""

from shardweave.extensions._version import __version__
from shardweave.extensions.all_gather import all_gather_in_dtype
from shardweave.extensions.tensor_parallel import DTensorParamHandler

__all__ = ["DTensorParamHandler", "__version__", "all_gather_in_dtype"]
