"""The pre-flight planner (``shardweave.fsdp.plan``).

Oracles: *closed form* (small models whose padding, bytes and schedule are computed by hand
here) and, for sharded sizes, the real engine: ``fully_shard`` on 2 gloo ranks, comparing what
each rank actually allocates (shard storages, all-gather outputs, sharded gradients,
AdamW state) with the plan. No process group is needed for the planner itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardweave.fsdp import MixedPrecisionPolicy, fully_shard
from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE
from shardweave.fsdp.core._state import get_fsdp_state
from shardweave.fsdp.plan import Plan, PlanError, format_table, plan
from tests._dist import WorkerPool
from tests.fsdp._models import Block, TinyGPT, loss_fn, make_batch, make_model

REPO = Path(__file__).resolve().parents[3]
F32, BF16 = 4, 2


class Stack(nn.Module):
    """Three blocks of different sizes, so the backward peak pairing is visible."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 5, bias=False)  # root: 15 params
        self.blocks = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)])
        self.blocks[1] = nn.Sequential(nn.Linear(5, 40), nn.Linear(40, 5))  # the big one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x


# --- closed form --------------------------------------------------------------------------------
def test_linear_padding_on_four_ranks() -> None:
    p = plan(lambda: nn.Linear(10, 7), mesh=4, optimizer="adamw")
    # weight (7, 10): ceil(7/4) = 2 rows per rank, padded to 8 rows; bias: 2 elements per rank
    assert p.groups[0].padded_shard_numel == 2 * 10 + 2
    assert p.sharded_param_bytes == 22 * F32
    assert p.grad_bytes == 22 * F32
    # optimizer state follows the real shard: rank 0 holds 2 rows, rank 3 holds 1 row; plus
    # Adam's 4-byte ``step`` per parameter
    assert p.optimizer_state_bytes == 2 * 22 * F32 + 2 * 4
    last = p.ranks["last_shard_rank"]
    assert last["real_shard_numel"] == 10 + 1
    assert last["optimizer_state_bytes"] == 2 * 11 * F32 + 2 * 4
    assert p.peak_gathered_param_bytes == 4 * 22 * F32
    # communication buffers: at most the reduce-scatter's input and output together
    assert p.peak_comm_buffer_bytes == 4 * 22 * F32 + 22 * F32
    assert p.unsharded_grad_bytes == 77 * F32  # real size, not padded
    # the root stays gathered after forward: one all-gather per step
    assert p.comm_bytes == {
        "all_gather": 4 * 22 * F32,
        "reduce_scatter": 4 * 22 * F32,
        "all_reduce": 0,
        "total": 8 * 22 * F32,
    }
    assert p.collectives == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0}
    # sharded params + optimizer state + (gathered params and the all-gather output they are
    # copied out of, live at once);
    # sharded grads appear at the end of backward (zero_grad's set_to_none)
    assert p.peak_tensor_bytes == 22 * F32 + (2 * 22 * F32 + 8) + 2 * 4 * 22 * F32
    assert p.lines_at_peak["gathered_params"] == p.lines_at_peak["comm_buffers"] == 4 * 22 * F32
    assert p.ranks["rank0"]["peak_tensor_bytes"] == p.peak_tensor_bytes
    # with the sharded grads kept between steps they are there all along
    kept = plan(lambda: nn.Linear(10, 7), mesh=4, optimizer="adamw", set_to_none=False)
    assert kept.peak_tensor_bytes == p.peak_tensor_bytes + 22 * F32
    assert p.world_size == 4 and p.shard_size == 4 and p.replicate_size == 1


def test_more_ranks_than_rows() -> None:
    p = plan(lambda: nn.Linear(4, 3, bias=False), mesh=8, optimizer="sgd")
    assert p.groups[0].padded_shard_numel == 4  # one (padded) row everywhere
    assert p.ranks["rank0"]["real_shard_numel"] == 4
    assert p.ranks["last_shard_rank"]["real_shard_numel"] == 0
    assert p.optimizer_state_bytes == 0


def test_mixed_precision_dtypes() -> None:
    p = plan(lambda: nn.Linear(10, 7), mesh=4, mp_policy="bf16")
    assert p.sharded_param_bytes == 22 * F32  # shards stay fp32
    assert p.peak_gathered_param_bytes == 4 * 22 * BF16
    assert p.unsharded_grad_bytes == 77 * BF16
    # reduce_dtype=None: in the parameters' dtype from torch 2.15, in param_dtype before
    default = F32 if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE else BF16
    assert p.comm_bytes["reduce_scatter"] == 4 * 22 * default
    q = plan(
        lambda: nn.Linear(10, 7),
        mesh=4,
        mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32),
    )
    assert q.comm_bytes["reduce_scatter"] == 4 * 22 * F32
    assert q.grad_bytes == 22 * F32
    # reduce dtype equal to param dtype means "the gradient's dtype"
    r = plan(lambda: nn.Linear(10, 7), mesh=4, mp_policy="bf16", reduce_dtype="bf16")
    assert r.comm_bytes["reduce_scatter"] == 4 * 22 * BF16


def test_param_dtype_override_fn() -> None:
    """torch 2.15's ``param_dtype_override_fn`` (offered on every torch): a bias kept in its
    own dtype is gathered in fp32, the weight in bf16; a bad answer is ``fully_shard``'s
    ``ValueError``, as a ``PlanError``. (The real engine's gathered bytes with an override:
    ``test_plan_vs_real``'s ``override`` case.)"""
    keep_bias = MixedPrecisionPolicy(
        torch.bfloat16,
        torch.float32,
        param_dtype_override_fn=lambda p: p.dtype if p.ndim == 1 else None,
    )
    p = plan(lambda: nn.Linear(10, 7), mesh=4, mp_policy=keep_bias)
    # weight: 7 rows padded to 8, 2 per rank, 10 columns; bias: 2 per rank
    assert p.peak_gathered_param_bytes == 4 * 20 * BF16 + 4 * 2 * F32
    everything_bf16 = plan(lambda: nn.Linear(10, 7), mesh=4, mp_policy="bf16")
    assert everything_bf16.peak_gathered_param_bytes == 4 * 22 * BF16
    fp16 = MixedPrecisionPolicy(torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16)
    with pytest.raises(PlanError, match="param_dtype_override_fn must return None"):
        plan(lambda: nn.Linear(10, 7), mesh=4, mp_policy=fp16)


def test_hsdp_all_reduce() -> None:
    p = plan(lambda: nn.Linear(10, 7), mesh="2x4", optimizer="sgd_momentum")
    assert (p.replicate_size, p.shard_size, p.world_size) == (2, 4, 8)
    assert p.comm_bytes["all_reduce"] == 22 * F32  # the reduce-scatter output
    assert p.collectives["all_reduce"] == 1
    assert p.optimizer_state_bytes == 22 * F32
    assert plan(lambda: nn.Linear(10, 7), mesh=(2, 4)).comm_bytes == p.comm_bytes
    # shard size 1: nothing is gathered or scattered, but the all-reduce still runs; the
    # unsharded parameters alias the shards, so no gathered bytes at all
    d = plan(lambda: nn.Linear(10, 7), mesh="8x1")
    assert d.collectives == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1}
    assert d.comm_bytes["all_reduce"] == 77 * F32
    assert d.peak_gathered_param_bytes == 0 and d.groups[0].aliases_shards
    # ... unless a cast to param_dtype makes a copy (no collective: the cast is the input)
    e = plan(lambda: nn.Linear(10, 7), mesh="8x1", mp_policy="bf16")
    assert e.peak_gathered_param_bytes == 77 * BF16 and e.collectives["all_gather"] == 0


def _stack_sizes() -> tuple[int, int, int, int]:
    # on 4 ranks, fp32: root (5, 3) -> 2 rows; blocks 0 and 2: (5,5)+(5,) -> 2 rows each
    root = 4 * (2 * 3) * F32
    small = 4 * (2 * 5 + 2) * F32
    big = 4 * ((10 * 5 + 10) + (2 * 40 + 2)) * F32  # (40,5)+(40,) and (5,40)+(5,)
    return root, small, big, small


def test_peak_gathered_schedule() -> None:
    root, b0, b1, b2 = _stack_sizes()

    def wrap(m: nn.Module) -> bool:
        if isinstance(m, nn.Sequential):
            return True
        return isinstance(m, nn.Linear) and m.in_features == 5 and m.out_features == 5

    p = plan(Stack, mesh=4, wrap=wrap, optimizer="sgd")
    assert [g.key for g in p.groups] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert [g.gathered_bytes for g in p.groups] == [root, b0, b1, b2]
    # gathered parameters (what modules compute with): root + one block at a time; the
    # prefetched previous block is an all-gather output in flight until its own pre-backward
    assert p.peak_gathered_param_bytes == root + b1
    assert p.peak_comm_buffer_bytes >= b1 + max(b0, b2) // 4  # a buffer beside a RS output
    assert p.collectives["all_gather"] == 1 + 2 * 3
    # reshard_after_forward=False: every block stays gathered until its backward
    q = plan(Stack, mesh=4, wrap=wrap, reshard_after_forward=False)
    assert q.peak_gathered_param_bytes == root + b0 + b1 + b2
    assert q.collectives["all_gather"] == 4
    # the root resharded too: it is gathered again in backward
    r = plan(Stack, mesh=4, wrap=wrap, root_reshard_after_forward=True)
    assert r.group("<root>").all_gathers_per_step == 2
    # explicit prefetch of 2 previous blocks in backward, 1 next block in forward: more
    # buffers in flight, the same gathered parameters
    s = plan(Stack, mesh=4, wrap=wrap, backward_prefetch=2, forward_prefetch=1)
    assert s.peak_gathered_param_bytes == root + b1
    assert s.peak_comm_buffer_bytes >= b0 + b1
    # tracer-comparable event order: forward then backward, each reshard after its unshard
    events = [
        (r.group, "unshard" if r.event == "all-gather issued" else r.event)
        for r in p.timeline
        if r.event in ("all-gather issued", "reshard")
    ]
    assert events[:7] == [
        ("<root>", "unshard"),
        ("blocks.0", "unshard"),
        ("blocks.0", "reshard"),
        ("blocks.1", "unshard"),
        ("blocks.1", "reshard"),
        ("blocks.2", "unshard"),
        ("blocks.2", "reshard"),
    ]
    assert events[7:] == [
        ("blocks.2", "unshard"),  # the root's implicit prefetch
        ("blocks.1", "unshard"),
        ("blocks.2", "reshard"),
        ("blocks.0", "unshard"),
        ("blocks.1", "reshard"),
        ("blocks.0", "reshard"),
        ("<root>", "reshard"),  # final callback
    ]


def test_reduce_scatter_max_input_buffers() -> None:
    """The replay retires reduce-scatters by the engine's rule (``_reduction``), so
    ``set_reduce_scatter_max_input_buffers(n)`` keeps up to ``n`` inputs alive in backward.
    Oracle: closed form (four groups with gradients: min(n, 4) inputs at once)."""

    def wrap(m: nn.Module) -> bool:
        if isinstance(m, nn.Sequential):
            return True
        return isinstance(m, nn.Linear) and m.in_features == 5 and m.out_features == 5

    def most_inputs_alive(p: Plan) -> int:
        alive = most = 0
        for r in p.timeline:
            alive += {"reduce-scatter input": 1, "reduce-scatter done": -1}.get(r.event, 0)
            most = max(most, alive)
        return most

    plans = {
        n: plan(Stack, mesh=4, wrap=wrap, optimizer="sgd", reduce_scatter_max_input_buffers=n)
        for n in (1, 2, 3)
    }
    assert {n: most_inputs_alive(p) for n, p in plans.items()} == {1: 1, 2: 2, 3: 3}
    assert plans[1].peak_comm_buffer_bytes <= plans[2].peak_comm_buffer_bytes
    assert plans[2].peak_comm_buffer_bytes <= plans[3].peak_comm_buffer_bytes


def test_int_reshard_after_forward() -> None:
    b1 = _stack_sizes()[2]
    wrap = "Sequential"
    p = plan(Stack, mesh=4, wrap=wrap, reshard_after_forward=2)
    big = p.group("blocks.1")
    assert big.reshard_after_forward == 2
    assert big.all_gathers_per_step == 2  # the backward one within 2 ranks: same output bytes
    assert big.all_gather_bytes == 2 * big.gathered_bytes
    assert big.post_forward_shard_bytes == b1 // 2
    assert (
        plan(Stack, mesh=4, wrap=wrap, reshard_after_forward=4)
        .group("blocks.1")
        .reshard_after_forward
        is True
    )
    assert (
        plan(Stack, mesh=4, wrap=wrap, reshard_after_forward=1)
        .group("blocks.1")
        .reshard_after_forward
        is False
    )
    with pytest.raises(PlanError, match="divide the shard size 4"):
        plan(Stack, mesh=4, wrap=wrap, reshard_after_forward=3)


def test_groups_follow_engine_discovery() -> None:
    # TinyGPT ties head.weight to tok.weight: both at the root, managed once
    p = plan(TinyGPT, mesh=2, wrap=Block)
    root = p.group("<root>")
    names = [q.fqn for q in root.params]
    assert "tok.weight" in names and not any(n.startswith("head.") for n in names)
    assert [g.key for g in p.groups] == ["<root>", "layers.0", "layers.1"]
    assert p.total_numel == sum(t.numel() for t in TinyGPT().parameters())
    # ignored parameters are left out
    model = TinyGPT()
    q = plan(model, mesh=2, wrap=Block, ignored_params={model.pos.weight})
    assert q.total_numel == p.total_numel - model.pos.weight.numel()
    # a weight tied across two groups is rejected, as fully_shard does at the first forward
    with pytest.raises(PlanError, match=r"tok\.weight"):
        plan(TinyGPT, mesh=2, wrap="Embedding")


def test_suggestions_flag_large_and_tiny_groups() -> None:
    p = plan(TinyGPT, mesh=2, wrap="Block,LayerNorm")
    text = " ".join(p.suggestions)
    assert "under 5% of the largest group" in text
    single = plan(TinyGPT, mesh=2)
    assert "only the root is sharded" in single.suggestions[0]
    assert "layers.0" in format_table(p)


def test_to_dict_is_json() -> None:
    p = plan(TinyGPT, mesh="2x2", wrap=Block, mp_policy="bf16")
    data = json.loads(json.dumps(p.to_dict(timeline=True)))
    assert data["comm_bytes"]["all_gather"] == p.comm_bytes["all_gather"]
    assert len(data["timeline"]) == len(p.timeline)


def test_module_is_callable_as_plan() -> None:
    """The issue's interface spells the API ``shardweave.fsdp.plan(...)``: the package calls
    :func:`plan` (same result as the function) and still runs as ``python -m``."""
    import shardweave.fsdp

    via_module = shardweave.fsdp.plan(TinyGPT, mesh=4, wrap=Block)  # type: ignore[operator]
    assert via_module.to_dict() == plan(TinyGPT, mesh=4, wrap=Block).to_dict() | {
        "planner_seconds": via_module.planner_seconds
    }


def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardweave.fsdp.plan",
            "--model",
            "tests.fsdp._models:TinyGPT",
            "--mesh",
            "2x4",
            "--wrap",
            "Block",
            "--mp",
            "bf16",
            "--reshard-after-forward",
            "2",
            "--optimizer",
            "sgd",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "gathered params, peak" in proc.stdout
    data = json.loads(out.read_text())
    for key in (
        "sharded_param_bytes",
        "grad_bytes",
        "optimizer_state_bytes",
        "peak_gathered_param_bytes",
        "peak_tensor_bytes",
        "unsharded_grad_bytes",
    ):
        assert isinstance(data[key], int)
    assert set(data["comm_bytes"]) >= {"all_gather", "reduce_scatter", "all_reduce"}
    assert (
        data["inputs"]["mesh"] == [2, 4] and data["inputs"]["model"] == "tests.fsdp._models:TinyGPT"
    )
    same = plan(
        TinyGPT, mesh="2x4", wrap=Block, mp_policy="bf16", reshard_after_forward=2, optimizer="sgd"
    )
    assert data["peak_tensor_bytes"] == same.peak_tensor_bytes
    bad = subprocess.run(
        [sys.executable, "-m", "shardweave.fsdp.plan", "--model", "nope", "--mesh", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "PKG.MODULE:FACTORY" in bad.stderr


def test_llama_70b_on_1024_ranks_is_fast() -> None:
    from demos.llama70b import llama_70b

    started = time.perf_counter()
    p = plan(llama_70b, mesh=1024, wrap="TransformerBlock", mp_policy="bf16")
    elapsed = time.perf_counter() - started
    assert elapsed < 20, f"planning took {elapsed:.1f} s"
    assert 70.5e9 < p.total_numel < 70.6e9
    assert len(p.groups) == 81 and p.largest_group == "<root>"
    block = p.group("layers.0")
    assert block.numel == 855_654_400 and block.all_gathers_per_step == 2
    assert p.peak_gathered_param_bytes == p.group("<root>").gathered_bytes + block.gathered_bytes
    assert any("tok_embeddings" in s for s in p.suggestions)


# --- the real engine on 2 ranks -----------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]


def engine_bytes(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """What fully_shard really allocates on this rank, in the planner's terms."""
    torch.manual_seed(0)
    model = make_model(cfg["kind"])
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(cfg.get("param_dtype"), cfg.get("reduce_dtype"))
    wrapped = (
        [m for m in model.modules() if isinstance(m, Block)]
        if cfg["kind"] == "gpt"
        else [
            model.in_proj,  # type: ignore[list-item]
            model.out_proj,  # type: ignore[list-item]
        ]
    )
    for m in wrapped:
        fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(cfg["kind"], seed=rank)
    loss_fn(cfg["kind"], model(batch), batch).backward()
    opt.step()
    groups = {}
    for m in model.modules():
        state = get_fsdp_state(m)
        if state is None:
            continue
        for group in state._fsdp_param_groups:
            groups[group._fqn] = group
    sharded = sum(
        p.sharded_param_data.numel() * p.sharded_param_data.element_size()
        for g in groups.values()
        for p in g.fsdp_params
    )
    # What the registered parameters' storages hold (each shard is its own allocation).
    param_storages = {
        _local(q).untyped_storage().data_ptr(): _local(q).untyped_storage().nbytes()
        for q in model.parameters()
    }
    storages = {}
    for param in model.parameters():
        if param.grad is not None:
            s = _local(param.grad).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    opt_bytes = sum(
        _local(t).numel() * _local(t).element_size()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    gathered: dict[str, int] = {}
    for m in model.modules():
        state = get_fsdp_state(m)
        if state is None:
            continue
        m.unshard()  # type: ignore[operator]
        for group in state._fsdp_param_groups:
            gathered[group._fqn] = sum(
                p.all_gather_output.untyped_storage().nbytes() for p in group.fsdp_params
            )
        m.reshard()  # type: ignore[operator]
    return {
        "sharded": sharded,
        "storage": sum(param_storages.values()),
        "grads": sum(storages.values()),
        "opt": opt_bytes,
        "gathered": gathered,
    }


@pytest.mark.parametrize(
    "cfg",
    [
        {"kind": "gpt"},
        {"kind": "gpt", "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
        {"kind": "mlp"},
    ],
    ids=["gpt", "gpt-bf16", "mlp"],
)
def test_matches_engine_allocations(world2: WorkerPool, cfg: dict[str, Any]) -> None:
    results = world2.run(engine_bytes, cfg)
    if cfg["kind"] == "gpt":
        wrap: Any = Block
        factory: Any = TinyGPT
    else:
        model = make_model("mlp")
        blocks = {model.in_proj, model.out_proj}  # head stays at the root

        def wrap(m: nn.Module) -> bool:
            return m in blocks

        factory = model
    mp = MixedPrecisionPolicy(cfg.get("param_dtype"), cfg.get("reduce_dtype"))
    p: Plan = plan(factory, mesh=2, wrap=wrap, mp_policy=mp, optimizer="adamw")
    for rank, got in enumerate(results):
        assert isinstance(got, dict)
        assert got["sharded"] == p.sharded_param_bytes == got["storage"]
        assert got["grads"] == p.grad_bytes
        row = "rank0" if rank == 0 else "last_shard_rank"
        assert got["opt"] == p.ranks[row]["optimizer_state_bytes"]
        assert got["gathered"] == {g.key: g.gathered_bytes for g in p.groups}


def test_readme_will_it_fit_example() -> None:
    """The README's "Will it fit?" figures are this plan's (so the README stays true)."""
    from demos.llama70b import llama_1b
    from shardweave.fsdp.plan._report import format_bytes

    p = plan(
        llama_1b,
        mesh=8,
        wrap="TransformerBlock",
        mp_policy="bf16",
        sample_input=((4, 2048), torch.long),
    )
    assert p.activations is not None
    readme = (REPO / "README.md").read_text()
    for figure in (p.activations.peak_bytes, p.activations.peak_activation_bytes):
        assert f"{format_bytes(figure)}" in readme, format_bytes(figure)
    assert p.activations.peak_group == "<root>" and p.activations.peak_phase == "forward"


def test_shard_placement_fn() -> None:
    from torch.distributed.tensor import Shard

    # Linear(8, 6).weight is (6, 8): Shard(1) on 4 ranks holds 2 of its 8 columns, no padding
    p = plan(lambda: nn.Linear(8, 6), mesh=4, shard_placement_fn=lambda q: Shard(q.ndim - 1))
    assert p.groups[0].padded_shard_numel == 6 * 2 + 2  # the bias (6,) on dim 0: 2 per rank
    assert p.sharded_param_bytes == 14 * F32
    # a dim the shard size does not divide is refused, as fully_shard refuses it
    with pytest.raises(PlanError, match="size 6 on dim 1"):
        plan(lambda: nn.Linear(6, 8), mesh=4, shard_placement_fn=lambda q: Shard(1))
    with pytest.raises(PlanError, match="Shard"):
        plan(lambda: nn.Linear(6, 8), mesh=4, shard_placement_fn=lambda q: "rows")


def test_cpu_offload() -> None:
    """CPUOffloadPolicy: shards, sharded grads and optimizer state are host memory; each
    all-gather copies the shards to the device first (straight into the output's slot)."""
    p = plan(lambda: nn.Linear(10, 7), mesh=4, optimizer="adamw", offload=True)
    assert p.host_bytes == 22 * F32 + 22 * F32 + (2 * 22 * F32 + 8)
    assert not p.groups[0].aliases_shards
    # the copy-out: the all-gather output and the gathered parameters, at once
    assert p.peak_tensor_bytes == 2 * 4 * 22 * F32
    # with a cast, the device copy is cast into the slot, then freed before the collective
    cast = plan(lambda: nn.Linear(10, 7), mesh=4, offload=True, mp_policy="bf16")
    # ... unless the reduction's copy-in is larger: from torch 2.15 the bf16 gradients (77
    # elements) are reduced in the parameters' fp32, a reduce-scatter input beside them
    rs_input = 4 * 22 * (F32 if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE else 2)
    assert cast.peak_tensor_bytes == max(2 * 4 * 22 * 2, rs_input + 77 * 2)
    assert p.lines_at_peak["sharded_params"] == p.lines_at_peak["sharded_grads"] == 0
    # shard size 1: offloaded shards are not aliased, they are copied to the device
    one = plan(lambda: nn.Linear(10, 7), mesh="2x1", offload=True)
    assert one.peak_gathered_param_bytes == 77 * F32 and one.collectives["all_gather"] == 0


def _one_rank_hsdp_replay(stream_ordered: bool) -> list[tuple[int, int]]:
    """(communication buffers, sharded gradients) after each post-backward of three groups on
    an R x 1 mesh whose bf16 reduce output is cast to fp32 gradients (100 bytes in and out,
    200 bytes of gradients each), in backward order c, b, a."""
    from shardweave.fsdp.plan._schedule import GroupTraffic, Replay

    def group(key: str, parent: str | None, grads: int) -> GroupTraffic:
        return GroupTraffic(
            key=key,
            parent=parent,
            gathered_bytes=0,
            all_gather_output_bytes=0,
            all_gather_input_bytes=0,
            post_forward_bytes=0,
            post_forward_input_bytes=0,
            unsharded_grad_bytes=grads,
            reduce_scatter_input_bytes=100,
            reduce_scatter_output_bytes=100,
            sharded_grad_bytes=200,
            reduce_output_cast=True,
            all_reduce=True,
            reshard_after_forward=True,
            deferred_post_backward=parent is None,
            reduce_scatter_issued=False,
        )

    replay = Replay(
        [group("r", None, 0), *(group(k, "r", 400) for k in "abc")],
        stream_ordered=stream_ordered,
    )
    replay.start_backward()
    lines = []
    for key in "cba":
        replay.grads_computed(key)
        replay.post_backward(key)
        lines.append((replay.bytes["comm_buffers"], replay.bytes["sharded_grads"]))
    replay.final_callback()
    assert replay.bytes["comm_buffers"] == 0 and replay.bytes["sharded_grads"] == 600
    return lines


def test_one_rank_hsdp_reduction_buffers() -> None:
    """Closed form (the engine's ReductionSchedule, R x 1): the input is copied into an output
    of its own, then all-reduced; the input is released when the next group's reduction
    retires it. On CPU the all-reduce is waited at the post-backward after that, when the
    output is cast into the gradients; on accelerators the reduction runs to its end at once
    (the gradients exist from then on) and the output waits for the next group's
    post-backward."""
    # CPU: own input and output, and the previous group's output (its all-reduce in flight).
    assert _one_rank_hsdp_replay(stream_ordered=False) == [(200, 0), (300, 0), (300, 200)]
    # Accelerators: own input and output; every gradient so far.
    assert _one_rank_hsdp_replay(stream_ordered=True) == [(200, 200), (200, 400), (200, 600)]
