"""``set_keep_unsharded_storage`` bodies shared by the world-2 and world-4 tests.

Oracles (see ``world_2/test_keep_unsharded_storage.py``): torch's ``fully_shard`` with the same
setting where its ``FSDPModule`` has the method, else ours with ``keep=False``; closed form for
the data pointers and the storage sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from tests.fsdp._models import loss_fn, make_batch, make_model
from tests.fsdp._stream_order import wrap_scenario

TORCH_HAS_IT = hasattr(TorchFSDPModule, "set_keep_unsharded_storage")


def groups_of(module: nn.Module) -> list[Any]:
    # Both engines' FSDPModule: the state's groups (torch's internals, read by the test only).
    return list(module._get_fsdp_state()._fsdp_param_groups)  # type: ignore[operator]


def storages(module: nn.Module) -> list[torch.Tensor]:
    """Each of ``module``'s own parameters' unsharded storage tensors (both engines)."""
    out: list[torch.Tensor] = []
    for group in groups_of(module):
        for p in group.fsdp_params:
            outs = getattr(p, "all_gather_outputs", None)  # torch's FSDPParam
            out += list(outs) if outs is not None else [p.all_gather_output]
    return out


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, TorchFSDPModule)]


def _unsharded_ptrs(model: nn.Module) -> list[int]:
    return [t.data_ptr() for m in fsdp_modules(model) for t in storages(m)]


def storage_bytes(model: nn.Module) -> list[int]:
    return [t.untyped_storage().nbytes() for m in fsdp_modules(model) for t in storages(m)]


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    # A block's parameters, or the root's outside its wrapped blocks.
    return [p for n, p in module.named_parameters() if not n.startswith("layers.")]


def _train(
    rank: int, world: int, engine: str, keep: bool | None, cfg: dict[str, Any]
) -> dict[str, Any]:
    """Three steps of TinyGPT, an explicit unshard/reshard of every module, a fourth step.

    Records the data pointers of the unsharded parameters as the forward sees them (a pre-hook
    registered after fully_shard's), the unsharded storage after each step, and the numbers.
    """
    model = make_model("gpt")
    wrap_scenario(model, cfg, world, engine)
    if keep is not None:
        model.set_keep_unsharded_storage(keep)  # type: ignore[operator]
    seen: list[list[int]] = []
    for m in fsdp_modules(model):
        m.register_forward_pre_hook(
            lambda mod, args: seen[-1].extend(p.data_ptr() for p in _own_params(mod))
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"loss": [], "grad": [], "param": [], "fwd": [], "after": []}
    out["bytes"] = []
    for step in range(4):
        if step == 3:
            # explicit unshard()/reshard() (not recursive) of every FSDP module
            for m in fsdp_modules(model):
                m.unshard()  # type: ignore[operator]
            out["explicit"] = _unsharded_ptrs(model)
            for m in fsdp_modules(model):
                m.reshard()  # type: ignore[operator]
        seen.append([])
        batch = make_batch("gpt", 1000 * step + rank)
        loss = loss_fn("gpt", model(batch), batch)
        loss.backward()
        out["loss"].append(loss.detach().clone())
        out["grad"] += [p.grad.to_local().clone() for p in model.parameters()]  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        out["fwd"].append(seen[-1])
        out["after"].append(_unsharded_ptrs(model))
        out["bytes"].append(storage_bytes(model))
    out["param"] = [p.to_local().clone() for p in model.parameters()]  # type: ignore[operator]
    return out


def same_numbers(got: dict[str, Any], want: dict[str, Any], tag: str) -> None:
    for key in ("loss", "grad", "param"):
        assert len(got[key]) == len(want[key]), f"{tag}: {key} count"
        for i, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{tag}: {key}[{i}] differs"


def _assert_kept(run: dict[str, Any], tag: str) -> None:
    fwd, after = run["fwd"], run["after"]
    assert fwd[0], f"{tag}: the forward saw no parameters"
    moved = [i for i, ptrs in enumerate(fwd) if ptrs != fwd[0]]
    assert not moved, f"{tag}: the forward's data pointers moved at steps {moved}"
    moved = [i for i, ptrs in enumerate(after) if ptrs != after[0]]
    assert not moved, f"{tag}: the unsharded storage moved at steps {moved}"
    assert run["explicit"] == after[0], f"{tag}: unshard() moved the storage"
    for nbytes in run["bytes"]:
        assert all(n > 0 for n in nbytes), f"{tag}: kept storage was freed: {nbytes}"


def keep_storage_case(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Body: with keep, one data pointer per unsharded parameter for the whole run and its
    storage allocated after every step; the numbers are the oracle's (module docstring)."""
    ours = _train(rank, world, "ours", True, cfg)
    _assert_kept(ours, f"ours {cfg}")
    if TORCH_HAS_IT:
        theirs = _train(rank, world, "torch", True, cfg)
        _assert_kept(theirs, f"torch {cfg}")  # the oracle keeps its pointers too
    else:
        theirs = _train(rank, world, "ours", False, cfg)
    same_numbers(ours, theirs, f"rank {rank} {cfg}")


def default_frees_case(rank: int, world: int) -> None:
    """Body: by default and with keep=False the storage is 0 bytes after every step."""
    runs = [("ours", None), ("ours", False)]
    if TORCH_HAS_IT:
        runs.append(("torch", None))
    results = [_train(rank, world, engine, keep, {}) for engine, keep in runs]
    for (engine, keep), run in zip(runs, results, strict=True):
        for nbytes in run["bytes"]:
            assert nbytes and all(n == 0 for n in nbytes), (engine, keep, nbytes)
    same_numbers(results[0], results[-1], f"rank {rank} default")
