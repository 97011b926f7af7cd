"""Reading a ``Plan``: regrouping suggestions and the human-readable table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from shardweave.fsdp._fsdp_common import CollectiveKind
from shardweave.fsdp.plan._model import ROOT_KEY, GroupSpec

if TYPE_CHECKING:
    from shardweave.fsdp.plan._result import GroupPlan, Plan

__all__ = ["format_bytes", "format_table", "suggestions"]

LARGE_RATIO: Final = 2.0  # a group gathering this many times the median is worth splitting
TINY_RATIO: Final = 0.05  # a group gathering under this share of the largest is worth merging
PADDING_RATIO: Final = 0.01  # padding above 1% of the real size is reported


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _numel(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _children(spec: GroupSpec | None, limit: int = 3) -> str:
    if spec is None or not spec.children:
        return "(it has no submodules with parameters: split the module itself)"
    return ", ".join(f"'{name}' ({_numel(n)})" for name, n in spec.children[:limit])


def suggestions(plan: Plan, specs: Sequence[GroupSpec]) -> list[str]:
    """Plain-language regrouping hints, most important first."""
    groups = plan.groups
    by_key = {s.key: s for s in specs}
    out: list[str] = []
    if not groups:
        return ["the model has no parameters to shard"]
    if len(groups) == 1:
        out.append(
            f"only the root is sharded, so the whole model ({format_bytes(groups[0].gathered_bytes)}"
            ") is gathered at once; wrap repeated blocks (wrap=<BlockClass>), e.g. "
            f"{_children(by_key.get(groups[0].key))}"
        )
        return out
    median = statistics.median(g.gathered_bytes for g in groups)
    largest = max(groups, key=lambda g: g.gathered_bytes)
    if median > 0 and largest.gathered_bytes >= LARGE_RATIO * median:
        out.append(
            f"largest group '{largest.key}' gathers {largest.gathered_bytes / median:.1f}x the "
            f"median group ({format_bytes(largest.gathered_bytes)} vs {format_bytes(median)}): "
            f"wrap its children separately: {_children(by_key.get(largest.key))}"
        )
    root = next((g for g in groups if g.key == ROOT_KEY), None)
    if root is not None and root.unsharded_grad_bytes:
        med_grad = statistics.median(g.unsharded_grad_bytes for g in groups)
        if root.unsharded_grad_bytes >= 0.5 * med_grad:
            out.append(
                f"the root group reduces its gradients only in the final callback, so its "
                f"{format_bytes(root.unsharded_grad_bytes)} of unsharded gradients stay alive "
                f"through the whole backward; wrap {_children(by_key.get(ROOT_KEY))} so they "
                "reduce when their backward ends"
            )
    tiny = [
        g
        for g in groups
        if g.key != ROOT_KEY and g.gathered_bytes < TINY_RATIO * largest.gathered_bytes
    ]
    if tiny:
        names = ", ".join(f"'{g.key}'" for g in tiny[:4]) + (" ..." if len(tiny) > 4 else "")
        out.append(
            f"{len(tiny)} group(s) gather under {TINY_RATIO:.0%} of the largest group ({names}): "
            "each still costs an all-gather and a reduce-scatter per step; stop wrapping them "
            "(they join their parent's group) or put neighbours in one fully_shard([a, b])"
        )
    real = sum(g.numel for g in groups)
    padded = plan.shard_size * sum(g.padded_shard_numel for g in groups)
    if real and padded - real > PADDING_RATIO * real:
        worst = sorted(
            (p for g in groups for p in g.params),
            key=lambda p: plan.shard_size * p.padded_shard_numel - _prod(p.shape),
            reverse=True,
        )[:3]
        out.append(
            f"padding adds {(padded - real) / real:.1%} to sharded and gathered bytes (dim 0 not "
            f"divisible by the shard size {plan.shard_size}); worst: "
            + ", ".join(f"'{p.fqn}' {tuple(p.shape)}" for p in worst)
        )
    kept = [g for g in groups if g.reshard_after_forward is False and g.key != ROOT_KEY]
    if len(kept) > 1 and plan.peak_gathered_param_bytes > 2 * largest.gathered_bytes:
        out.append(
            f"reshard_after_forward=False keeps {len(kept)} groups gathered from forward to "
            f"backward (peak {format_bytes(plan.peak_gathered_param_bytes)}); True or an int "
            "trades that memory for a second all-gather in backward"
        )
    return out


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _row(g: GroupPlan) -> tuple[object, ...]:
    return (
        g.module_type,
        g.numel,
        g.gathered_bytes,
        g.all_gathers_per_step,
        g.reduce_scatter_bytes,
        g.all_reduce_bytes,
        g.reshard_after_forward,
    )


def format_table(plan: Plan) -> str:
    """The report printed by the CLI.

    Example::

        from shardweave.fsdp.plan import format_table, plan

        print(format_table(plan(build_model, mesh="8x128", wrap="TransformerBlock")))
    """
    # Past 80 lines: the report's lines in their printed order, nothing else.
    mesh = "x".join(str(d) for d in plan.inputs["mesh"])  # type: ignore[attr-defined]
    kind = "HSDP (replicate x shard)" if plan.replicate_size > 1 else "FSDP"
    dtypes = plan.inputs["mp_policy"]
    assert isinstance(dtypes, dict)
    mp = f"param {dtypes['param_dtype'] or 'orig'} / reduce {dtypes['reduce_dtype'] or 'grad'}"
    peaks_at = plan.schedule.get("peaks_at", {})
    assert isinstance(peaks_at, dict)
    lines = [
        f"shardweave plan: {_numel(plan.total_numel)} params in {len(plan.groups)} groups, mesh "
        f"{mesh} {kind}, tp {plan.inputs['tp']}, world {plan.world_size}; mp {mp}; "
        f"reshard_after_forward {plan.inputs['reshard_after_forward']}; optimizer "
        f"{plan.inputs['optimizer']}; target {plan.inputs['target']}",
        "",
        "per rank (shard rank 0; the last shard rank differs only in optimizer state)",
        f"  sharded params          {format_bytes(plan.sharded_param_bytes):>12}",
        f"  sharded grads           {format_bytes(plan.grad_bytes):>12}  (after backward)",
        f"  optimizer state         {format_bytes(plan.optimizer_state_bytes):>12}  (last shard "
        f"rank {format_bytes(plan.ranks['last_shard_rank']['optimizer_state_bytes'])})",
        f"  gathered params, peak   {format_bytes(plan.peak_gathered_param_bytes):>12}  (at "
        f"{peaks_at.get('gathered_params') or '-'})",
        f"  comm buffers, peak      {format_bytes(plan.peak_comm_buffer_bytes):>12}  (at "
        f"{peaks_at.get('comm_buffers') or '-'})",
        f"  unsharded grads, peak   {format_bytes(plan.unsharded_grad_bytes):>12}",
    ]
    if plan.host_bytes:
        lines.append(
            f"  offloaded to host       {format_bytes(plan.host_bytes):>12}  (sharded params, grads "
            "and optimizer state: not in the device peaks below)"
        )
    if plan.peak_post_forward_shard_bytes:
        lines.append(
            f"  post-forward shards     {format_bytes(plan.peak_post_forward_shard_bytes):>12}"
        )
    lines += [
        f"  peak sum                {format_bytes(plan.peak_tensor_bytes):>12}  (at "
        f"{plan.peak_at}; activations not included)",
    ]
    act = plan.activations
    if act is not None:
        lines += [
            "",
            f"with activations (sample input {act.sample_input}; one fake-tensor step)",
            f"  step planned            {act.step}",
            f"  activations, peak       {format_bytes(act.peak_activation_bytes):>12}",
            f"  peak with activations   {format_bytes(act.peak_bytes):>12}  (at {act.peak_phase}"
            f" of '{act.peak_group}', {act.peak_event}; last shard rank "
            f"{format_bytes(act.last_shard_rank_peak_bytes)})",
            "  at that moment: "
            + ", ".join(
                f"{name.replace('_', ' ')} {format_bytes(v)}"
                for name, v in act.lines_at_peak.items()
                if v
            ),
        ]
    lines += [
        "",
        "per step per rank (logical payload)",
    ]
    for kind in CollectiveKind:
        lines.append(
            f"  {kind.value:<22}{format_bytes(plan.comm_bytes[kind]):>12}  in "
            f"{plan.collectives[kind]} collectives"
        )
    lines += ["", "groups (forward order; identical neighbours collapsed)"]
    header = ("group", "type", "params", "gathered", "AG/step", "RS bytes", "AR bytes", "reshard")
    rows: list[tuple[str, ...]] = [header]
    i = 0
    groups = plan.groups
    while i < len(groups):
        j = i
        while j + 1 < len(groups) and _row(groups[j + 1]) == _row(groups[i]):
            j += 1
        g = groups[i]
        name = g.key if j == i else f"{g.key} .. {groups[j].key} (x{j - i + 1})"
        flag = "  <- largest" if plan.largest_group in {x.key for x in groups[i : j + 1]} else ""
        rows.append(
            (
                name + flag,
                g.module_type,
                _numel(g.numel),
                format_bytes(g.gathered_bytes),
                str(g.all_gathers_per_step),
                format_bytes(g.reduce_scatter_bytes),
                format_bytes(g.all_reduce_bytes),
                str(g.reshard_after_forward),
            )
        )
        i = j + 1
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for r in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    if plan.suggestions:
        lines += ["", "suggestions"]
        lines += [f"  - {s}" for s in plan.suggestions]
    lines.append(f"\n(planned in {plan.planner_seconds:.2f} s)")
    return "\n".join(lines)
