"""Pre-flight planner: per-rank memory and per-step communication of a ``fully_shard`` setup,
predicted from a meta-device model with no process group (``python -m shardweave.fsdp.plan``)."""

from shardweave.fsdp.plan._model import PlanError
from shardweave.fsdp.plan._plan import GroupPlan, ParamPlan, Plan, plan
from shardweave.fsdp.plan._report import format_table
from shardweave.fsdp.plan._schedule import TimelineRecord

__all__ = ["GroupPlan", "ParamPlan", "Plan", "PlanError", "TimelineRecord", "format_table", "plan"]
