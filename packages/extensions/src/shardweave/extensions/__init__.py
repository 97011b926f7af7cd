"""shardweave.extensions: plugins that extend the shardweave FSDP engine.

Installed, this package registers (through entry points, see its ``pyproject.toml``):

* ``shardweave.param_handling`` / ``dtensor``: :class:`DTensorParamHandler`, so ``fully_shard``
  and ``replicate`` accept DTensor parameters from ``parallelize_module`` (FSDP x TP on a
  ``(dp, tp)`` mesh, ``_StridedShard`` where both shard one dim).

Still to come: the tensor-subclass all-gather protocol and TP-aware state-dict helpers.
"""

from shardweave.extensions._version import __version__
from shardweave.extensions.tensor_parallel import DTensorParamHandler

__all__ = ["DTensorParamHandler", "__version__"]
