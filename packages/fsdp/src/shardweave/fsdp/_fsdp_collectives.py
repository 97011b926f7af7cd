"""The group collectives: all-gather copy-in/copy-out and gradient reduction.

Functions here take explicit buffers, process groups and comm objects; they never look at
modules or training state (the param group decides *when*, this module decides *how*).
See Design note: tensor vocabulary (``_fsdp_common``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch
import torch.distributed as dist

from shardweave.fsdp import _fault, _trace
from shardweave.fsdp._fsdp_api import AllGather, ReduceScatter

if TYPE_CHECKING:
    from shardweave.fsdp._fsdp_param import FSDPParam

__all__ = [
    "AllGatherResult",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "ProcessGroupAllocAllGather",
    "ProcessGroupAllocReduceScatter",
    "SymmMemAllGather",
    "SymmMemReduceScatter",
    "all_gather_copy_in",
    "all_gather_copy_out",
    "foreach_reduce",
    "gradient_divide_factors",
    "release_finished_buffer",
]

ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType


class _EmptyAllocate:
    """Staging buffers from ``torch.empty`` (the caching allocator on GPUs)."""

    def allocate(
        self, size: tuple[int, ...] | torch.Size, *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _GroupAllocate:
    """Staging buffers from the process group's own allocator when its backend has one (NCCL
    zero-copy registration); otherwise (gloo) ``torch.empty``, as torch's FSDP2 does."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(
        self, size: tuple[int, ...] | torch.Size, *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        backend = self._group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            numel = 1
            for s in size:
                numel *= int(s)
            return backend.allocate_tensor(numel, dtype=dtype, device=device)
        return torch.empty(size, dtype=dtype, device=device)


class _SymmMemAllocate:
    """Staging buffers in symmetric memory (CUDA with NCCL): every peer can address them, so
    NCCL may pick its copy-engine or symmetric-kernel collectives. They come from the
    symmetric-memory pool, so a step reuses the segments registered by the previous one
    instead of registering new ones."""

    def __init__(self, group: dist.ProcessGroup, backend: Literal["NCCL"] = "NCCL") -> None:
        # Imported here: the module needs a CUDA-enabled build to be useful, and CPU-only users
        # never construct this class.
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self._group = group
        symm_mem.set_backend(backend)
        # The first rendezvous needs the group's communicator to exist; a barrier creates it
        # once, at setup, instead of inside the first all-gather.
        dist.barrier(group=group)

    def allocate(
        self, size: tuple[int, ...] | torch.Size, *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        pool = self._symm_mem.get_mem_pool(device)
        with torch.cuda.use_mem_pool(pool):
            return torch.empty(size, dtype=dtype, device=device)

    def _rendezvous(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        self._symm_mem.rendezvous(tensor, group=group.group_name)


class _AllGatherSingle(AllGather):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        return cast("dist.Work | None", work)


class _ReduceScatterSingle(ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = dist.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )
        return cast("dist.Work | None", work)


class SymmMemAllGather(_SymmMemAllocate, _AllGatherSingle):
    """``all_gather_single`` into a symmetric-memory output buffer (``set_symm_mem_for_comm``).

    The all-gather is in place (each rank's input is its slice of the output), so only the
    output is exchanged with the peers."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self._rendezvous(output_tensor, group)
        return super().__call__(output_tensor, input_tensor, group, async_op)


class SymmMemReduceScatter(_SymmMemAllocate, _ReduceScatterSingle):
    """``reduce_scatter_single`` with input and output in symmetric memory."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        self._rendezvous(input_tensor, group)
        self._rendezvous(output_tensor, group)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class DefaultAllGather(_EmptyAllocate, _AllGatherSingle):
    """``all_gather_single`` on the group, into a ``torch.empty`` buffer."""


class DefaultReduceScatter(_EmptyAllocate, _ReduceScatterSingle):
    """``reduce_scatter_single`` on the group, into a ``torch.empty`` buffer."""


class ProcessGroupAllocAllGather(_GroupAllocate, _AllGatherSingle):
    """All-gather whose buffers come from the process group's allocator when it has one."""


class ProcessGroupAllocReduceScatter(_GroupAllocate, _ReduceScatterSingle):
    """Reduce-scatter whose buffers come from the process group's allocator when it has one."""


def release_finished_buffer(buffer: torch.Tensor, comm: AllGather | ReduceScatter) -> None:
    """Free a collective's engine-allocated buffer once the collective has been waited on.

    Design note: releasing collective buffers
        A backend's Work keeps the tensors it was given until the Work object is destroyed, and
        gloo destroys it on its worker thread, on that thread's schedule: often well after
        ``wait()`` returned. On the benchmark GPT, all-gather outputs and reduce-scatter inputs
        of groups long finished were still allocated at the backward peak, 3-6 MiB (10-20%) on
        some ranks and steps and nothing on others, so the peak depended on thread timing.
        After ``wait()`` on CPU the collective has finished and nothing reads the buffer again
        (the all-gather output has been copied out, the reduce-scatter input was only read), so
        its storage is freed here (resized to 0 bytes; the Work keeps an empty tensor).

        Only ``torch.empty`` buffers of the default comms on CPU are released: a custom comm's
        ``allocate`` may hand out memory it reuses (a pool, symmetric memory), and on CUDA the
        caching allocator's stream bookkeeping decides when a block may be reused.
    """
    if buffer.device.type == "cpu" and type(comm) in (DefaultAllGather, DefaultReduceScatter):
        buffer.untyped_storage().resize_(0)


@dataclass
class AllGatherResult:
    """An issued all-gather whose copy-out has not run yet."""

    output: torch.Tensor  # 1D, world_size * input numel, rank-major
    work: dist.Work | None
    world_size: int
    split_sizes: list[int]  # each param's numel per rank, in units of ``output``'s dtype
    as_bytes: bool  # output is uint8 because the inputs' dtypes differed
    post_forward: bool  # gathered from the post-forward shards (already in final layout)


def all_gather_copy_in(
    fsdp_params: Sequence[FSDPParam],
    flat_sharded: torch.Tensor | None,
    param_dtype: torch.dtype | None,
    device: torch.device,
    post_forward: bool,
) -> tuple[torch.Tensor, list[int], bool]:
    """The 1D all-gather input, each param's numel in it, and whether it is a byte view.

    With the group's flat sharded storage (see Design note: flat storage in
    ``_fsdp_param_group``) the input *is* the storage, or one cast of it: no per-parameter copy.
    """
    if flat_sharded is not None and not post_forward:
        data = flat_sharded
        if data.device != device:
            data = data.to(device, non_blocking=True)
        if param_dtype is not None and data.dtype != param_dtype:
            data = data.to(param_dtype)
        return data, [p.padded_sharded_numel for p in fsdp_params], False
    inputs = [t for p in fsdp_params for t in p.all_gather_inputs()]
    dtypes = {t.dtype for t in inputs}
    as_bytes = len(dtypes) > 1
    if as_bytes:
        # Mixed dtypes (e.g. frozen bf16 beside fp32) travel as one byte buffer.
        inputs = [t.contiguous().view(torch.uint8) for t in inputs]
    sizes = [t.numel() for t in inputs]
    if len(inputs) == 1:
        return inputs[0], sizes, as_bytes
    return torch.cat(inputs), sizes, as_bytes


def all_gather_copy_out(result: AllGatherResult, fsdp_params: Sequence[FSDPParam]) -> None:
    """Split the gathered buffer into each parameter's all-gather output in one pass."""
    world = result.world_size
    outs: list[torch.Tensor] = []
    fixups: list[tuple[FSDPParam, torch.Tensor]] = []
    for fsdp_param in fsdp_params:
        targets = fsdp_param.alloc_all_gather_outputs()
        if fsdp_param.shard_dim != 0 and not result.post_forward and not fsdp_param.has_extension:
            # Rows of a dim-d shard are chunks along d: gather into a scratch buffer, then
            # concatenate along d into the real layout.
            scratch = torch.empty_like(targets[0])
            fixups.append((fsdp_param, scratch))
            targets = [scratch]
        for target in targets:
            if result.as_bytes:
                target = target.view(torch.uint8)
            outs.append(target.view(world, -1))
    gathered = result.output.view(world, -1)
    if len(outs) == 1:
        outs[0].copy_(gathered)
    else:
        torch.split_with_sizes_copy(gathered, result.split_sizes, dim=1, out=outs)
    for fsdp_param, scratch in fixups:
        shards = scratch.view(world * fsdp_param.padded_sharded_size[0], -1)
        pieces = [c.view(fsdp_param.padded_sharded_size) for c in torch.chunk(shards, world, dim=0)]
        torch.cat(
            pieces,
            dim=fsdp_param.shard_dim,
            out=fsdp_param.all_gather_output.view(fsdp_param.orig_size),
        )


def gradient_divide_factors(
    reduce_scatter_size: int,
    all_reduce_size: int,
    reduce_dtype: torch.dtype,
    factor: float | None,
    force_sum: bool,
) -> tuple[float | None, float | None, ReduceOpLike, ReduceOpLike]:
    """(pre-divide, post-divide, reduce-scatter op, all-reduce op) for a gradient reduction.

    The default averages over every data-parallel rank; ``factor`` replaces that divisor.
    fp32/bf16 divide inside the collective (AVG); other dtypes (fp16's narrow range) and
    ``force_sum`` use SUM with explicit division, split before and after the collective for
    overflow-prone dtypes. The choices match torch's FSDP2 so results are bitwise comparable.
    """
    size = reduce_scatter_size * all_reduce_size
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            if size == 1:
                return None, None, dist.ReduceOp.SUM, dist.ReduceOp.SUM
            return None, None, dist.ReduceOp.AVG, dist.ReduceOp.AVG
        if factor == reduce_scatter_size:
            return None, None, dist.ReduceOp.AVG, dist.ReduceOp.SUM
        premul = torch._C._distributed_c10d._make_nccl_premul_sum(1.0 / factor)
        return None, None, premul, dist.ReduceOp.SUM
    total = float(size) if factor is None else factor
    if not overflow_risk:
        return None, total, dist.ReduceOp.SUM, dist.ReduceOp.SUM
    pre = 1
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return float(pre), total / pre, dist.ReduceOp.SUM, dist.ReduceOp.SUM


def _div_(tensor: torch.Tensor, factor: float | None) -> None:
    if factor is not None and factor != 1:
        tensor.div_(factor)


def foreach_reduce(
    fsdp_params: Sequence[FSDPParam],
    grads: list[torch.Tensor],
    reduce_scatter_group: dist.ProcessGroup | None,
    reduce_scatter_comm: ReduceScatter,
    orig_dtype: torch.dtype,
    reduce_dtype: torch.dtype | None,
    device: torch.device,
    divide_factor: float | None,
    all_reduce_group: dist.ProcessGroup | None,
    all_reduce_grads: bool,
    partial_reduce_output: torch.Tensor | None,
    all_reduce_hook: Callable[[torch.Tensor], None] | None,
    force_sum: bool,
    group_name: str = "",
) -> torch.Tensor | None:
    """Reduce-scatter (then all-reduce for HSDP) one group's gradients into its sharded grads.

    Returns the HSDP partial sum to carry to the next microbatch when ``all_reduce_grads`` is
    False, else None.
    """
    grad_dtypes = {g.dtype for g in grads}
    if len(grad_dtypes) != 1:
        names = ", ".join(p.param_fqn for p in fsdp_params)
        raise AssertionError(
            f"FSDP reduce-scatter expects one gradient dtype per group, got {grad_dtypes} for "
            f"[{names}]"
        )
    rdtype = reduce_dtype or grads[0].dtype
    world = reduce_scatter_group.size() if reduce_scatter_group is not None else 1
    ar_size = all_reduce_group.size() if all_reduce_group is not None else 1
    pre, post, rs_op, ar_op = gradient_divide_factors(
        world, ar_size, rdtype, divide_factor, force_sum
    )
    laid_out = [
        p.grad_for_reduce_scatter(g, world) for p, g in zip(fsdp_params, grads, strict=True)
    ]
    out_numel = sum(p.padded_sharded_numel for p in fsdp_params)
    rs_input = reduce_scatter_comm.allocate((world * out_numel,), dtype=rdtype, device=device)
    # One kernel: chunk every grad into `world` dim-0 pieces (zero padded), cast, and lay
    # rank i's pieces side by side in row i.
    torch._chunk_cat(laid_out, dim=0, num_chunks=world, out=rs_input.view(world, -1))
    grads.clear()  # the unsharded grads can be freed now
    del laid_out
    if _trace.ACTIVE is not None:  # see Design note: tracing hooks (_trace)
        _trace.ACTIVE.grads_reduced()
    _div_(rs_input, pre)
    if world > 1:
        assert reduce_scatter_group is not None
        output = reduce_scatter_comm.allocate((out_numel,), dtype=rdtype, device=device)
        if _fault.checks_enabled():
            _fault.check_collective(
                reduce_scatter_group, "reduce_scatter", group_name, rs_input.numel(), rdtype
            )
        if _trace.ACTIVE is not None:
            _trace.ACTIVE.reduce_issue("reduce_scatter", rs_input, reduce_scatter_group)
        work = reduce_scatter_comm(
            output_tensor=output,
            input_tensor=rs_input,
            group=reduce_scatter_group,
            op=rs_op,
            async_op=True,
        )
        _fault.wait(work, lambda: f"the reduce-scatter of group '{group_name}'")
        release_finished_buffer(rs_input, reduce_scatter_comm)
        if _trace.ACTIVE is not None:
            _trace.ACTIVE.reduce_done()
    else:
        output = rs_input
        if divide_factor is not None and pre is None and post is None:
            # Difference from torch: torch divides by the factor here *and* applies pre/post
            # factors in the fp16/force-sum cases; we divide exactly once.
            output = output / divide_factor
    if all_reduce_group is not None:
        if not all_reduce_grads:
            if partial_reduce_output is not None:
                partial_reduce_output += output
                return partial_reduce_output
            return output
        if partial_reduce_output is not None:
            output += partial_reduce_output
        if _fault.checks_enabled():
            _fault.check_collective(
                all_reduce_group, "all_reduce", group_name, output.numel(), output.dtype
            )
        if _trace.ACTIVE is not None:
            _trace.ACTIVE.reduce_issue("all_reduce", output, all_reduce_group)
        work = dist.all_reduce(output, op=ar_op, group=all_reduce_group, async_op=True)
        _fault.wait(work, lambda: f"the all-reduce of group '{group_name}'")
        if _trace.ACTIVE is not None:
            _trace.ACTIVE.reduce_done()
    if all_reduce_hook is not None:
        all_reduce_hook(output)
    _div_(output, post)
    if output.dtype != orig_dtype:
        output = output.to(orig_dtype)
    offset = 0
    for fsdp_param in fsdp_params:
        numel = fsdp_param.padded_sharded_numel
        fsdp_param.assign_sharded_grad(output.narrow(0, offset, numel))
        offset += numel
    return None
