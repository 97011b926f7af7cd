#!/usr/bin/env python3
"""Check the repository invariants of STYLE.md section 1; run by `nox -s lint`.

Fails (exit 1, one line per problem) on:
  * a ``packages/*/src/shardweave/__init__.py`` (``shardweave`` is a PEP 420 namespace shared by
    all four distributions; an ``__init__.py`` in one wheel would shadow the others);
  * a package without ``CHANGELOG.md``, ``py.typed`` or ``_version.py``, or whose distribution is
    not named ``shardweave-<folder>``;
  * a declared shardweave dependency the architecture does not allow (mesh <- fsdp <- replicate,
    mesh <- extensions), or one whose range excludes the sibling's current version;
  * an import of ``shardweave.<x>`` in ``packages/<p>/src`` where ``x`` is neither ``p`` nor a
    declared dependency ``shardweave-<x>`` in ``packages/<p>/pyproject.toml``;
  * an import of a sibling's private module or name (``shardweave.<x>._y``, ``x`` not ``p``):
    siblings are released separately, so they meet at public names only (for the engine,
    ``shardweave.fsdp.engine``);
  * an import of torch's FSDP engine in package source: shardweave ships its own (only the
    policy dataclasses and the ``FSDPModule`` marker class of ``torch.distributed.fsdp`` may be
    imported, by name);
  * a module under ``tests/`` importing a test module (``tests/**/test_*.py``): what tests share
    lives in helper modules (``tests/<pkg>/_*.py``, ``tests/_dist``), so deleting or renaming a
    test never breaks another.

Usage: python tools/check_layout.py [--root DIR]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Which siblings each package may depend on (ARCHITECTURE.md, "Layers").
ALLOWED_DEPS: Final[dict[str, frozenset[str]]] = {
    "mesh": frozenset(),
    "fsdp": frozenset({"mesh"}),
    "replicate": frozenset({"mesh", "fsdp"}),
    "extensions": frozenset({"mesh"}),
}
# torch's own FSDP/replicate engine; a prefix match also covers submodules.
BANNED_TORCH_MODULES: Final[tuple[str, ...]] = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fully_shard",
    "torch.distributed._composable.replicate",
    "torch.distributed._composable.replicate_with_fsdp",
    "torch.distributed.tensor.parallel.fsdp",
)
# The public names of torch.distributed.fsdp that package code may import: the policy
# dataclasses, which fully_shard and replicate accept as well as their own, and FSDPModule, a
# marker base of the classes they create so torch's isinstance checks hold (ARCHITECTURE.md,
# "Interop with torch's ecosystem"). Nothing else from that package, its engine least of all.
ALLOWED_TORCH_NAMES: Final[frozenset[str]] = frozenset(
    f"torch.distributed.fsdp.{name}"
    for name in ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "FSDPModule")
)
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_banned(module: str) -> bool:
    if module in ALLOWED_TORCH_NAMES:
        return False
    return any(module == b or module.startswith(b + ".") for b in BANNED_TORCH_MODULES)


def _imported_modules(
    tree: ast.Module, module_name: str, is_pkg: bool
) -> Iterator[tuple[int, str]]:
    """Yield (line, absolute module) for every import, including ``from a import b`` as ``a.b``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module_name.split(".")
                base_parts = parts if is_pkg else parts[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(p for p in [*base_parts, node.module or ""] if p)
            else:
                base = node.module or ""
            names = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
            # `from torch.distributed.fsdp import MixedPrecisionPolicy` imports one allowed name,
            # not the package as a whole
            if not (len(names) == len(node.names) and all(n in ALLOWED_TORCH_NAMES for n in names)):
                yield node.lineno, base
            for name in names:
                yield node.lineno, name
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in {"__import__", "import_module"}
                )
            )
        ):
            yield node.lineno, node.args[0].value


def _declared_shardweave_deps(pyproject: dict[str, object]) -> dict[str, str]:
    """Map sibling name ("mesh") to its requirement string, from [project].dependencies."""
    project = pyproject.get("project")
    deps = project.get("dependencies", []) if isinstance(project, dict) else []
    found: dict[str, str] = {}
    for req in deps if isinstance(deps, list) else []:
        match = _REQ_NAME.match(str(req))
        if match:
            name = _normalize(match.group(1))
            if name.startswith("shardweave-"):
                found[name.removeprefix("shardweave-")] = str(req)
    return found


def _read_version(path: Path) -> str | None:
    match = re.search(
        r"""^__version__\s*(?::\s*\w+\s*)?=\s*["']([^"']+)["']""", path.read_text(), re.M
    )
    return match.group(1) if match else None


def check(root: Path) -> list[str]:
    problems: list[str] = []
    packages_dir = root / "packages"
    packages = sorted(p for p in packages_dir.iterdir() if (p / "pyproject.toml").is_file())
    if not packages:
        return [f"{packages_dir}: no packages found (expected packages/<name>/pyproject.toml)"]
    names = {p.name for p in packages}
    versions: dict[str, str | None] = {}
    declared: dict[str, dict[str, str]] = {}

    for pkg in packages:
        rel = pkg.relative_to(root)
        src = pkg / "src" / "shardweave"
        if (src / "__init__.py").exists():
            problems.append(
                f"{rel}/src/shardweave/__init__.py: remove it; shardweave is a PEP 420 namespace "
                "package shared by every distribution"
            )
        if (pkg / "src" / "__init__.py").exists():
            problems.append(f"{rel}/src/__init__.py: remove it; src/ is not a package")
        if not (pkg / "CHANGELOG.md").is_file():
            problems.append(f"{rel}: missing CHANGELOG.md (this package's history only)")
        for marker in ("py.typed", "_version.py"):
            if not (src / pkg.name / marker).is_file():
                problems.append(f"{rel}: missing src/shardweave/{pkg.name}/{marker}")
        version_file = src / pkg.name / "_version.py"
        versions[pkg.name] = _read_version(version_file) if version_file.is_file() else None
        if version_file.is_file() and versions[pkg.name] is None:
            problems.append(f'{rel}/src/shardweave/{pkg.name}/_version.py: no __version__ = "..."')
        try:
            pyproject = tomllib.loads((pkg / "pyproject.toml").read_text())
        except tomllib.TOMLDecodeError as exc:
            problems.append(f"{rel}/pyproject.toml: invalid TOML: {exc}")
            continue
        project = pyproject.get("project", {})
        dist_name = project.get("name") if isinstance(project, dict) else None
        if dist_name is None or _normalize(str(dist_name)) != f"shardweave-{pkg.name}":
            problems.append(
                f"{rel}/pyproject.toml: [project].name is {dist_name!r}, expected 'shardweave-{pkg.name}'"
            )
        declared[pkg.name] = _declared_shardweave_deps(pyproject)
        allowed = ALLOWED_DEPS.get(pkg.name)
        for dep in sorted(declared[pkg.name]):
            if dep not in names:
                problems.append(
                    f"{rel}/pyproject.toml: depends on shardweave-{dep}, which is not in packages/"
                )
            elif allowed is not None and dep not in allowed:
                problems.append(
                    f"{rel}/pyproject.toml: {pkg.name} must not depend on shardweave-{dep} "
                    f"(ARCHITECTURE.md allows: {', '.join(sorted(allowed)) or 'no siblings'})"
                )

        for path in sorted((pkg / "src").rglob("*.py")):
            problems += _check_source(root, pkg.name, path, declared[pkg.name])

    problems += _check_ranges(root, declared, versions)
    problems += _check_test_imports(root)
    return problems


def _check_source(root: Path, pkg: str, path: Path, deps: dict[str, str]) -> list[str]:
    rel = path.relative_to(root)
    parts = path.relative_to(root / "packages" / pkg / "src").with_suffix("").parts
    is_pkg = parts[-1] == "__init__"
    module_name = ".".join(parts[:-1] if is_pkg else parts)
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        return [f"{rel}:{exc.lineno}: syntax error: {exc.msg}"]
    problems: list[str] = []
    seen: set[tuple[int, str]] = set()
    for line, module in _imported_modules(tree, module_name, is_pkg):
        parts = module.split(".")
        if parts[0] == "shardweave" and len(parts) > 1:
            sibling = parts[1]
            if sibling != pkg and sibling not in deps and (line, sibling) not in seen:
                seen.add((line, sibling))
                problems.append(
                    f"{rel}:{line}: imports shardweave.{sibling}, but packages/{pkg}/pyproject.toml "
                    f"does not declare shardweave-{sibling}"
                    + (
                        f" (and {pkg} may only depend on: {', '.join(sorted(ALLOWED_DEPS[pkg])) or 'no siblings'})"
                        if pkg in ALLOWED_DEPS and sibling not in ALLOWED_DEPS[pkg]
                        else ""
                    )
                )
            private = next(
                (i for i, p in enumerate(parts) if i > 1 and p[:1] == "_" and p[:2] != "__"), None
            )
            # one problem per private module, not per name imported from it
            name = ".".join(parts[: private + 1]) if private is not None else ""
            if sibling != pkg and private is not None and (line, name) not in seen:
                seen.add((line, name))
                problems.append(
                    f"{rel}:{line}: imports {name}, private to shardweave-{sibling}; siblings are "
                    "released separately, so use its public names (add one there, e.g. to "
                    "shardweave.fsdp.engine, if it lacks what you need)"
                )
        if _is_banned(module) and (line, module) not in seen:
            seen.add((line, module))
            problems.append(
                f"{rel}:{line}: imports {module}: torch's FSDP engine must not be used in package "
                "code; shardweave ships its own (tests may use it as an oracle)"
            )
    return problems


def _test_module_of(root: Path, module: str) -> str | None:
    """The ``tests/**/test_*.py`` file that importing ``module`` loads, if any (relative path)."""
    parts = module.split(".")
    # `from tests.a import test_b` yields tests.a.test_b; `import tests.a.test_b.x` reaches it too
    for end in range(2, len(parts) + 1):
        if parts[end - 1].startswith("test_"):
            path = root.joinpath(*parts[:end]).with_suffix(".py")
            if path.is_file():
                return str(path.relative_to(root))
    return None


def _check_test_imports(root: Path) -> list[str]:
    tests = root / "tests"
    if not tests.is_dir():
        return []
    problems: list[str] = []
    for path in sorted(tests.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        module_name = ".".join(parts[:-1] if is_pkg else parts)
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as exc:
            problems.append(f"{path.relative_to(root)}:{exc.lineno}: syntax error: {exc.msg}")
            continue
        seen: set[tuple[int, str]] = set()
        for line, module in _imported_modules(tree, module_name, is_pkg):
            if not module.startswith("tests."):
                continue
            target = _test_module_of(root, module)
            if target is not None and (line, target) not in seen:
                seen.add((line, target))
                problems.append(
                    f"{path.relative_to(root)}:{line}: imports the test module {target}; move "
                    "what tests share into a helper module (tests/<pkg>/_*.py or tests/_dist)"
                )
    return problems


def _check_ranges(
    root: Path, declared: dict[str, dict[str, str]], versions: dict[str, str | None]
) -> list[str]:
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # the lint session installs packaging; skip this check without it
        return []
    problems: list[str] = []
    for pkg, deps in declared.items():
        for dep, req_text in deps.items():
            version = versions.get(dep)
            if version is None:
                continue
            try:
                req = Requirement(req_text)
            except InvalidRequirement as exc:
                problems.append(
                    f"packages/{pkg}/pyproject.toml: invalid requirement {req_text!r}: {exc}"
                )
                continue
            if not req.specifier.contains(version, prereleases=True):
                problems.append(
                    f"packages/{pkg}/pyproject.toml: requires {req_text!r}, but packages/{dep} is at "
                    f"{version}; widen the range or bump the sibling"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    problems = check(args.root.resolve())
    for problem in problems:
        print(f"check_layout: {problem}", file=sys.stderr)
    if problems:
        print(f"check_layout: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("check_layout: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
