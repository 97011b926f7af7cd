"""What ``plan()`` returns: ``Plan`` and its rows (``GroupPlan``, ``ParamPlan``,
``ActivationPlan``), plain frozen dataclasses that the planner fills and the report reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shardweave.fsdp.plan._schedule import TimelineRecord

__all__ = ["ActivationPlan", "GroupPlan", "ParamPlan", "Plan"]


@dataclass(frozen=True)
class ParamPlan:
    """One parameter of a group: its gathered shape, its original dtype's short name, and its
    elements per rank (the padded shard every rank holds; the real elements on shard rank 0
    and on the last shard rank).

    Example::

        for pp in p.group("layers.0").params:
            padding = pp.padded_shard_numel - pp.last_rank_numel  # zeros the last rank holds
            print(pp.fqn, pp.shape, pp.dtype, pp.requires_grad, padding)
    """

    fqn: str
    shape: tuple[int, ...]  # gathered shape (the TP-local shape under tensor parallelism)
    dtype: str
    requires_grad: bool
    padded_shard_numel: int
    rank0_numel: int
    last_rank_numel: int


@dataclass(frozen=True)
class GroupPlan:
    """One group's per-rank bytes and per-step traffic. ``key`` is the tracer's group key.

    Example::

        p = plan(build_model, mesh=64, wrap="Block")
        g = p.group("layers.0")  # the root's key is "<root>"
        print(g.gathered_bytes, g.all_gathers_per_step, g.reduce_scatter_bytes)
        biggest = max(p.groups, key=lambda g: g.gathered_bytes)
        assert biggest.key == p.largest_group
    """

    key: str
    module_type: str
    reshard_after_forward: bool | int
    num_params: int
    numel: int
    trainable_numel: int
    padded_shard_numel: int
    sharded_param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int  # shard rank 0 (the most)
    last_rank_optimizer_state_bytes: int
    rank0_numel: int  # real (unpadded) elements on shard rank 0
    last_rank_numel: int
    gathered_bytes: int  # one all-gather's output: W * padded shard numel in the gather dtype
    unsharded_grad_bytes: int
    post_forward_shard_bytes: int
    all_gathers_per_step: int
    all_gather_bytes: int  # per step
    reduce_scatters_per_step: int
    reduce_scatter_bytes: int  # per step (input bytes)
    all_reduces_per_step: int
    all_reduce_bytes: int  # per step
    children: tuple[tuple[str, int], ...]
    params: tuple[ParamPlan, ...] = field(repr=False)
    aliases_shards: bool = False  # one rank per shard group, no cast: nothing is gathered


@dataclass(frozen=True)
class ActivationPlan:
    """The step's peak with activations, from one fake-tensor forward and backward of a sample
    input under the engine's schedule (bytes per rank; see docs/plan.md, "Reading the report").

    ``peak_bytes`` is the most live tensor bytes on shard rank 0 during forward and backward
    (every line of the plan plus activations); ``peak_phase`` / ``peak_group`` say when
    (``"backward"``, ``"layers.3"``); ``lines_at_peak`` splits ``peak_bytes`` into the plan's
    lines at that moment; ``peaks`` gives each line's own peak over this step (unsharded
    gradients appear as autograd makes them here, not a group at a time).

    Example::

        p = plan(build_model, mesh=8, wrap="Block", sample_input=((8, 1024), torch.long))
        a = p.activations
        print(a.peak_bytes / 2**30, "GiB at", a.peak_phase, a.peak_group)
    """

    sample_input: str
    peak_bytes: int
    last_shard_rank_peak_bytes: int
    peak_phase: str
    peak_group: str
    peak_event: str
    peak_activation_bytes: int
    lines_at_peak: dict[str, int]
    peaks: dict[str, int]  # each line's own peak over the fake step (as ``CATEGORIES``)
    seconds: float
    step: str = ""  # the step planned, up to its loss (``_activations.resolve_step``)


@dataclass(frozen=True)
class Plan:
    """Per-rank predictions for one training step (bytes; shard rank 0, the most loaded).

    Memory on every rank is the same except optimizer state: the engine keeps padded shards
    (and padded sharded gradients) on every rank, while optimizer state follows the real shard,
    which is largest on shard rank 0; ``ranks`` gives rank 0 and the last shard rank. The
    lines (docs/plan.md defines each): ``sharded_param_bytes``, ``grad_bytes`` (sharded
    gradients), ``optimizer_state_bytes``, ``peak_gathered_param_bytes``,
    ``peak_comm_buffer_bytes``, ``unsharded_grad_bytes`` (its peak),
    ``peak_post_forward_shard_bytes``, and ``peak_tensor_bytes``, the peak of their sum at one
    moment of the step (``peak_at``; ``lines_at_peak`` splits it). Activations are in
    ``activations`` when a sample input was given.

    Example::

        p = plan(build_model, mesh="8x128", wrap="TransformerBlock", mp_policy="bf16")
        print(p.peak_tensor_bytes / 2**30, "GiB per rank before activations")
        print(p.comm_bytes["all_gather"], p.collectives["all_gather"])  # per step
        for hint in p.suggestions:  # regrouping hints, most important first
            print(hint)
        Path("plan.json").write_text(json.dumps(p.to_dict(params=False), default=str))
    """

    inputs: dict[str, object]
    world_size: int
    shard_size: int
    replicate_size: int
    total_numel: int
    sharded_param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    peak_gathered_param_bytes: int
    peak_comm_buffer_bytes: int
    unsharded_grad_bytes: int
    peak_post_forward_shard_bytes: int
    peak_tensor_bytes: int
    peak_at: str
    lines_at_peak: dict[str, int]
    comm_bytes: dict[str, int]
    collectives: dict[str, int]
    ranks: dict[str, dict[str, int]]
    groups: tuple[GroupPlan, ...]
    largest_group: str
    suggestions: tuple[str, ...]
    schedule: dict[str, object]
    timeline: tuple[TimelineRecord, ...] = field(repr=False)
    activations: ActivationPlan | None = None
    host_bytes: int = 0  # with offload: sharded params, sharded grads, optimizer state
    planner_seconds: float = 0.0

    def group(self, key: str) -> GroupPlan:
        for g in self.groups:
            if g.key == key:
                return g
        raise KeyError(f"no group {key!r}; groups: {[g.key for g in self.groups]}")

    def to_dict(self, *, params: bool = True, timeline: bool = False) -> dict[str, object]:
        """JSON-ready (dtypes as names); per-parameter rows and the timeline are optional."""
        out = asdict(self)
        if not params:
            for g in out["groups"]:
                g.pop("params")
        out["timeline"] = [asdict(r) for r in self.timeline] if timeline else None
        if not timeline:
            out.pop("timeline")
        return out
