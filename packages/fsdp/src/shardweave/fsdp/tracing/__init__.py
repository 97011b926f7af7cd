"""Tracing: what the engine did, step by step.

Owns the tracer's recorder (``_recorder``: the records, ``ACTIVE`` and the instrumentation
points the engine calls with group keys, never groups) and its reports (``_report``:
``FSDPTracer``, the summary, table, Chrome trace and memory plot). No engine module imports
``_report``.

May use: ``_fsdp_common``. Nothing of the communication layer or the engine core, which
call the recorder only when a tracer is active.

Nothing here is public; ``shardweave.fsdp`` re-exports ``trace``, ``FSDPTracer`` and the
record types.
"""

__all__: list[str] = []
