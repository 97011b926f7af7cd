"""The guard between our ``FSDPModule`` and torch's marker: a method a later torch adds to its
``FSDPModule`` raises a clear error on our modules instead of running torch's code over our state.

Oracle: closed form. A stand-in for torch's class with one method we implement and one we do
not; the guard built from it answers only for the second, and says which torch and which method.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardweave.fsdp._fully_shard import FSDPModule
from shardweave.fsdp._torch_interop import _method_guard, unimplemented_torch_methods


class FutureTorchFSDPModule:
    """torch's FSDPModule as a later release might define it."""

    def reshard(self) -> str:  # we implement this one
        return "torch's reshard"

    def set_future_feature(self, enabled: bool) -> str:  # and not this one
        return "torch's engine code over our state"

    @property
    def future_property(self) -> str:
        return "torch's property"


def _future_class() -> type:
    marker = FutureTorchFSDPModule
    return type("FSDPLinear", (FSDPModule, _method_guard(marker), marker, nn.Linear), {})


def test_new_torch_method_raises_naming_it() -> None:
    cls = _future_class()
    module = object.__new__(cls)  # only the method lookup matters here
    with pytest.raises(NotImplementedError, match="set_future_feature") as info:
        module.set_future_feature(True)
    assert f"torch {torch.__version__}" in str(info.value)
    with pytest.raises(NotImplementedError, match="future_property"):
        _ = module.future_property


def test_ours_win_over_the_guard() -> None:
    cls = _future_class()
    assert cls.reshard is FSDPModule.reshard
    assert unimplemented_torch_methods(cls) == ["future_property", "set_future_feature"]


def test_no_guard_means_nothing_unimplemented() -> None:
    assert unimplemented_torch_methods(type("Plain", (FSDPModule, nn.Linear), {})) == []
