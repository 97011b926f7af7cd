"""``fit()`` / ``--fit``: the planner's "make it fit" search.

Oracle: ``plan()`` itself. Every configuration's peak in ``fit`` is derived by replaying one
fake step's recorded calls; it must equal ``plan(...)``'s own peak with activations for that
configuration (one fake step each), for every search dimension. The rest is closed form: the
budget parser's units, the ranking order, the JSON schema, and the answer when nothing fits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardweave.fsdp.plan import FitConfig, PlanError, fit, parse_budget, plan
from shardweave.fsdp.plan._apply import checkpoint_blocks

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
        backend="gloo",
        offload=cfg.offload,
    )
    assert p.activations is not None
    return p.activations.peak_bytes


def test_replayed_peaks_equal_plan(searched: Any) -> None:
    """One configuration per searched dimension, each against its own fake step in plan()."""
    by_cfg = {f.config: f for f in searched.kept}
    base = FitConfig("Block", True, False, None, None, 0, False)
    variants = [
        base,
        FitConfig("Block", False, False, None, None, 0, False),
        FitConfig("Block", True, True, None, None, 0, False),
        FitConfig("Block", True, False, "bf16", "fp32", 0, False),
        FitConfig("Block", True, False, "bf16", None, 1, False),
        FitConfig("Block", False, False, None, None, 2, True),
        FitConfig(None, True, True, None, None, 0, False),
    ]
    for cfg in variants:
        assert cfg in by_cfg, cfg
        assert by_cfg[cfg].peak_bytes == _plan_peak(cfg), cfg


def test_ranked_by_step_time_and_fit(searched: Any) -> None:
    times = [f.step_seconds for f in searched.kept]
    assert times == sorted(times)
    assert all(f.peak_bytes <= searched.budget_bytes for f in searched.kept)
    assert searched.searched >= len(searched.kept) > 0
    for f in searched.kept:
        assert f.dominant in ("compute", "exposed_comm", "offload")
        # checkpointing recomputes: more FLOPs than the same configuration without it
    flops = {
        (f.config.wrap, f.config.param_dtype, f.config.checkpoint_every): f.terms["flops"]
        for f in searched.kept
    }
    assert flops[("Block", None, 1)] > flops[("Block", None, 2)] > flops[("Block", None, 0)]
    space = searched.search_space
    assert "not searched (fixed)" in space and "time model" in space


def test_budget_below_default_finds_smaller_and_is_monotone(searched: Any) -> None:
    default = next(
        f
        for f in searched.kept
        if f.config == FitConfig("Block", True, False, None, None, 0, False)
    )
    budget = default.peak_bytes - 1
    tight = fit(Net, mesh=2, sample_input=SAMPLE, budget=budget, wrap="Block", backend="gloo")
    assert tight.kept and all(f.peak_bytes <= budget for f in tight.kept)
    assert default.config not in {f.config for f in tight.kept}
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


def test_cli_json_and_nothing_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In-process ``main`` (the ``python -m`` entry is covered by test_plan's CLI test)."""
    from shardweave.fsdp.plan.__main__ import main

    out = tmp_path / "fit.json"
    base = [
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
    ]
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
