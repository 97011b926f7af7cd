"""shardweave's test suite: a regular package, so spawned workers import test bodies by name."""
