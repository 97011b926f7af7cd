"""Deterministic seeding for test bodies (STYLE.md section 7)."""

from __future__ import annotations

import importlib
import random

import torch


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, torch (CPU and any accelerator) and NumPy when it is installed.

    Call it with one seed on every rank for identical parameter init; derive input seeds from
    rank and step (e.g. ``1000 * step + rank``) so any rank can rebuild every rank's batch.
    """
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device when CUDA is present
    try:  # NumPy is optional (torch does not require it); imported by name so mypy needs no stubs
        np_random = importlib.import_module("numpy.random")
    except ImportError:
        return
    np_random.seed(seed % 2**32)
