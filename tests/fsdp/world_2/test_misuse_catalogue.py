"""A catalogue of misuses of the public API: every one fails fast, on every rank, with torch's
exception type, and with a message that names the offending argument and says how to fix it.

Each case is one misuse, written once against a ``Lib`` (the public names of one
implementation), so the same code runs against shardweave and, as the oracle, against torch:

* ``SAME``: torch raises too; we must raise an instance of torch's exception type (the type
  users catch). Our message may (and usually does) say more.
* ``SILENT``: torch accepts the misuse at this point (and fails later, obscurely, or never);
  we raise a clear error anyway. The oracle checks that torch really is silent, so a torch
  upgrade that starts raising shows up here and the case can move to ``SAME``.

Each case is its own test (``-k <case id>`` picks one), but the cases selected in a session run
in one spawned body (one pass over them per rank, a barrier between cases), so the catalogue
costs one trip to the pool, not 65. Misuses already covered by ``test_errors.py`` are not
repeated here.
"""

from __future__ import annotations

import copy
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from tests._dist import WorkerPool
from tests._dist.sync import barrier

SAME: Final = "same"
SILENT: Final = "silent"


@dataclass(frozen=True)
class Lib:
    """The public names of one implementation (shardweave's or torch's)."""

    name: str
    fully_shard: Any
    replicate: Any
    FSDPModule: Any
    MixedPrecisionPolicy: Any
    OffloadPolicy: Any
    CPUOffloadPolicy: Any
    DataParallelMeshDims: Any
    AllGather: Any
    ReduceScatter: Any
    register_fsdp_forward_method: Any
    share_comm_ctx: Any


def ours() -> Lib:
    import shardweave.fsdp as f
    from shardweave.replicate import replicate

    return Lib(
        "shardweave",
        f.fully_shard,
        replicate,
        f.FSDPModule,
        f.MixedPrecisionPolicy,
        f.OffloadPolicy,
        f.CPUOffloadPolicy,
        f.DataParallelMeshDims,
        f.AllGather,
        f.ReduceScatter,
        f.register_fsdp_forward_method,
        f.share_comm_ctx,
    )


def theirs() -> Lib:
    import torch.distributed.fsdp as f
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return Lib(
        "torch",
        f.fully_shard,
        replicate,
        f.FSDPModule,
        f.MixedPrecisionPolicy,
        f.OffloadPolicy,
        f.CPUOffloadPolicy,
        f.DataParallelMeshDims,
        AllGather,
        ReduceScatter,
        f.register_fsdp_forward_method,
        f.share_comm_ctx,
    )


@dataclass(frozen=True)
class Case:
    """One misuse: ``run(lib)`` must raise ``raises`` with a message matching ``names`` (the
    offending argument or method) and ``fix`` (the remedy)."""

    id: str
    run: Callable[[Lib], object]
    raises: type[BaseException]
    names: str
    fix: str
    torch: str = SAME
    note: str = ""


# --------------------------------------------------------------------------------- builders


def world() -> int:
    return dist.get_world_size()


def mesh_1d(names: tuple[str, ...] | None = None) -> DeviceMesh:
    return init_device_mesh("cpu", (world(),), mesh_dim_names=names)


class Pair(nn.Module):
    """Two children, so nested and grouped applications have something to work on."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def sharded(lib: Lib, **kwargs: Any) -> Any:
    return lib.fully_shard(nn.Linear(4, 4), **kwargs)


def nested(lib: Lib) -> Pair:
    model = Pair()
    lib.fully_shard(model.a)
    lib.fully_shard(model.b)
    lib.fully_shard(model)
    return model


def hsdp_mesh() -> DeviceMesh:
    # (replicate=W, shard=1): HSDP whose all-reduce group spans every rank
    return init_device_mesh("cpu", (world(), 1), mesh_dim_names=("replicate", "shard"))


class NotAnAllGather:
    """Duck-types a comm without deriving from the AllGather ABC (and gets the call wrong)."""

    def __call__(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise AssertionError("never called")


def _meta_unshard(lib: Lib) -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    lib.fully_shard(model)
    model.unshard(async_op=True)  # type: ignore[operator]


def _mixed_dtypes(lib: Lib) -> None:
    model = nn.Linear(4, 4)
    model.bias.data = model.bias.data.double()  # one group, two original dtypes
    lib.fully_shard(model)
    model(torch.randn(2, 4))


def _tied_across_groups(lib: Lib) -> None:
    model = Pair()
    model.b.weight = model.a.weight
    lib.fully_shard(model.a)  # owns the tied weight
    lib.fully_shard(model)  # manages b, which refers to the same weight
    model(torch.randn(2, 4))


def _reset_non_root(lib: Lib) -> None:
    model = nested(lib)
    model(torch.randn(2, 4))
    model.a.reset_iter_state()  # type: ignore[operator]


def _grouped_forward(lib: Lib) -> None:
    model = Pair()
    lib.fully_shard([model.a, model.b])
    model.a(torch.randn(2, 4))


def _child_first(lib: Lib) -> None:
    model = nested(lib)
    model.a(torch.randn(2, 4))  # child lazily initializes as its own root
    model(torch.randn(2, 4))


def _reshard_pending(lib: Lib) -> None:
    module = sharded(lib)
    handle = module.unshard(async_op=True)
    try:
        module.reshard()
    finally:
        handle.wait()


def _all_reduce_stream_hsdp(lib: Lib) -> None:
    module = sharded(lib, mesh=hsdp_mesh())
    module.set_all_reduce_hook(lambda t: None, stream=torch.Stream("cpu"))


def _dp_dims_plain_params(lib: Lib) -> None:
    mesh = mesh_1d(("dp",))
    lib.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=lib.DataParallelMeshDims(shard="dp"))


CASES: Final[list[Case]] = [
    # ---- the module argument
    Case(
        "module_is_str",
        lambda lib: lib.fully_shard("encoder"),
        TypeError,
        r"module",
        r"nn\.Module",
        SAME,
        "torch: AttributeError ('str' object has no attribute 'modules').",
    ),
    Case(
        "module_list_holds_non_module",
        lambda lib: lib.fully_shard([nn.Linear(2, 2), "head"]),
        TypeError,
        r"module\[1\]",
        r"nn\.Module",
    ),
    Case(
        "module_dict_container",
        lambda lib: lib.replicate(nn.ModuleDict({"a": nn.Linear(2, 2)})),
        ValueError,
        r"ModuleDict",
        r"each child|forward",
    ),
    # ---- mesh
    Case(
        "mesh_is_str",
        lambda lib: sharded(lib, mesh="cpu"),
        TypeError,
        r"mesh",
        r"init_device_mesh",
        SAME,
        "torch: AttributeError ('str' object has no attribute 'ndim').",
    ),
    Case(
        "mesh_is_process_group",
        lambda lib: sharded(lib, mesh=dist.group.WORLD),
        TypeError,
        r"mesh",
        r"DeviceMesh\.from_group",
        SAME,
        "torch: AttributeError (no attribute 'ndim').",
    ),
    # ---- reshard_after_forward (bool/int/None; an int divides the shard world size)
    Case(
        "reshard_negative_int",
        lambda lib: sharded(lib, reshard_after_forward=-1),
        ValueError,
        r"reshard_after_forward",
        r"factor of 2",
    ),
    Case(
        "reshard_zero",
        lambda lib: sharded(lib, reshard_after_forward=0),
        ValueError,
        r"reshard_after_forward",
        r"factor of 2",
    ),
    Case(
        "reshard_float",
        lambda lib: sharded(lib, reshard_after_forward=0.5),
        ValueError,
        r"reshard_after_forward",
        r"bool or an int",
    ),
    # ---- shard_placement_fn
    Case(
        "placement_fn_is_a_placement",
        lambda lib: sharded(lib, shard_placement_fn=Shard(0)),
        TypeError,
        r"shard_placement_fn",
        r"lambda|callable|function",
    ),
    Case(
        "placement_fn_returns_int",
        lambda lib: sharded(lib, shard_placement_fn=lambda p: 0),
        ValueError,
        r"shard_placement_fn",
        r"Shard\(0\)|Shard\(dim\)",
    ),
    Case(
        "placement_fn_returns_replicate",
        lambda lib: sharded(lib, shard_placement_fn=lambda p: Replicate()),
        ValueError,
        r"shard_placement_fn",
        r"ignored_params|replicate\(\)",
    ),
    # ---- policies
    Case(
        "mp_policy_is_a_dtype",
        lambda lib: sharded(lib, mp_policy=torch.bfloat16),
        TypeError,
        r"mp_policy",
        r"MixedPrecisionPolicy\(param_dtype=",
        SILENT,
    ),
    Case(
        "mp_policy_is_the_class",
        lambda lib: sharded(lib, mp_policy=lib.MixedPrecisionPolicy),
        TypeError,
        r"mp_policy",
        r"MixedPrecisionPolicy\(",
        SILENT,
    ),
    Case(
        "mp_param_dtype_str",
        lambda lib: lib.MixedPrecisionPolicy(param_dtype="bfloat16"),
        TypeError,
        r"param_dtype",
        r"torch\.bfloat16",
        SILENT,
    ),
    Case(
        "mp_reduce_dtype_integer",
        lambda lib: lib.MixedPrecisionPolicy(reduce_dtype=torch.int32),
        ValueError,
        r"reduce_dtype",
        r"floating-point",
        SILENT,
        "torch stores it; an integer reduction would truncate gradients.",
    ),
    Case(
        "mp_cast_forward_inputs_str",
        lambda lib: lib.MixedPrecisionPolicy(cast_forward_inputs="no"),
        TypeError,
        r"cast_forward_inputs",
        r"True or False|bool",
        SILENT,
        "'no' is truthy: torch casts the inputs.",
    ),
    Case(
        "offload_policy_bool",
        lambda lib: sharded(lib, offload_policy=True),
        TypeError,
        r"offload_policy",
        r"CPUOffloadPolicy\(",
        SILENT,
    ),
    Case(
        "offload_policy_is_the_class",
        lambda lib: sharded(lib, offload_policy=lib.CPUOffloadPolicy),
        TypeError,
        r"offload_policy",
        r"CPUOffloadPolicy\(\)",
        SILENT,
    ),
    # ---- ignored_params
    Case(
        "ignored_params_single_parameter",
        lambda lib: (m := nn.Linear(4, 4), lib.fully_shard(m, ignored_params=m.weight)),
        TypeError,
        r"ignored_params",
        r"\{module\.weight\}",
        SILENT,
        "torch accepts it.",
    ),
    Case(
        "ignored_params_holds_a_module",
        lambda lib: (m := Pair(), lib.fully_shard(m, ignored_params={m.a})),
        TypeError,
        r"ignored_params",
        r"parameters\(\)",
        SILENT,
        "torch accepts it; a module is never a parameter, so nothing would be ignored.",
    ),
    # ---- DataParallelMeshDims / dp_mesh_dims
    Case(
        "dp_dims_both_none",
        lambda lib: lib.DataParallelMeshDims(),
        ValueError,
        r"shard=|replicate=",
        r"DataParallelMeshDims\(shard=",
    ),
    Case(
        "dp_dims_name_not_str",
        lambda lib: lib.DataParallelMeshDims(shard=0),
        TypeError,
        r"shard",
        r"mesh_dim_names|name",
        SILENT,
    ),
    Case(
        "dp_dims_not_dims",
        lambda lib: sharded(lib, mesh=mesh_1d(("dp",)), dp_mesh_dims="dp"),
        TypeError,
        r"dp_mesh_dims",
        r"DataParallelMeshDims\(shard='dp'\)",
        SAME,
        "torch: AttributeError ('str' object has no attribute 'shard').",
    ),
    Case(
        "dp_dims_unknown_name",
        lambda lib: sharded(
            lib, mesh=mesh_1d(("dp",)), dp_mesh_dims=lib.DataParallelMeshDims(shard="fsdp")
        ),
        ValueError,
        r"'fsdp'",
        r"\('dp',\)",
    ),
    Case(
        "dp_dims_unnamed_mesh",
        lambda lib: sharded(lib, mesh=mesh_1d(), dp_mesh_dims=lib.DataParallelMeshDims(shard="dp")),
        ValueError,
        r"dp_mesh_dims|dim names",
        r"mesh_dim_names=",
    ),
    Case(
        "dp_dims_one_dim_both_roles",
        lambda lib: sharded(
            lib,
            mesh=mesh_1d(("dp",)),
            dp_mesh_dims=lib.DataParallelMeshDims(shard="dp", replicate="dp"),
        ),
        ValueError,
        r"'dp'",
        r"not both",
        SAME,
        "torch: RuntimeError ('Cannot concatenate overlapping meshes').",
    ),
    Case(
        "dp_dims_int_reshard",
        lambda lib: sharded(
            lib,
            mesh=mesh_1d(("dp",)),
            dp_mesh_dims=lib.DataParallelMeshDims(shard="dp"),
            reshard_after_forward=2,
        ),
        NotImplementedError,
        r"reshard_after_forward",
        r"True or False",
    ),
    Case(
        "dp_dims_plain_params",
        _dp_dims_plain_params,
        ValueError,
        r"weight",
        r"distribute_tensor",
    ),
    Case(
        "dp_dims_replicate_only_with_placement_fn",
        lambda lib: sharded(
            lib,
            mesh=mesh_1d(("dp",)),
            dp_mesh_dims=lib.DataParallelMeshDims(replicate="dp"),
            shard_placement_fn=lambda p: Shard(0),
        ),
        ValueError,
        r"shard_placement_fn",
        r"drop shard_placement_fn|add a shard dim",
    ),
    # ---- applying twice / mixing APIs
    Case(
        "replicate_after_fully_shard",
        lambda lib: lib.replicate(sharded(lib)),
        RuntimeError,
        r"replicate",
        r"drop one of the calls",
    ),
    Case(
        "fully_shard_after_replicate",
        lambda lib: lib.fully_shard(lib.replicate(nn.Linear(2, 2))),
        AssertionError,
        r"replicate",
        r"remove the second call",
    ),
    Case(
        "replicate_twice",
        lambda lib: lib.replicate(lib.replicate(nn.Linear(2, 2))),
        AssertionError,
        r"replicate",
        r"remove the second call",
    ),
    # ---- replicate
    Case(
        "replicate_2d_mesh",
        lambda lib: lib.replicate(nn.Linear(2, 2), mesh=hsdp_mesh()),
        ValueError,
        r"1D DeviceMesh",
        r"dp_mesh_dims=DataParallelMeshDims\(replicate=",
    ),
    Case(
        "replicate_shard_dims",
        lambda lib: lib.replicate(
            nn.Linear(2, 2),
            mesh=mesh_1d(("dp",)),
            dp_mesh_dims=lib.DataParallelMeshDims(shard="dp"),
        ),
        ValueError,
        r"dp_mesh_dims",
        r"use fully_shard",
    ),
    Case(
        "replicate_set_reshard_after_forward",
        lambda lib: lib.replicate(nn.Linear(2, 2)).set_reshard_after_forward(True),
        AssertionError,
        r"set_reshard_after_forward",
        r"fully_shard",
    ),
    Case(
        "replicate_module_is_str",
        lambda lib: lib.replicate("encoder"),
        TypeError,
        r"module",
        r"nn\.Module",
        SAME,
        "torch: AttributeError ('str' object has no attribute 'modules').",
    ),
    # ---- FSDPModule setters
    Case(
        "forward_prefetch_not_a_list",
        lambda lib: (m := nested(lib)).a.set_modules_to_forward_prefetch(m.b),
        TypeError,
        r"set_modules_to_forward_prefetch",
        r"\[",
    ),
    Case(
        "backward_prefetch_holds_str",
        lambda lib: nested(lib).b.set_modules_to_backward_prefetch(["a"]),
        ValueError,
        r"set_modules_to_backward_prefetch",
        r"fully_shard",
    ),
    Case(
        "share_comm_ctx_non_fsdp",
        lambda lib: lib.share_comm_ctx([sharded(lib), nn.Linear(2, 2)]),
        ValueError,
        r"share_comm_ctx",
        r"fully_shard",
    ),
    Case(
        "share_comm_ctx_not_a_list",
        lambda lib: lib.share_comm_ctx(sharded(lib)),
        TypeError,
        r"share_comm_ctx",
        r"\[",
    ),
    Case(
        "register_forward_method_missing",
        lambda lib: lib.register_fsdp_forward_method(sharded(lib), "generate"),
        ValueError,
        r"generate",
        r"define|typo|name",
    ),
    Case(
        "register_forward_method_not_callable",
        lambda lib: lib.register_fsdp_forward_method(sharded(lib), "weight"),
        TypeError,
        r"weight",
        r"method|callable",
    ),
    Case(
        "register_forward_method_name_not_str",
        lambda lib: lib.register_fsdp_forward_method(sharded(lib), 7),
        TypeError,
        r"method_name",
        r"str|name",
    ),
    Case(
        "gradient_divide_factor_zero",
        lambda lib: sharded(lib).set_gradient_divide_factor(0),
        ValueError,
        r"set_gradient_divide_factor",
        r"positive|> 0",
        SILENT,
        "torch stores it; gradients would be divided by zero.",
    ),
    Case(
        "gradient_divide_factor_negative",
        lambda lib: sharded(lib).set_gradient_divide_factor(-2.0),
        ValueError,
        r"set_gradient_divide_factor",
        r"positive|> 0",
        SILENT,
    ),
    Case(
        "gradient_divide_factor_str",
        lambda lib: sharded(lib).set_gradient_divide_factor("2"),
        TypeError,
        r"set_gradient_divide_factor",
        r"number|float",
        SILENT,
    ),
    Case(
        "rs_max_input_buffers_zero",
        lambda lib: sharded(lib).set_reduce_scatter_max_input_buffers(0),
        ValueError,
        r"max_input_buffers",
        r">= 1",
    ),
    Case(
        "rs_max_input_buffers_bool",
        lambda lib: sharded(lib).set_reduce_scatter_max_input_buffers(True),
        TypeError,
        r"max_input_buffers",
        r"int",
    ),
    Case(
        "all_reduce_hook_not_callable",
        lambda lib: sharded(lib).set_all_reduce_hook("sum"),
        TypeError,
        r"set_all_reduce_hook",
        r"callable|function",
        SILENT,
        "torch stores it until the next backward calls it.",
    ),
    Case(
        "all_reduce_hook_stream_with_hsdp",
        _all_reduce_stream_hsdp,
        ValueError,
        r"stream",
        r"omit stream|without stream",
    ),
    Case(
        "custom_all_gather_wrong_type",
        lambda lib: sharded(lib).set_custom_all_gather(NotAnAllGather()),
        TypeError,
        r"set_custom_all_gather",
        r"subclass|AllGather",
        SILENT,
        "torch stores it until the next all-gather calls it.",
    ),
    Case(
        "custom_reduce_scatter_gets_all_gather",
        lambda lib: sharded(lib).set_custom_reduce_scatter(NotAnAllGather()),
        TypeError,
        r"set_custom_reduce_scatter",
        r"subclass|ReduceScatter",
        SILENT,
    ),
    Case(
        "symm_mem_on_gloo",
        lambda lib: sharded(lib).set_symm_mem_for_comm(),
        RuntimeError,
        r"set_symm_mem_for_comm",
        r"remove|drop|do not call|default",
    ),
    Case(
        "requires_gradient_sync_str",
        lambda lib: sharded(lib).set_requires_gradient_sync("False"),
        TypeError,
        r"requires_gradient_sync",
        r"True or False",
        SILENT,
        "'False' is truthy: torch keeps syncing gradients.",
    ),
    Case(
        "reshard_after_backward_none",
        lambda lib: sharded(lib).set_reshard_after_backward(None),
        TypeError,
        r"reshard_after_backward",
        r"True or False",
        SILENT,
    ),
    # ---- unshard / UnshardHandle
    Case(
        "unshard_async_op_str",
        lambda lib: sharded(lib).unshard(async_op="no"),
        TypeError,
        r"async_op",
        r"True or False",
        SAME,
        "torch: TypeError from the c10d all-gather options (incompatible function arguments).",
    ),
    Case(
        "reshard_while_async_unshard_pending",
        _reshard_pending,
        RuntimeError,
        r"reshard|UnshardHandle",
        r"wait\(\)",
        SILENT,
        "torch skips the reshard; the later wait() leaves the module unsharded.",
    ),
    Case(
        "unshard_meta_params",
        _meta_unshard,
        RuntimeError,
        r"meta",
        r"to_empty",
    ),
    # ---- lazy-initialization errors (first forward)
    Case(
        "mixed_original_dtypes_in_one_group",
        _mixed_dtypes,
        AssertionError,
        r"float64|torch\.float64",
        r"cast the module|split",
    ),
    Case(
        "tied_parameter_across_groups",
        _tied_across_groups,
        ValueError,
        r"weight",
        r"fully_shard\(\[",
    ),
    Case(
        "reset_iter_state_on_non_root",
        _reset_non_root,
        RuntimeError,
        r"reset_iter_state",
        r"root",
    ),
    Case(
        "grouped_modules_run_alone",
        _grouped_forward,
        RuntimeError,
        r"FSDP requires a single root module",
        r"forward through a module",
    ),
    Case(
        "child_forward_before_root",
        _child_first,
        RuntimeError,
        r"FSDP state has already been lazily initialized",
        r"running forward through the root",
    ),
    Case(
        "offload_pin_memory_without_accelerator",
        lambda lib: sharded(lib, offload_policy=lib.CPUOffloadPolicy()),
        RuntimeError,
        r"pin_memory",
        r"CPUOffloadPolicy\(pin_memory=False\)",
        note="only where no accelerator is present (pinning needs one)",
    ),
    Case(
        "deepcopy_sharded_module",
        lambda lib: copy.deepcopy(sharded(lib)),
        AssertionError,
        r"deepcopy",
        r"state_dict|state dict",
    ),
]


def cases() -> list[Case]:
    """The cases that apply on this machine."""
    accelerator = torch.accelerator.is_available()
    return [
        c for c in CASES if not (accelerator and c.id == "offload_pin_memory_without_accelerator")
    ]


def _outcome(case: Case, lib: Lib) -> BaseException | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            case.run(lib)
        except Exception as exc:
            return exc
    return None


def _describe(exc: BaseException | None) -> str:
    return "no exception" if exc is None else f"{type(exc).__name__}: {exc}"


def _check(case: Case, mine: Lib, torch_lib: Lib) -> list[str]:
    """The ways ``case`` falls short; empty when it passes."""
    problems: list[str] = []
    theirs_exc = _outcome(case, torch_lib)
    started = time.monotonic()
    exc = _outcome(case, mine)
    if time.monotonic() - started > 10:
        problems.append("took more than 10 s to fail")
    if exc is None:
        return [*problems, "shardweave raised nothing"]
    text = str(exc)
    if not isinstance(exc, case.raises):
        problems.append(f"expected {case.raises.__name__}, got {_describe(exc)}")
    if not re.search(case.names, text, re.S):
        problems.append(f"message does not name the argument (/{case.names}/): {text}")
    if not re.search(case.fix, text, re.S):
        problems.append(f"message suggests no fix (/{case.fix}/): {text}")
    if case.torch == SAME:
        if theirs_exc is None:
            problems.append("torch raises nothing: mark the case SILENT")
        elif not isinstance(exc, type(theirs_exc)):
            problems.append(
                f"torch raises {_describe(theirs_exc)}; we raise {type(exc).__name__} "
                "(not an instance of torch's type)"
            )
    elif case.torch == SILENT and theirs_exc is not None:
        problems.append(f"torch now raises {_describe(theirs_exc)}: mark the case SAME")
    return problems


def catalogue(rank: int, world_size: int, ids: list[str]) -> dict[str, list[str]]:
    """Run the cases named by ``ids`` that apply on this machine; map each to its problems."""
    mine, torch_lib = ours(), theirs()
    wanted = set(ids)
    report: dict[str, list[str]] = {}
    for case in cases():
        if case.id not in wanted:
            continue
        report[case.id] = _check(case, mine, torch_lib)
        # a failed case must not leave the ranks out of step for the next one
        barrier()
    return report


def test_catalogue_has_distinct_cases() -> None:
    """Oracle: closed form (the table itself): at least 30 cases, ids unique."""
    ids = [c.id for c in CASES]
    assert len(ids) >= 30 and len(set(ids)) == len(ids)


@pytest.fixture(scope="module")
def reports(world2: WorkerPool, request: pytest.FixtureRequest) -> list[dict[str, list[str]]]:
    """Every rank's report for the cases this session selected, from one run on the pool."""
    ids = [
        item.callspec.params["case_id"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname == test_misuse_catalogue.__name__
        and item.module is request.module
    ]
    return world2.run(catalogue, ids, timeout=90)  # type: ignore[return-value]


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_misuse_catalogue(reports: list[dict[str, list[str]]], case_id: str) -> None:
    """Oracle: compatibility (torch's exception type for the same misuse, where torch raises)
    and closed form (message names the argument and a remedy), on every rank."""
    if not any(case_id in report for report in reports):
        pytest.skip(f"{case_id} does not apply on this machine")
    lines = [
        f"rank {rank}: {problem}"
        for rank, report in enumerate(reports)
        for problem in report.get(case_id, ["did not run on this rank"])
    ]
    assert not lines, f"{case_id}: {len(lines)} problems:\n" + "\n".join(lines)
