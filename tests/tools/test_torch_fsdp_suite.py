"""tools/torch_fsdp_suite.py on a tiny fake test file: the swap takes, results are compared."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.tools._load import load_tool

FAKE_TESTS = """\
import unittest

import pytest
import shardweave.fsdp
import shardweave.replicate
from torch.distributed._composable.fsdp import FSDPModule
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import fully_shard


def test_torch_engine():
    assert fully_shard is not shardweave.fsdp.fully_shard


def test_passes_with_both():
    assert callable(fully_shard)


def test_skipped():
    pytest.skip("needs CUDA")


class TestSwap(unittest.TestCase):
    def test_names(self):
        self.assertIs(fully_shard, shardweave.fsdp.fully_shard)
        # torch's class stays: shardweave's module classes derive from it
        self.assertIsNot(FSDPModule, shardweave.fsdp.FSDPModule)
        self.assertIs(replicate, shardweave.replicate.replicate)
"""


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("torch_fsdp_suite")


def test_sitecustomize_compiles(tool: ModuleType) -> None:
    source = tool.render_sitecustomize()
    compile(source, "sitecustomize.py", "exec")
    assert "torch.distributed._composable.replicate_with_fsdp" in source


def test_compare_on_fake_file(tool: ModuleType, tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(FAKE_TESTS)
    out = tmp_path / "report.json"
    rc = tool.main(["--tests", str(tests), "--timeout", "60", "--out", str(out)])
    report = json.loads(out.read_text())
    results = {
        row["test"]: (row["torch"]["result"], row["shardweave"]["result"])
        for row in report["tests"]
    }
    assert results == {
        "test_fake.py::TestSwap::test_names": ("failed", "passed"),
        "test_fake.py::test_passes_with_both": ("passed", "passed"),
        "test_fake.py::test_skipped": ("skipped", "skipped"),
        "test_fake.py::test_torch_engine": ("passed", "failed"),
    }
    assert report["fail_only_with_shardweave"] == ["test_fake.py::test_torch_engine"]
    assert report["counts"]["test_fake.py"] == {
        "torch": {"passed": 2, "failed": 1, "skipped": 1},
        "shardweave": {"passed": 2, "failed": 1, "skipped": 1},
    }
    swap = report["runs"]["test_fake.py"]["shardweave"]["swap"]
    assert "torch.distributed.fsdp.fully_shard" in swap["patched"]
    assert swap["missing"] == []
    assert rc == 1  # a test passes with torch and fails with shardweave


def test_fails_loudly_without_swap(
    tool: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "test_fake.py").write_text("def test_ok():\n    pass\n")
    monkeypatch.setattr(tool, "render_sitecustomize", lambda: "")  # a swap that does nothing
    with pytest.raises(SystemExit, match="the swap did not take"):
        tool.main(["--tests", str(tmp_path), "--only", "shardweave", "--timeout", "60"])


def test_failure_reason_unwraps_rank_exception(tool: ModuleType) -> None:
    text = (
        "RuntimeError: Thread 1 exited with exception:\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "E           AttributeError: 'FSDPState' object has no attribute '_fsdp_param_group'\n"
    )
    reason = tool.failure_reason("RuntimeError: Thread 1 exited with exception:", text)
    assert reason == "AttributeError: 'FSDPState' object has no attribute '_fsdp_param_group'"
    assert tool.failure_reason("assert 1 == 2\nmore", "") == "assert 1 == 2"
    worker = (
        "E   RuntimeError: Exception in worker process:\n"
        "E   Traceback (most recent call last):\n"
        "E   AttributeError: 'FSDPState' object has no attribute '_fsdp_param_group'\n"
    )
    reason = tool.failure_reason("RuntimeError: Exception in worker process:", worker)
    assert reason == "AttributeError: 'FSDPState' object has no attribute '_fsdp_param_group'"


FAKE_FSDPTEST = """\
import torch.distributed as dist
from torch.testing._internal.common_fsdp import FSDPTest


class TestTwoRanks(FSDPTest):
    @property
    def world_size(self):
        return 2

    def test_runs_on_gloo(self):
        self.assertEqual(dist.get_world_size(), 2)
        self.assertEqual(dist.get_backend(), "gloo")
"""


def test_cpu_fsdptest_runs_on_gloo(tool: ModuleType, tmp_path: Path) -> None:
    """The harness: a multi-process FSDPTest runs its ranks on a CPU-only machine (the installed
    common_fsdp alone skips every rank there for too few accelerators)."""
    (tmp_path / "test_fake_ranks.py").write_text(FAKE_FSDPTEST)
    out = tmp_path / "report.json"
    tool.main(["--tests", str(tmp_path), "--only", "torch", "--timeout", "120", "--out", str(out)])
    rows = json.loads(out.read_text())["tests"]
    assert [(r["test"], r["torch"]["result"]) for r in rows] == [
        ("test_fake_ranks.py::TestTwoRanks::test_runs_on_gloo", "passed")
    ]


FAKE_CONTINUOUS = """\
import unittest


class TestSharedGroup(unittest.TestCase):
    # Stands in for torch's MultiProcContinuousTest: after one test of the class fails, it
    # skips the rest with this message.
    failed = False

    def test_a_fails(self):
        type(self).failed = True
        self.fail("boom")

    def test_b_after(self):
        if type(self).failed:
            self.skipTest("Previous test failed, skipping test_b_after")
"""


def test_cascade_skip_runs_alone(tool: ModuleType, tmp_path: Path) -> None:
    """A test skipped only because a class-mate failed is run again on its own, and that
    outcome is the one reported."""
    (tmp_path / "test_fake_cascade.py").write_text(FAKE_CONTINUOUS)
    out = tmp_path / "report.json"
    tool.main(["--tests", str(tmp_path), "--only", "torch", "--timeout", "60", "--out", str(out)])
    report = json.loads(out.read_text())
    results = {row["test"]: row["torch"]["result"] for row in report["tests"]}
    assert results == {
        "test_fake_cascade.py::TestSharedGroup::test_a_fails": "failed",
        "test_fake_cascade.py::TestSharedGroup::test_b_after": "passed",
    }
    run = report["runs"]["test_fake_cascade.py"]["torch"]
    assert run["rerun_alone"] == ["test_fake_cascade.py::TestSharedGroup::test_b_after"]
