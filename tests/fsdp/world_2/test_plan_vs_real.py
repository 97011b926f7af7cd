"""The planner's predictions against real training steps on 2 ranks.

Oracle: *measurement* on real ranks (``tests/fsdp/_plan_real``): the bytes each rank holds
(parameter shards, sharded gradients, optimizer state) and the peaks of gathered parameters
and of unsharded gradients must match the plan exactly; the step's peak live tensor bytes, counted as the benchmark counts
them, within 5% of the plan's peak with activations and, on R x 1 meshes computing in fp32,
never above it (``_plan_real.never_below``: the smallest peak of three steps). Cases with
``accelerator`` run the engine's accelerator branches on CPU tensors (``use_device_module(...,
stream_ordered=True)``) against the plan for NCCL.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import WorkerPool
from tests.fsdp._oracle import TORCH_HAS_EXPLICIT_GRAD_DTYPE
from tests.fsdp._plan_real import assert_plan_matches, case_id, measure

CASES: list[dict[str, Any]] = [
    {"kind": "gpt"},
    {"kind": "gpt_ac"},
    {"kind": "gpt", "mp": True},
    {"kind": "gpt", "mp": True, "override": True},  # param_dtype_override_fn
    {"kind": "gpt", "reshard": False},
    {"kind": "mlp", "optim": "sgd_momentum"},
    {"kind": "gpt", "mesh": (2, 1)},
    {"kind": "gpt", "placement": True},
    {"kind": "mlp", "mesh": (2, 1)},
    {"kind": "mlp", "mesh": (2, 1), "reduce": "bf16"},
    {"kind": "mlp", "mesh": (2, 1), "accelerator": True},
    {"kind": "mlp", "mesh": (2, 1), "reduce": "bf16", "accelerator": True},
]
# An explicit Parameter.grad_dtype on the matrices (torch 2.15 only): gradients made, reduced
# and kept in bf16 beside fp32 ones; with bf16 compute and an fp32 reduce_dtype, kept in bf16.
# SGD with momentum: torch's Adam does not step fp32 parameters with bf16 gradients.
GRAD_DTYPE_CASES: list[dict[str, Any]] = [
    {"kind": "gpt", "grad_dtype": "bf16", "optim": "sgd_momentum"},
    {"kind": "gpt", "mp": True, "grad_dtype": "bf16", "optim": "sgd_momentum"},
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_plan_vs_real_world2(world2: WorkerPool, case: dict[str, Any]) -> None:
    assert_plan_matches(world2.run(measure, case), case)


@pytest.mark.skipif(
    not TORCH_HAS_EXPLICIT_GRAD_DTYPE,
    reason="parameters have no explicit-grad_dtype flag before torch 2.15",
)
@pytest.mark.parametrize("case", GRAD_DTYPE_CASES, ids=case_id)
def test_plan_vs_real_explicit_grad_dtype(world2: WorkerPool, case: dict[str, Any]) -> None:
    assert_plan_matches(world2.run(measure, case), case)
