"""Tensor subclasses with the fsdp_pre/post_all_gather protocol, and the bodies that train them
under shardweave's ``fully_shard`` and torch's side by side (CPU ports of torch's GPU-only
``test_fully_shard_extensions.py``).

Two protocol users, as upstream has them:

* torch's test ``TwoTensor`` (two inner tensors): its hooks all-gather both inner tensors (two
  all-gather inputs per parameter) and rebuild a ``TwoTensor`` in the parameter dtype. The hooks
  are set on the class only for the duration of one body (``two_tensor_hooks``), as upstream
  does, and log every call, so the two engines' calls can be compared.
* ``BF16Gather``: a one-tensor wrapper subclass that all-gathers in bf16 and pads uneven shards
  itself from ``outer_size`` (the padding contract of the five-argument pre-hook).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.two_tensor import TwoTensor

from shardweave.fsdp import MixedPrecisionPolicy, fully_shard
from shardweave.fsdp.core._state import get_fsdp_state

Event = tuple[object, ...]


@dataclass
class HookLog:
    """Every hook call in this process, in order: ``("pre", mesh ndim, mesh size, input
    shapes, outer size, outer stride)``, ``("post", dtype)``, ``("post_out", dtype)``."""

    events: list[Event] = field(default_factory=list)

    def since(self, start: int) -> list[Event]:
        return self.events[start:]


LOG = HookLog()


def _log_pre(mesh: DeviceMesh, inputs: tuple[torch.Tensor, ...], outer: object) -> None:
    shapes = tuple(tuple(t.shape) for t in inputs)
    LOG.events.append(("pre", mesh.ndim, mesh.size(), shapes, outer))


def _two_pre_v1(self: TwoTensor, mesh: DeviceMesh) -> tuple[tuple[torch.Tensor, ...], Any]:
    inputs = (self.a, self.b)
    _log_pre(mesh, inputs, None)
    return inputs, None


def _two_pre_v2(
    self: TwoTensor,
    mesh: DeviceMesh,
    outer_size: torch.Size,
    outer_stride: tuple[int, ...],
    module: nn.Module,
    mp_policy: object,
) -> tuple[tuple[torch.Tensor, ...], Any]:
    inputs = (self.a, self.b)
    _log_pre(mesh, inputs, (tuple(outer_size), tuple(outer_stride), type(module).__name__))
    return inputs, None


def _two_post(
    self: TwoTensor,
    all_gather_outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    assert metadata is None, metadata
    a, b = all_gather_outputs
    if out is not None:
        LOG.events.append(("post_out", param_dtype))
        assert isinstance(out, TwoTensor), type(out)
        if a.dtype == param_dtype:  # no cast: ``out`` still views the all-gather outputs
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
            assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
        else:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    LOG.events.append(("post", param_dtype))
    # Without a cast ``.to`` returns the gathered tensors themselves: the parameter views them.
    return TwoTensor(a, b).to(param_dtype), (a, b)  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def two_tensor_hooks(version: int) -> Iterator[HookLog]:
    """``TwoTensor`` with the protocol for the ``with`` body (``version`` 1: ``pre(mesh)``, 2:
    the five-argument pre-hook); the class is restored after it."""
    global LOG
    LOG = HookLog()
    cls: Any = TwoTensor
    cls.fsdp_pre_all_gather = _two_pre_v1 if version == 1 else _two_pre_v2
    cls.fsdp_post_all_gather = _two_post
    try:
        yield LOG
    finally:
        del cls.fsdp_pre_all_gather
        del cls.fsdp_post_all_gather


class PairMLP(nn.Module):
    """Bias-free projections whose weights are ``TwoTensor`` s; ``b`` is an affine copy of
    ``a``, so mixing up the two all-gather inputs shows."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, dim, bias=False)
        for lin in (self.in_proj, self.out_proj):
            w = lin.weight.detach()
            lin.weight = nn.Parameter(TwoTensor(w.clone(), w * 1.5 + 0.01))  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.out_proj(torch.relu(self.in_proj(x))))


def pair_stack(layers: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(PairMLP() for _ in range(layers)))


class BF16Gather(torch.Tensor):
    """A wrapper subclass around ``_data`` whose all-gather sends bf16, padded to the padded
    shard size from ``outer_size`` when FSDP's sharding is uneven."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> BF16Gather:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:  # type: ignore[override]
        return f"BF16Gather({self._data})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: None, outer_size: object, outer_stride: object
    ) -> BF16Gather:
        return BF16Gather(inner["_data"])

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(
            *pytree.tree_map_only(cls, lambda t: t._data, args),
            **pytree.tree_map_only(cls, lambda t: t._data, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: object,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        rows = math.ceil(outer_size[0] / mesh.size())
        if outer_size[0] % mesh.size() != 0:
            sent = self._data.new_zeros((rows, *outer_size[1:]), dtype=torch.bfloat16)
            sent[: self._data.size(0)].copy_(self._data)
        else:
            sent = self._data.to(torch.bfloat16)
        _log_pre(mesh, (sent,), (tuple(outer_size), tuple(outer_stride), type(module).__name__))
        return (sent,), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (gathered,) = all_gather_outputs
        assert gathered.dtype == torch.bfloat16, gathered.dtype
        if out is not None:
            LOG.events.append(("post_out", param_dtype))
            # ``out`` is the unsharded leaf parameter: refill it outside autograd (both
            # engines call this hook with grad mode on).
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.size(0)])  # dim-0 padding is the trailing rows
            return None
        LOG.events.append(("post", param_dtype))
        upcast = gathered.to(param_dtype)
        return upcast, (gathered, upcast)


class ReleasingBF16Gather(BF16Gather):
    """``BF16Gather`` whose post-hook keeps only its own upcast copy and says so with torch
    2.15's ``fsdp_should_release_all_gather_outputs_after_post_all_gather`` (``RELEASE``
    answers it: True, or a non-bool to be refused)."""

    RELEASE: Any = True

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: None, outer_size: object, outer_stride: object
    ) -> ReleasingBF16Gather:
        return ReleasingBF16Gather(inner["_data"])

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> Any:
        return ReleasingBF16Gather.RELEASE

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        result = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        if result is None:
            return None
        upcast, _ = result
        return upcast, (upcast,)  # the gathered bf16 buffer is not kept


class WideMLP(nn.Module):
    """dim 3, hidden 9: uneven at 2 ranks (rows 9 -> 5 + 4, 3 -> 2 + 1); weights ``BF16Gather``,
    biases plain, in one parameter group."""

    def __init__(self, wrapper: type[BF16Gather] = BF16Gather) -> None:
        super().__init__()
        self.in_proj = nn.Linear(3, 9)
        self.out_proj = nn.Linear(9, 3)
        for lin in (self.in_proj, self.out_proj):
            lin.weight = nn.Parameter(wrapper(lin.weight.detach().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out_proj(torch.relu(self.in_proj(x)))
        return out


def shard_stack(model: nn.Module, shard: Callable[..., Any], **kwargs: Any) -> None:
    """``shard`` each child, then the root, with the same keyword arguments."""
    for child in model.children():
        shard(child, **kwargs)
    shard(model, **kwargs)


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """A (local) tensor's values as plain tensors: both halves of a ``TwoTensor``."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if isinstance(local, TwoTensor):
        return [local.a, local.b]
    if isinstance(local, BF16Gather):
        return [local._data]
    return [local]


def assert_bitwise(model: nn.Module, tmodel: nn.Module, tag: str) -> None:
    """Same parameter classes, local shards and grads (every inner tensor) as torch's run."""
    pairs = zip(model.named_parameters(), tmodel.named_parameters(), strict=True)
    for (name, p), (tname, tp) in pairs:
        assert name == tname, (name, tname)
        assert isinstance(p, DTensor) and isinstance(tp, DTensor), f"{tag} {name}"
        assert p.placements == tp.placements, f"{tag} {name}: {p.placements} vs {tp.placements}"
        assert type(p.to_local()) is type(tp.to_local()), f"{tag} {name}"
        for ours, theirs in zip(_plain(p), _plain(tp), strict=True):
            assert torch.equal(ours, theirs), f"{tag} {name}: params differ from torch"
        if tp.grad is None:
            assert p.grad is None, f"{tag} {name}: torch has no grad, we do"
            continue
        assert p.grad is not None, f"{tag} {name}: torch has a grad, we don't"
        assert type(p.grad.to_local()) is type(tp.grad.to_local()), f"{tag} {name} grad"  # type: ignore[attr-defined]
        for ours, theirs in zip(_plain(p.grad), _plain(tp.grad), strict=True):
            assert torch.equal(ours, theirs), f"{tag} {name}: grads differ from torch"


def train_side_by_side(
    model: nn.Module, tmodel: nn.Module, rank: int, dim: int, tag: str, steps: int = 3
) -> list[Event]:
    """Adam steps on both engines, each rank its own batch: the same loss, params, grads and
    hook calls (in order, with their arguments) as torch at every step. Returns our calls."""
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in (model, tmodel)]
    assert_bitwise(model, tmodel, f"{tag} init")
    ours_all: list[Event] = []
    for step in range(steps):
        x = torch.randn(2, dim, generator=torch.Generator().manual_seed(100 * step + rank))
        losses, calls = [], []
        for m in (model, tmodel):
            start = len(LOG.events)
            loss = m(x).sum()
            loss.backward()
            losses.append(loss)
            calls.append(LOG.since(start))
        for ours, theirs in zip(_plain(losses[0]), _plain(losses[1]), strict=True):
            assert torch.equal(ours, theirs), f"{tag} step {step}: losses differ from torch"
        assert calls[0] == calls[1], f"{tag} step {step}: hook calls {calls[0]} vs {calls[1]}"
        ours_all += calls[0]
        assert_bitwise(model, tmodel, f"{tag} step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        assert_bitwise(model, tmodel, f"{tag} step {step} after Adam")
    return ours_all


def kinds(events: list[Event]) -> dict[str, int]:
    """How many pre / post / post_out calls."""
    counts: dict[str, int] = {}
    for e in events:
        counts[str(e[0])] = counts.get(str(e[0]), 0) + 1
    return counts


def two_tensor_train_parity(rank: int, world: int, version: int, raf: bool) -> dict[str, int]:
    """torch's ``test_all_gather_extensions_train_parity``: a three-block ``TwoTensor`` MLP."""
    with two_tensor_hooks(version):
        model, tmodel = pair_stack(), pair_stack()
        shard_stack(model, fully_shard, reshard_after_forward=raf)
        shard_stack(tmodel, torch_fully_shard, reshard_after_forward=raf)
        events = train_side_by_side(model, tmodel, rank, 8, f"v{version} raf={raf}")
    pres = [e for e in events if e[0] == "pre"]
    # Two inputs per parameter, each this rank's rows of a or b: (16, 8) / 2, (8, 16) / 2.
    assert {e[3] for e in pres} == {((8, 8), (8, 8)), ((4, 16), (4, 16))}, pres
    assert {(e[1], e[2]) for e in pres} == {(1, world)}
    if version == 2:
        assert {e[4] for e in pres} == {((16, 8), (8, 1), "Linear"), ((8, 16), (16, 1), "Linear")}
    return kinds(events)


def two_tensor_meta_mixed_precision(rank: int, world: int, raf: bool) -> dict[str, int]:
    """torch's ``test_all_gather_extensions_end_to_end``: meta-device init, ``to_empty``, bf16
    ``param_dtype``; here also trained against torch, bitwise."""
    with two_tensor_hooks(2):
        models = []
        for shard, mp in (
            (fully_shard, MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
            (torch_fully_shard, TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        ):
            with torch.device("meta"):
                m = pair_stack()
            assert all(p.device.type == "meta" for p in m.parameters())
            shard_stack(m, shard, reshard_after_forward=raf, mp_policy=mp)
            m.to_empty(device="cpu")
            torch.manual_seed(7)
            for p in m.parameters():
                nn.init.trunc_normal_(p)
            models.append(m)
        events = train_side_by_side(models[0], models[1], rank, 8, f"meta bf16 raf={raf}")
    assert {e[1] for e in events if e[0] != "pre"} == {torch.bfloat16}, events
    return kinds(events)


def bf16_gather_uneven(rank: int, world: int, raf: bool) -> dict[str, int]:
    """torch's ``test_all_gather_extension_outer_size_stride``: uneven shards padded by the
    pre-hook from ``outer_size``; plain biases in the same group."""
    global LOG
    LOG = HookLog()
    models = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        m = WideMLP()
        shard(m, reshard_after_forward=raf)
        models.append(m)
    events = train_side_by_side(models[0], models[1], rank, 3, f"bf16 uneven raf={raf}")
    pres = [e for e in events if e[0] == "pre"]
    assert {e[3] for e in pres} == {((5, 3),), ((2, 9),)}, pres  # padded shard sizes
    assert {e[4] for e in pres} == {((9, 3), (3, 1), "Linear"), ((3, 9), (9, 1), "Linear")}
    return kinds(events)


def _gather_output_bytes(model: nn.Module) -> list[int]:
    """Storage bytes of every extension parameter's all-gather outputs (our engine)."""
    return [
        sum(t.untyped_storage().nbytes() for t in p._all_gather.state.outputs or ())
        for m in model.modules()
        if (state := get_fsdp_state(m)) is not None
        for g in state._fsdp_param_groups
        for p in g.fsdp_params
        if p._all_gather.is_extension
    ]


def bf16_gather_release(rank: int, world: int, raf: bool) -> dict[str, int]:
    """torch 2.15's ``fsdp_should_release_all_gather_outputs_after_post_all_gather``: trained
    against torch (which frees them too from 2.15, and ignores the hook before), bitwise; with
    the parameters unsharded after a forward (``reshard_after_forward=False``), the outputs
    are already freed (right after each post-hook), where the plain ``BF16Gather``'s are still
    held."""
    global LOG
    LOG = HookLog()
    ReleasingBF16Gather.RELEASE = True
    models = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        m = WideMLP(ReleasingBF16Gather)
        shard(m, reshard_after_forward=raf)
        models.append(m)
    events = train_side_by_side(models[0], models[1], rank, 3, f"bf16 release raf={raf}")
    if not raf:
        # Unsharded after a forward: the plain wrapper's outputs are still held (54 bytes
        # each at 2 ranks), the releasing one's are freed.
        kept = WideMLP()
        fully_shard(kept, reshard_after_forward=False)
        x = torch.randn(2, 3)
        outs = [m(x).sum() for m in (kept, models[0])]
        held, released = _gather_output_bytes(kept), _gather_output_bytes(models[0])
        assert len(held) == 2 and all(n > 0 for n in held), held
        assert released == [0, 0], released
        for out in outs:
            out.backward()
    return kinds(events)


def bf16_gather_release_not_bool(rank: int, world: int) -> str:
    """A non-bool answer is refused at the first forward (lazy init), naming the parameter."""
    ReleasingBF16Gather.RELEASE = "yes"
    try:
        m = WideMLP(ReleasingBF16Gather)
        fully_shard(m)
        try:
            m(torch.randn(2, 3))
        except AssertionError as exc:
            return str(exc)
        return "nothing raised"
    finally:
        ReleasingBF16Gather.RELEASE = True


def two_tensor_hsdp(rank: int, world: int) -> dict[str, int]:
    """torch's ``test_all_gather_extension_hsdp_mesh``: on a 2 x 2 (replicate, shard) mesh the
    pre-hook gets the 1-D shard mesh; here also trained against torch, bitwise."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    with two_tensor_hooks(1):
        model, tmodel = pair_stack(), pair_stack()
        shard_stack(model, fully_shard, mesh=mesh)
        shard_stack(tmodel, torch_fully_shard, mesh=mesh)
        events = train_side_by_side(model, tmodel, rank, 8, "hsdp")
    assert {(e[1], e[2]) for e in events if e[0] == "pre"} == {(1, 2)}
    return kinds(events)


def int_reshard_after_forward_errors(rank: int, world: int) -> list[str]:
    """Each engine's exception for an extension parameter under ``reshard_after_forward=2``
    (a post-forward mesh of 2 of the 4 ranks), over a forward and backward."""
    global LOG
    LOG = HookLog()
    raised = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = nn.Sequential(WideMLP(), WideMLP())
        shard_stack(model, shard, reshard_after_forward=2)
        try:
            model(torch.randn(2, 3)).sum().backward()
        except Exception as exc:  # the type is the result
            raised.append(type(exc).__name__)
        else:
            raised.append("nothing")
    return raised
