"""The README's demo command delivers what the README shows.

``nox -s demo`` runs ``torchrun --standalone --nproc-per-node 2 demos/train_gpt.py`` in a venv
holding torch, the four packages and ``DEMO_REQUIREMENTS`` (noxfile.py). These tests check that
that install set covers what the demo's report and pictures need, then run the real script the
same way (torchrun, 2 CPU processes, fewer steps, in a scratch directory) and check that every
``demo-output/...`` file the README names exists on every rank and that no rank printed a
missing-dependency notice. The ``tests`` session installs everything the demo session does, so
a missing matplotlib fails here instead of skipping: the README promises the PNG.

Oracle: *closed form* (the README's own list of files; PNG and JSON signatures).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
RANKS = 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_PACKAGE_REQ = re.compile(r"^\./packages/(?P<pkg>[a-z]+)(?:\[(?P<extras>[^\]]*)\])?$")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def demo_requirements() -> tuple[str, ...]:
    """``DEMO_REQUIREMENTS`` from noxfile.py, read with ast (this venv need not have nox), after
    checking that the demo session installs it."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    value: tuple[str, ...] | None = None
    demo_uses_it = False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "DEMO_REQUIREMENTS" for t in node.targets
        ):
            value = tuple(ast.literal_eval(node.value))
        if isinstance(node, ast.FunctionDef) and node.name == "demo":
            demo_uses_it = any(
                isinstance(n, ast.Name) and n.id == "DEMO_REQUIREMENTS" for n in ast.walk(node)
            )
    assert value is not None, "noxfile.py: no DEMO_REQUIREMENTS"
    assert demo_uses_it, "noxfile.py: the demo session does not install DEMO_REQUIREMENTS"
    return value


def optional_dependencies(pkg: str) -> dict[str, list[str]]:
    with open(ROOT / "packages" / pkg / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"].get("optional-dependencies", {})
    assert isinstance(extras, dict)
    return extras


def third_party(requirements: tuple[str, ...]) -> list[str]:
    """The third-party requirements behind ``requirements``: a package folder with extras
    (``./packages/fsdp[plot]``) stands for those extras' requirements in its pyproject."""
    out: list[str] = []
    for req in requirements:
        match = _PACKAGE_REQ.match(req)
        if match is None:
            out.append(req)
            continue
        extras = optional_dependencies(match["pkg"])
        for extra in filter(None, (e.strip() for e in (match["extras"] or "").split(","))):
            assert extra in extras, f"{req}: packages/{match['pkg']} has no extra {extra!r}"
            out += extras[extra]
    return out


def requirement_name(requirement: str) -> str:
    match = _REQ_NAME.match(requirement)
    assert match is not None, requirement
    return match[1]


def readme_outputs() -> list[str]:
    """Every ``demo-output/...`` file the README names, ``{N}`` expanded to each rank."""
    named = set(re.findall(r"`(demo-output/[^`\s]+)`", (ROOT / "README.md").read_text()))
    return sorted({n.replace("{N}", str(r)) for n in named for r in range(RANKS)})


def test_demo_session_installs_the_plot_extra() -> None:
    """The memory timeline is drawn by FSDPTracer.plot_memory, whose dependency is the fsdp
    package's ``plot`` extra: the demo session must install it, and this environment must hold
    everything the demo session installs (else the run below proves nothing about it)."""
    requirements = demo_requirements()
    assert "./packages/fsdp[plot]" in requirements, requirements
    plot = [requirement_name(r) for r in third_party(("./packages/fsdp[plot]",))]
    assert "matplotlib" in plot, plot
    missing = []
    for req in third_party(requirements):
        try:
            importlib.metadata.distribution(requirement_name(req))
        except importlib.metadata.PackageNotFoundError:
            missing.append(req)
    assert not missing, (
        f"nox -s demo installs {missing}, which this environment lacks; the tests session "
        "must install everything the demo session does"
    )


def test_readme_demo_writes_every_file_it_names(tmp_path: Path) -> None:
    outputs = readme_outputs()
    for rank in range(RANKS):  # the README must keep naming both pictures
        assert f"demo-output/trace-rank{rank}.json" in outputs, outputs
        assert f"demo-output/memory-rank{rank}.png" in outputs, outputs
    # The README's command, with fewer steps; cwd is the scratch directory, so demo-output/
    # (the script's default --trace-dir, relative) lands there and never in the repository.
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(RANKS), str(ROOT / "demos" / "train_gpt.py"), "--steps", "8",
    ]  # fmt: skip
    env = dict(os.environ)
    if env.get("PYTHONPATH"):  # the quick loop's relative src paths, from the new cwd too
        env["PYTHONPATH"] = os.pathsep.join(
            str(Path(p).resolve()) for p in env["PYTHONPATH"].split(os.pathsep) if p
        )
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert proc.stdout.count("== train_gpt report") == 1, output  # rank 0's report, once
    for needle in ("no memory plot", "not installed"):
        assert needle not in output, output
    notices = [line for line in output.splitlines() if line.startswith("train_gpt.py:")]
    assert not notices, notices
    for name in outputs:
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 0, (name, output)
        if name.endswith(".png"):
            assert path.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC, name
        elif name.endswith(".json"):
            json.loads(path.read_text())  # whole, not cut short
        assert name in output, f"the report does not list {name}"
