"""Replay of one training step's unshard / reshard / reduce order, in bytes, with no tensors.

Design note: the modeled step
    Groups are the ``fully_shard`` calls, in forward order (root first, wrapped modules in
    ``named_modules`` order, nested ones inside their parent). One step is replayed as the
    engine's hooks run it:

    forward, recursively from the root: pre-forward unshards the group (all-gather) and, with
    ``forward_prefetch=k``, issues the all-gathers of the next ``k`` non-root groups; then its
    wrapped children run; then post-forward reshards it: ``True`` frees the gathered bytes,
    ``False`` keeps them, an int ``N`` frees them and keeps post-forward shards (``1/N`` of the
    padded parameters in the compute dtype). The root's default (``None``) keeps it gathered.

    backward, in reverse: pre-backward unshards the group again if it was resharded (a no-op
    when a prefetch already issued it) and prefetches the group whose forward finished just
    before this one's (the engine's implicit prefetch; ``backward_prefetch=k > 1`` prefetches
    the ``k`` previous groups instead, as explicit ``set_modules_to_backward_prefetch`` lists
    do); the group's unsharded gradients then appear (its backward compute); its wrapped
    children run; post-backward reshards it, takes its unsharded gradients and reduces them.
    The root's post-backward, and that of a wrapped ``nn.Embedding`` (its input needs no grad),
    run in the final callback after every other group (root first).

    Counters follow the tracer's definitions (``_trace``: Design note: traced quantities):
    *gathered* bytes become live when an all-gather is issued and die at reshard; *unsharded
    gradient* bytes live from post-backward's take until the reduce-scatter input is built.
    Two extra counters feed ``peak_tensor_bytes``: post-forward shards, and *held* gradients,
    live from the group's backward compute until reduced (so the root's, reduced last, are held
    through the whole backward). Not modeled: activations, all-gather / reduce-scatter staging
    buffers, the transient second copy during copy-out, activation-checkpoint recompute,
    modules run more than once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

__all__ = ["GroupTraffic", "ScheduleResult", "TimelineRecord", "simulate_step"]


class _State(Enum):
    SHARDED = auto()
    POST_FORWARD = auto()
    UNSHARDED = auto()


@dataclass(frozen=True)
class GroupTraffic:
    """What the schedule needs to know about one group."""

    key: str
    parent: str | None
    gathered_bytes: int  # all-gather output bytes (full padded group in the all-gather dtype)
    post_forward_bytes: int  # bytes kept per rank after an int reshard_after_forward
    unsharded_grad_bytes: int  # trainable params' unsharded gradients
    reshard_after_forward: bool | int  # resolved: False / True / int N (2 <= N < shard size)
    deferred_post_backward: bool  # root, or a wrapped nn.Embedding


@dataclass(frozen=True)
class TimelineRecord:
    """One change of the counters, with totals after it (event names as the tracer's).

    Example::

        p = plan(build_model, mesh=8, wrap="Block")
        peak = max(p.timeline, key=lambda r: r.dynamic_bytes)
        print(peak.phase, peak.event, peak.group, peak.dynamic_bytes)
        backward = [r for r in p.timeline if r.phase == "backward"]
    """

    phase: str  # "forward" | "backward" | "final_callback"
    group: str
    # unshard | reshard | grads_taken | grads_reduced as the tracer records them, plus the
    # planner-only grads_computed (held gradients appear; no tracer counterpart)
    event: str
    delta: int
    gathered_bytes: int
    grad_bytes: int
    post_forward_bytes: int
    held_grad_bytes: int

    @property
    def dynamic_bytes(self) -> int:
        return self.gathered_bytes + self.post_forward_bytes + self.held_grad_bytes


@dataclass
class ScheduleResult:
    timeline: list[TimelineRecord] = field(default_factory=list)
    all_gathers: dict[str, int] = field(default_factory=dict)  # per group, per step
    peak_gathered_bytes: int = 0
    peak_grad_bytes: int = 0
    peak_dynamic_bytes: int = 0
    peak_gathered_at: str = ""  # "phase: group event"
    peak_dynamic_at: str = ""


class _Replay:
    def __init__(self, groups: list[GroupTraffic], forward_prefetch: int, backward_prefetch: int):
        self.groups = {g.key: g for g in groups}
        self.order = [g.key for g in groups]
        self.children: dict[str | None, list[str]] = {}
        for g in groups:
            self.children.setdefault(g.parent, []).append(g.key)
        self.root = self.order[0]
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self.state = dict.fromkeys(self.order, _State.SHARDED)
        self.pending: set[str] = set()
        self.post_forward_order: list[str] = []
        self.indices: dict[str, list[int]] = {k: [] for k in self.order}
        self.gathered = self.grads = self.post_forward = self.held = 0
        self.phase = "forward"
        self.result = ScheduleResult(all_gathers=dict.fromkeys(self.order, 0))

    # --- counters -----------------------------------------------------------------------------
    def _record(self, group: str, event: str, delta: int) -> None:
        r = TimelineRecord(
            self.phase,
            group,
            event,
            delta,
            self.gathered,
            self.grads,
            self.post_forward,
            self.held,
        )
        self.result.timeline.append(r)
        res = self.result
        if r.gathered_bytes > res.peak_gathered_bytes:
            res.peak_gathered_bytes = r.gathered_bytes
            res.peak_gathered_at = f"{self.phase}: {group} {event}"
        res.peak_grad_bytes = max(res.peak_grad_bytes, r.grad_bytes)
        if r.dynamic_bytes > res.peak_dynamic_bytes:
            res.peak_dynamic_bytes = r.dynamic_bytes
            res.peak_dynamic_at = f"{self.phase}: {group} {event}"

    # --- group transitions (as FSDPParamGroup's) ----------------------------------------------
    def unshard(self, key: str) -> None:
        if key in self.pending or self.state[key] == _State.UNSHARDED:
            return
        g = self.groups[key]
        self.pending.add(key)
        self.result.all_gathers[key] += 1
        self.gathered += g.gathered_bytes
        self._record(key, "unshard", g.gathered_bytes)

    def wait(self, key: str) -> None:
        if key not in self.pending:
            return
        self.pending.discard(key)
        if self.state[key] == _State.POST_FORWARD:
            self.post_forward -= self.groups[key].post_forward_bytes
        self.state[key] = _State.UNSHARDED

    def reshard(self, key: str, forward: bool) -> None:
        g = self.groups[key]
        mode = g.reshard_after_forward
        if forward and mode is False:
            return
        if self.state[key] == _State.UNSHARDED:
            self.gathered -= g.gathered_bytes
            if forward and mode is not True:
                self.state[key] = _State.POST_FORWARD
                self.post_forward += g.post_forward_bytes
            else:
                self.state[key] = _State.SHARDED
            self._record(key, "reshard", -g.gathered_bytes)
        elif not forward and self.state[key] == _State.POST_FORWARD:
            self.state[key] = _State.SHARDED
            self.post_forward -= g.post_forward_bytes
            self._record(key, "reshard", 0)

    # --- hooks --------------------------------------------------------------------------------
    def forward(self, key: str) -> None:
        self.unshard(key)
        self.wait(key)
        if key != self.root and self.forward_prefetch > 0:
            later = [k for k in self.order[self.order.index(key) + 1 :] if k != self.root]
            for target in later[: self.forward_prefetch]:
                self.unshard(target)
        for child in self.children.get(key, []):
            self.forward(child)
        self.reshard(key, forward=True)
        self.indices[key].append(len(self.post_forward_order))
        self.post_forward_order.append(key)

    def backward(self, key: str) -> None:
        self.unshard(key)
        self.wait(key)
        if self.indices[key]:
            index = self.indices[key].pop()
            depth = 1 if key == self.root else max(1, self.backward_prefetch)
            for j in range(1, depth + 1):
                if index - j >= 0:
                    self.unshard(self.post_forward_order[index - j])
        g = self.groups[key]
        if g.unsharded_grad_bytes:
            self.held += g.unsharded_grad_bytes
            self._record(key, "grads_computed", g.unsharded_grad_bytes)
        for child in reversed(self.children.get(key, [])):
            self.backward(child)
        if not g.deferred_post_backward:
            self.post_backward(key)

    def post_backward(self, key: str) -> None:
        g = self.groups[key]
        self.reshard(key, forward=False)
        if g.unsharded_grad_bytes:
            self.grads += g.unsharded_grad_bytes
            self._record(key, "grads_taken", g.unsharded_grad_bytes)
            self.grads -= g.unsharded_grad_bytes
            self.held -= g.unsharded_grad_bytes
            self._record(key, "grads_reduced", -g.unsharded_grad_bytes)

    def run(self) -> ScheduleResult:
        self.phase = "forward"
        self.forward(self.root)
        self.phase = "backward"
        self.backward(self.root)
        self.phase = "final_callback"
        for key in self.order:  # the root's state first, then the others in module order
            if self.groups[key].deferred_post_backward:
                self.post_backward(key)
        return self.result


def simulate_step(
    groups: list[GroupTraffic], *, forward_prefetch: int = 0, backward_prefetch: int = 1
) -> ScheduleResult:
    """Replay one step over ``groups`` (forward order, root first); see Design note above."""
    if not groups:
        return ScheduleResult()
    return _Replay(groups, forward_prefetch, backward_prefetch).run()
