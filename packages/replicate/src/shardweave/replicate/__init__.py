"""shardweave.replicate: data parallelism (DDP) built on the shardweave FSDP engine.

``replicate()`` and ``ReplicateModule`` arrive with the replicate issue; this release ships
only the package and its version.
"""

from shardweave.replicate._version import __version__

__all__ = ["__version__"]
