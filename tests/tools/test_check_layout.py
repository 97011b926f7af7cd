"""tools/check_layout.py on small fake repositories: each invariant fails with a clear message."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.tools._load import load_tool

DEPS = {"mesh": [], "fsdp": ["mesh"], "replicate": ["mesh", "fsdp"], "extensions": ["mesh"]}


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("check_layout")


def _write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _repo(root: Path) -> Path:
    for pkg, deps in DEPS.items():
        base = root / "packages" / pkg
        reqs = ", ".join([f'"shardweave-{d}>=0.1,<0.2"' for d in deps] + ['"torch>=2.13"'])
        _write(
            base / "pyproject.toml",
            f'[project]\nname = "shardweave-{pkg}"\ndependencies = [{reqs}]\n',
        )
        _write(base / "CHANGELOG.md", "# Changelog\n")
        _write(base / "src" / "shardweave" / pkg / "py.typed")
        _write(base / "src" / "shardweave" / pkg / "_version.py", '__version__ = "0.1.0"\n')
        imports = "".join(f"import shardweave.{d}\n" for d in deps)
        _write(base / "src" / "shardweave" / pkg / "__init__.py", imports)
    return root


def test_clean_repo_passes(tool: ModuleType, tmp_path: Path) -> None:
    assert tool.check(_repo(tmp_path)) == []
    assert tool.main(["--root", str(tmp_path)]) == 0


def test_namespace_init_fails(tool: ModuleType, tmp_path: Path) -> None:
    _write(_repo(tmp_path) / "packages" / "fsdp" / "src" / "shardweave" / "__init__.py")
    (problem,) = tool.check(tmp_path)
    assert "packages/fsdp/src/shardweave/__init__.py" in problem and "PEP 420" in problem


@pytest.mark.parametrize(
    ("relative", "expected"),
    [
        ("CHANGELOG.md", "missing CHANGELOG.md"),
        ("src/shardweave/mesh/py.typed", "missing src/shardweave/mesh/py.typed"),
        ("src/shardweave/mesh/_version.py", "missing src/shardweave/mesh/_version.py"),
    ],
)
def test_missing_files_fail(tool: ModuleType, tmp_path: Path, relative: str, expected: str) -> None:
    (_repo(tmp_path) / "packages" / "mesh" / relative).unlink()
    problems = tool.check(tmp_path)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "source",
    [
        "import shardweave.extensions\n",
        "from shardweave.extensions import all_gather\n",
        "from shardweave import extensions\n",
        "from .. import extensions\n",  # relative, from shardweave/fsdp/_x.py
        "import importlib\nimportlib.import_module('shardweave.extensions.all_gather')\n",
    ],
)
def test_undeclared_sibling_import_fails(tool: ModuleType, tmp_path: Path, source: str) -> None:
    _write(_repo(tmp_path) / "packages" / "fsdp" / "src" / "shardweave" / "fsdp" / "_x.py", source)
    problems = tool.check(tmp_path)
    assert len(problems) == 1, problems
    assert "_x.py:" in problems[0]
    assert "imports shardweave.extensions" in problems[0]
    assert "does not declare shardweave-extensions" in problems[0]


def test_declared_but_forbidden_dependency_fails(tool: ModuleType, tmp_path: Path) -> None:
    pyproject = _repo(tmp_path) / "packages" / "mesh" / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "shardweave-mesh"\ndependencies = ["shardweave_FSDP"]\n'
    )
    problems = tool.check(tmp_path)
    assert any("mesh must not depend on shardweave-fsdp" in p for p in problems), problems


def test_range_excluding_sibling_version_fails(tool: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("packaging")
    version = _repo(tmp_path) / "packages" / "mesh" / "src" / "shardweave" / "mesh" / "_version.py"
    version.write_text('__version__ = "0.2.0"\n')
    problems = tool.check(tmp_path)
    assert len(problems) == 3, problems  # fsdp, replicate and extensions all pin mesh <0.2
    assert all("packages/mesh is at 0.2.0" in p for p in problems)


@pytest.mark.parametrize(
    "source",
    [
        "from torch.distributed.fsdp import fully_shard\n",
        "import torch.distributed.fsdp._fully_shard._fsdp_param as p\n",
        "from torch.distributed import fsdp\n",
        "from torch.distributed._composable import replicate_with_fsdp\n",
        "from torch.distributed._composable.fsdp import fully_shard\n",
        "from torch.distributed.tensor.parallel.fsdp import DTensorExtensions\n",
        # an allowed policy name does not carry another name along, nor the package itself
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n",
        "import torch.distributed.fsdp\n",
        "from torch.distributed.fsdp._fully_shard._fsdp_api import MixedPrecisionPolicy\n",
        "from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule\n",
    ],
)
def test_torch_fsdp_engine_import_fails(tool: ModuleType, tmp_path: Path, source: str) -> None:
    _write(_repo(tmp_path) / "packages" / "fsdp" / "src" / "shardweave" / "fsdp" / "_y.py", source)
    problems = tool.check(tmp_path)
    assert problems and all("torch's FSDP engine" in p for p in problems), problems


def test_allowed_torch_imports_pass(tool: ModuleType, tmp_path: Path) -> None:
    source = (
        "import torch.distributed as dist\nfrom torch.distributed.tensor import DTensor\n"
        # torch's policy dataclasses, accepted by fully_shard and replicate
        "from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP\n"
        "from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy\n"
        # torch's FSDPModule, the marker base of the classes fully_shard creates
        "from torch.distributed.fsdp import FSDPModule as TorchFSDPModule\n"
    )
    _write(_repo(tmp_path) / "packages" / "fsdp" / "src" / "shardweave" / "fsdp" / "_z.py", source)
    assert tool.check(tmp_path) == []


@pytest.mark.parametrize(
    "source",
    [
        "from tests.fsdp.world_2.test_a import helper\n",
        "import tests.fsdp.world_2.test_a\n",
        "from tests.fsdp.world_2 import test_a\n",
        "from .test_a import helper\n",  # relative, from tests/fsdp/world_2/test_b.py
        "def body() -> None:\n    from tests.fsdp.world_2.test_a import helper\n",
        "import importlib\nimportlib.import_module('tests.fsdp.world_2.test_a')\n",
    ],
)
def test_test_module_importing_a_test_module_fails(
    tool: ModuleType, tmp_path: Path, source: str
) -> None:
    world_2 = _repo(tmp_path) / "tests" / "fsdp" / "world_2"
    _write(world_2 / "test_a.py", "def helper() -> None: ...\n")
    _write(world_2 / "test_b.py", source)
    problems = tool.check(tmp_path)
    assert len(problems) == 1, problems
    assert problems[0].startswith("tests/fsdp/world_2/test_b.py:")
    assert "imports the test module tests/fsdp/world_2/test_a.py" in problems[0]


def test_helper_module_imports_pass(tool: ModuleType, tmp_path: Path) -> None:
    fsdp = _repo(tmp_path) / "tests" / "fsdp"
    _write(fsdp / "_helpers.py", "def test_like_name() -> None: ...\n")
    _write(fsdp / "world_2" / "test_a.py", "from tests.fsdp._helpers import test_like_name\n")
    _write(fsdp / "world_4" / "test_a.py", "from tests.fsdp import _helpers\nimport tests._dist\n")
    assert tool.check(tmp_path) == []


@pytest.mark.parametrize(
    ("pkg", "source", "name"),
    [
        (
            "replicate",
            "from shardweave.fsdp._fsdp_init import a, b\n",
            "shardweave.fsdp._fsdp_init",
        ),
        ("replicate", "import shardweave.fsdp._fully_shard\n", "shardweave.fsdp._fully_shard"),
        ("replicate", "from shardweave.fsdp import _trace\n", "shardweave.fsdp._trace"),
        (
            "replicate",
            "from shardweave.fsdp import _private_name\n",
            "shardweave.fsdp._private_name",
        ),
        ("fsdp", "from shardweave.mesh._dims import check\n", "shardweave.mesh._dims"),
        (
            "fsdp",
            "from shardweave.mesh.extension_points import _hidden\n",
            "shardweave.mesh.extension_points._hidden",
        ),
    ],
)
def test_sibling_private_import_fails(
    tool: ModuleType, tmp_path: Path, pkg: str, source: str, name: str
) -> None:
    _write(_repo(tmp_path) / "packages" / pkg / "src" / "shardweave" / pkg / "_x.py", source)
    problems = tool.check(tmp_path)
    assert len(problems) == 1, problems
    assert f"_x.py:1: imports {name}, private to shardweave-" in problems[0]


def test_public_and_own_private_imports_pass(tool: ModuleType, tmp_path: Path) -> None:
    source = (
        "from shardweave.fsdp import engine, fully_shard, __version__\n"
        "from shardweave.fsdp.engine import attach_engine\n"
        "from shardweave.mesh import check_mesh_argument\n"
        "from shardweave.replicate._replicate import replicate\n"  # its own private module
    )
    _write(
        _repo(tmp_path) / "packages" / "replicate" / "src" / "shardweave" / "replicate" / "_x.py",
        source,
    )
    assert tool.check(tmp_path) == []


# --- the module tables of docs/architecture.md, import cycles, private names across modules ---

FSDP_SRC = Path("packages") / "fsdp" / "src" / "shardweave" / "fsdp"


def _tables(root: Path, fsdp: list[str], plan: list[str] | None = None) -> None:
    """docs/architecture.md with a module table per package (bottom-up), ``fsdp``'s as given."""
    rows = {"mesh": ["_version", "__init__"], "fsdp": fsdp}
    rows |= {"replicate": ["_version", "__init__"], "extensions": ["_version", "__init__"]}
    if plan is not None:
        rows["fsdp.plan"] = plan
    text = "# Architecture\n\n"
    for pkg, names in rows.items():
        text += f"## Inside `shardweave.{pkg}`\n\n| module | what it is |\n|---|---|\n"
        text += "".join(f"| `{name}` | a module |\n" for name in names) + "\nSome prose.\n\n"
    _write(root / "docs" / "architecture.md", text)


def _fsdp(root: Path, modules: dict[str, str]) -> Path:
    """The fake repository with ``modules`` (name: source) in shardweave.fsdp."""
    for name, source in modules.items():
        _write(root / FSDP_SRC / f"{name.replace('.', '/')}.py", source)
    return root


def test_modules_in_table_order_pass(tool: ModuleType, tmp_path: Path) -> None:
    _fsdp(
        _repo(tmp_path),
        {
            "_a": "X = 1\n",
            "_b": (
                "from typing import TYPE_CHECKING\nfrom shardweave.fsdp._a import X\n"
                "if TYPE_CHECKING:\n    from shardweave.fsdp import _a\n"
                "def f() -> int:\n    from ._a import X as Y\n    return Y\n"
            ),
        },
    )
    _tables(tmp_path, ["_version", "_a", "_b", "__init__"])
    assert tool.check(tmp_path, known_back_edges=frozenset()) == []


@pytest.mark.parametrize(
    ("source", "how"),
    [
        ("from shardweave.fsdp._b import Y\n", "_a imports shardweave.fsdp._b"),
        ("from . import _b\n", "_a imports shardweave.fsdp._b"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import Y\n",
            "_a imports shardweave.fsdp._b under TYPE_CHECKING",
        ),
        (
            "def f() -> object:\n    from shardweave.fsdp._b import Y\n    return Y\n",
            "_a imports shardweave.fsdp._b inside a function",
        ),
        (
            "import importlib\nM = importlib.import_module('shardweave.fsdp._b')\n",
            "_a imports shardweave.fsdp._b, which",
        ),
    ],
)
def test_import_of_a_module_below_fails(
    tool: ModuleType, tmp_path: Path, source: str, how: str
) -> None:
    # _b is below _a in the table; _b itself imports nothing, so this is no cycle
    _fsdp(_repo(tmp_path), {"_a": source, "_b": "Y = 2\n"})
    _tables(tmp_path, ["_version", "_a", "_b", "__init__"])
    (problem,) = tool.check(tmp_path, known_back_edges=frozenset())
    assert problem.startswith(f"{FSDP_SRC}/_a.py:"), problem
    assert how in problem and "not above `_a` in the module table" in problem


def test_subpackage_is_one_line_of_its_parent(tool: ModuleType, tmp_path: Path) -> None:
    modules = {
        "_a": "X = 1\n",
        "plan.__init__": "",
        "plan._p": "from shardweave.fsdp._a import X\n",
    }
    _fsdp(_repo(tmp_path), modules)
    _tables(tmp_path, ["_version", "_a", "plan/", "__init__"], plan=["_p", "__init__"])
    assert tool.check(tmp_path, known_back_edges=frozenset()) == []
    # the planner may not reach an engine module below its line
    _tables(tmp_path, ["_version", "plan/", "_a", "__init__"], plan=["_p", "__init__"])
    (problem,) = tool.check(tmp_path, known_back_edges=frozenset())
    assert "plan/_p.py:1: shardweave.fsdp.plan._p imports shardweave.fsdp._a" in problem
    assert "not above `plan/` in the module table of shardweave.fsdp" in problem


def _folder_tables(root: Path) -> None:
    """docs/architecture.md for two subsystem folders of shardweave.fsdp, ``comm/`` below
    ``core/`` (each one line of the package's table, and a table of its own)."""
    _tables(root, ["_version", "comm/", "core/", "__init__"])
    doc = root / "docs" / "architecture.md"
    text = doc.read_text()
    for folder, names in (("comm", ["_seam", "__init__"]), ("core", ["_param", "__init__"])):
        text += f"### Inside `shardweave.fsdp.{folder}`\n\n| module | what it is |\n|---|---|\n"
        text += "".join(f"| `{name}` | a module |\n" for name in names) + "\n"
    doc.write_text(text)


@pytest.mark.parametrize(
    ("source", "line", "how"),
    [
        ("from shardweave.fsdp.core._param import FSDPParam\n", 1, ""),
        ("from ..core import _param\n", 1, ""),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from shardweave.fsdp.core._param import FSDPParam\n",
            3,
            " under TYPE_CHECKING",
        ),
        (
            "def f() -> object:\n    from shardweave.fsdp.core import _param\n    return _param\n",
            2,
            " inside a function",
        ),
    ],
)
def test_import_from_a_lower_folder_into_a_higher_one_fails(
    tool: ModuleType, tmp_path: Path, source: str, line: int, how: str
) -> None:
    """A subsystem folder is one line of its package's table: a module of the lower folder
    (comm/) may not import one of the higher (core/), however it imports it."""
    modules = {
        "comm.__init__": "",
        "comm._seam": source,
        "core.__init__": "",
        "core._param": "from shardweave.fsdp.comm._seam import issue\nclass FSDPParam: ...\n",
    }
    _fsdp(_repo(tmp_path), modules)
    _folder_tables(tmp_path)
    problems = tool.check(tmp_path, known_back_edges=frozenset())
    upward = [p for p in problems if "not above" in p]
    assert len(upward) == 1, problems
    assert f"comm/_seam.py:{line}: shardweave.fsdp.comm._seam imports " in upward[0]
    assert f"imports shardweave.fsdp.core._param{how}" in upward[0]
    assert "which is not above `comm/` in the module table of shardweave.fsdp" in upward[0]
    assert "declare what `comm/` needs of it as an interface in `comm/`" in upward[0]
    # the downward import alone (core/ -> comm/) passes
    _write(tmp_path / FSDP_SRC / "comm" / "_seam.py", "def issue() -> None: ...\n")
    assert tool.check(tmp_path, known_back_edges=frozenset()) == []


def test_real_tree_rejects_an_upward_import_between_folders(
    tool: ModuleType, tmp_path: Path
) -> None:
    """The repository's own layout: its tables pass, and an import of the engine core from the
    communication layer (the all-gather reaching for ``FSDPParam``) is refused."""
    import shutil

    from tests.tools._load import REPO

    shutil.copytree(
        REPO / "packages", tmp_path / "packages", ignore=shutil.ignore_patterns("*.pyc")
    )
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / "docs" / "architecture.md", tmp_path / "docs" / "architecture.md")
    assert tool.check(tmp_path) == []
    all_gather = tmp_path / FSDP_SRC / "comm" / "_all_gather.py"
    all_gather.write_text(
        all_gather.read_text()
        + "\n\ndef _reach_up() -> object:\n"
        + "    from shardweave.fsdp.core._param import FSDPParam\n\n    return FSDPParam\n"
    )
    (problem,) = tool.check(tmp_path)
    assert "shardweave.fsdp.comm._all_gather imports shardweave.fsdp.core._param" in problem
    assert "not above `comm/` in the module table of shardweave.fsdp" in problem


def test_subpackage_init_imported_from_inside_fails(tool: ModuleType, tmp_path: Path) -> None:
    # `from shardweave.fsdp.plan import plan` inside the planner climbs to its __init__
    modules = {
        "plan.__init__": "from shardweave.fsdp.plan._p import plan\n",
        "plan._p": "def plan() -> None:\n    from shardweave.fsdp.plan import other\n",
    }
    _fsdp(_repo(tmp_path), modules)
    _tables(tmp_path, ["_version", "plan/", "__init__"], plan=["_p", "__init__"])
    problems = tool.check(tmp_path, known_back_edges=frozenset())
    assert any("_p imports shardweave.fsdp.plan inside a function" in p for p in problems)
    assert any("import cycle" in p for p in problems)


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (["_version", "__init__"], "`_a` of shardweave.fsdp is not in its module table"),
        (["_version", "_a", "_gone", "__init__"], "lists `_gone`, which does not exist"),
    ],
)
def test_table_and_modules_must_match(
    tool: ModuleType, tmp_path: Path, table: list[str], expected: str
) -> None:
    _fsdp(_repo(tmp_path), {"_a": "X = 1\n"})
    _tables(tmp_path, table)
    (problem,) = tool.check(tmp_path, known_back_edges=frozenset())
    assert problem.startswith("docs/architecture.md: ") and expected in problem


def test_package_without_table_fails(tool: ModuleType, tmp_path: Path) -> None:
    _fsdp(_repo(tmp_path), {"plan.__init__": ""})
    _tables(tmp_path, ["_version", "plan/", "__init__"])  # no table for shardweave.fsdp.plan
    (problem,) = tool.check(tmp_path, known_back_edges=frozenset())
    assert "no module table for shardweave.fsdp.plan" in problem


@pytest.mark.parametrize(
    "a_source",
    [
        "from shardweave.fsdp._b import Y\nX = 1\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import Y\nX = 1\n",
        "X = 1\ndef f() -> object:\n    from shardweave.fsdp import _b\n    return _b\n",
    ],
)
def test_import_cycle_fails_even_without_tables(
    tool: ModuleType, tmp_path: Path, a_source: str
) -> None:
    _fsdp(_repo(tmp_path), {"_a": a_source, "_b": "from shardweave.fsdp._a import X\nY = 2\n"})
    (problem,) = tool.check(tmp_path, known_back_edges=frozenset())
    assert problem.startswith("packages/fsdp: import cycle")
    assert "among shardweave.fsdp._a, shardweave.fsdp._b" in problem


def test_acyclic_imports_pass_without_tables(tool: ModuleType, tmp_path: Path) -> None:
    _fsdp(_repo(tmp_path), {"_a": "X = 1\n", "_b": "from shardweave.fsdp._a import X\nY = X\n"})
    assert tool.check(tmp_path, known_back_edges=frozenset()) == []


def test_known_back_edges_pass_and_must_exist(tool: ModuleType, tmp_path: Path) -> None:
    back = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import Y\nX = 1\n"
    _fsdp(_repo(tmp_path), {"_a": back, "_b": "from ._a import X\nY = X\n"})
    _tables(tmp_path, ["_version", "_a", "_b", "__init__"])
    edge = ("shardweave.fsdp._a", "shardweave.fsdp._b")
    assert tool.check(tmp_path, known_back_edges=frozenset({edge})) == []
    assert len(tool.check(tmp_path, known_back_edges=frozenset())) == 2  # the edge, the cycle
    stale = ("shardweave.fsdp._b", "shardweave.fsdp._gone")
    (problem,) = tool.check(tmp_path, known_back_edges=frozenset({edge, stale}))
    assert "KNOWN_BACK_EDGES lists shardweave.fsdp._b -> shardweave.fsdp._gone" in problem


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("from ._a import _hidden\n", "shardweave.fsdp._a._hidden"),
        ("from shardweave.fsdp._a import X, _hidden\n", "shardweave.fsdp._a._hidden"),
        ("from shardweave.fsdp import _a\nZ = _a._hidden\n", "shardweave.fsdp._a._hidden"),
        ("from . import _a as a\nZ = a._hidden.real\n", "shardweave.fsdp._a._hidden"),
        (
            "import shardweave.fsdp._a\nZ = shardweave.fsdp._a._hidden\n",
            "shardweave.fsdp._a._hidden",
        ),
    ],
)
def test_private_name_of_another_module_fails(
    tool: ModuleType, tmp_path: Path, source: str, name: str
) -> None:
    _fsdp(_repo(tmp_path), {"_a": "X = 1\n_hidden = 2\n", "_b": source})
    (problem,) = tool.check(tmp_path, known_back_edges=frozenset())
    assert problem.startswith(f"{FSDP_SRC}/_b.py:") and f"uses {name}, a private name" in problem


def test_public_names_and_own_private_names_pass(tool: ModuleType, tmp_path: Path) -> None:
    source = (
        "from shardweave.fsdp import _a\nfrom ._a import X\nfrom . import _a as a\n"
        "_mine = _a.X + a.X + X\nZ = _mine + _a.__name__.count('_') + len(a.__dict__)\n"
        "def f(obj: object) -> object:\n    return obj._private  # an object's, not a module's\n"
    )
    _fsdp(_repo(tmp_path), {"_a": "X = 1\n_hidden = 2\n", "_b": source})
    assert tool.check(tmp_path, known_back_edges=frozenset()) == []


def test_repository_has_no_cycles_but_the_known_one(tool: ModuleType) -> None:
    """The real tree: green as it stands, and every cycle left goes through KNOWN_BACK_EDGES."""
    from tests.tools._load import REPO

    assert tool.check(REPO) == []
    for pkg in ("mesh", "fsdp", "replicate", "extensions"):
        edges, _ = tool.package_edges(REPO, pkg)
        kept = [e for e in edges if (e.importer, e.imported) not in tool.KNOWN_BACK_EDGES]
        assert tool._cycles(kept) == [], pkg
