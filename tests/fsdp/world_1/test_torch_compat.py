"""``shardweave.fsdp._torch_compat``: each name reaches torch 2.13's function where it exists
and the older one where it does not (torch 2.11 and 2.12), resolved at call time."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardweave.fsdp import _torch_compat

PAIRS = [
    ("all_gather_single", "all_gather_single", "all_gather_into_tensor"),
    ("reduce_scatter_single", "reduce_scatter_single", "reduce_scatter_tensor"),
]


def _recorder(calls: list[tuple[str, Any]], name: str) -> Any:
    def fn(*args: Any, **kwargs: Any) -> str:
        calls.append((name, kwargs))
        return name

    return fn


@pytest.mark.parametrize(("compat", "new", "old"), PAIRS)
@pytest.mark.parametrize("has_new", [True, False], ids=["torch>=2.13", "torch<2.13"])
def test_compat_calls_the_name_torch_has(
    monkeypatch: pytest.MonkeyPatch, compat: str, new: str, old: str, has_new: bool
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(dist, old, _recorder(calls, old), raising=False)
    if has_new:
        monkeypatch.setattr(dist, new, _recorder(calls, new), raising=False)
    else:
        monkeypatch.delattr(dist, new, raising=False)
    out, inp = torch.empty(4), torch.empty(2)
    result = getattr(_torch_compat, compat)(out, inp, async_op=True)
    assert result == (new if has_new else old)
    assert [name for name, _ in calls] == [result]
    assert calls[0][1]["async_op"] is True and calls[0][1]["group"] is None


def test_this_torch_has_one_of_each() -> None:
    for _, new, old in PAIRS:
        assert hasattr(dist, new) or hasattr(dist, old), (new, old)


def test_state_exposes_one_group_before_2_13() -> None:
    """torch 2.11 and 2.12's PipelineStage reads ``state._fsdp_param_group``; 2.13 does not."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert _torch_compat.STATE_EXPOSES_ONE_GROUP is ((major, minor) < (2, 13))


def test_spmd_types_params_where_torch_converts_them() -> None:
    """``SPMD_TYPES_PARAMS`` holds exactly where torch's own FSDPParam converts plain parameters
    annotated by spmd_types (torch 2.14 added it; 2.13 raises for them)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam as TorchFSDPParam

    torch_converts = hasattr(TorchFSDPParam, "_resolve_spmd_types_for_storage")
    assert _torch_compat.SPMD_TYPES_PARAMS is torch_converts
