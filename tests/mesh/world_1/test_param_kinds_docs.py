"""The one-registration rule for parameter kinds is what the docs, examples and plugins say.

Oracle: closed form (the names the repository's text uses, read against the extension points
``shardweave.mesh.extension_points`` really has).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import tomllib

import shardweave.mesh.extension_points as points
from shardweave.mesh import ExtensionPoint
from shardweave.mesh.extension_points import PARAM_KINDS, ParamKind

ROOT = Path(__file__).resolve().parents[3]
REMOVED = re.compile(
    # not CollectiveKind.ALL_GATHER, nor that enum member's definition
    r"(?<![A-Za-z_.])(PARAM_HANDLING|ALL_GATHER|STATE_DICT)\b(?! = \")"
    r"|shardweave\.(param_handling|all_gather|state_dict)\b"
)
GROUPS = {p.group for p in vars(points).values() if isinstance(p, ExtensionPoint)}


def tracked(*suffixes: str) -> list[Path]:
    """The repository's own text files with these suffixes (no build or tool output)."""
    skip = {"__pycache__", "build", "dist", "_build", "node_modules"}
    found = [p for p in ROOT.glob("*") if p.is_file() and p.name.endswith(suffixes)]
    for top in ("docs", "examples", "packages", "tests", "tools"):
        found += [
            p
            for p in (ROOT / top).rglob("*")
            if p.is_file()
            and p.name.endswith(suffixes)
            and not any(part.startswith(".") or part in skip for part in p.parts[len(ROOT.parts) :])
        ]
    return found


def test_no_text_names_the_removed_per_part_points() -> None:
    """Only the CHANGELOGs (which record the removal) and the test that they are gone may."""
    allowed = {"CHANGELOG.md", "test_registry.py", Path(__file__).name}
    hits = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in tracked(".py", ".md", ".toml", ".rst", ".txt")
        if path.name not in allowed and path.exists()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if REMOVED.search(line)
    ]
    assert hits == [], hits


def test_entry_points_use_only_existing_points() -> None:
    declared = {}
    for path in tracked("pyproject.toml"):
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
        for group in project.get("entry-points", {}):
            declared[group] = path.relative_to(ROOT)
    shardweave_groups = {
        g: p
        for g, p in declared.items()
        if g.startswith("shardweave.") and g != "shardweave.test_broken"
    }
    assert set(shardweave_groups) <= GROUPS, shardweave_groups
    assert "shardweave.param_kinds" in shardweave_groups  # extensions and the plugin fixtures


def test_framework_guide_describes_one_registration_per_kind() -> None:
    guide = (ROOT / "docs" / "framework_guide.md").read_text(encoding="utf-8")
    section = guide.split("## Writing and registering a plugin", 1)[1].split("\n## ", 1)[0]
    # Its table of points is the module's points, and nothing else.
    listed = set(re.findall(r"^\| `[A-Z_]+` \| `(shardweave\.[a-z_]+)` \|", section, re.M))
    assert listed == GROUPS, listed
    assert "A parameter kind is one registration" in section
    # Every part of a ParamKind has its row, naming the Protocol it must satisfy.
    parts = [f.name for f in dataclasses.fields(ParamKind) if f.name != "handled_type"]
    for part, protocol in zip(
        parts, ("ParamHandler", "AllGatherExtension", "StateDictTransform"), strict=True
    ):
        assert re.search(rf"^\| `{part}` \| `{protocol}`", section, re.M), part
    assert PARAM_KINDS.group == "shardweave.param_kinds"
    assert "Design note: one registration per kind" in (points.__doc__ or "")
