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
