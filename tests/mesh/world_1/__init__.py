"""shardweave.mesh tests that need no process group."""
