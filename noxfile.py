"""Every check shardweave runs. CI runs `nox` (the default sessions) and nothing else.

    nox                     tests, typecheck, lint, isolated(mesh|fsdp|replicate|extensions),
                            integration
    nox -s integration      the frameworks (Lightning, Fabric, accelerate, pipelining, DCP,
                            torchft) with torch's FSDP2 and ours in the same test
    nox -s demo             train a small GPT with fully_shard on 2 local CPU processes (torchrun)
    nox -s bench            timing scripts; never gates a merge
    nox -s compat           the version matrix: parity, accelerator-branch and integration tests
                            on torch 2.11.0, 2.14.1 and 2.15.0, e.g. nox -s "compat(torch='2.15.0')"
    nox -s gpu              on a machine with a CUDA GPU: the GPU kit's JSON report (tools/gpu_kit)
    nox -s docs             build the Sphinx docs into docs/_build/html, warnings as errors
    nox -s tests -- -k fsdp -x     arguments after -- go to pytest (or to the demo / bench script)

Every session that installs torch installs it first, from SHARDWEAVE_TORCH_SPEC (default
"torch==2.13.0", the CPU build CI tests), so no later requirement pulls in a multi-GB build:

    SHARDWEAVE_TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" nox
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox itself may run on an older Python than the sessions
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
PYTHON = "3.11"
TORCH_SPEC_ENV = "SHARDWEAVE_TORCH_SPEC"
DEFAULT_TORCH_SPEC = "torch==2.13.0"
# Pinned so `ruff format --check` and `mypy --strict` give the same answer everywhere.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
TEST_DEPS = ("pytest>=8", "hypothesis>=6.100")
LINT_PATHS = (
    "packages", "tests", "tools", "demos", "benchmarks", "examples", "docs", "noxfile.py",
)  # fmt: skip
TEST_PLUGIN = "tests/fixtures/shardweave_test_plugin"
# What the demo's report and pictures need besides torch and the four packages, installed in the
# same pip call: the fsdp package's `plot` extra (matplotlib, for demo-output/memory-rank{N}.png)
# and numpy (torch 2.13's object collectives need it on gloo). The one list: the demo session
# installs it, and tests/demos/test_readme_demo.py reads it (with ast: no nox needed there).
DEMO_REQUIREMENTS = ("./packages/fsdp[plot]", "numpy")
# The frameworks tests/integration drives, pinned: each release checked to leave torch 2.13.0 in
# place (pip install --dry-run "torch==2.13.0" <pins> installs no other torch). lightning is the
# newest release (its Trainer and Fabric strategies for FSDP2); accelerate for its FSDP2 wrapping;
# transformers for its own FSDP2 path (from_pretrained with a DistributedConfig); torchft for fault
# tolerance across replica groups (test_torchft.py; its wheel carries the Rust lighthouse and
# managers; the dry run with torch 2.11.0, 2.14.1 or 2.15.0 installs no other torch either).
INTEGRATION_REQUIREMENTS = (
    "lightning==2.6.6",
    "accelerate==1.15.0",
    "transformers==5.24.0",
    "torchft==0.2.0",
)

# The torch releases of the version matrix (`nox -s compat`) besides CI's 2.13.0: the oldest the
# packages accept, the last 2.14 and the current release.
COMPAT_TORCH = ("2.11.0", "2.14.1", "2.15.0")
# This machine's pip configuration (/etc/xdg/pip) constrains torch to at most this release (what
# lies on its disk); a newer torch installs only with that configuration left unread.
PIP_CONSTRAINT_CAP = (2, 14, 1)
# What `compat` runs, by group (paths under tests/; each test that needs an API its torch lacks
# skips itself with the reason):
# - parity: every test that checks our engine against torch's own `fully_shard` / `replicate`
#   (bitwise, same seeds) or torch's public FSDPModule surface: training, policies, features and
#   communication controls at world 2, training / HSDP at world 4, replicate, the extensions
#   (FSDP x TP, subclass all-gather, SPMD meshes) and the version rules in _torch_compat;
# - accelerator: the engine's accelerator branches under the stream sanitizer;
# - faults: the never-hang contract;
# - planner: the planner's predictions against real steps, and its closed forms;
# - integration: the frameworks (pinned), where their pins accept that torch (see
#   COMPAT_INTEGRATION_TORCH).
COMPAT_GROUPS: dict[str, tuple[str, ...]] = {
    "parity": (
        "tests/fsdp/world_1/test_torch_compat.py",
        "tests/fsdp/world_1/test_torch_method_guard.py",
        "tests/fsdp/world_2/test_torch_marker.py",
        "tests/fsdp/world_2/test_training.py",
        "tests/fsdp/world_2/test_policies_parity.py",
        "tests/fsdp/world_2/test_features.py",
        "tests/fsdp/world_2/test_comm_controls.py",
        "tests/fsdp/world_2/test_grad_accumulation.py",
        "tests/fsdp/world_2/test_frozen_params.py",
        "tests/fsdp/world_2/test_state_dict.py",
        "tests/fsdp/world_2/test_user_objects.py",
        "tests/fsdp/world_4/test_user_objects.py",
        "tests/fsdp/world_2/test_partial_all_reduce.py",
        "tests/fsdp/world_2/test_dtype_change.py",
        "tests/fsdp/world_2/test_torch215_mixed_precision.py",
        "tests/fsdp/world_2/test_manual_finalization.py",
        "tests/fsdp/world_2/test_keep_unsharded_storage.py",
        "tests/fsdp/world_4/test_keep_unsharded_storage.py",
        "tests/fsdp/world_2/test_spmd_types_params.py",
        "tests/fsdp/world_1/test_lifetime.py",
        "tests/fsdp/world_4/test_training.py",
        "tests/fsdp/world_4/test_hsdp.py",
        "tests/replicate",
        "tests/extensions/world_2",
        "tests/extensions/world_4",
    ),
    "accelerator": (
        "tests/fsdp/world_2/test_accelerator_branches.py",
        "tests/fsdp/world_4/test_accelerator_branches.py",
        "tests/fsdp/world_2/test_stream_order.py",
        "tests/fsdp/world_4/test_stream_order.py",
    ),
    # the never-hang contract: its checks run collectives of their own (one, on torch 2.11,
    # called a c10d function that release lacks)
    "faults": (
        "tests/fsdp/world_2/test_never_hang.py",
        "tests/fsdp/world_2/test_peer_exit.py",
        "tests/fsdp/world_2/test_watchdog_accelerator.py",
    ),
    # the planner against real steps: its dtype rules follow the release's (the reduce dtype
    # from 2.15), and its closed forms name them
    "planner": (
        "tests/fsdp/world_1/test_plan.py",
        "tests/fsdp/world_1/test_plan_fit.py",
        "tests/fsdp/world_2/test_plan_vs_real.py",
        "tests/fsdp/world_2/test_plan_vs_trace.py",
        "tests/fsdp/world_2/test_plan_fit_real.py",
        "tests/fsdp/world_4/test_plan_vs_real.py",
        "tests/fsdp/world_4/test_plan_fit_real.py",
    ),
    "integration": ("tests/integration",),
}
# The torch releases the pinned frameworks (INTEGRATION_REQUIREMENTS) accept, checked with
# `pip install --dry-run "torch==X" <pins>` (no other torch installed); on the others `compat`
# leaves the integration group out and says so.
COMPAT_INTEGRATION_TORCH = ("2.11.0", "2.14.1", "2.15.0")
# torchtitan 0.3.0 (tests/integration/world_2/test_torchtitan.py) needs torch 2.14 or newer and
# triton, which PyPI's Linux torch wheels bring; the tests session's CPU build of 2.13 has
# neither, so the test skips there and runs here.
COMPAT_TORCHTITAN = ("torchtitan==0.3.0",)
COMPAT_TORCHTITAN_TORCH = ("2.14.1", "2.15.0")

nox.options.default_venv_backend = "venv"
# demo, bench, docs on request
nox.options.sessions = ["tests", "typecheck", "lint", "isolated", "integration"]
nox.options.error_on_external_run = True


def _pyproject(pkg: str) -> dict[str, object]:
    with open(ROOT / "packages" / pkg / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _requirements(pkg: str) -> list[str]:
    project = _pyproject(pkg).get("project", {})
    deps = project.get("dependencies", []) if isinstance(project, dict) else []
    return [str(d) for d in deps]


def _req_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else requirement


# Package folder -> the sibling folders it declares in its pyproject (the single source of truth;
# tools/check_layout.py checks that the declarations follow ARCHITECTURE.md).
PACKAGES: dict[str, list[str]] = {
    pkg: [
        _req_name(r).removeprefix("shardweave-")
        for r in _requirements(pkg)
        if _req_name(r).startswith("shardweave-")
    ]
    for pkg in ("mesh", "fsdp", "replicate", "extensions")
}


def _closure(pkg: str) -> list[str]:
    """``pkg`` and every sibling it needs, dependencies first."""
    order: list[str] = []

    def visit(p: str) -> None:
        for dep in PACKAGES[p]:
            visit(dep)
        if p not in order:
            order.append(p)

    visit(pkg)
    return order


def _install_torch(session: nox.Session, default: str = DEFAULT_TORCH_SPEC) -> None:
    # First, so that the packages' `torch>=2.11,<2.16` is already satisfied when pip sees it.
    spec = os.environ.get(TORCH_SPEC_ENV, "").strip() or default
    # --no-compile: byte-compiling all of torch costs more than compiling what a run imports.
    session.install("--no-compile", *shlex.split(spec))


def _above_pip_cap(version: str) -> bool:
    """Whether torch ``version`` is newer than what this machine's pip constraint allows."""
    release = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return release > PIP_CONSTRAINT_CAP


def _install_requirements_file(session: nox.Session, path: str) -> None:
    if (ROOT / path).is_file():
        session.install("-r", path)


def _install_all_packages(session: nox.Session, *extra: str) -> None:
    # One pip call, so each sibling requirement resolves to the local folder, never an index.
    # A folder with extras in `extra` ("./packages/fsdp[plot]") is passed besides the plain one:
    # pip then installs the folder once with those extras, while given only the extras form it
    # looks for a sibling's requirement on that package (shardweave-fsdp) on the index.
    session.install(*(f"./packages/{p}" for p in PACKAGES), *extra)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All four packages (built, not editable) + the test plugin; the whole suite in one pytest.

    One pytest process means one spawned worker pool per world size for the whole suite.
    """
    _install_torch(session)
    extra = [f"./{TEST_PLUGIN}"] if (ROOT / TEST_PLUGIN).is_dir() else []
    # numpy: torch warns at import without it and its object collectives need it. The isolated
    # sessions leave it out, so package code that needs it undeclared fails there.
    # safetensors and matplotlib: the fsdp package's optional extras (interop and plot tests).
    # expecttest: torch's threaded in-process group (torch.testing._internal) imports it.
    _install_all_packages(
        session, *extra, *TEST_DEPS, "numpy", "safetensors>=0.4", "matplotlib", "expecttest"
    )
    # With arguments, pytest gets only those (testpaths = ["tests"] still applies to `-k ...`).
    session.run("pytest", *(session.posargs or ["tests"]))


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """tests/integration: each framework test runs torch's fully_shard and ours side by side.

    The frameworks come pinned from INTEGRATION_REQUIREMENTS, in the same pip call as the four
    packages, after torch (so none of them can pull another torch). The tests session never
    installs them, and tests/integration/conftest.py collects nothing where Lightning is missing.
    """
    _install_torch(session)
    # numpy: torch's object collectives on gloo; expecttest: torch's testing internals import it
    _install_all_packages(session, *TEST_DEPS, "numpy", "expecttest", *INTEGRATION_REQUIREMENTS)
    session.run("pytest", *(session.posargs or ["tests/integration"]))


@nox.session(python=PYTHON, default=False)
@nox.parametrize("torch", list(COMPAT_TORCH))
def compat(session: nox.Session, torch: str) -> None:
    """The version matrix: COMPAT_GROUPS' tests on one torch release (never a default session).

    torch is installed first (SHARDWEAVE_TORCH_SPEC, when set, replaces "torch==<version>", as in
    every session), then the four packages, the test plugin and the test deps as `tests` does,
    and the pinned frameworks where COMPAT_INTEGRATION_TORCH lists the release. Arguments after
    -- go to pytest instead of the groups' paths.
    """
    # A torch above this machine's pip constraint (/etc/xdg/pip) installs only when pip leaves
    # that configuration unread; only for those releases, so the others keep the local mirrors.
    if _above_pip_cap(torch):
        session.env["PIP_CONFIG_FILE"] = os.devnull
    _install_torch(session, default=f"torch=={torch}")
    extra = [f"./{TEST_PLUGIN}"] if (ROOT / TEST_PLUGIN).is_dir() else []
    frameworks = INTEGRATION_REQUIREMENTS if torch in COMPAT_INTEGRATION_TORCH else ()
    if torch in COMPAT_TORCHTITAN_TORCH:
        frameworks = (*frameworks, *COMPAT_TORCHTITAN, f"torch=={torch}")  # torch stays put
    _install_all_packages(
        session, *extra, *TEST_DEPS, "numpy", "safetensors>=0.4", "matplotlib", "expecttest",
        *frameworks,
    )  # fmt: skip
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    groups = dict(COMPAT_GROUPS)
    if not frameworks:
        session.warn(f"torch {torch}: the pinned frameworks do not accept it; no integration")
        groups.pop("integration")
    # One pytest per group, so each group's counts are its own; every group runs even when
    # one fails, and the session fails at the end.
    failed = []
    for group, paths in groups.items():
        session.log(f"compat({torch}) group {group}: {' '.join(paths)}")
        try:
            session.run("pytest", "-q", "-rfEs", *paths)
        except nox.command.CommandFailed:
            failed.append(group)
    if failed:
        session.error(f"torch {torch}: failures in {', '.join(failed)}")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the four src trees (namespace-aware; config in pyproject.toml)."""
    _install_torch(session)
    session.install(MYPY, *TEST_DEPS)
    modules = [arg for pkg in PACKAGES for arg in ("-p", f"shardweave.{pkg}")]
    session.run("mypy", *modules, "-p", "tests._dist", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, then tools/check_layout.py; no torch needed."""
    session.install(RUFF, "packaging")
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
    session.run("python", "tools/check_layout.py")


@nox.session(python=PYTHON)
@nox.parametrize("pkg", list(PACKAGES), ids=list(PACKAGES))  # isolated(mesh), ...
def isolated(session: nox.Session, pkg: str) -> None:
    """Wheels only: install `pkg` alone (with its declared siblings), import it, run its checks.

    Siblings come only from the wheels built here (--no-index), so an undeclared sibling
    dependency fails the import or the tests instead of being satisfied by accident.
    """
    needed = _closure(pkg)
    wheels = Path(session.create_tmp()) / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    session.run(
        "python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels),
        *(f"./packages/{p}" for p in needed),
    )  # fmt: skip
    _install_torch(session)
    third_party = sorted(
        {
            r
            for p in needed
            for r in _requirements(p)
            if not _req_name(r).startswith("shardweave-") and _req_name(r) != "torch"
        }
    )
    session.install(*third_party, *TEST_DEPS)
    session.install("--no-index", "--find-links", str(wheels), f"shardweave-{pkg}")
    session.run("python", "-c", f"import shardweave.{pkg}")
    test_paths = [p for p in (f"tests/{pkg}/world_1", "tests/isolation") if (ROOT / p).is_dir()]
    if not test_paths:
        session.log(f"no tests/{pkg}/world_1 or tests/isolation yet; import check only")
        return
    session.run(
        "pytest", *test_paths, "-k", pkg, *session.posargs,
        env={"SHARDWEAVE_ISOLATED": pkg},
        success_codes=[0, 5],  # 5: nothing collected for this package yet
    )  # fmt: skip


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Train a small GPT-like model with fully_shard on 2 local CPU processes (gloo)."""
    _install_torch(session)
    _install_all_packages(session, *DEMO_REQUIREMENTS)
    session.run(
        "torchrun", "--standalone", "--nproc-per-node", "2", "demos/train_gpt.py",
        *session.posargs,
    )  # fmt: skip


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Timing scripts (writes JSON; see benchmarks/). Never part of the default run."""
    _install_torch(session)
    _install_all_packages(session, "numpy")
    _install_requirements_file(session, "benchmarks/requirements.txt")
    session.run("python", "benchmarks/run.py", *session.posargs)
    # The engine's own host time per step, communication taken out (about a minute).
    session.run("python", "benchmarks/host_time.py")


@nox.session(python=False, venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU kit (tools/gpu_kit, a package run as a folder: one module per section): parity
    with torch's FSDP2 on NCCL, delayed collectives with consumer-side delays, the tests'
    stream mutations (each must be caught), a transformers Llama (when installed), host
    syncs, CUDA's sanitizer and a 0.5B-parameter benchmark (each round in a fresh process),
    in one JSON report.

    Runs with the machine's own python and torch (torch 2.11 or newer, no package index
    needed): the packages are imported from packages/*/src. Without CUDA, or without torch in
    that python, it prints one line and exits 0. Arguments after -- go to the script (e.g.
    -- --out report.json). Never a default.
    """
    session.run("python", "tools/gpu_kit", *session.posargs, external=True)


DOCS_DEPS = ("sphinx>=8", "myst-parser>=4")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Sphinx HTML docs (API reference from each package's ``__all__``) into docs/_build/html.

    ``-W``: a warning (say, bad RST in a docstring) fails the build. Never a default session.
    """
    _install_torch(session)
    _install_all_packages(session, *DOCS_DEPS)
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html",
        *session.posargs,
    )  # fmt: skip
