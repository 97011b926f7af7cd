"""shardweave.replicate: data parallelism (DDP semantics) built on the shardweave FSDP engine.

``replicate(module)`` keeps a full copy of the parameters on every rank and all-reduces the
gradients, with the API of torch 2.13's ``replicate`` (the FSDP-engine one); the result is also
an ``FSDPModule``, so gradient-sync, prefetch and mixed-precision controls work the same way.
"""

from shardweave.replicate._replicate import ReplicateModule, replicate
from shardweave.replicate._version import __version__

__all__ = ["ReplicateModule", "__version__", "replicate"]
