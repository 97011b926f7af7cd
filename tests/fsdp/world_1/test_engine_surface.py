"""``shardweave.fsdp.engine``, the surface sibling packages build on: its published contract.

Oracles: *closed form* (the signatures the docs promise: keyword-only past the first argument)
and *reference* (the module's example, a data-parallel API of our own built from the engine, run as
written: it trains like the plain model at world size 1).
"""

from __future__ import annotations

import copy
import inspect
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

from shardweave.fsdp import FSDPModule, OffloadPolicy, engine
from shardweave.mesh import ArgumentTypeError
from tests._dist import WorkerPool

FUNCTIONS = [
    name
    for name in engine.__all__
    if inspect.isfunction(getattr(engine, name)) and name != "get_fsdp_state"
]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_keyword_only_past_the_first_argument(name: str) -> None:
    params = list(inspect.signature(getattr(engine, name)).parameters.values())
    kinds = [p.kind for p in params]
    if name == "resolve_policies":  # no subject: every argument is a keyword
        assert set(kinds) == {inspect.Parameter.KEYWORD_ONLY}, params
    else:
        assert kinds[0] == inspect.Parameter.POSITIONAL_OR_KEYWORD, params
        assert set(kinds[1:]) == {inspect.Parameter.KEYWORD_ONLY}, params


def test_state_arguments_past_modules_are_keywords() -> None:
    params = list(inspect.signature(engine.FSDPState.__init__).parameters.values())[1:]
    assert [p.kind for p in params[1:]] == [inspect.Parameter.KEYWORD_ONLY] * (len(params) - 1)


def test_validators_name_the_calling_api() -> None:
    with pytest.raises(ArgumentTypeError, match=r"my_api: module must be an nn\.Module"):
        engine.module_arguments("model", api="my_api")
    with pytest.raises(TypeError, match="my_api: ignored_params must be a set"):
        engine.validate_ignored_params(torch.zeros(2), api="my_api")
    with pytest.raises(TypeError, match="my_api: mp_policy must be a MixedPrecisionPolicy"):
        engine.resolve_policies(
            mp_policy=torch.bfloat16, offload_policy=OffloadPolicy(), api="my_api"
        )


def module_example() -> dict[str, Any]:
    """The names ``shardweave.fsdp.engine``'s docstring example defines, run as written."""
    doc = engine.__doc__ or ""
    code = textwrap.dedent(doc.split("::\n", 1)[1])  # the one literal block: the example
    namespace: dict[str, Any] = {}
    exec(compile(code, "shardweave.fsdp.engine example", "exec"), namespace)
    return namespace


def own_api_trains(rank: int, world: int) -> dict[str, Any]:
    my_api = module_example()["my_api"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    my_api(model[0])
    my_api(model)
    state = engine.get_fsdp_state(model)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    grads_equal = all(
        torch.equal(p.grad.full_tensor(), q.grad)  # type: ignore[union-attr]
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return {
        "class": type(model).__name__,
        "is_fsdp_module": isinstance(model, FSDPModule),
        "state": (type(state).__name__, state.api.name if state is not None else None),
        "grads_equal": grads_equal,
    }


def test_an_api_built_on_the_engine_trains(world1: WorkerPool) -> None:
    (result,) = world1.run(own_api_trains)
    assert result == {
        "class": "MySequential",
        "is_fsdp_module": True,
        "state": ("FSDPState", "my_api"),
        "grads_equal": True,
    }
