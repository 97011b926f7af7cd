"""``python -m shardweave.fsdp.plan --model PKG.MODULE:FACTORY --mesh 8x128 --wrap Block``
(add ``--sample-input 8x2048:long`` for the peak with activations)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from shardweave.fsdp.plan._activations import StepFn
from shardweave.fsdp.plan._fit_config import BACKENDS
from shardweave.fsdp.plan._model import PlanError
from shardweave.fsdp.plan._plan import DTYPE_NAMES, OPTIMIZER_STATES, plan
from shardweave.fsdp.plan._report import format_table


def _load_factory(spec: str, option: str = "--model") -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PlanError(f"{option} must be PKG.MODULE:FACTORY, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # let `demos.x:f` resolve from the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PlanError(f"{option}: cannot import {module_name!r}: {exc}") from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise PlanError(f"{option}: {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise PlanError(f"{option}: {spec!r} is not callable")
    return factory


def _load_step(spec: str) -> StepFn | str:
    """``--step``: a built-in (``auto``, ``labels``, ``sum``) or ``PKG.MODULE:FN``."""
    if spec in ("auto", "labels", "sum"):
        return spec
    return _load_factory(spec, "--step")


_INT_DTYPES = {"long": torch.long, "int64": torch.long, "int": torch.int32, "int32": torch.int32}


def _parse_sample(spec: str | None) -> tuple[tuple[int, ...], torch.dtype] | None:
    """``8x1024`` (float32) or ``8x1024:long`` / ``8x3x224x224:bf16``."""
    if spec is None:
        return None
    shape_text, _, dtype_text = spec.partition(":")
    try:
        shape = tuple(int(d) for d in shape_text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise PlanError(
            f"--sample-input: {spec!r} is not SHAPE[:DTYPE], e.g. 8x1024:long"
        ) from None
    name = (dtype_text or "fp32").lower()
    dtype = _INT_DTYPES.get(name) or DTYPE_NAMES.get(name)
    if dtype is None or any(d < 1 for d in shape):
        raise PlanError(
            f"--sample-input: {spec!r} is not SHAPE[:DTYPE]; dtypes: "
            f"{sorted({*_INT_DTYPES, *DTYPE_NAMES})}"
        )
    return shape, dtype


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"{option}: {text!r} is not comma-separated integers") from None


def _parser() -> argparse.ArgumentParser:
    # Past 80 lines: one add_argument per option, nothing else.
    p = argparse.ArgumentParser(
        prog="python -m shardweave.fsdp.plan",
        description="Predict per-rank memory and per-step communication of fully_shard, "
        "from a model built on the meta device (no GPUs, no process group).",
    )
    p.add_argument("--model", required=True, help="PKG.MODULE:FACTORY (zero-argument)")
    p.add_argument("--mesh", required=True, help="shard size '1024', or 'RxS' for HSDP")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (approximate)")
    p.add_argument("--mp", default=None, help="param dtype: bf16, fp16 or fp32")
    p.add_argument("--reduce-dtype", default=None, help="reduce dtype: bf16, fp16 or fp32")
    p.add_argument("--reshard-after-forward", default="true", help="true, false or an int N")
    p.add_argument(
        "--root-reshard-after-forward", default=None, help="the root's (default: stays gathered)"
    )
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    p.add_argument("--wrap", default=None, help="module class name(s) to wrap, comma-separated")
    p.add_argument("--forward-prefetch", type=int, default=0)
    p.add_argument("--backward-prefetch", type=int, default=1)
    p.add_argument(
        "--sample-input",
        default=None,
        help="SHAPE[:DTYPE] of one step's input (e.g. 8x2048:long): adds the peak with "
        "activations, from one forward and backward under fake tensors",
    )
    p.add_argument(
        "--step",
        default="auto",
        help="the step trained, up to its loss: PKG.MODULE:FN with FN(model, batch) -> loss, "
        "'labels' (transformers: model(input_ids=batch, labels=batch).loss), 'sum' (the first "
        "floating output summed) or 'auto' (labels where forward takes labels, else sum)",
    )
    p.add_argument(
        "--target",
        default=None,
        help="DEVICE[/BACKEND] planned for: cuda/nccl (default), cpu/gloo, cuda/gloo; the "
        "answer's first line names it",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=BACKENDS,
        help="without --target: nccl (GPUs), gloo (CPU)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="CPUOffloadPolicy: sharded params, grads and optimizer state in host memory",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="sharded gradients stay between steps (zero_grad(set_to_none=False))",
    )
    p.add_argument(
        "--fit",
        default=None,
        metavar="BUDGET",
        help="make it fit: search configurations whose peak fits BUDGET per rank (bytes, or "
        "24GiB / 24G = 2^30-based, 24GB = 10^9-based) and rank them by estimated step time; "
        "needs --sample-input; --wrap names the classes to try (default: the repeated blocks)",
    )
    p.add_argument(
        "--allow-lower-precision",
        action="store_true",
        help="--fit: also try bf16 parameters (fp32 or bf16 reductions)",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="--fit: samples per optimizer step over all ranks; fit then also chooses the layout "
        "(FSDP over --mesh N, or HSDP RxS) and the local batch x accumulation steps",
    )
    p.add_argument(
        "--devices-per-node", type=int, default=None, help="--fit: node size (default 8)"
    )
    p.add_argument(
        "--accumulation",
        default="1,2,4,8",
        help="--fit with --global-batch: accumulation steps to try, comma-separated",
    )
    p.add_argument("--device", default="h100", help="--fit time model: h100 or a100")
    p.add_argument("--device-flops", type=float, default=None, help="override FLOP/s")
    p.add_argument("--shard-link", type=float, default=None, help="override bytes/s")
    p.add_argument("--replicate-link", type=float, default=None, help="override bytes/s")
    p.add_argument("--host-link", type=float, default=None, help="override bytes/s")
    p.add_argument("--json", default=None, help="write the plan as JSON to this path")
    p.add_argument("--timeline", action="store_true", help="include the event timeline in JSON")
    p.add_argument("--quiet", action="store_true", help="no table on stdout")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.fit is not None:
        return _main_fit(args)
    try:
        result = plan(
            _load_factory(args.model),
            mesh=args.mesh,
            tp=args.tp,
            wrap=args.wrap,
            mp_policy=args.mp,
            reduce_dtype=args.reduce_dtype,
            reshard_after_forward=args.reshard_after_forward,
            root_reshard_after_forward=args.root_reshard_after_forward,
            optimizer=args.optimizer,
            forward_prefetch=args.forward_prefetch,
            backward_prefetch=args.backward_prefetch,
            set_to_none=not args.keep_grads,
            sample_input=_parse_sample(args.sample_input),
            step=_load_step(args.step),
            backend=args.backend,
            target=args.target,
            offload=args.offload,
        )
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        data = result.to_dict(timeline=args.timeline)
        data["inputs"]["model"] = args.model  # type: ignore[index]
        Path(args.json).write_text(json.dumps(data, indent=1, default=str) + "\n")
    if not args.quiet:
        print(format_table(result))
    return 0


def _main_fit(args: argparse.Namespace) -> int:
    from shardweave.fsdp.plan._fit import fit
    from shardweave.fsdp.plan._fit_report import format_fit
    from shardweave.fsdp.plan._time_model import DEVICES

    try:
        sample = _parse_sample(args.sample_input)
        if sample is None:
            raise PlanError("--fit needs --sample-input SHAPE[:DTYPE] (activations decide it)")
        if args.device not in DEVICES:
            raise PlanError(f"--device must be one of {sorted(DEVICES)}, got {args.device!r}")
        result = fit(
            _load_factory(args.model),
            mesh=args.mesh,
            sample_input=sample,
            budget=args.fit,
            wrap=args.wrap,
            allow_lower_precision=args.allow_lower_precision,
            optimizer=args.optimizer,
            backend=args.backend,
            target=args.target,
            step=_load_step(args.step),
            device=args.device,
            device_flops=args.device_flops,
            shard_link_bytes_per_s=args.shard_link,
            replicate_link_bytes_per_s=args.replicate_link,
            host_link_bytes_per_s=args.host_link,
            global_batch=args.global_batch,
            devices_per_node=args.devices_per_node,
            accumulation_choices=_ints(args.accumulation, "--accumulation"),
        )
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(result.to_json())
    if not args.quiet:
        print(format_fit(result))
    return 0 if result.kept else 1


if __name__ == "__main__":
    sys.exit(main())
