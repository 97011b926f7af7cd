"""Folding a stack of identical blocks: one fake-tensor step over a few of them stands for all.

``fit`` replays one recorded fake step per wrapping choice, and a fake step costs about a
millisecond per operator (FakeTensor dispatch), so a 70 B Llama's 80 blocks cost seconds per
step. The blocks of a ``ModuleList`` whose children share a class and parameter shapes do the
same work, so the step is run with the list cut to its first ``keep`` blocks, and the events
recorded between block boundaries (markers this module's hooks write) are repeated for the
blocks that were cut, with the blocks' group keys renamed.

What makes it exact, not an approximation:

* the edge blocks (the first and the last) are recorded as they ran, so what happens between
  the stack and the rest of the model (the first block's input, the last block's output) is
  never copied;
* each middle block of the full model is a copy of the kept block with the same index modulo
  ``period`` (activation checkpointing every k-th block makes blocks alike only k apart), and
  the kept middle blocks must already repeat with that period (checked in ``unfold``), or the
  step is run unfolded;
* the events are deltas (bytes allocated and freed, calls into the schedule's replay keyed by
  group), never running totals, so a copied segment means the same wherever it lands;
* a group that holds parameters of several blocks and runs its own post-backward (a wrapped
  container of unwrapped blocks; the root's runs in the final callback, from its traffic)
  frees the gradients of the cut blocks there too: those bytes are added to its recorded
  free, after checking that the recorded free is exactly its kept parameters' gradient
  bytes.

Markers: ``("mark", "fwd", j)`` when block ``j``'s forward starts (before any group's hook on
it) and ``("mark", "bout", j)`` when the gradient of its output arrives (before the engine's
pre-backward hook on that output).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn
from torch.utils import _pytree as pytree

from shardweave.fsdp.plan._model import ROOT_KEY, GroupSpec

Events = list[tuple[Any, ...]]

MIN_BLOCKS: Final = 6  # below this a fold saves little and the edges are most of the step


@dataclass(frozen=True)
class Fold:
    """A stack to fold: ``fqn`` names the ``ModuleList``/``Sequential`` of ``blocks`` alike
    children, of which the first ``keep`` run; middle blocks repeat with ``period``."""

    fqn: str
    blocks: int
    keep: int
    period: int


def find_fold(model: nn.Module, period: int) -> Fold | None:
    """The largest stack of alike blocks (same class, same parameter and buffer names,
    shapes and dtypes, same plain attributes) worth folding, or None."""
    best: tuple[int, Fold] | None = None
    for fqn, module in model.named_modules():
        if not fqn or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < MIN_BLOCKS or len({_signature(c) for c in children}) != 1:
            continue
        if not _attributes_agree(children):
            continue
        # keep: the first block, two periods to compare, then a last block whose index is
        # the full stack's last modulo the period (so its checkpointing matches)
        keep = 2 * period + 2
        keep += (len(children) - keep) % period
        if keep + period > len(children):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, Fold(fqn, len(children), keep, period))
    return best[1] if best is not None else None


def _signature(block: nn.Module) -> tuple[Any, ...]:
    """What must agree between blocks for one to stand for another (with
    ``_attributes_agree``): the class, the submodule tree, parameters and buffers."""
    return (
        type(block),
        tuple((type(m).__name__, n) for n, m in block.named_modules()),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
    )


def _attributes_agree(blocks: Sequence[nn.Module]) -> bool:
    """The plain attributes of every submodule (numbers, strings, None, tuples of them) are
    the same in all blocks (a per-layer attention type or window differs there), except one
    that holds each block's own position (a ``layer_idx``)."""
    per_block = [
        {
            (name, key): value
            for name, m in block.named_modules()
            for key, value in vars(m).items()
            if not key.startswith("_") and _is_plain(value)
        }
        for block in blocks
    ]
    for k in set().union(*per_block):
        values = [attrs.get(k, _MISSING) for attrs in per_block]
        if all(type(v) is type(values[0]) and v == values[0] for v in values):
            continue
        if not all(type(v) is int and v == i for i, v in enumerate(values)):
            return False
    return True


_MISSING: Final = object()


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(_is_plain(v) for v in value)


def cut(model: nn.Module, fold: Fold) -> None:
    """Keep only the first ``fold.keep`` blocks of the stack (in place)."""
    stack = model.get_submodule(fold.fqn)
    kept = list(stack.children())[: fold.keep]
    short = nn.ModuleList(kept) if isinstance(stack, nn.ModuleList) else nn.Sequential(*kept)
    parent_fqn, _, name = fold.fqn.rpartition(".")
    model.get_submodule(parent_fqn)._modules[name] = short


def kept_specs(model: nn.Module, specs: Sequence[GroupSpec]) -> list[GroupSpec]:
    """The groups whose module the cut model still has."""
    present = {n for n, _ in model.named_modules()}
    return [s for s in specs if s.key == ROOT_KEY or s.key in present]


def install_markers(model: nn.Module, fold: Fold, replay: Any) -> list[Any]:
    """Hooks on the kept blocks writing the markers (see the module docstring); installed
    after the engine's hooks, prepended so they run first."""
    stack = model.get_submodule(fold.fqn)
    handles: list[Any] = []
    for j, block in enumerate(stack.children()):

        def pre(_m: nn.Module, _args: Any, j: int = j) -> None:
            if replay.phase == "forward":
                replay.mark("fwd", j)

        def post(_m: nn.Module, _args: Any, output: Any, j: int = j) -> None:
            if replay.phase != "forward":
                return
            fired: list[bool] = []

            def on_grad(grad: torch.Tensor) -> torch.Tensor:
                if not fired:
                    fired.append(True)
                    replay.mark("bout", j)
                return grad

            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(on_grad)  # type: ignore[no-untyped-call]

        handles.append(block.register_forward_pre_hook(pre, prepend=True))
        handles.append(block.register_forward_hook(post, prepend=True))
    return handles


class FoldMismatch(Exception):
    """The kept blocks did not repeat: the step must run unfolded."""


def unfold(
    events: Events,
    fold: Fold,
    grad_bytes_of: Callable[[str], tuple[int, int]],
) -> Events:
    """The full stack's event stream from the cut run's. ``grad_bytes_of(key)``: the gradient
    bytes of group ``key``'s parameters in one block of the stack, and in all the cut model
    kept, for the spanning groups' frees (see ``_spanning_free``)."""
    n, keep, p = fold.blocks, fold.keep, fold.period
    fwd = {j: _index(events, ("mark", "fwd", j)) for j in range(keep)}
    bout = {j: _index(events, ("mark", "bout", j)) for j in range(keep)}

    def template(i: int) -> int:  # the kept block a middle block copies
        return 1 + (i - 1) % p

    fwd_seg = {j: _unmarked(events[fwd[j] : fwd[j + 1]]) for j in range(1, keep - 1)}
    bwd_seg = {j: _unmarked(events[bout[j] : bout[j - 1]]) for j in range(1, keep - 1)}
    for j in range(1 + p, keep - 1):  # the kept middle blocks repeat with the period
        if _rename(fwd_seg[j - p], fold, p) != fwd_seg[j]:
            raise FoldMismatch(f"block {j}'s forward differs from block {j - p}'s")
        if _rename(bwd_seg[j - p], fold, p) != bwd_seg[j]:
            raise FoldMismatch(f"block {j}'s backward differs from block {j - p}'s")
    forward_middle: Events = []
    for i in range(1, n - 1):
        forward_middle += _rename(fwd_seg[template(i)], fold, i - template(i))
    backward_middle: Events = []
    for i in range(n - 2, 0, -1):
        backward_middle += _rename(bwd_seg[template(i)], fold, i - template(i))
    last = n - keep
    out = (
        events[: fwd[1]]
        + forward_middle
        + _rename(events[fwd[keep - 1] : bout[keep - 2]], fold, last, first=1)
        + backward_middle
        + events[bout[0] :]
    )
    return _spanning_free(_unmarked(out), fold, grad_bytes_of)


def _unmarked(events: Events) -> Events:
    return [ev for ev in events if ev[0] != "mark"]


def _index(events: Events, marker: tuple[Any, ...]) -> int:
    for i, ev in enumerate(events):
        if ev == marker:
            return i
    raise FoldMismatch(f"no marker {marker} (the stack's blocks did not all run)")


def _rename(segment: Events, fold: Fold, offset: int, first: int = 0) -> Events:
    """``segment`` with every group key of a block ``j >= first`` of the stack read as block
    ``j + offset`` (nested post-backward lists included)."""
    if offset == 0:
        return list(segment)
    pattern = re.compile(rf"^{re.escape(fold.fqn)}\.(\d+)(?=\.|$)")

    def shift(m: re.Match[str]) -> str:
        j = int(m.group(1))
        return f"{fold.fqn}.{j + offset if j >= first else j}"

    def key(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(shift, value)
        if isinstance(value, list):
            return [tuple(key(v) for v in ev) for ev in value]
        return value

    return [(ev[0], *(key(v) for v in ev[1:])) for ev in segment]


def _spanning_free(
    events: Events, fold: Fold, grad_bytes_of: Callable[[str], tuple[int, int]]
) -> Events:
    """Each group holding parameters of the cut blocks frees their gradients at its
    post-backward: the recorded free covered the kept blocks only."""
    cut_blocks = fold.blocks - fold.keep
    out: Events = []
    for ev in events:
        if ev[0] == "post_backward":
            per_block, kept_total = grad_bytes_of(ev[1])
            if per_block:
                nested = list(ev[2])
                freed = -sum(  # ("bytes" | "add", category, delta, ...)
                    e[2] for e in nested if e[0] in ("bytes", "add") and e[1] == "unsharded_grads"
                )
                if freed != kept_total:
                    raise FoldMismatch(
                        f"group {ev[1]} freed {freed} gradient bytes, {kept_total} expected"
                    )
                nested.append(("bytes", "unsharded_grads", -per_block * cut_blocks))
                ev = (ev[0], ev[1], nested)
        out.append(ev)
    return out
