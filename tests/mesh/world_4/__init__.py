"""shardweave.mesh tests on a 4-rank gloo process group (2x2 meshes for HSDP)."""
