"""Pre-flight planner: per-rank memory and per-step communication of a ``fully_shard`` setup,
predicted from a meta-device model with no process group, and with a sample input the step's
peak with activations from one fake-tensor step (``python -m shardweave.fsdp.plan``)."""

import sys
import types
from typing import Any

from shardweave.fsdp.plan._apply import apply
from shardweave.fsdp.plan._fit import FitResult, Fitted, fit, parse_budget
from shardweave.fsdp.plan._fit_config import FitConfig
from shardweave.fsdp.plan._fit_report import format_fit
from shardweave.fsdp.plan._model import PlanError
from shardweave.fsdp.plan._plan import plan
from shardweave.fsdp.plan._report import format_table
from shardweave.fsdp.plan._result import ActivationPlan, GroupPlan, ParamPlan, Plan
from shardweave.fsdp.plan._schedule import TimelineRecord

__all__ = [
    "ActivationPlan",
    "FitConfig",
    "FitResult",
    "Fitted",
    "GroupPlan",
    "ParamPlan",
    "Plan",
    "PlanError",
    "TimelineRecord",
    "apply",
    "fit",
    "format_fit",
    "format_table",
    "parse_budget",
    "plan",
]


class _CallablePlanModule(types.ModuleType):
    """Lets ``shardweave.fsdp.plan(...)`` call :func:`plan` (the name the issue's interface and
    the CLI share) while ``python -m shardweave.fsdp.plan`` and ``from ... import plan`` keep
    working: a module cannot be both a package and a function any other way."""

    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePlanModule
