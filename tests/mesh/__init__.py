"""Tests of shardweave.mesh: mesh info types and the plugin registry."""
