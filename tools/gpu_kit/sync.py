"""``sync``: every host synchronization of steady-state steps (torch's sync-debug warnings
only), ours against torch's FSDP2 in the same loop; passes iff ours makes no more."""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._common import KIT_DIR, init_world1
from ._training import apply_engine, make_model

# The text of the warning ``torch.cuda.set_sync_debug_mode("warn")`` raises at a synchronizing
# CUDA call (c10/cuda/CUDAFunctions.cpp, ``warn_or_error_on_sync``; a UserWarning in Python).
# Any other warning in the loop (say, the autograd "returned a view tensor" warning of a
# pre-backward hook) is listed apart, never counted as a synchronization.
SYNC_WARNING = "called a synchronizing CUDA operation"


def is_sync_warning(message: Any) -> bool:
    return SYNC_WARNING in str(message)


def _site(filename: str, lineno: int) -> str:
    """'file:line function' of the innermost engine/optimizer frame of the current stack."""
    frames = [
        f"{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()
        if ("shardweave" in f.filename or "fsdp" in f.filename or "optim" in f.filename)
        and Path(f.filename).resolve().parent != KIT_DIR  # the kit's own frames never count
    ]
    return frames[-1] if frames else f"{Path(filename).name}:{lineno}"


@contextlib.contextmanager
def recording_syncs() -> Iterator[dict[str, list[str]]]:
    """Collects, while active, the site of every synchronization warning (``syncs``, one entry
    per warning) and every other warning's text (``other``)."""
    found: dict[str, list[str]] = {"syncs": [], "other": []}

    def record(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if is_sync_warning(message):
            found["syncs"].append(_site(filename, lineno))
        else:
            name = getattr(category, "__name__", str(category))
            found["other"].append(f"{name}: {str(message)[:160]} ({Path(filename).name}:{lineno})")

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        yield found


def sync_verdict(ours: list[str], theirs: list[str]) -> dict[str, Any]:
    """Ours against torch's FSDP2: every synchronization counted (per site), pass iff ours
    makes no more of them than torch's does in the same loop."""
    from collections import Counter

    return {
        "shardweave": dict(sorted(Counter(ours).items())),
        "torch": dict(sorted(Counter(theirs).items())),
        "counts": {"shardweave": len(ours), "torch": len(theirs)},
        "ok": len(ours) <= len(theirs),
    }


def _sync_warnings(engine: str, steps: int = 3) -> dict[str, list[str]]:
    """The synchronization warnings (and the other warnings) of steady-state steps."""
    import torch

    device = torch.device("cuda")
    model = make_model(256, 4, device)
    apply_engine(engine, model, "fsdp", "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(8, 32, 256, device=device)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # lazy init and the first optimizer step are not steady state
        step()
    torch.cuda.synchronize()
    with recording_syncs() as found:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def section_sync(device_type: str) -> dict[str, Any]:
    import torch.distributed as dist

    init_world1(device_type)
    try:
        ours, theirs = _sync_warnings("shardweave"), _sync_warnings("torch")
    finally:
        dist.destroy_process_group()
    result = sync_verdict(ours["syncs"], theirs["syncs"])
    result["other_warnings"] = {"shardweave": ours["other"][:20], "torch": theirs["other"][:20]}
    result["note"] = "per site ('file:line function' of the innermost engine/optimizer frame)"
    return result
