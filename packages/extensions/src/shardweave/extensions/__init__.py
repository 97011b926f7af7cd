"""shardweave.extensions: tensor-parallel interop and tensor-subclass all-gather plugins.

The plugins (DTensor parameters from ``parallelize_module``, ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` subclasses, state-dict chunking) arrive with the tensor-parallel
issue; this release ships only the package and its version. Until then a DTensor parameter
given to ``fully_shard`` raises ``shardweave.mesh.MissingExtensionError``.
"""

from shardweave.extensions._version import __version__

__all__ = ["__version__"]
