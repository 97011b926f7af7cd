"""Policies and the gradient divide-factor table, without a process group.

Oracle: *closed form* — the table of torch 2.13's FSDP2 (reference/fsdp2-behavior.md §4.6) and
torch's own dataclasses for the policy defaults.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from shardweave.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shardweave.fsdp.comm._reduction import gradient_divide_factors

AVG, SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM


def test_policy_defaults_match_torch() -> None:
    ours = {f.name: f.default for f in dataclasses.fields(MixedPrecisionPolicy)}
    theirs = {f.name: f.default for f in dataclasses.fields(TorchMixedPrecisionPolicy)}
    # torch 2.15's param_dtype_override_fn is offered on every torch (default None)
    assert ours == theirs | {"param_dtype_override_fn": None}
    assert CPUOffloadPolicy().pin_memory == TorchCPUOffloadPolicy().pin_memory
    assert isinstance(CPUOffloadPolicy(), OffloadPolicy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        MixedPrecisionPolicy().param_dtype = torch.float16  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"param_dtype": "bf16"},
        {"reduce_dtype": 32},
        {"output_dtype": torch.float32, "cast_forward_inputs": 1},
    ],
)
def test_mixed_precision_policy_rejects_non_dtypes(kwargs: dict[str, object]) -> None:
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        MixedPrecisionPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rs", "ar", "dtype", "factor", "force_sum", "expected"),
    [
        (2, 1, torch.float32, None, False, (None, None, AVG, AVG)),
        (1, 1, torch.float32, None, False, (None, None, SUM, SUM)),
        (2, 2, torch.bfloat16, None, False, (None, None, AVG, AVG)),
        (2, 1, torch.float32, 2.0, False, (None, None, AVG, SUM)),
        (2, 1, torch.float16, None, False, (2.0, 1.0, SUM, SUM)),
        (4, 1, torch.float16, None, False, (2.0, 2.0, SUM, SUM)),
        (2, 1, torch.float32, None, True, (None, 2.0, SUM, SUM)),
        (2, 2, torch.float32, 8.0, True, (None, 8.0, SUM, SUM)),
    ],
)
def test_gradient_divide_factors(
    rs: int,
    ar: int,
    dtype: torch.dtype,
    factor: float | None,
    force_sum: bool,
    expected: tuple[object, ...],
) -> None:
    assert gradient_divide_factors(rs, ar, dtype, factor, force_sum) == expected


def test_custom_factor_uses_premul_sum() -> None:
    *_, rs_op, ar_op = gradient_divide_factors(2, 1, torch.float32, 3.0, False)
    assert rs_op not in (AVG, SUM) and ar_op == SUM  # PREMUL_SUM(1/3), NCCL only


def test_param_dtype_override_fn_resolves_as_torch_2_15() -> None:
    """Oracle: closed form (torch 2.15's documented rule): None or param_dtype -> param_dtype,
    the parameter's own dtype -> kept, anything else -> ValueError; keyword-only."""
    p = torch.nn.Parameter(torch.ones(2))
    for answer, expected in ((None, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                             (torch.float32, torch.float32)):  # fmt: skip
        policy = MixedPrecisionPolicy(torch.bfloat16, param_dtype_override_fn=lambda _, a=answer: a)
        assert policy.resolve_param_dtype(p) == expected
        assert policy.for_param(p).param_dtype == expected
        assert policy.for_param(p).param_dtype_override_fn is None
    for bad in (torch.float16, "fp32", 32):
        policy = MixedPrecisionPolicy(torch.bfloat16, param_dtype_override_fn=lambda _, a=bad: a)
        with pytest.raises(ValueError, match="param_dtype_override_fn must return"):
            policy.resolve_param_dtype(p)
    with pytest.raises(TypeError):
        MixedPrecisionPolicy(None, None, None, True, None)  # type: ignore[misc]
    with pytest.raises(TypeError, match="callable"):
        MixedPrecisionPolicy(param_dtype_override_fn=torch.float32)  # type: ignore[arg-type]
