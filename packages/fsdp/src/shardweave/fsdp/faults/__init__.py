"""Faults: never hang, and tell a fault from a pause.

Owns the one cross-rank channel (``_channel``: the store protocol, scoped keys, generations,
the timeout policy), the root's cross-rank configuration check (``_consistency``), failures
shared between ranks with the rank's progress and the opt-in collective checks
(``_failures``), and the watchdog thread that judges what is in flight (``_watchdog``).

May use: ``_fsdp_common``, ``_torch_compat`` and ``shardweave.mesh``. Nothing of the
communication layer or the engine core: they report to this folder (the seam registers each
collective in flight, the state enters phases), never the other way round.

Nothing here is public; ``shardweave.fsdp`` re-exports the errors and the timeout setters.
"""

__all__: list[str] = []
