"""Reading a ``FitResult``: the answer as text (``--fit``'s output) and the winner as code."""

from __future__ import annotations

from collections.abc import Sequence

from shardweave.fsdp.plan._fit import FitResult
from shardweave.fsdp.plan._fit_config import FitConfig, dtype_name, every_label
from shardweave.fsdp.plan._report import format_bytes

__all__ = ["format_fit", "snippet"]


def _folded_note(folded: Sequence[str]) -> str:
    if not folded:
        return ""
    return f", {len(folded)} folded ({', '.join(sorted(set(folded)))})"


def _devices(result: FitResult) -> str:
    mesh = "x".join(map(str, result.mesh))
    if result.global_batch is None:
        return f"mesh {mesh}"
    return f"{mesh} devices, global batch {result.global_batch}"


def format_fit(result: FitResult, top: int = 5) -> str:
    lines = [
        f"make it fit on {result.target}: budget {format_bytes(result.budget_bytes)} per rank, "
        f"{_devices(result)}; searched {result.searched} configurations "
        f"({result.fake_steps} fake steps{_folded_note(result.folded)}) in "
        f"{result.search_seconds:.2f} s",
        f"step planned: {result.step}",
        "search space:",
    ]
    for k, v in result.search_space.items():
        lines.append(f"  {k}: {v}")
    if not result.kept:
        lines += ["", *result.advice]
        return "\n".join(lines)
    twins = sum(len(f.alternatives) for f in result.kept)
    also = f" ({twins} more as alternatives of a row)" if twins else ""
    lines += [
        "",
        f"{len(result.kept)} fit{also}; fastest first (step time is an estimate):",
    ]
    for i, f in enumerate(result.kept[:top]):
        t = f.terms
        lines.append(
            f"  {i + 1}. peak {format_bytes(f.peak_bytes)} (margin "
            f"{format_bytes(result.budget_bytes - f.peak_bytes)}), step ~{f.step_seconds:.3g} s "
            f"[compute {t['compute']:.3g}, exposed comm {t['exposed_comm']:.3g} "
            f"of {t['comm']:.3g}, offload {t['offload']:.3g}, optimizer {t['optimizer']:.3g} s"
            f"{_per_step(f.config.grad_accumulation)}; "
            f"{f.dominant} dominates]"
        )
        lines.append(f"     {f.config.describe()}")
        if f.alternatives:
            same = "; ".join(
                ", ".join(f"{k}={v}" for k, v in alt.items()) for alt in f.alternative_settings()
            )
            lines.append(f"     (the same peak and time with {same})")
    best = result.kept[0]
    lines += ["", "the winner as code:", snippet(best.config)]
    return "\n".join(lines)


def _per_step(accumulation: int) -> str:
    return f"; {accumulation} microbatches per step" if accumulation > 1 else ""


def snippet(cfg: FitConfig) -> str:
    return "\n".join(
        [
            "from shardweave.fsdp.plan import FitConfig, apply",
            f"apply(model, {cfg!r})",
            "# which is:",
            *("# " + line for line in _explain(cfg)),
            *("# " + line for line in cfg.how_to_run()),
        ]
    )


def _explain(cfg: FitConfig) -> list[str]:
    out = []
    device = cfg.target.split("/")[0]
    if len(cfg.mesh) == 2:
        out.append(
            f"mesh = init_device_mesh({device!r}, {cfg.mesh}, "
            "mesh_dim_names=('replicate', 'shard'))  # HSDP: fully_shard(..., mesh=mesh)"
        )
    elif cfg.mesh:
        out.append(f"mesh = init_device_mesh({device!r}, {cfg.mesh})")
    mp = (
        f"MixedPrecisionPolicy(param_dtype=torch.{dtype_name(cfg.param_dtype)}, "
        f"reduce_dtype={'torch.' + dtype_name(cfg.reduce_dtype) if cfg.reduce_dtype else None})"
        if cfg.param_dtype
        else "MixedPrecisionPolicy()"
    )
    off = "CPUOffloadPolicy()" if cfg.offload else "OffloadPolicy()"
    on = ", mesh=mesh" if cfg.mesh else ""
    if cfg.wrap:
        if cfg.checkpoint_every:
            out.append(
                f"checkpoint the forward of {every_label(cfg.checkpoint_every)} of class {cfg.wrap} "
                "(torch.utils.checkpoint, use_reentrant=False)"
            )
        out.append(f"for m in model.modules(): if type(m).__name__ == {cfg.wrap!r}:")
        out.append(
            f"    fully_shard(m, reshard_after_forward={cfg.reshard_after_forward!r}, "
            f"mp_policy={mp}, offload_policy={off}{on})"
        )
    out.append(
        f"fully_shard(model, reshard_after_forward={cfg.root_reshard_after_forward!r}, "
        f"mp_policy={mp}, offload_policy={off}{on})"
    )
    return out
