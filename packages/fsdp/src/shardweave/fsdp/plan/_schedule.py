"""Replay of one training step's unshard / reshard / reduce order, in bytes, with no tensors.

Design note: the modeled step
    Groups are the ``fully_shard`` calls, in forward order (root first, wrapped modules in
    ``named_modules`` order, nested ones inside their parent). The replay is a state machine
    with the engine's hooks as its methods (``pre_forward``, ``post_forward``,
    ``pre_backward``, ``post_backward``, ``final_callback``); ``simulate_step`` drives it over a
    sequential model with no tensors (``walk``), and ``_activations`` drives it from the hooks
    of a fake-tensor forward and backward, so both follow one set of rules:

    unshard (pre-forward, pre-backward, prefetch) issues the all-gather: its output buffer,
    and the all-gather input when it is not the shard storage itself (a cast to
    ``param_dtype``, or the concatenated post-forward shards), become *communication
    buffers*. The wait (the group's own pre-forward / pre-backward) allocates the unsharded
    parameters (*gathered parameters*), copies out and frees the output buffer; a cast input
    is kept until the next all-gather is issued in forward (the engine orders the streams
    with it) and freed at the wait in backward. With one rank per shard group and no cast,
    the unsharded parameters view the shards: nothing is gathered or buffered.

    post-forward reshards: ``True`` frees the gathered parameters, ``False`` keeps them, an
    int ``N`` keeps a clone of ``1/N`` of them (*post-forward shards*, freed at the backward
    wait). A checkpoint's recompute in backward reshards nothing. The root (``None``) stays
    gathered until its post-backward.

    post-backward takes the group's *unsharded gradients*, frees the gathered parameters,
    and starts the reduction: the reduce-scatter input (``W x`` padded shard, reduce dtype)
    is allocated, the unsharded gradients are freed, the output (one padded shard) is
    allocated and the reduce-scatter issued (with one rank per shard group the input is copied
    into the output, which the engine allocates all the same, and an HSDP all-reduce is issued
    at once). When each reduction is retired is the engine's
    rule, read from ``_reduction`` (``reduce_scatters_to_retire``, as ``ReductionSchedule``
    applies it): the next post-backward first finishes the all-reduces issued at earlier
    retirements, then retires the oldest reduce-scatters until at most
    ``reduce_scatter_max_input_buffers`` inputs are alive with its own (its input is freed;
    under HSDP its all-reduce is issued and finished at a later post-backward), then the output
    becomes the *sharded gradients* (or is cast to the parameter dtype, a new tensor, and
    freed). The root's post-backward, and that of a module whose inputs need no grad, run in
    the final callback (root first), which then finishes every reduction. That is the CPU
    schedule; on accelerators (``stream_ordered``, the plan for NCCL) a reduction runs to its
    end when started: its sharded gradients exist from its post-backward on, its input is
    freed at its retirement, and so is an all-reduced output that is not the gradients (a
    cast's source, or one added into existing gradients).

    With ``set_to_none`` (``optimizer.zero_grad()``'s default) sharded gradients do not exist
    when the step starts and appear as reductions finish; otherwise they are there all along
    and each reduction's output is added into them and freed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

from shardweave.fsdp.comm._reduction import reduce_scatters_to_retire

__all__ = [
    "CATEGORIES",
    "GroupTraffic",
    "Replay",
    "ScheduleResult",
    "TimelineRecord",
    "simulate_step",
]

# The per-rank lines that change during a step, in report order.
CATEGORIES = (
    "gathered_params",
    "comm_buffers",
    "unsharded_grads",
    "post_forward_shards",
    "sharded_grads",
    "activations",
)


class _State(Enum):
    SHARDED = auto()
    POST_FORWARD = auto()
    UNSHARDED = auto()


@dataclass(frozen=True)
class GroupTraffic:
    """What the replay needs to know about one group (bytes per rank)."""

    key: str
    parent: str | None
    gathered_bytes: int  # unsharded parameters (0 when they alias the shards)
    all_gather_output_bytes: int  # the all-gather's output buffer (0: no collective)
    all_gather_input_bytes: int  # a copy of the shards as the all-gather input (0: none)
    post_forward_bytes: int  # the post-forward shards of an int reshard_after_forward
    post_forward_input_bytes: int  # their concatenation when gathered again (0: one param)
    unsharded_grad_bytes: int
    reduce_scatter_input_bytes: int
    # Allocated on the reduce-scatter stream also with one rank per shard group, where the
    # input is copied into it rather than reduce-scattered (``_reduction.GradientReduction``).
    reduce_scatter_output_bytes: int
    sharded_grad_bytes: int
    reduce_output_cast: bool  # reduce dtype differs from the parameters': output is cast
    all_reduce: bool  # HSDP: the reduce-scatter output is all-reduced over replicas
    reshard_after_forward: bool | int  # resolved: False / True / int N (2 <= N < shard size)
    deferred_post_backward: bool  # root, or a module whose inputs need no gradient
    # A dim other than 0 (shard_placement_fn): scratch for the copy-out, and the gradients
    # re-laid out as dim-0 chunks for the reduce-scatter input.
    copy_out_scratch_bytes: int = 0
    # Offload: the shards' device copy while it is cast (gone once the cast copy exists).
    all_gather_input_transient_bytes: int = 0
    reduce_scatter_layout_bytes: int = 0
    # Staging copies the backend makes while a collective runs (gloo: see _plan's BACKENDS).
    backend_all_gather_bytes: int = 0
    backend_reduce_scatter_bytes: int = 0
    backend_all_reduce_bytes: int = 0
    # False with one rank per shard group: no reduce-scatter runs (the copy is done at once),
    # so an HSDP all-reduce is issued at the group's post-backward, not at its retirement.
    reduce_scatter_issued: bool = True


@dataclass(frozen=True)
class TimelineRecord:
    """One event and the per-rank bytes of each dynamic line right after it."""

    phase: str
    group: str
    event: str
    delta: int
    gathered_bytes: int
    comm_buffer_bytes: int
    grad_bytes: int  # unsharded gradients
    post_forward_bytes: int
    sharded_grad_bytes: int
    activation_bytes: int

    @property
    def dynamic_bytes(self) -> int:
        return (
            self.gathered_bytes
            + self.comm_buffer_bytes
            + self.grad_bytes
            + self.post_forward_bytes
            + self.sharded_grad_bytes
            + self.activation_bytes
        )


@dataclass
class ScheduleResult:
    timeline: list[TimelineRecord] = field(default_factory=list)
    all_gathers: dict[str, int] = field(default_factory=dict)  # per group, per step
    peaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    peaks_at: dict[str, str] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, ""))
    peak_dynamic_bytes: int = 0
    peak_dynamic_at: str = ""
    peak_moment: tuple[str, str, str] = ("", "", "")  # (phase, group, event)
    at_peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))


class Replay:
    """The engine's per-group states and buffers, advanced by its hooks (see Design note)."""

    def __init__(
        self,
        groups: list[GroupTraffic],
        *,
        forward_prefetch: int = 0,
        backward_prefetch: int = 1,
        set_to_none: bool = True,
        keep_timeline: bool = True,
        reduce_scatter_max_input_buffers: int = 1,
        stream_ordered: bool = False,
    ) -> None:
        self.groups = {g.key: g for g in groups}
        self.order = [g.key for g in groups]
        self.root = self.order[0] if self.order else ""
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self.set_to_none = set_to_none
        self.keep_timeline = keep_timeline
        self.max_input_buffers = reduce_scatter_max_input_buffers
        # Accelerators (ReductionSchedule.start): each reduction runs to its end when started,
        # ordered by events; its input waits for its retirement, and so does an output another
        # stream used (an HSDP all-reduce's) that is not the gradients themselves.
        self.stream_ordered = stream_ordered
        self.kept_outputs: dict[str, int] = {}
        self.state = dict.fromkeys(self.order, _State.SHARDED)
        self.pending: set[str] = set()
        self.pending_from_post_forward: set[str] = set()
        self.kept_input = 0  # a forward all-gather's cast input, freed at the next all-gather
        self.post_forward_order: list[str] = []
        self.indices: dict[str, list[int]] = {k: [] for k in self.order}
        self.pre_backward_done: set[str] = set()
        self.post_backward_done: set[str] = set()
        self.reduce_scatters: list[GroupTraffic] = []
        self.all_reduces: list[GroupTraffic] = []
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        if not set_to_none:
            self.bytes["sharded_grads"] = sum(g.sharded_grad_bytes for g in groups)
        self.phase = "forward"
        self.current = self.root
        self.result = ScheduleResult(all_gathers=dict.fromkeys(self.order, 0))
        self._record("", "start", 0)

    # --- counters -----------------------------------------------------------------------------
    def add(self, category: str, delta: int, group: str, event: str) -> None:
        if delta:
            self.bytes[category] += delta
            # A free moves no peak (bytes change elsewhere only downwards: a gradient moved
            # out of "activations", a reduce output freed): recorded for the timeline only.
            if delta > 0 or self.keep_timeline:
                self._record(group, event, delta, category)

    def _record(self, group: str, event: str, delta: int, category: str | None = None) -> None:
        b = self.bytes
        res = self.result
        where = ""  # built only where a peak moves: most records move none (fit replays many)
        # only the category that grew can reach a new peak of its own
        for cat, value in b.items() if category is None else ((category, b[category]),):
            if value > res.peaks[cat]:
                where = where or f"{self.phase}: {group or self.current} {event}"
                res.peaks[cat] = value
                res.peaks_at[cat] = where
        total = sum(b.values())
        if total > res.peak_dynamic_bytes or not res.peak_dynamic_at:
            res.peak_dynamic_bytes = total
            res.peak_dynamic_at = where or f"{self.phase}: {group or self.current} {event}"
            res.peak_moment = (self.phase, group or self.current, event)
            res.at_peak = dict(b)
        if self.keep_timeline:
            res.timeline.append(
                TimelineRecord(
                    self.phase,
                    group,
                    event,
                    delta,
                    b["gathered_params"],
                    b["comm_buffers"],
                    b["unsharded_grads"],
                    b["post_forward_shards"],
                    b["sharded_grads"],
                    b["activations"],
                )
            )

    # --- group transitions (as FSDPParamGroup's) ----------------------------------------------
    def unshard(self, key: str) -> None:
        if key in self.pending or self.state[key] == _State.UNSHARDED:
            return
        g = self.groups[key]
        self.pending.add(key)
        if g.gathered_bytes == 0:
            return  # the unsharded parameters alias the shards: no collective, no buffer
        self.result.all_gathers[key] += 1 if g.all_gather_output_bytes else 0
        if self.kept_input:
            kept, self.kept_input = self.kept_input, 0
            self.add("comm_buffers", -kept, key, "previous all-gather input freed")
        transient = 0
        if self.state[key] == _State.POST_FORWARD:
            self.pending_from_post_forward.add(key)
            extra = g.post_forward_input_bytes
        else:
            extra, transient = g.all_gather_input_bytes, g.all_gather_input_transient_bytes
        # What the input is built from (a device copy, each parameter's cast) is alive while
        # the copy-in writes the output's slot, so beside the output.
        self.add("comm_buffers", transient, key, "copy-in source")
        self.add("comm_buffers", extra, key, "all-gather input")
        self.add("comm_buffers", g.all_gather_output_bytes, key, "all-gather issued")
        self.add("comm_buffers", -transient, key, "copy-in source freed")
        self.add("comm_buffers", g.backend_all_gather_bytes, key, "backend staging")

    def wait(self, key: str) -> None:
        if key not in self.pending:
            return
        self.pending.discard(key)
        g = self.groups[key]
        from_post_forward = key in self.pending_from_post_forward
        self.pending_from_post_forward.discard(key)
        self.state[key] = _State.UNSHARDED
        if g.gathered_bytes == 0:
            return
        self.add("comm_buffers", -g.backend_all_gather_bytes, key, "all-gather done")
        self.add("gathered_params", g.gathered_bytes, key, "copy-out")
        if g.copy_out_scratch_bytes:
            self.add("comm_buffers", g.copy_out_scratch_bytes, key, "copy-out scratch")
            self.add("comm_buffers", -g.copy_out_scratch_bytes, key, "scratch freed")
        self.add("comm_buffers", -g.all_gather_output_bytes, key, "all-gather output freed")
        if from_post_forward:
            self.add("post_forward_shards", -g.post_forward_bytes, key, "post-forward freed")
            self.add("comm_buffers", -g.post_forward_input_bytes, key, "input freed")
        elif self.phase == "forward":
            self.kept_input += g.all_gather_input_bytes
        else:
            self.add("comm_buffers", -g.all_gather_input_bytes, key, "all-gather input freed")

    def reshard(self, key: str, forward: bool) -> None:
        g = self.groups[key]
        mode = g.reshard_after_forward
        if forward and mode is False:
            return
        if self.state[key] != _State.UNSHARDED:
            return
        if forward and mode is not True:
            self.state[key] = _State.POST_FORWARD
            if g.gathered_bytes:
                self.add("post_forward_shards", g.post_forward_bytes, key, "post-forward kept")
        else:
            self.state[key] = _State.SHARDED
        self.add("gathered_params", -g.gathered_bytes, key, "reshard")

    # --- hooks --------------------------------------------------------------------------------
    def pre_forward(self, key: str) -> None:
        self.current = key
        self.unshard(key)
        self.wait(key)
        if self.phase != "forward" or key == self.root or self.forward_prefetch <= 0:
            return
        later = [k for k in self.order[self.order.index(key) + 1 :] if k != self.root]
        for target in later[: self.forward_prefetch]:
            self.unshard(target)

    def _leave(self, key: str) -> None:
        # Operators after a group's forward (or backward) belong to its parent's module.
        self.current = self.groups[key].parent or self.root

    def post_forward(self, key: str) -> None:
        if self.phase != "forward":
            return  # a checkpoint's recompute in backward: nothing resharded or reordered
        self._leave(key)
        self.reshard(key, forward=True)
        self.indices[key].append(len(self.post_forward_order))
        self.post_forward_order.append(key)
        if key == self.root and self.kept_input:
            kept, self.kept_input = self.kept_input, 0
            self.add("comm_buffers", -kept, key, "last all-gather input freed")

    def start_backward(self) -> None:
        self.phase = "backward"

    def pre_backward(self, key: str) -> None:
        if key in self.pre_backward_done:
            return
        self.pre_backward_done.add(key)
        self.current = key
        self.unshard(key)
        self.wait(key)
        if self.indices[key]:
            index = self.indices[key].pop()
            depth = 1 if key == self.root else max(1, self.backward_prefetch)
            for j in range(1, depth + 1):
                if index - j >= 0:
                    self.unshard(self.post_forward_order[index - j])

    def grads_computed(self, key: str) -> None:
        """The group's unsharded gradients appear (a tensor-free replay's stand-in for them)."""
        g = self.groups[key]
        self.add("unsharded_grads", g.unsharded_grad_bytes, key, "grads computed")

    def post_backward(self, key: str, free_grads: Callable[[], None] | None = None) -> None:
        """``free_grads`` drops the caller's own unsharded gradients (the fake-tensor run's);
        without it the replay's ``grads_computed`` bytes are freed."""
        if key in self.post_backward_done:
            return
        self.post_backward_done.add(key)
        self._leave(key)
        g = self.groups[key]
        self.reshard(key, forward=False)
        if not g.unsharded_grad_bytes:
            return
        for red in self.all_reduces:
            self._finish(red)
        self.all_reduces.clear()
        for _ in range(
            reduce_scatters_to_retire(len(self.reduce_scatters), self.max_input_buffers)
        ):
            self._retire(self.reduce_scatters.pop(0))
        self.add("comm_buffers", g.reduce_scatter_layout_bytes, key, "gradient re-layout")
        self.add("comm_buffers", g.reduce_scatter_input_bytes, key, "reduce-scatter input")
        self.add("comm_buffers", -g.reduce_scatter_layout_bytes, key, "re-layout freed")
        if free_grads is not None:
            free_grads()
        else:
            self.add("unsharded_grads", -g.unsharded_grad_bytes, key, "grads freed")
        self.add("comm_buffers", g.reduce_scatter_output_bytes, key, "reduce-scatter output")
        if g.reduce_scatter_issued:
            self.add("comm_buffers", g.backend_reduce_scatter_bytes, key, "backend staging")
        elif g.all_reduce:  # nothing to reduce-scatter: the all-reduce is issued at once
            self.add("comm_buffers", g.backend_all_reduce_bytes, key, "backend staging")
        self.reduce_scatters.append(g)
        if self.stream_ordered:
            if g.all_reduce and g.reduce_scatter_issued:
                self.add("comm_buffers", g.backend_all_reduce_bytes, key, "backend staging")
            self._finish(g, keep_output=g.all_reduce)

    def _retire(self, g: GroupTraffic) -> None:
        # The engine's _retire_reduce_scatter: the reduce-scatter is waited for (with one
        # rank, the copy was), its input released; an HSDP all-reduce is issued if it was not.
        if g.reduce_scatter_issued:
            self.add("comm_buffers", -g.backend_reduce_scatter_bytes, g.key, "backend done")
        self.add("comm_buffers", -g.reduce_scatter_input_bytes, g.key, "reduce-scatter done")
        if self.stream_ordered:  # finished when started; what it kept is released now
            self.add("comm_buffers", -self.kept_outputs.pop(g.key, 0), g.key, "output released")
            return
        if g.all_reduce and g.reduce_scatter_issued:
            self.add("comm_buffers", g.backend_all_reduce_bytes, g.key, "backend staging")
        if g.all_reduce:
            self.all_reduces.append(g)  # issued now, finished at the next post-backward
        else:
            self._finish(g)

    def _finish(self, g: GroupTraffic, keep_output: bool = False) -> None:
        """The reduction's end: the sharded gradients. ``keep_output``: an output that is
        not the gradients stays until the reduction is retired (accelerators, after an
        all-reduce: the reduce-scatter stream waits for its last use first)."""
        if g.all_reduce:
            self.add("comm_buffers", -g.backend_all_reduce_bytes, g.key, "all-reduce done")
        out = g.reduce_scatter_output_bytes
        if g.reduce_output_cast:  # cast to the parameters' dtype: a new tensor, then free
            made = g.sharded_grad_bytes if self.set_to_none else 0
            self.add("sharded_grads", made, g.key, "sharded grads (cast)")
            if not self.set_to_none:  # the cast copy is added into the grads, then freed
                self.add("comm_buffers", g.sharded_grad_bytes, g.key, "cast for accumulation")
                self.add("comm_buffers", -g.sharded_grad_bytes, g.key, "accumulated")
        elif self.set_to_none:  # the output becomes the sharded gradients
            self.bytes["comm_buffers"] -= out
            self.add("sharded_grads", g.sharded_grad_bytes, g.key, "sharded grads")
            return
        # A cast's source, or (accumulating) an output added into the existing gradients.
        if keep_output:
            self.kept_outputs[g.key] = out
        else:
            self.add("comm_buffers", -out, g.key, "reduce output freed")

    def final_callback(self) -> None:
        self.phase = "final_callback"
        for key in self.order:  # the root's state first, then the others in module order
            self.post_backward(key)
        # ReductionSchedule.finish: the all-reduces in flight, then every reduction left,
        # oldest first, each finished in full (all-reduce included) and retired.
        for red in self.all_reduces:
            self._finish(red)
        self.all_reduces.clear()
        for g in self.reduce_scatters:
            self._retire(g)
            for red in self.all_reduces:
                self._finish(red)
            self.all_reduces.clear()
        self.reduce_scatters.clear()
        self.phase = "after_backward"

    # --- a tensor-free step over a sequential model -------------------------------------------
    def walk(self) -> ScheduleResult:
        children: dict[str | None, list[str]] = {}
        for key in self.order:
            children.setdefault(self.groups[key].parent, []).append(key)

        def forward(key: str) -> None:
            self.pre_forward(key)
            for child in children.get(key, []):
                forward(child)
            self.post_forward(key)

        def backward(key: str) -> None:
            self.pre_backward(key)
            self.grads_computed(key)
            for child in reversed(children.get(key, [])):
                backward(child)
            if not self.groups[key].deferred_post_backward:
                self.post_backward(key)

        forward(self.root)
        self.start_backward()
        backward(self.root)
        self.final_callback()
        return self.result


def simulate_step(
    groups: list[GroupTraffic],
    *,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
    set_to_none: bool = True,
    reduce_scatter_max_input_buffers: int = 1,
    stream_ordered: bool = False,
) -> ScheduleResult:
    """Replay one step over ``groups`` (forward order, root first); see Design note above."""
    if not groups:
        return ScheduleResult()
    return Replay(
        groups,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        set_to_none=set_to_none,
        reduce_scatter_max_input_buffers=reduce_scatter_max_input_buffers,
        stream_ordered=stream_ordered,
    ).walk()
