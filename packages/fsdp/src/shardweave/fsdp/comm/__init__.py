"""Communication: *how* a collective runs (the engine core decides *when*).

Owns the streams and events of one device (``_streams``, with the stream-ordering design
note), the comm objects (``_collectives``: the c10d calls behind the ``COLLECTIVES`` plugin
point, the ``AllGather`` / ``ReduceScatter`` comms and their allocators), the one seam every
collective passes through (``_seam``: check, trace record, watchdog entry, wait), a group's
all-gather copy-in and copy-out (``_all_gather``) and the one gradient reduction pipeline with
its schedule (``_reduction``).

May use: ``_fsdp_api``, ``_fsdp_common``, ``_torch_compat``, ``faults/``, ``tracing/`` and
``shardweave.mesh``. Never the engine core: what it reads of a parameter is a Protocol
declared here (``AllGatherParam``, ``ReducedParam``), which ``FSDPParam`` satisfies, and
groups are passed as names and keys.

Nothing here is public.
"""

__all__: list[str] = []
