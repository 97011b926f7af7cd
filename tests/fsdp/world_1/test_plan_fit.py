"""``fit()`` / ``--fit``: the planner's "make it fit" search.

Oracle: ``plan()`` itself. Every configuration's peak in ``fit`` is derived by replaying one
fake step's recorded calls; it must equal ``plan(...)``'s own peak with activations for that
configuration (one fake step each), for every search dimension. The rest is closed form: the
budget parser's units, the ranking order, the JSON schema, and the answer when nothing fits.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import asdict, astuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardweave.fsdp import MixedPrecisionPolicy
from shardweave.fsdp._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE
from shardweave.fsdp.plan import (
    FitConfig,
    PlanError,
    fit,
    format_fit,
    format_table,
    parse_budget,
    plan,
)
from shardweave.fsdp.plan._activations import resolve_step
from shardweave.fsdp.plan._apply import checkpoint_blocks
from shardweave.fsdp.plan._fold import find_fold
from shardweave.fsdp.plan._layouts import layouts, microbatches
from shardweave.fsdp.plan._model import discover_groups, module_wrap_predicate
from shardweave.fsdp.plan._plan import group_plans
from shardweave.fsdp.plan._recording import flops_and_trace
from shardweave.fsdp.plan._time_model import DEVICES, STEP_TERMS

SAMPLE = ((2, 16), torch.long)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab: int = 37, dim: int = 24, layers: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def mlp_stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 3)
    )


@pytest.fixture(scope="module")
def searched() -> Any:
    return fit(
        Net, mesh=2, sample_input=SAMPLE, budget="1GiB", allow_lower_precision=True, backend="gloo"
    )


def test_parse_budget_units() -> None:
    assert parse_budget("24GiB") == 24 * 2**30
    assert parse_budget("24G") == 24 * 2**30
    assert parse_budget("24GB") == 24 * 10**9  # SI, documented
    assert parse_budget("1.5 MiB") == 3 * 2**19
    assert parse_budget(1000) == parse_budget("1000") == 1000
    for bad in ("24 parsecs", "GiB", "-3GiB", "0", ""):
        with pytest.raises(PlanError, match="budget"):
            parse_budget(bad)


def _plan_peak(cfg: FitConfig) -> int:
    def factory() -> nn.Module:
        model = Net()
        if cfg.wrap and cfg.checkpoint_every:
            checkpoint_blocks(model, cfg.wrap, cfg.checkpoint_every)
        return model

    p = plan(
        factory,
        mesh=2,
        wrap=cfg.wrap,
        mp_policy=cfg.param_dtype,
        reduce_dtype=cfg.reduce_dtype,
        reshard_after_forward=cfg.reshard_after_forward,
        root_reshard_after_forward=cfg.root_reshard_after_forward,
        sample_input=SAMPLE,
        target=cfg.target,
        offload=cfg.offload,
    )
    assert p.activations is not None
    return p.activations.peak_bytes


GLOO = "cpu/gloo"


def test_replayed_peaks_equal_plan(searched: Any) -> None:
    """One configuration per searched dimension, each against its own fake step in plan()."""
    by_cfg = {c: f for f in searched.kept for c in (f.config, *f.alternatives)}
    base = FitConfig("Block", True, False, None, None, 0, False, target=GLOO, mesh=(2,))
    variants = [
        base,
        dataclasses.replace(base, reshard_after_forward=False),
        dataclasses.replace(base, root_reshard_after_forward=True),
        dataclasses.replace(base, param_dtype="bf16", reduce_dtype="fp32"),
        dataclasses.replace(base, param_dtype="bf16", checkpoint_every=1),
        dataclasses.replace(base, reshard_after_forward=False, checkpoint_every=2),
        FitConfig(None, True, True, None, None, 0, False, target=GLOO, mesh=(2,)),
    ]
    for cfg in variants:
        assert cfg in by_cfg, cfg
        assert by_cfg[cfg].peak_bytes == _plan_peak(cfg), cfg
    # offload, on an accelerator target (the accelerator's schedule, gloo's staging)
    on_gpus = fit(
        Net,
        mesh=2,
        sample_input=SAMPLE,
        budget="1GiB",
        wrap="Block",
        target="cuda/gloo",
        checkpoint_choices=(2,),
    )
    cfg = FitConfig("Block", False, False, None, None, 2, True, target="cuda/gloo", mesh=(2,))
    row = next(f for f in on_gpus.kept if cfg in (f.config, *f.alternatives))
    assert row.peak_bytes == _plan_peak(cfg)


def test_ranked_by_step_time_and_fit(searched: Any) -> None:
    times = [f.step_seconds for f in searched.kept]
    assert times == sorted(times)
    assert all(f.peak_bytes <= searched.budget_bytes for f in searched.kept)
    assert searched.searched >= len(searched.kept) > 0
    for f in searched.kept:
        assert f.dominant in STEP_TERMS
        assert f.step_seconds == pytest.approx(sum(f.terms[k] for k in STEP_TERMS))
        # checkpointing recomputes: more FLOPs than the same configuration without it
    flops = {
        (f.config.wrap, f.config.param_dtype, f.config.checkpoint_every): f.terms["flops"]
        for f in searched.kept
    }
    assert flops[("Block", None, 1)] > flops[("Block", None, 2)] > flops[("Block", None, 0)]
    space = searched.search_space
    assert "not searched (fixed)" in space and "time model" in space


def test_budget_below_default_finds_smaller_and_is_monotone(searched: Any) -> None:
    default_cfg = FitConfig("Block", True, False, None, None, 0, False, target=GLOO, mesh=(2,))
    default = next(f for f in searched.kept if default_cfg in (f.config, *f.alternatives))
    budget = default.peak_bytes - 1
    tight = fit(Net, mesh=2, sample_input=SAMPLE, budget=budget, wrap="Block", backend="gloo")
    assert tight.kept and all(f.peak_bytes <= budget for f in tight.kept)
    assert default_cfg not in {c for f in tight.kept for c in (f.config, *f.alternatives)}
    tighter = fit(
        Net,
        mesh=2,
        sample_input=SAMPLE,
        budget=tight.kept[0].peak_bytes - 1,
        wrap="Block",
        backend="gloo",
    )
    if tighter.kept:  # a smaller budget never gives a faster best plan
        assert tighter.kept[0].step_seconds >= tight.kept[0].step_seconds


def test_nothing_fits_is_an_answer() -> None:
    r = fit(
        Net,
        mesh=2,
        sample_input=SAMPLE,
        budget=1000,
        wrap="Block",
        backend="gloo",
        checkpoint_choices=(0,),
    )
    assert not r.kept and r.smallest is not None
    text = " ".join(r.advice)
    assert "smallest peak" in text and "4 ranks" in text and "smaller sample input" in text
    assert r.to_dict()["kept"] == []


def test_bad_inputs() -> None:
    with pytest.raises(PlanError, match=r"candidates.*Block"):
        fit(Net, mesh=2, sample_input=SAMPLE, budget="1GiB", wrap="NoSuchBlock")
    with pytest.raises(PlanError, match="sample_input"):
        fit(
            mlp_stack,
            mesh=2,
            sample_input=((4, 7), torch.float32),
            budget="1GiB",
            wrap="Linear",
            checkpoint_choices=(0,),
            offload_choices=(False,),
        )

    def on_cuda_only() -> nn.Module:
        raise RuntimeError("needs a real device")

    with pytest.raises(PlanError, match="meta device"):
        fit(on_cuda_only, mesh=2, sample_input=SAMPLE, budget="1GiB")


# The CLI's arguments for the tiny Net of this module on 2 gloo ranks.
NET_CLI = (
    "--model",
    "tests.fsdp.world_1.test_plan_fit:Net",
    "--mesh",
    "2",
    "--sample-input",
    "2x16:long",
    "--wrap",
    "Block",
    "--backend",
    "gloo",
)


def test_cli_json_and_nothing_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In-process ``main`` (the ``python -m`` entry is covered by test_plan's CLI test)."""
    from shardweave.fsdp.plan.__main__ import main

    out = tmp_path / "fit.json"
    base = list(NET_CLI)
    assert main([*base, "--fit", "1GiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the winner as code" in text and "estimate" in text and "search space" in text
    data = json.loads(out.read_text())
    assert data["budget_bytes"] == 2**30
    assert set(data["kept"][0]) >= {"config", "peak_bytes", "step_seconds", "margin_bytes"}
    assert data["searched"] >= len(data["kept"]) and data["search_seconds"] > 0
    assert data["kept"][0]["margin_bytes"] == 2**30 - data["kept"][0]["peak_bytes"]
    assert main([*base, "--fit", "1KiB"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    assert main([*base, "--fit", "lots"]) == 2
    assert "cannot read the budget" in capsys.readouterr().err


def test_candidates_prefer_own_blocks_and_cover_an_mlp_stack() -> None:
    """Repeated classes with parameters, the model's own before torch's leaf layers; a plain
    nn.Sequential stack falls back to its Linear layers."""
    r = fit(
        Net,
        mesh=4,
        sample_input=SAMPLE,
        budget="1GiB",
        checkpoint_choices=(0,),
        offload_choices=(False,),
    )
    assert r.search_space["wrap"] == ["Block", "(root only)"]
    m = fit(
        mlp_stack,
        mesh=4,
        sample_input=((8, 12), torch.float32),
        budget="1GiB",
        checkpoint_choices=(0, 1),
        offload_choices=(False,),
    )
    assert m.search_space["wrap"] == ["Linear", "(root only)"]
    assert m.kept and m.kept[0].peak_bytes <= m.budget_bytes


# --- folding a stack of alike blocks (shardweave.fsdp.plan._fold) --------------------------------
# Oracle: the same search with fold=False (every block run), whose peaks the tests above tie to
# plan()'s. Nine blocks: folded runs keep 4 (7 with checkpointing every 2nd block).


def deep_net() -> Net:
    return Net(layers=9)


def _rows(result: Any) -> list[tuple[str, int, float]]:
    rows = [(f.config.describe(), f.peak_bytes, f.step_seconds) for f in result.kept]
    smallest = result.smallest
    return [*sorted(rows), ("smallest", smallest.peak_bytes, smallest.step_seconds)]


def test_fold_is_exact() -> None:
    kwargs: dict[str, Any] = dict(
        mesh=4, sample_input=SAMPLE, budget="1GiB", allow_lower_precision=True, backend="gloo"
    )
    folded = fit(deep_net, **kwargs)
    full = fit(deep_net, fold=False, **kwargs)
    # every fake step folded: each wrap (the root alone included, whose group spans the
    # blocks), each precision, checkpointing of every block and of every 2nd
    assert len(folded.folded) == folded.fake_steps == full.fake_steps
    assert set(folded.folded) == {"layers: 9 blocks run as 4", "layers: 9 blocks run as 7"}
    assert full.folded == ()
    assert _rows(folded) == _rows(full)
    assert "folded (layers: 9 blocks run as 4" in format_fit(folded)


class Counted(Block):
    """A block whose third call in a forward allocates more (it behaves by position, with
    nothing in its attributes to say so)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counted.calls += 1
        if Counted.calls % 9 == 3:
            x = x + torch.cat([x, x], dim=-1)[..., : x.shape[-1]]
        return super().forward(x)


class ByPosition(Net):
    def __init__(self, attribute: bool) -> None:
        super().__init__(layers=9)
        if attribute:  # e.g. a per-layer attention type
            for i, block in enumerate(self.layers):
                block.wide = i == 6  # type: ignore[assignment]
        else:
            self.layers = nn.ModuleList(Counted(24) for _ in range(9))
        for i, block in enumerate(self.layers):
            block.layer_idx = i  # type: ignore[assignment]  # as transformers' layers have

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        Counted.calls = 0
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x) * 2 if getattr(layer, "wide", False) else layer(x)
        return self.head(x)


@pytest.mark.parametrize("attribute", [True, False], ids=["attribute", "behaviour"])
def test_fold_refused_when_blocks_differ(attribute: bool) -> None:
    """Blocks that differ by an attribute are never folded; blocks that differ in what they
    do among the kept ones fail the fold's check and run unfolded. ``layer_idx`` alone
    (equal to the block's position) does not stop a fold."""
    kwargs: dict[str, Any] = dict(mesh=2, sample_input=SAMPLE, budget="1GiB", backend="gloo")
    kwargs["wrap"] = "Block" if attribute else "Counted"
    factory = functools.partial(ByPosition, attribute)
    # by attribute: no stack to fold; by behaviour: a stack, whose check then fails
    assert (find_fold(factory(), period=1) is None) == attribute
    checked = fit(factory, **kwargs)
    full = fit(factory, fold=False, **kwargs)
    assert checked.folded == ()
    assert _rows(checked) == _rows(full)


def test_fold_ignores_layer_idx() -> None:
    def indexed() -> Net:
        net = deep_net()
        for i, block in enumerate(net.layers):
            block.layer_idx = i  # type: ignore[assignment]
            block.heads = 4  # type: ignore[assignment]  # the same in all (block 4's index too)
        return net

    r = fit(indexed, mesh=2, sample_input=SAMPLE, budget="1GiB", wrap="Block", backend="gloo")
    assert r.folded and len(r.folded) == r.fake_steps


def _normalized(events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A post-backward's nested frees as bytes per category (a group spanning the blocks
    frees the cut blocks' gradients in one event, where the full run frees them one by one)."""
    out = []
    for ev in events:
        if ev[0] == "post_backward":
            sums: dict[str, int] = {}
            for e in ev[2]:
                assert e[0] in ("bytes", "add"), e  # add: (category, delta, group, event)
                sums[e[1]] = sums.get(e[1], 0) + e[2]
            ev = (ev[0], ev[1], sorted(sums.items()))
        out.append(ev)
    return out


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(24) for _ in range(9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Nested(nn.Module):
    """The blocks inside a wrapped container: its group holds every block's parameters and,
    its input needing grad, frees their gradients in its own post-backward (the root's runs
    from the final callback, its input being tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(37, 24)
        self.body = Body()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.body(self.tok(idx))


@pytest.mark.parametrize(
    ("model", "wrap", "every"),
    [
        ("net", "Block", 0),
        ("net", "Block", 1),
        ("net", "Block", 2),
        ("net", None, 0),
        ("nested", "Body", 0),
    ],
    ids=["blocks", "blocks-ac1", "blocks-ac2", "root_only", "container"],
)
def test_fold_replays_the_full_stream(model: str, wrap: str | None, every: int) -> None:
    """Event for event, the unfolded stream is the full run's (bytes, FLOPs, calls into the
    replay and their group keys)."""
    factory: Any = deep_net if model == "net" else Nested
    specs_of = functools.partial(discover_groups, wrap=module_wrap_predicate(wrap), shard_size=4)
    with torch.device("meta"):
        specs = specs_of(factory())
    traffic = group_plans(specs, True, False, 4, MixedPrecisionPolicy(), 2, 1, "gloo", False)[1]
    step = resolve_step("sum", None, None).run
    args = (factory, specs_of, traffic, SAMPLE, step, None, wrap, every)
    folded, flops, stack = flops_and_trace(*args, fold=True)
    full, full_flops, no_stack = flops_and_trace(*args, fold=False)
    assert stack is not None and no_stack is None
    assert flops == full_flops > 0
    assert _normalized(folded) == _normalized(full)
    if model == "nested":  # the container's post-backward, freeing all blocks' gradients
        assert any(ev[0] == "post_backward" and ev[1] == "body" for ev in full)


def test_latency_and_optimizer_terms() -> None:
    """Closed form: NCCL's ring latency model, and the optimizer step's streamed bytes over
    device memory (host memory with offload), against plan()'s own per-group bytes."""
    h100 = DEVICES["h100"]
    assert h100.ring_latency(1, 1) == 0.0
    assert h100.ring_latency(8, 1) == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert h100.ring_latency(16, 2) == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 9.6e-6)
    assert h100.ring_latency(4, 4, all_reduce=True) == pytest.approx(8.4e-6 + 6 * 9.6e-6)
    cfg = FitConfig("Block", True, False, None, None, 0, False, mesh=(16,))
    for offload in (False, True):
        r = fit(
            Net,
            mesh=16,
            sample_input=SAMPLE,
            budget="1GiB",
            wrap="Block",
            checkpoint_choices=(0,),
            offload_choices=(offload,),
        )
        want = dataclasses.replace(cfg, offload=offload)
        row = next(f for f in r.kept if want in (f.config, *f.alternatives))
        p = plan(
            Net,
            mesh=16,
            wrap="Block",
            reshard_after_forward=True,
            offload=offload,
            root_reshard_after_forward=False,
            sample_input=SAMPLE,
        )
        streamed = sum(3 * g.grad_bytes + 2 * g.optimizer_state_bytes for g in p.groups)
        memory = h100.host_memory_bytes_per_s if offload else h100.hbm_bytes_per_s
        assert row.terms["optimizer"] == pytest.approx(streamed / memory)
        # every collective pays its latency: 16 ranks on 2 nodes of 8, the network's bandwidth
        ring, bw, lat = 15 / 16, h100.inter_node_bytes_per_s, h100.ring_latency(16, 2)
        comm = 0.0
        for g in p.groups:
            comm += g.all_gathers_per_step * (g.gathered_bytes * ring / bw + lat)
            if g.trainable_numel:
                comm += g.reduce_scatter_bytes * ring / bw + lat
        assert row.terms["comm"] == pytest.approx(comm)


class Routed(nn.Module):
    """Routes by ``nonzero`` (as a mixture of experts' eager loop does)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked = (x[:, 0] > 0).nonzero()[:, 0]
        return self.proj(x[picked])


def test_data_dependent_shape_is_named() -> None:
    with pytest.raises(PlanError, match=r"depends on the\s+data.*experts_implementation"):
        fit(Routed, mesh=2, sample_input=((4, 24), torch.float32), budget="1GiB")


def test_label_names_the_reduce_dtype() -> None:
    """With ``reduce_dtype=None`` the label names what the engine reduces in: the parameters'
    own dtype from torch 2.15, ``param_dtype`` before."""
    cfg = FitConfig("Block", True, False, "bf16", None, 0, False)
    expected = "fp32" if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE else "bf16"
    assert f"mp=bf16/{expected} " in cfg.describe()
    assert "mp=bf16/fp32 " in dataclasses.replace(cfg, reduce_dtype="fp32").describe()
    assert "mp=fp32/fp32 " in dataclasses.replace(cfg, param_dtype=None).describe()


# --- the step planned (issue 43, item 1) ---------------------------------------------------------
# Oracle: plan() with the same step (its own fake step); the step changes what is planned.


class LabelsLM(Net):
    """Takes ``labels`` as transformers' heads do and returns its loss beside the logits (a
    large vocabulary: the loss's log-softmax and its gradient move the peak)."""

    def __init__(self) -> None:
        super().__init__(vocab=997)

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor | None]:
        logits = super().forward(input_ids)
        loss = None
        if labels is not None:
            flat = logits.float().flatten(0, 1)
            loss = torch.nn.functional.cross_entropy(flat, labels.flatten())
        return {"loss": loss, "logits": logits}


def mse_step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """A user's step: its own loss on the logits (for the CLI's --step)."""
    return model(batch).float().pow(2).mean()


def test_labels_model_plans_its_loss() -> None:
    """A model taking ``labels`` is planned with them (transformers' step), not with the sum of
    its first output; the answer names the step; each peak is plan()'s with that step."""
    kwargs: dict[str, Any] = dict(
        mesh=2, sample_input=SAMPLE, budget="1GiB", wrap="Block", backend="gloo"
    )
    r = fit(LabelsLM, checkpoint_choices=(0,), **kwargs)
    assert r.step.startswith("labels") and "auto" in r.step
    assert "step planned: labels" in format_fit(r) and r.to_dict()["step"] == r.step
    summed = fit(LabelsLM, checkpoint_choices=(0,), step="sum", **kwargs)
    assert summed.step.startswith("sum")
    peaks = {f.config: f.peak_bytes for f in r.kept}
    for f in summed.kept[:2]:
        cfg = f.config
        p = {
            s: plan(
                LabelsLM,
                mesh=2,
                wrap="Block",
                reshard_after_forward=cfg.reshard_after_forward,
                root_reshard_after_forward=cfg.root_reshard_after_forward,
                sample_input=SAMPLE,
                backend="gloo",
                step=s,
            ).activations
            for s in ("labels", "sum")
        }
        assert p["labels"] is not None and p["sum"] is not None
        assert peaks[cfg] == p["labels"].peak_bytes != p["sum"].peak_bytes == f.peak_bytes
        assert p["labels"].step == r.step.replace(" (auto: its forward takes labels)", "")
    with pytest.raises(PlanError, match="not both"):
        fit(Net, step="sum", loss_fn=lambda o, i: o.sum(), **kwargs)


def test_cli_step(capsys: pytest.CaptureFixture[str]) -> None:
    from shardweave.fsdp.plan.__main__ import main

    base = list(NET_CLI)
    assert (
        main([*base, "--fit", "1GiB", "--step", "tests.fsdp.world_1.test_plan_fit:mse_step"]) == 0
    )
    assert "step planned: tests.fsdp.world_1.test_plan_fit:mse_step(model, batch)" in (
        capsys.readouterr().out
    )
    assert main([*base, "--step", "tests.fsdp.world_1.test_plan_fit:mse_step"]) == 0
    assert "step planned            tests.fsdp.world_1.test_plan_fit:mse_step" in (
        capsys.readouterr().out
    )
    assert main([*base, "--fit", "1GiB", "--step", "nope"]) == 2
    assert "--step must be PKG.MODULE:FACTORY" in capsys.readouterr().err


# --- the target (issue 43, item 2) ---------------------------------------------------------------
# Closed form: what is searched and named per target.


def test_target_named_and_offload_only_off_the_cpu(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = dict(
        mesh=2, sample_input=SAMPLE, budget="1GiB", wrap="Block", checkpoint_choices=(0,)
    )
    cpu = fit(Net, backend="gloo", **kwargs)
    assert cpu.target == "cpu/gloo" == fit(Net, target="cpu", **kwargs).target
    assert not any(f.config.offload for f in cpu.kept)
    assert {f.config.target for f in cpu.kept} == {"cpu/gloo"}
    assert "not searched" in str(cpu.search_space["cpu_offload"])
    assert format_fit(cpu).startswith("make it fit on cpu/gloo:")
    assert cpu.to_dict()["target"] == "cpu/gloo"
    gpus = fit(Net, **kwargs)  # the default, named
    assert gpus.target == "cuda/nccl" and format_fit(gpus).startswith("make it fit on cuda/nccl:")
    assert any(f.config.offload for f in gpus.kept)
    assert fit(Net, target="cuda/gloo", **kwargs).target == "cuda/gloo"
    nothing = fit(Net, backend="gloo", **{**kwargs, "budget": 1000})
    assert not nothing.kept and "allow CPU offload" not in " ".join(nothing.advice)
    assert not nothing.smallest.config.offload
    for bad in ("cpu/nccl", "tpu/mpi", "cuda/gloo/x"):
        with pytest.raises(PlanError, match="target"):
            fit(Net, target=bad, **kwargs)
    p = plan(Net, mesh=2, wrap="Block", target="cpu/gloo")
    assert p.inputs["target"] == "cpu/gloo" and "target cpu/gloo" in format_table(p).splitlines()[0]


# --- twins folded (issue 43, item 3) -------------------------------------------------------------


def test_twins_are_one_row() -> None:
    """Closed form: configurations with the same peak and step time that differ in one setting
    are one row listing the others; every fitting configuration is a row or an alternative.
    Compute dominates here (a slow device), so the root's extra all-gather is hidden: the root's
    resharding changes neither peak nor time for most configurations."""
    searched = fit(
        Net,
        mesh=2,
        sample_input=SAMPLE,
        budget="1GiB",
        wrap="Block",
        backend="gloo",
        device_flops=1e6,
        allow_lower_precision=True,
    )
    rows = searched.kept
    assert any(f.alternatives for f in rows)
    assert sum(1 + len(f.alternatives) for f in rows) == searched.searched  # all fit 1 GiB
    for f in rows:
        assert all(alt for alt in f.alternative_settings())
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            if (a.peak_bytes, a.step_seconds) == (b.peak_bytes, b.step_seconds):
                apart = sum(x != y for x, y in zip(astuple(a.config), astuple(b.config)))
                assert apart > 1, (a.config, b.config)
    twin = next(f for f in rows if f.alternatives)
    assert {"root_reshard_after_forward": True} in twin.alternative_settings()
    text = format_fit(searched, top=len(rows))
    # (more alternatives follow on torch 2.15, where a reduce_dtype equal to the gradients'
    # own dtype changes neither peak nor time either)
    assert "(the same peak and time with root_reshard_after_forward=True" in text
    row = next(r for r in searched.to_dict()["kept"] if r["config"] == asdict(twin.config))
    assert row["alternatives"] == twin.alternative_settings()


# --- layouts and microbatches (issue 43, item 4) -------------------------------------------------
# Oracle: plan() on each kept row's mesh and local batch (set_to_none=False for the last of
# several microbatches: the accumulated sharded gradients are there from its start); closed
# forms for the shapes searched and the accumulation's time.


def test_layouts_searched_within_a_node_first() -> None:
    h100 = DEVICES["h100"]
    found = layouts((1024,), h100, True, dict.fromkeys(("shard", "replicate", "host")))
    assert [x.label for x in found] == [
        "1024 (FSDP)",
        *(f"{1024 // s}x{s} (HSDP)" for s in (8, 4, 2, 1, 16, 32, 64, 128, 256, 512)),
    ]
    links = {x.dims: x.links for x in found}
    assert links[(128, 8)].shard_bw == h100.intra_node_bytes_per_s
    assert links[(128, 8)].repl_bw == links[(64, 16)].shard_bw == h100.inter_node_bytes_per_s
    one_node = layouts((8,), h100, True, dict.fromkeys(("shard", "replicate", "host")))
    assert [x.dims for x in one_node] == [(8,), (2, 4), (4, 2), (8, 1)]
    assert one_node[1].links.repl_bw == h100.intra_node_bytes_per_s  # the mesh is one node
    assert microbatches(64, 8, SAMPLE) == ((8, 1), (4, 2), (2, 4), (1, 8))
    with pytest.raises(PlanError, match="multiple of the 8 ranks"):
        microbatches(12, 8, SAMPLE)


def test_fit_chooses_layout_and_microbatch() -> None:
    r = fit(
        Net,
        mesh=8,
        sample_input=SAMPLE,
        budget="1GiB",
        wrap="Block",
        global_batch=32,
        checkpoint_choices=(0,),
        offload_choices=(False,),
    )
    rows = [c for f in r.kept for c in (f.config, *f.alternatives)]
    assert {c.mesh for c in rows} == {(8,), (2, 4), (4, 2), (8, 1)}
    assert {(c.local_batch, c.grad_accumulation) for c in rows} == {(4, 1), (2, 2), (1, 4)}
    assert "layout (replicate x shard)" in r.search_space and r.to_dict()["global_batch"] == 32
    text = format_fit(r)
    assert text.splitlines()[0].startswith("make it fit on cuda/nccl: budget 1.00 GiB per rank, 8 ")
    by_cfg = {c: f for f in r.kept for c in (f.config, *f.alternatives)}
    picked = [
        next(c for c in rows if c.mesh == (2, 4) and c.grad_accumulation == 2),
        next(c for c in rows if c.mesh == (8,) and c.grad_accumulation == 4),
        next(c for c in rows if c.mesh == (4, 2) and c.grad_accumulation == 1),
    ]
    for cfg in picked:
        p = plan(
            Net,
            mesh=cfg.mesh,
            wrap="Block",
            reshard_after_forward=cfg.reshard_after_forward,
            root_reshard_after_forward=cfg.root_reshard_after_forward,
            sample_input=((cfg.local_batch, SAMPLE[0][1]), SAMPLE[1]),
            set_to_none=cfg.grad_accumulation == 1,
        )
        assert p.activations is not None
        assert by_cfg[cfg].peak_bytes == p.activations.peak_bytes, cfg
    # accumulation: the same FLOPs per optimizer step, more collectives
    one = by_cfg[dataclasses.replace(picked[1], local_batch=4, grad_accumulation=1)]
    four = by_cfg[picked[1]]
    assert four.terms["flops"] == one.terms["flops"]
    assert four.terms["comm"] > one.terms["comm"] and four.step_seconds > one.step_seconds
    assert "model.set_requires_all_reduce(i == 1)" in "\n".join(picked[0].how_to_run())
    assert picked[2].how_to_run() == []


def test_cli_global_batch(capsys: pytest.CaptureFixture[str]) -> None:
    from shardweave.fsdp.plan.__main__ import main

    args = ["--model", "tests.fsdp.world_1.test_plan_fit:Net", "--mesh", "8"]
    args += ["--sample-input", "2x16:long", "--wrap", "Block", "--fit", "1GiB"]
    assert main([*args, "--global-batch", "16", "--accumulation", "1,2"]) == 0
    text = capsys.readouterr().out
    assert "8 devices, global batch 16" in text and "(HSDP)" in text and "micro=" in text
    assert main([*args, "--global-batch", "12"]) == 2
    assert "multiple of the 8 ranks" in capsys.readouterr().err
