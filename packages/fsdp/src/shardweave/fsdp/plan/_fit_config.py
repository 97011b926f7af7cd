"""One configuration ``fit`` searches and ``apply`` applies: ``FitConfig``, the ``Target`` it is
planned for, and the short labels the answer prints for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE
from shardweave.fsdp.plan._model import PlanError

__all__ = [
    "BACKENDS",
    "DTYPES",
    "FitConfig",
    "Target",
    "dtype_name",
    "every_label",
    "parse_target",
    "reduce_label",
]

# Collective backends whose collectives stage data in tensors of their own while they run:
# gloo copies an all-gather's output and a reduce-scatter's input, and reduces bf16/fp16 in
# fp32 (measured on torch 2.13's ProcessGroupGloo). NCCL works in the given buffers.
BACKENDS: Final = ("nccl", "gloo")

DTYPES: Final[dict[str | None, torch.dtype | None]] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


@dataclass(frozen=True)
class Target:
    """What a plan is for: the device type the engine computes on and the process group's
    backend. On an accelerator (any device type but ``cpu``) the engine's schedule is stream
    ordered (each reduction runs to its end when started) and CPU offload moves parameters,
    gradients and optimizer state off the device; on ``cpu`` the host *is* the device, so
    offload saves nothing and is not searched. ``gloo`` stages its collectives in copies of
    its own (counted); ``nccl`` works in the given buffers."""

    device: str = "cuda"
    backend: str = "nccl"

    def __str__(self) -> str:
        return f"{self.device}/{self.backend}"

    @property
    def accelerator(self) -> bool:
        return self.device != "cpu"


def parse_target(target: str | Target | None = None, backend: str | None = None) -> Target:
    """``"cuda/nccl"``, ``"cpu/gloo"``, ``"cuda/gloo"``, or a device type alone (``"cuda"``:
    NCCL, ``"cpu"``: gloo). Without a target, ``backend`` alone says it as before targets were
    named: ``"gloo"`` is CPU processes, ``"nccl"`` (the default) GPUs."""
    if backend is not None and backend not in BACKENDS:
        raise PlanError(f"plan: backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(target, Target):
        found = target
    elif target is None:
        found = Target("cpu", "gloo") if backend == "gloo" else Target()
    else:
        device, _, named = target.strip().lower().partition("/")
        found = Target(device, named or ("gloo" if device == "cpu" else "nccl"))
        if backend is not None and backend != found.backend:
            raise PlanError(f"plan: target {target!r} and backend {backend!r} disagree")
    if found.backend not in BACKENDS or not found.device.isidentifier():
        raise PlanError(
            f"plan: target must be DEVICE[/BACKEND] with a backend in {BACKENDS}, e.g. "
            f"'cuda/nccl' or 'cpu/gloo', got {target!r}"
        )
    if found.backend == "nccl" and not found.accelerator:
        raise PlanError(f"plan: target {found}: NCCL runs on GPUs only; use 'cpu/gloo'")
    return found


@dataclass(frozen=True)
class FitConfig:
    """One configuration: everything ``apply`` needs to reproduce it."""

    wrap: str | None  # module class name wrapped with fully_shard (None: the root only)
    reshard_after_forward: bool | int
    root_reshard_after_forward: bool
    param_dtype: str | None
    reduce_dtype: str | None
    checkpoint_every: int  # 0: none, 1: every wrapped block, k: every k-th (the 1st, k+1th, ...)
    offload: bool
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    reduce_scatter_max_input_buffers: int = 1
    target: str = "cuda/nccl"  # where it was planned (``Target``): ``apply`` checks it
    # The layout: ``(N,)`` FSDP over N ranks, ``(R, S)`` HSDP (R replicas of S-rank shard
    # groups); ``()``: not stated (the mesh ``apply`` is given, or the world).
    mesh: tuple[int, ...] = ()
    # The microbatch: ``local_batch`` samples per rank per forward (0: the sample input as
    # given), ``grad_accumulation`` forwards and backwards per optimizer step.
    local_batch: int = 0
    grad_accumulation: int = 1

    def describe(self) -> str:
        ac = every_label(self.checkpoint_every)
        where = ""
        if self.mesh:
            kind = "HSDP" if len(self.mesh) == 2 else "FSDP"
            where = f"mesh={'x'.join(map(str, self.mesh))} ({kind}) "
        if self.local_batch:
            where += f"micro={self.local_batch}x{self.grad_accumulation} "
        return (
            f"{where}wrap={self.wrap or '-'} reshard={self.reshard_after_forward} "
            f"root_reshard={self.root_reshard_after_forward} "
            f"mp={self.param_dtype or 'fp32'}/{reduce_label(self.param_dtype, self.reduce_dtype)} "
            f"checkpoint={ac} offload={self.offload}"
        )

    def how_to_run(self) -> list[str]:
        """The step as a loop, where it accumulates gradients (empty where it does not)."""
        a = self.grad_accumulation
        if a <= 1:
            return []
        hsdp = len(self.mesh) == 2
        lines = [
            f"gradient accumulation: {a} microbatches of {self.local_batch or '?'} per rank per "
            "optimizer step, each reduce-scattered (gradients accumulate sharded)"
            + ("; the HSDP all-reduce on the last only" if hsdp else ""),
            f"for i, micro in enumerate(batch.chunk({a})):",
        ]
        if hsdp:
            lines.append(f"    model.set_requires_all_reduce(i == {a - 1})")
        lines += [
            f"    (step(model, micro) / {a}).backward()",
            "optimizer.step(); optimizer.zero_grad()",
        ]
        return lines


def reduce_label(param: str | None, reduce: str | None, model: str = "fp32") -> str:
    """The dtype gradients are reduced in: ``reduce``, or without it the parameters' own
    dtype from torch 2.15 (``REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE``) and ``param`` before."""
    if reduce is not None:
        return reduce
    if param is None or REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE:
        return model
    return param


def every_label(k: int) -> str:
    if k <= 1:
        return "none" if k == 0 else "every block"
    suffix = {2: "nd", 3: "rd"}.get(k % 10 if k % 100 not in (12, 13) else 0, "th")
    return f"every {k}{suffix} block"


def dtype_name(name: str | None) -> str:
    """``torch.<name>`` spelled out: ``bf16`` -> ``bfloat16``."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name or "", str(name))
