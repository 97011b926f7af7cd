"""Every communication knob of FSDPModule shows its effect, not only that it can be called.

Oracles: *compatibility* (torch's fully_shard with the same setting: same results, or the same
exception type) and *closed form* (call counts, divide factors, buffer sizes).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import AllGather, FSDPModule, MixedPrecisionPolicy, ReduceScatter, fully_shard
from shardweave.fsdp._torch_compat import all_gather_single, reduce_scatter_single
from tests._dist import WorkerPool, assert_close
from tests.fsdp._counting import count_collectives
from tests.fsdp._models import loss_fn, make_batch, make_model, shard_blocks
from tests.fsdp._oracle import TORCH_HAS_EXPLICIT_GRAD_DTYPE, assert_same_as_torch


def _skip_unless_torch_has(*methods: str) -> None:
    """Skip where torch's FSDPModule (the oracle) lacks a method the test calls on it (torch
    2.11 lacks several that later releases added); a capability, not a version."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    missing = [m for m in methods if not hasattr(TorchFSDPModule, m)]
    if missing:
        pytest.skip(f"torch {torch.__version__}'s FSDPModule has no {', '.join(missing)}")


def _train_pair(
    rank: int, world: int, configure: Callable[[nn.Module], None], steps: int = 2
) -> tuple[nn.Module, nn.Module]:
    """Our model and torch's, both configured the same way, trained in lockstep."""
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    shard_blocks(tmodel, torch_fully_shard)
    configure(model)
    configure(tmodel)
    for step in range(steps):
        batch = make_batch("gpt", 100 * step + rank)
        for m in (model, tmodel):
            loss_fn("gpt", m(batch), batch).backward()
        assert_same_as_torch(model, tmodel, f"step {step}")
        if step < steps - 1:
            for m in (model, tmodel):
                m.zero_grad(set_to_none=True)
    return model, tmodel


class RecordingAllGather(AllGather):
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls.append((output_tensor.numel(), input_tensor.numel(), group.size()))
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)  # type: ignore[no-any-return]


class RecordingReduceScatter(ReduceScatter):
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls.append((output_tensor.numel(), input_tensor.numel()))
        return reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )  # type: ignore[no-any-return]


def _recording_first_layer(
    model: nn.Module,
) -> tuple[nn.Module, RecordingAllGather, RecordingReduceScatter]:
    """Give ``model.layers[0]`` recording custom comms; returns the layer and both comms."""
    layer = model.layers[0]  # type: ignore[index]
    ag, rs = RecordingAllGather(), RecordingReduceScatter()
    layer.set_custom_all_gather(ag)
    layer.set_custom_reduce_scatter(rs)
    return layer, ag, rs


def custom_comms(rank: int, world: int) -> None:
    model = make_model("gpt")
    ref = copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    shard_blocks(ref, fully_shard)
    layer, ag, rs = _recording_first_layer(model)
    batch = make_batch("gpt", rank)
    for m in (model, ref):
        loss_fn("gpt", m(batch), batch).backward()
    # the layer's shard numel: every param's padded shard, laid end to end
    shard_numel = sum(p.to_local().numel() for p in layer.parameters())
    assert len(ag.calls) == 2, ag.calls  # forward, and again in backward (resharded)
    for out_numel, in_numel, size in ag.calls:
        assert size == world and out_numel == world * in_numel and in_numel >= shard_numel
    assert len(rs.calls) == 1 and rs.calls[0][1] == world * rs.calls[0][0]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad.to_local(), q.grad.to_local())  # type: ignore[union-attr]


def test_custom_all_gather_and_reduce_scatter(world2: WorkerPool) -> None:
    """Oracle: closed form (called once per unshard / reduction, with world-sized buffers)
    and the default comms' result."""
    world2.run(custom_comms)


def all_reduce_hook(rank: int, world: int) -> None:
    seen: list[torch.Tensor] = []

    def configure(m: nn.Module) -> None:
        m.layers[0].set_all_reduce_hook(lambda t: (seen.append(t.clone()), t.mul_(2.0))[1])  # type: ignore[index, operator]

    _model, _tmodel = _train_pair(rank, world, configure)
    assert len(seen) == 4  # two steps, ours and torch's
    assert torch.equal(seen[0], seen[1]), "the hook sees the same reduced buffer as torch's"


def test_all_reduce_hook(world2: WorkerPool) -> None:
    """Oracle: compatibility (a hook doubling the reduced grads gives torch's result)."""
    world2.run(all_reduce_hook)


def divide_factor(rank: int, world: int, factor: float, force_sum: bool) -> None:
    def configure(m: nn.Module) -> None:
        for sub in m.modules():
            if hasattr(sub, "set_gradient_divide_factor"):
                sub.set_gradient_divide_factor(factor)
                sub.set_force_sum_reduction_for_comms(force_sum)

    model, _ = _train_pair(rank, world, configure, steps=1)
    # closed form: grads = sum over ranks / factor = mean * world / factor
    base, _ = _train_pair(rank, world, lambda m: None, steps=1)
    for p, q in zip(model.parameters(), base.parameters(), strict=True):
        assert_close(p.grad.to_local(), q.grad.to_local() * (world / factor))  # type: ignore[union-attr]


@pytest.mark.parametrize(("factor", "force_sum"), [(2.0, False), (1.0, True), (4.0, True)])
def test_gradient_divide_factor(world2: WorkerPool, factor: float, force_sum: bool) -> None:
    """Oracles: compatibility and closed form (sum / factor)."""
    world2.run(divide_factor, factor, force_sum)


def premul_sum_on_gloo(rank: int, world: int) -> None:
    types = []
    for api in (torch_fully_shard, fully_shard):
        model = nn.Linear(4, 4)
        api(model)
        model.set_gradient_divide_factor(3.0)  # type: ignore[operator]
        with pytest.raises(Exception) as err:
            model(torch.randn(2, 4)).sum().backward()
        types.append(type(err.value))
        model.reset_iter_state()  # type: ignore[operator]
    assert types[0] is types[1], types


def test_custom_factor_on_gloo_raises_like_torch(world2: WorkerPool) -> None:
    """Oracle: compatibility (gloo has no PREMUL_SUM)."""
    _skip_unless_torch_has("reset_iter_state")
    world2.run(premul_sum_on_gloo)


def deprecated_alias(rank: int, world: int) -> None:
    model = nn.Linear(4, 4)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(2.0)  # type: ignore[operator]
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert model._get_fsdp_state()._fsdp_param_groups[0].gradient_divide_factor == 2.0  # type: ignore[operator]


def test_reduce_scatter_divide_factor_is_deprecated(world2: WorkerPool) -> None:
    world2.run(deprecated_alias)


class Routed(nn.Module):
    """Each rank uses a different expert: the unused one gets no gradient on that rank."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, which: int) -> torch.Tensor:
        return self.experts[which](x)


# What the unused expert's zero gradient is made in: the dtype autograd would have made its
# gradient in, as torch's engine makes it.
UNUSED_VARIANTS: dict[str, dict[str, bool]] = {
    "fp32": {},
    # bf16 compute, no reduce_dtype: bf16 zeros, and fp32 from torch 2.15 (the gradient's dtype)
    "bf16-compute": {"mp": True},
    # an explicit bf16 grad_dtype on the experts' weights (torch 2.15): bf16 zeros for them
    "explicit-grad-dtype": {"grad_dtype": True},
}


def unused_params(rank: int, world: int, variant: str) -> None:
    cfg = UNUSED_VARIANTS[variant]
    torch.manual_seed(0)
    model = Routed()
    ref, tmodel = copy.deepcopy(model), copy.deepcopy(model)
    if cfg.get("grad_dtype"):  # after the copies: deepcopy does not carry the flag
        for m in (model, tmodel):
            for expert in m.experts:  # type: ignore[union-attr]
                expert.weight.grad_dtype = torch.bfloat16
    for m, api, policy in (
        (model, fully_shard, MixedPrecisionPolicy),
        (tmodel, torch_fully_shard, TorchMixedPrecisionPolicy),
    ):
        api(m, mp_policy=policy(param_dtype=torch.bfloat16 if cfg.get("mp") else None))
        m.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for m in (model, tmodel):
        m(xs[rank], rank % 2).float().sum().backward()
    grads = [(p.grad.dtype, tp.grad.dtype) for p, tp in  # type: ignore[union-attr]
             zip(model.parameters(), tmodel.parameters(), strict=True)]  # fmt: skip
    assert all(ours == theirs for ours, theirs in grads), (variant, grads)
    assert_same_as_torch(model, tmodel, variant)
    if not cfg:  # fp32: the gradients of the whole batch, one process
        (sum(ref(x, r % 2).sum() for r, x in enumerate(xs)) / world).backward()  # type: ignore[union-attr]
        for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
            assert_close(p.grad.full_tensor(), rp.grad)  # type: ignore[union-attr, arg-type]


@pytest.mark.parametrize("variant", list(UNUSED_VARIANTS))
def test_reduce_scatter_unused_params(world2: WorkerPool, variant: str) -> None:
    """Oracles: reference and compatibility: ranks using different experts still issue the
    same reduce-scatter, and gradients are right; the unused expert's zeros are in the dtype
    torch's engine makes them in (bf16 compute, an explicit grad_dtype), bitwise."""
    _skip_unless_torch_has("set_reduce_scatter_unused_params")
    if UNUSED_VARIANTS[variant].get("grad_dtype") and not TORCH_HAS_EXPLICIT_GRAD_DTYPE:
        pytest.skip("parameters have no explicit-grad_dtype flag before torch 2.15")
    world2.run(unused_params, variant)


def separate_rs_group(rank: int, world: int) -> None:
    model, _tmodel = _train_pair(rank, world, lambda m: m.set_separate_reduce_scatter_group(True))  # type: ignore[operator]
    groups = model._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
    info = groups[0].mesh_info
    assert info.reduce_scatter_process_group is not None
    assert info.reduce_scatter_process_group is not info.shard_process_group
    model.set_separate_reduce_scatter_group(False)  # type: ignore[operator]
    assert info.reduce_scatter_process_group is None


def test_separate_reduce_scatter_group(world2: WorkerPool) -> None:
    """Oracle: compatibility (same grads) and closed form (a distinct process group)."""
    _skip_unless_torch_has("set_separate_reduce_scatter_group")
    world2.run(separate_rs_group)


def pg_allocation(rank: int, world: int) -> None:
    _train_pair(rank, world, lambda m: m.set_allocate_memory_from_process_group_for_comm(True))  # type: ignore[operator]
    types = []
    for api in (torch_fully_shard, fully_shard):
        m = nn.Linear(2, 2)
        api(m)
        m.set_custom_all_gather(RecordingAllGather())  # type: ignore[operator]
        with pytest.raises(Exception) as err:
            m.set_allocate_memory_from_process_group_for_comm(True)  # type: ignore[operator]
        types.append(type(err.value))
    assert types[0] is types[1] is AssertionError, types


def test_allocate_memory_from_process_group(world2: WorkerPool) -> None:
    """Oracle: compatibility (gloo falls back to torch.empty; refused after a custom comm)."""
    world2.run(pg_allocation)


def max_input_buffers_and_symm_mem(rank: int, world: int) -> None:
    for bad, exc in ((True, TypeError), (2.5, TypeError), (0, ValueError)):
        for api in (torch_fully_shard, fully_shard):
            m = nn.Linear(2, 2)
            api(m)
            with pytest.raises(exc):
                m.set_reduce_scatter_max_input_buffers(bad)  # type: ignore[operator]
    model, _ = _train_pair(rank, world, lambda m: m.set_reduce_scatter_max_input_buffers(3))  # type: ignore[operator]
    assert model._get_fsdp_state()._comm_ctx.reduce_scatter_max_input_buffers == 3  # type: ignore[operator]
    types: list[type[BaseException] | None] = []
    for api in (torch_fully_shard, fully_shard):
        m = nn.Linear(2, 2)
        api(m)
        try:
            m.set_symm_mem_for_comm()  # type: ignore[operator]
        except Exception as exc:  # the type is what is compared
            types.append(type(exc))
        else:
            types.append(None)
    # Ours refuses symmetric memory off CUDA on every torch. torch's refusal depends on its build,
    # not its release: a CPU build has no NCCL symmetric-memory backend and raises here, a CUDA
    # build (2.14.1 and 2.15.0 from the registry) accepts the call on a CPU module. Where torch
    # refuses, ours raises the same type or a subclass.
    assert types[1] is not None and issubclass(types[1], RuntimeError), types
    if types[0] is not None:
        assert issubclass(types[1], types[0]), types


def test_max_input_buffers_and_symm_mem(world2: WorkerPool) -> None:
    """Oracle: compatibility (validation errors; symmetric memory refused off CUDA/NCCL where
    torch's build refuses it too)."""
    _skip_unless_torch_has("set_reduce_scatter_max_input_buffers")
    world2.run(max_input_buffers_and_symm_mem)


def collectives_with_no_sync(rank: int, world: int) -> None:
    model = make_model("gpt")
    shard_blocks(model, fully_shard)
    batch = make_batch("gpt", rank)
    loss_fn("gpt", model(batch), batch).backward()
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    with count_collectives() as counts:
        loss_fn("gpt", model(batch), batch).backward()
    assert counts["reduce_scatter_single"] == 0, dict(counts)
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    with count_collectives() as counts:
        loss_fn("gpt", model(batch), batch).backward()
    assert counts["reduce_scatter_single"] == len(model.layers) + 1  # type: ignore[arg-type]


def test_gradient_sync_off_skips_reduce_scatter(world2: WorkerPool) -> None:
    """Oracle: closed form (no reduce-scatter while accumulating, one per group after)."""
    world2.run(collectives_with_no_sync)


class FakeSymmMem:
    """Stands in for ``torch.distributed._symmetric_memory`` on gloo: records what the engine
    asks of it (no GPU here, so the real module cannot run)."""

    def __init__(self) -> None:
        self.backends: list[str] = []
        self.pools: list[torch.device] = []
        self.rendezvous_calls: list[tuple[int, str]] = []

    def set_backend(self, name: str) -> None:
        self.backends.append(name)

    def get_mem_pool(self, device: torch.device) -> object:
        self.pools.append(torch.device(device))
        return object()

    def rendezvous(self, tensor: torch.Tensor, group: str) -> None:
        self.rendezvous_calls.append((tensor.numel(), group))


def symm_mem_wiring(rank: int, world: int) -> None:
    import contextlib

    import torch.distributed._symmetric_memory as symm_mem_module

    from shardweave.fsdp.comm._collectives import SymmMemAllGather

    fake = FakeSymmMem()
    # Per all-gather: (its input lies in its output's storage, input offset, input numel).
    inputs: list[tuple[bool, int, int]] = []
    issue_all_gather = SymmMemAllGather.__call__

    def record(
        self: Any, output_tensor: torch.Tensor, input_tensor: torch.Tensor, **kw: Any
    ) -> Any:
        out, inp = output_tensor.untyped_storage(), input_tensor.untyped_storage()
        inputs.append(
            (inp.data_ptr() == out.data_ptr(), input_tensor.storage_offset(), input_tensor.numel())
        )
        return issue_all_gather(self, output_tensor, input_tensor, **kw)

    SymmMemAllGather.__call__ = record  # type: ignore[method-assign]
    saved = {n: getattr(symm_mem_module, n) for n in ("set_backend", "get_mem_pool", "rendezvous")}
    saved_pool = torch.cuda.use_mem_pool
    for name in saved:
        setattr(symm_mem_module, name, getattr(fake, name))
    torch.cuda.use_mem_pool = lambda pool: contextlib.nullcontext()  # type: ignore[assignment, misc]
    try:
        model = make_model("mlp")
        tmodel = copy.deepcopy(model)
        shard_blocks(model, fully_shard)
        shard_blocks(tmodel, torch_fully_shard)
        groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._groups()]
        for g in groups:
            # The module-level call refuses CPU; the group-level switch is what it runs on CUDA.
            g.set_symm_mem("NCCL")
        assert fake.backends == ["NCCL"] * 2 * len(groups), fake.backends
        # A group on symmetric memory refuses more than one reduce-scatter input buffer.
        with pytest.raises(ValueError, match="max_input_buffers"):
            model.set_reduce_scatter_max_input_buffers(2)  # type: ignore[operator]
        batch = make_batch("mlp", rank)
        for m in (model, tmodel):
            loss_fn("mlp", m(batch), batch).backward()
        assert_same_as_torch(model, tmodel, "symmetric-memory comms")
        # In place: each all-gather's input is this rank's slot of the symmetric output.
        assert inputs and all(same for same, _, _ in inputs), inputs
        assert all(offset == rank * numel for _, offset, numel in inputs), inputs
        group_name = groups[0].mesh_info.shard_process_group.group_name  # type: ignore[union-attr]
        sizes = sorted({n for n, name in fake.rendezvous_calls if name == group_name})
        expected_ag = sorted(
            {world * sum(p.padded_sharded_numel for p in g.fsdp_params) for g in groups}
        )
        # Every all-gather output and reduce-scatter input (world x shard) and reduce-scatter
        # output (one shard) was registered, and every buffer came from the pool.
        assert set(expected_ag) <= set(sizes), (expected_ag, sizes)
        assert {n // world for n in expected_ag} <= set(sizes), (expected_ag, sizes)
        assert len(fake.pools) >= len(fake.rendezvous_calls) > 0
        assert all(d.type == "cpu" for d in fake.pools)
    finally:
        for name, fn in saved.items():
            setattr(symm_mem_module, name, fn)
        torch.cuda.use_mem_pool = saved_pool  # type: ignore[assignment]
        SymmMemAllGather.__call__ = issue_all_gather  # type: ignore[method-assign]

    m = nn.Linear(2, 2)
    fully_shard(m)
    with pytest.raises(ValueError, match="backend must be 'NCCL'"):
        m.set_symm_mem_for_comm("NVSHMEM")  # type: ignore[arg-type]
    m.set_custom_all_gather(RecordingAllGather())
    with pytest.raises(AssertionError, match="custom"):
        m.set_symm_mem_for_comm()


def test_symm_mem_wiring(world2: WorkerPool) -> None:
    """Oracle: torch (bitwise, with symmetric-memory staging swapped in through a stand-in
    module, since this machine has no GPU) and closed form (each staging buffer registered
    with the shard group, sized world x shard and shard)."""
    world2.run(symm_mem_wiring)


def _record_allocations(comm: AllGather | ReduceScatter, into: list[torch.Tensor]) -> None:
    """Keep every buffer ``comm`` hands out (the instance's method is wrapped, its type kept)."""
    allocate = comm.allocate

    def recording(size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = allocate(size, dtype=dtype, device=device)
        into.append(buffer)
        return buffer

    comm.allocate = recording  # type: ignore[method-assign]


def released_buffers(rank: int, world: int) -> dict[str, int]:
    model = make_model("gpt")
    tmodel = copy.deepcopy(model)
    shard_blocks(model, fully_shard)
    shard_blocks(tmodel, torch_fully_shard)
    custom, ag, rs = _recording_first_layer(model)
    default: list[torch.Tensor] = []
    custom_bufs: list[torch.Tensor] = []
    _record_allocations(ag, custom_bufs)
    _record_allocations(rs, custom_bufs)
    for module in model.modules():
        if isinstance(module, FSDPModule) and module is not custom:
            for group in module._get_fsdp_state()._fsdp_param_groups:  # type: ignore[operator]
                _record_allocations(group._all_gather_comm, default)
                _record_allocations(group._reduce_scatter_comm, default)
    for step in range(2):
        batch = make_batch("gpt", 100 * step + rank)
        for m in (model, tmodel):
            loss_fn("gpt", m(batch), batch).backward()
        assert_same_as_torch(model, tmodel, f"step {step}")
    # Our references keep every buffer object alive: only an explicit release empties one.
    return {
        "default": len(default),
        "default_full": sum(b.untyped_storage().nbytes() != 0 for b in default),
        "custom": len(custom_bufs),
        "custom_full": sum(b.untyped_storage().nbytes() != 0 for b in custom_bufs),
    }


def test_default_comm_buffers_released_after_wait(world2: WorkerPool) -> None:
    """Oracles: closed form and torch. With the default comms, every all-gather output and
    reduce-scatter input is freed once its collective was waited on (gloo's Work would
    otherwise keep it until its worker thread lets go); only the reduce-scatter outputs, which
    become the sharded gradients, keep their memory. A custom comm's buffers are never touched
    (its ``allocate`` may reuse them). Gradients stay bitwise torch's."""
    for counts in world2.run(released_buffers):
        # Per step, the default groups (layers[1] and the root) allocate 3 all-gather outputs
        # (layers[1] in forward and again in backward; the root, kept unsharded after forward,
        # once), 2 reduce-scatter inputs and 2 reduce-scatter outputs: 7, over 2 steps 14.
        assert counts == {"default": 14, "default_full": 4, "custom": 8, "custom_full": 8}, counts
