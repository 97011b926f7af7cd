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
    test never breaks another;
  * inside a package, against the module tables of ``docs/architecture.md`` (each
    ``## Inside `shardweave.<p>``` section): an import of a module not on a line above the
    importer (at module level, inside a function, or under ``TYPE_CHECKING``: type-only imports
    are arrows too; a subpackage, such as a subsystem folder of ``shardweave.fsdp``, is one
    line of its parent's table, so this orders the folders too, and has a table of its own), a
    module missing from its table or a line naming none, an import cycle, and one module's use
    of another's private name (``from ._x import _y``, ``_x._y``);
    ``KNOWN_BACK_EDGES`` would list back edges allowed while a restructuring lands (empty), and
    only those that exist.

Usage: python tools/check_layout.py [--root DIR] [--strict] [--cycles]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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
# Back edges the checker lets through, as (importer, imported) full module names: none. The set
# exists for a restructuring that lands in steps (issue 28 used it while the communication
# layer's circle was broken on another branch); an entry whose import is gone is an error, so
# it cannot outlive its reason.
KNOWN_BACK_EDGES: Final[frozenset[tuple[str, str]]] = frozenset()

_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_banned(module: str) -> bool:
    if module in ALLOWED_TORCH_NAMES:
        return False
    return any(module == b or module.startswith(b + ".") for b in BANNED_TORCH_MODULES)


def _dynamic_import(node: ast.AST) -> str | None:
    """The module a call imports by name (``importlib.import_module("m")``, a bare
    ``import_module("m")`` or ``__import__("m")``), else None."""
    if not (
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return None
    func = node.func
    if (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in {"__import__", "import_module"}
    ):
        return node.args[0].value
    return None


def _imported_modules(
    tree: ast.Module, module_name: str, is_pkg: bool
) -> Iterator[tuple[int, str]]:
    """Yield (line, absolute module) for every import, including ``from a import b`` as ``a.b``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, module_name, is_pkg)
            names = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
            # `from torch.distributed.fsdp import MixedPrecisionPolicy` imports one allowed name,
            # not the package as a whole
            if not (len(names) == len(node.names) and all(n in ALLOWED_TORCH_NAMES for n in names)):
                yield node.lineno, base
            for name in names:
                yield node.lineno, name
        elif (dynamic := _dynamic_import(node)) is not None:
            yield node.lineno, dynamic


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


def check(
    root: Path, *, known_back_edges: frozenset[tuple[str, str]] = KNOWN_BACK_EDGES
) -> list[str]:
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
    problems += _check_module_order(root, packages, known_back_edges)
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


# --- the module order inside each package (docs/architecture.md, "Inside `shardweave.<p>`") ---

_SECTION = re.compile(r"^##+\s+Inside\s+`(shardweave(?:\.\w+)+)`")
_TABLE_NAME = re.compile(r"`([\w.]+/?)`")


@dataclass(frozen=True)
class _Edge:
    """One import of a module of the same distribution: ``importer`` imports ``imported``."""

    importer: str
    imported: str
    path: Path
    line: int
    kind: str  # "module", "TYPE_CHECKING" or "function"


def _module_tables(doc: Path) -> dict[str, list[frozenset[str]]]:
    """Each ``## Inside `shardweave.<p>``` section's table: its rows' module names, top first
    (a subpackage is named ``plan/``)."""
    tables: dict[str, list[frozenset[str]]] = {}
    current: str | None = None
    for raw in doc.read_text().splitlines():
        line = raw.strip()
        header = _SECTION.match(line)
        if header:
            current = header.group(1)
            tables[current] = []
            continue
        if line.startswith("#"):
            current = None
        if current is None or not line.startswith("|"):
            if current is not None and tables[current] and line:
                current = None  # the first table of a section is its module table
            continue
        cell = line.strip("|").split("|")[0].strip()
        if set(cell) <= set("-: ") or cell == "module":
            continue  # separator or header row
        names = frozenset(_TABLE_NAME.findall(cell))
        if names:
            tables[current].append(names)
    return tables


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a module of ``modules``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _own_imports(
    tree: ast.Module, module_name: str, is_pkg: bool, modules: set[str]
) -> Iterator[tuple[int, str, str]]:
    """(line, imported module of ``modules``, kind) for each import in ``tree``; ``from
    p import name`` is an import of ``p.name`` when that is a module, else of ``p``."""

    def visit(node: ast.AST, kind: str) -> Iterator[tuple[int, str, str]]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kind = "function" if kind == "module" else kind
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                yield from visit(stmt, "TYPE_CHECKING")
            for stmt in node.orelse:
                yield from visit(stmt, kind)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target is not None:
                    yield node.lineno, target, kind
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, module_name, is_pkg)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in modules else _resolve(base, modules)
                if target is not None:
                    yield node.lineno, target, kind
        elif (dynamic := _dynamic_import(node)) is not None:
            target = _resolve(dynamic, modules)
            if target is not None:
                yield node.lineno, target, kind
        for child in ast.iter_child_nodes(node):
            yield from visit(child, kind)

    yield from visit(tree, "module")


def _import_base(node: ast.ImportFrom, module_name: str, is_pkg: bool) -> str:
    """The absolute module a ``from ... import`` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    parts = module_name.split(".")
    base_parts = parts if is_pkg else parts[:-1]
    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
    return ".".join(p for p in [*base_parts, node.module or ""] if p)


def _is_private(name: str) -> bool:
    return name[:1] == "_" and name[:2] != "__"


def _private_uses(
    tree: ast.Module, module_name: str, is_pkg: bool, modules: set[str]
) -> Iterator[tuple[int, str]]:
    """(line, ``module.name``) for each private name of another module of ``modules`` that
    ``tree`` imports (``from ._x import _y``) or reads (``_x._y``)."""
    bound: dict[str, str] = {}  # a local name bound to a module of ``modules``
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is not None and alias.name in modules:
                    bound[alias.asname] = alias.name
                elif alias.asname is None and _resolve(alias.name, modules):
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, module_name, is_pkg)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    bound[alias.asname or alias.name] = full
                elif base in modules and base != module_name and _is_private(alias.name):
                    yield node.lineno, full
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        dotted = ".".join([bound[value.id], *reversed(chain)])
        owner = _resolve(dotted, modules)
        if owner is None or owner == module_name or dotted == owner:
            continue
        rest = dotted[len(owner) + 1 :].split(".")
        if _is_private(rest[0]) and f"{owner}.{rest[0]}" not in modules:
            yield node.lineno, f"{owner}.{rest[0]}"


def _unit(module: str, package: str, packages: set[str]) -> str:
    """``module``'s line in ``package``'s table: its name, ``<sub>/`` for a subpackage or a
    module in one, ``__init__`` for the package itself."""
    if module == package:
        return "__init__"
    head = module[len(package) + 1 :].split(".")
    sub = f"{package}.{head[0]}"
    return f"{head[0]}/" if len(head) > 1 or sub in packages else head[0]


def _module_names(src: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under ``src`` (``.../src``) by dotted name, with its path and is-package."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return found


def _cycles(edges: Sequence[_Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if edge.importer != edge.imported:
            graph.setdefault(edge.importer, set()).add(edge.imported)
            graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def package_edges(root: Path, pkg: str) -> tuple[list[_Edge], list[str]]:
    """The imports between modules of ``packages/<pkg>``, and its private-name problems."""
    src = root / "packages" / pkg / "src"
    found = _module_names(src)
    modules = set(found)
    edges: list[_Edge] = []
    problems: list[str] = []
    for name, (path, is_pkg) in found.items():
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError:
            continue  # reported by _check_source
        rel = path.relative_to(root)
        seen: set[tuple[int, str]] = set()
        for line, target, kind in _own_imports(tree, name, is_pkg, modules):
            if target != name and (line, target) not in seen:
                seen.add((line, target))
                edges.append(_Edge(name, target, rel, line, kind))
        for line, private in sorted(set(_private_uses(tree, name, is_pkg, modules))):
            problems.append(
                f"{rel}:{line}: uses {private}, a private name of another module; make it public "
                "in its module (no leading underscore), or move the code that needs it there"
            )
    return edges, problems


def _check_module_order(
    root: Path, packages: Sequence[Path], allowed: frozenset[tuple[str, str]]
) -> list[str]:
    """Import cycles, back edges against docs/architecture.md's module tables, unlisted modules
    and private names used across modules, for every package, but for the ``allowed`` edges
    (which must all exist, when the tables are checked)."""
    doc = root / "docs" / "architecture.md"
    tables = _module_tables(doc) if doc.is_file() else None
    problems: list[str] = []
    found: set[tuple[str, str]] = set()
    for pkg in packages:
        edges, private = package_edges(root, pkg.name)
        problems += private
        found |= {(e.importer, e.imported) for e in edges}
        edges = [e for e in edges if (e.importer, e.imported) not in allowed]
        for cycle in _cycles(edges):
            problems.append(
                f"packages/{pkg.name}: import cycle (type-only and function-level imports "
                f"included) among {', '.join(cycle)}; move what both need into the lower module"
            )
        if tables is not None:
            problems += _check_tables(root, pkg.name, edges, tables)
    if tables is not None:
        for importer, imported in sorted(allowed - found):
            problems.append(
                f"tools/check_layout.py: KNOWN_BACK_EDGES lists {importer} -> {imported}, an "
                "import that no longer exists; remove it from the list"
            )
    return problems


def _check_tables(
    root: Path,
    pkg: str,
    edges: Sequence[_Edge],
    tables: dict[str, list[frozenset[str]]],
) -> list[str]:
    src = root / "packages" / pkg / "src"
    found = _module_names(src)
    packages = sorted(n for n, (_, is_pkg) in found.items() if is_pkg)
    pkg_set = set(packages)
    problems: list[str] = []
    rank: dict[str, dict[str, int]] = {}
    for package in packages:
        table = tables.get(package)
        if table is None:
            problems.append(
                f"docs/architecture.md: no module table for {package} (a section "
                f"'## Inside `{package}`' whose table lists its modules bottom-up)"
            )
            continue
        rank[package] = {unit: i for i, row in enumerate(table) for unit in row}
        units = {
            _unit(n, package, pkg_set) for n in found if n == package or n.startswith(package + ".")
        }
        for unit in sorted(units - set(rank[package])):
            problems.append(
                f"docs/architecture.md: `{unit}` of {package} is not in its module table; add "
                "a line for it, below everything it imports and above everything importing it"
            )
        for unit in sorted(set(rank[package]) - units):
            problems.append(
                f"docs/architecture.md: the module table of {package} lists `{unit}`, which "
                "does not exist"
            )
    for edge in edges:
        a, b = edge.importer.split("."), edge.imported.split(".")
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        # the deepest package holding both (a package's own __init__ is in that package)
        package = ".".join(a[:common])
        while package not in rank and package.count(".") > 1:
            package = package.rsplit(".", 1)[0]
        if package not in rank:
            continue
        if edge.importer != package and not edge.importer.startswith(package + "."):
            continue
        src_unit = _unit(edge.importer, package, pkg_set)
        dst_unit = _unit(edge.imported, package, pkg_set)
        if src_unit == dst_unit:
            continue  # inside one subpackage: its own table decides
        order = rank[package]
        if src_unit not in order or dst_unit not in order:
            continue  # reported as unlisted
        if order[dst_unit] < order[src_unit]:
            continue
        where = {
            "module": "",
            "TYPE_CHECKING": " under TYPE_CHECKING (type-only imports count too)",
            "function": " inside a function (a runtime import hides a cycle, it does not "
            "remove it)",
        }[edge.kind]
        if src_unit.endswith("/") or dst_unit.endswith("/"):
            # between subsystem folders: the lower one owns the interface it needs
            remedy = (
                f"`{dst_unit}` is a higher subsystem: declare what `{src_unit}` needs of it as "
                f"an interface in `{src_unit}` (a Protocol, or data passed down) and let "
                f"`{dst_unit}` pass it in"
            )
        else:
            remedy = "move what it needs into a lower module, or pass it in"
        problems.append(
            f"{edge.path}:{edge.line}: {edge.importer} imports {edge.imported}{where}, which "
            f"is not above `{src_unit}` in the module table of {package} "
            f"(docs/architecture.md); {remedy}"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--strict", action="store_true", help="ignore KNOWN_BACK_EDGES")
    parser.add_argument(
        "--cycles",
        action="store_true",
        help="only print the import cycles of each package, KNOWN_BACK_EDGES included, and exit 0",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.cycles:
        count = 0
        for pkg in sorted(p for p in (root / "packages").iterdir() if (p / "src").is_dir()):
            for cycle in _cycles(package_edges(root, pkg.name)[0]):
                count += 1
                print(f"{pkg.name}: {len(cycle)} modules: {', '.join(cycle)}")
        print(f"check_layout: {count} import cycle(s)")
        return 0
    problems = check(root, known_back_edges=frozenset() if args.strict else KNOWN_BACK_EDGES)
    for problem in problems:
        print(f"check_layout: {problem}", file=sys.stderr)
    if problems:
        print(f"check_layout: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("check_layout: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
