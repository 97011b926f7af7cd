"""The execution layer: where the engine waits for its collectives, and what it overlaps.

Oracles: *compatibility* (torch's fully_shard trained in lockstep: bitwise the same shards and
gradients, so deferring waits and prefetching change no number) and *closed form* (the tracer's
hook spans and collective records say inside which hook each collective was issued or waited;
the engine's schedule fixes that exactly).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import FSDPTracer, fully_shard, trace
from shardweave.fsdp.tracing._recorder import CollectiveRecord, SpanRecord
from tests._dist import WorkerPool
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import assert_same_as_torch


def _traced_pair(rank: int, configure: Callable[[nn.Module], None], steps: int) -> FSDPTracer:
    """Train ours (traced) and torch's in lockstep on the per-block gpt; compare every step."""
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    shard_blocks(tmodel, torch_fully_shard)
    configure(model)
    with trace() as tracer:
        for step in range(steps):
            if step:
                tracer.step()
            batch = make_batch("gpt", 100 * step + rank)
            for m in (model, tmodel):
                loss_fn("gpt", m(batch), batch).backward()
            assert_same_as_torch(model, tmodel, f"step {step}")
            for m in (model, tmodel):
                m.zero_grad(set_to_none=True)
    return tracer


def _hook(tracer: FSDPTracer, name: str, group: str, step: int) -> SpanRecord:
    spans = [
        s
        for s in tracer.spans
        if s.category == "hook" and s.name == name and s.group == group and s.step == step
    ]
    assert len(spans) == 1, (name, group, step, spans)
    return spans[0]


def _collectives(tracer: FSDPTracer, kind: str, step: int) -> dict[str, CollectiveRecord]:
    """The first collective of ``kind`` per group in ``step``."""
    found: dict[str, CollectiveRecord] = {}
    for c in tracer.collectives:
        if c.kind == kind and c.step == step:
            found.setdefault(c.group, c)
    return found


def _within(t: int | None, span: SpanRecord) -> bool:
    return t is not None and span.begin_ns <= t <= span.end_ns


def deferred_reduce_scatter(rank: int, world: int, max_input_buffers: int) -> None:
    tracer = _traced_pair(
        rank,
        lambda m: m.set_reduce_scatter_max_input_buffers(max_input_buffers),  # type: ignore[operator]
        steps=2,
    )
    for step in range(2):
        rs = _collectives(tracer, "reduce_scatter", step)
        assert set(rs) == {"layers.0", "layers.1", "<root>"}, rs
        last_block = rs["layers.1"]  # the first group to reduce in backward
        assert last_block.wait_ns is not None and last_block.complete_ns is not None
        issued_in = _hook(tracer, "post_backward", "layers.1", step)
        next_post_backward = _hook(tracer, "post_backward", "layers.0", step)
        # Issued in its own post-backward, never waited there: the next group's backward
        # computes while it runs.
        assert _within(last_block.issue_ns, issued_in)
        assert not _within(last_block.wait_ns, issued_in)
        if max_input_buffers == 1:
            # Waited as soon as the next group needs room for its own reduce-scatter input.
            assert _within(last_block.wait_ns, next_post_backward), (last_block, next_post_backward)
            assert last_block.complete_ns <= rs["layers.0"].issue_ns
        else:
            # Two inputs may stay referenced: the next group issues without waiting.
            assert last_block.wait_ns >= next_post_backward.end_ns, (last_block, next_post_backward)
            assert last_block.complete_ns >= rs["layers.0"].issue_ns


def test_reduce_scatter_waited_at_next_post_backward(world2: WorkerPool) -> None:
    """Closed form (default max_input_buffers=1): a reduce-scatter is issued in its group's
    post-backward and waited in the next group's, before that one issues; gradients bitwise
    torch's."""
    world2.run(deferred_reduce_scatter, 1)


def test_max_input_buffers_two_defers_one_more_group(world2: WorkerPool) -> None:
    """Closed form: with two input buffers the next group issues its reduce-scatter before the
    previous one is waited on; gradients bitwise torch's."""
    world2.run(deferred_reduce_scatter, 2)


def implicit_forward_prefetch(rank: int, world: int, enable: bool) -> None:
    tracer = _traced_pair(
        rank,
        lambda m: m.set_implicit_forward_prefetch(enable),  # type: ignore[operator]
        steps=3,
    )
    for step in range(3):
        ag = _collectives(tracer, "all_gather", step)  # forward's come first
        issued_in_previous = _within(
            ag["layers.1"].issue_ns, _hook(tracer, "pre_forward", "layers.0", step)
        )
        # Step 0 learns the order; later steps prefetch layers.1 during layers.0's pre-forward.
        assert issued_in_previous == (enable and step > 0), (step, ag["layers.1"])


def test_implicit_forward_prefetch_issues_next_all_gather_early(world2: WorkerPool) -> None:
    """Closed form: with set_implicit_forward_prefetch(), from the second step on, layers.1's
    all-gather is issued inside layers.0's pre-forward; results bitwise torch's."""
    world2.run(implicit_forward_prefetch, True)


def test_forward_prefetch_off_by_default_as_torch(world2: WorkerPool) -> None:
    """Closed form: without the knob each forward all-gather is issued by its own module, as in
    torch's FSDP2."""
    world2.run(implicit_forward_prefetch, False)


def hsdp_style_all_reduce_hook_order(rank: int, world: int) -> list[str]:
    """The all-reduce hook sees the reduce-scatter output before division and assignment."""
    seen: list[str] = []
    model = make_model("gpt")
    shard_blocks(model, fully_shard)

    def hook(grads: torch.Tensor) -> None:
        # Before the post-divide and the assignment: no sharded gradient exists yet.
        seen.append("hook" if model.layers[1].fc1.weight.grad is None else "late")  # type: ignore[index,union-attr]

    model.layers[1].set_all_reduce_hook(hook)  # type: ignore[index,operator]
    batch = make_batch("gpt", rank)
    loss_fn("gpt", model(batch), batch).backward()
    assert model.layers[1].fc1.weight.grad is not None  # type: ignore[index,union-attr]
    return seen


def test_all_reduce_hook_runs_before_gradients_are_assigned(world2: WorkerPool) -> None:
    """Closed form: the deferred reduction still runs the hook exactly once per backward, on
    the reduced flat gradients, before the sharded gradients exist."""
    assert world2.run(hsdp_style_all_reduce_hook_order) == [["hook"], ["hook"]]


def retired_inputs_released(rank: int, world: int) -> list[bool]:
    """HSDP with one rank per shard group (2x1 mesh), on CPU: whether each retired reduction's
    reduce-scatter input was still referenced anywhere right after its retirement."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardweave.fsdp.comm._reduction import GradientReduction, ReductionSchedule

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inputs: dict[int, weakref.ref[torch.Tensor]] = {}
    alive: list[bool] = []
    start, retire = GradientReduction.start, ReductionSchedule._retire_reduce_scatter

    def recording_start(self: GradientReduction) -> None:
        start(self)
        assert self.reduce_scatter_input is not None
        inputs[id(self)] = weakref.ref(self.reduce_scatter_input)

    def checking_retire(self: ReductionSchedule, reduction: GradientReduction) -> None:
        retire(self, reduction)
        alive.append(inputs[id(reduction)]() is not None)

    GradientReduction.start = recording_start  # type: ignore[method-assign]
    ReductionSchedule._retire_reduce_scatter = checking_retire  # type: ignore[method-assign]
    try:
        model(torch.randn(4, 8)).sum().backward()
    finally:
        GradientReduction.start = start  # type: ignore[method-assign]
        ReductionSchedule._retire_reduce_scatter = retire  # type: ignore[method-assign]
    return alive


def test_one_rank_reduce_scatter_input_released_at_retirement(world2: WorkerPool) -> None:
    """Closed form (ReductionSchedule's rule, point 6): a retired reduction's input is released
    even while its HSDP all-reduce still runs. With one rank per shard group the input is
    copied into the output, then all-reduced; on CPU the reduction pauses at the all-reduce,
    and its paused sequence used to keep the input alive until the all-reduce finished (one
    group's input above the planner's peak, and above torch's, which drops it there)."""
    for alive in world2.run(retired_inputs_released):
        assert alive and not any(alive), alive
