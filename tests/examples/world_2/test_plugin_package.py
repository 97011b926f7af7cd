"""examples/plugin_package + examples/plugin_usage.py: a plugin found through its entry point.

The test does not pip-install the example distribution into the shared environment: each
worker puts the package's ``src`` and a minimal ``.dist-info`` (its ``entry_points.txt`` made
from the package's ``pyproject.toml``, as pip would) on ``sys.path`` for the body only, which
is what ``importlib.metadata`` discovery reads. The pool restores the registries after the body.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import tomllib
import torch

from examples import plugin_usage as ex
from shardweave.mesh.extension_points import PARAM_KINDS
from tests._dist import WorkerPool
from tests._dist.sync import barrier

PACKAGE = Path(__file__).resolve().parents[3] / "examples" / "plugin_package"


@contextlib.contextmanager
def installed_example_plugin() -> Iterator[None]:
    """The example distribution on ``sys.path`` (code and metadata), as if pip-installed."""
    with open(PACKAGE / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    with tempfile.TemporaryDirectory(prefix="sw-example-plugin-") as site:
        info = Path(site) / f"shardweave_example_plugin-{project['version']}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
        )
        lines = []
        for group, entries in project["entry-points"].items():
            lines += [f"[{group}]", *(f"{k} = {v}" for k, v in entries.items()), ""]
        (info / "entry_points.txt").write_text("\n".join(lines))
        added = [site, str(PACKAGE / "src")]
        sys.path[:0] = added
        importlib.invalidate_caches()
        try:
            yield
        finally:
            for path in added:
                sys.path.remove(path)
            importlib.invalidate_caches()


def body(rank: int, world: int) -> None:
    with installed_example_plugin():
        shard, full = ex.run()
        kind = PARAM_KINDS.registered()["int8"]  # discovered: nothing called register()
        plugin = kind.all_gather
        assert type(plugin).__module__ == "shardweave_example_plugin", plugin
        assert kind.handler is None  # sharded as a plain tensor
    shards = [torch.randn(3, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    assert torch.equal(shard, shards[rank])
    # Closed form: each rank's rows are its shard quantized to int8 with scale absmax / 127.
    for r, s in enumerate(shards):
        scale = s.abs().amax() / 127.0
        expected = torch.round(s / scale).to(torch.int8).float() * scale
        got = full[3 * r : 3 * (r + 1)]
        torch.testing.assert_close(got, expected)
        assert (got - s).abs().max() <= scale / 2 + 1e-6
    barrier()


def test_plugin_package(world2: WorkerPool) -> None:
    """Oracle: closed form (per-shard int8 quantization of every rank's known shard, within
    half a quantization step of the fp32 values); the plugin comes from entry-point discovery."""
    world2.run(body)
