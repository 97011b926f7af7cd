"""The engine core: parameters, groups, states and the arguments that build them.

Owns each parameter's lifecycle (``_param``: ``FSDPParam``, asking its kind's handler,
``_param_handler``, ``_spmd_types`` and ``_subclass_gather``), *when* a group gathers and
reduces (``_param_group``: ``FSDPParamGroup``, ``FSDPCommContext``), the hooks and root logic
of one call's modules (``_state``: ``FSDPState``, ``EngineAPI``), the checks of
``fully_shard``'s arguments (``_args``) and the assembly of the state and its groups
(``_assembly``).

May use: ``_fsdp_api``, ``_fsdp_common``, ``_sharding_rules``, ``_torch_compat``,
``_torch_interop``, ``comm/``, ``faults/``, ``tracing/`` and ``shardweave.mesh``. The public
API (``_fully_shard``, ``engine``) sits above it and passes its mixin class down.

Nothing here is public; ``shardweave.fsdp.engine`` publishes what sibling packages need.
"""

__all__: list[str] = []
