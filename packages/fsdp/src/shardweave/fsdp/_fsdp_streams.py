"""STAND-IN (wip/sanitizer only): the device-module seam the engine will use for its streams.

The real module is being written on ``main``; this copy has exactly its interface so the test
sanitizer can be developed against it. It is deleted when ``main`` is merged in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["device_module", "use_device_module"]

_OVERRIDE: list[object] = []


def device_module(device: torch.device) -> Any:
    """``torch.get_device_module(device)`` unless ``use_device_module`` overrides it."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    return torch.get_device_module(device)


@contextlib.contextmanager
def use_device_module(module: object) -> Iterator[None]:
    """Every comm context created inside uses ``module`` as its device module."""
    _OVERRIDE.append(module)
    try:
        yield
    finally:
        _OVERRIDE.pop()
