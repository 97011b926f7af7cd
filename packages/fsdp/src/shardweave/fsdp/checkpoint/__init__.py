"""Checkpoints: full state dicts and safetensors files of a ``fully_shard``-ed model.

Owns full state dicts one tensor at a time (``_full_state_dict``) and streaming safetensors
files on top of them (``_safetensors``).

May use: the public ``FSDPModule`` (``_fully_shard``), ``_torch_compat`` and
``shardweave.mesh.extension_points``; it works on a model as users hold it, never on the
engine's groups.

Nothing here is public; ``shardweave.fsdp`` re-exports the functions.
"""

__all__: list[str] = []
