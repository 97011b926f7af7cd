"""The comm objects: the c10d calls (the default ``COLLECTIVES`` plugin), ``collectives_for``,
and the ``AllGather`` / ``ReduceScatter`` comms with their staging-buffer allocators.

Nothing here issues a collective on its own: the seam (``_seam.issue``) calls these inside
the stream the collective belongs to. The c10d calls themselves come from the
``COLLECTIVES`` extension point (c10d by default, shipped by this package).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
import torch.distributed as dist

from shardweave.fsdp._fsdp_api import AllGather, ReduceScatter
from shardweave.fsdp._torch_compat import all_gather_single, reduce_scatter_single
from shardweave.mesh.extension_points import COLLECTIVES, Collectives

__all__ = [
    "C10dCollectives",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "ProcessGroupAllocAllGather",
    "ProcessGroupAllocReduceScatter",
    "ReduceOpLike",
    "SymmMemAllGather",
    "SymmMemReduceScatter",
    "collectives_for",
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


class C10dCollectives:
    """The engine's collectives as plain c10d calls: the default ``COLLECTIVES`` plugin.

    Registered under the key ``"default"`` through this package's entry point; a plugin
    registered for a device type (``"cuda"``, ``"cpu"``, ...) replaces it for that type.
    """

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        async_op: bool = False,
    ) -> dist.Work | None:
        return all_gather_single(output, input, group=group, async_op=async_op)

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        return reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        return cast(
            "dist.Work | None", dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        )


_C10D = C10dCollectives()
# Keyed by the device itself: hashing a torch.device is a fifth of reading its ``type`` (which
# builds a new string), and this runs at every collective.
_collectives_cache: dict[torch.device, Collectives] = {}


def collectives_for(device: torch.device) -> Collectives:
    """The ``COLLECTIVES`` plugin for ``device``'s type, else the ``"default"`` one.

    Looked up once per device type and process (a plugin registered later applies to the
    next process). Without installed metadata (sources on ``PYTHONPATH``) the entry point
    is not discoverable, so the built-in c10d default is used directly.
    """
    found = _collectives_cache.get(device)
    if found is None:
        registered = COLLECTIVES.registered()
        found = registered.get(device.type) or registered.get("default") or _C10D
        _collectives_cache[device] = found
    return found


class _AllGatherSingle(AllGather):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return collectives_for(output_tensor.device).all_gather_into_tensor(
            output_tensor, input_tensor, group, async_op=async_op
        )


class _ReduceScatterSingle(ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        return collectives_for(output_tensor.device).reduce_scatter_tensor(
            output_tensor, input_tensor, group, op=op, async_op=async_op
        )


class SymmMemAllGather(_SymmMemAllocate, _AllGatherSingle):
    """``all_gather_single`` into a symmetric-memory output buffer (``set_symm_mem_for_comm``).

    The all-gather is in place: the group copies its input into this rank's slot of the
    symmetric output (``FSDPParamGroup.unshard``), so only the output is exchanged with the
    peers."""

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

        Only ``torch.empty`` buffers of the default comms, and only where the collective was
        finished by a host wait (``InFlight.finished_on_host``: not on stream-ordered devices),
        are released: a custom comm's ``allocate`` may hand out memory it reuses (a pool,
        symmetric memory), and on accelerators dropping the last reference after the owning
        stream waited is the release. Callers release only after the stream that allocated
        the buffer has waited for its last use (see Design note: stream ordering), so the
        discipline is the accelerators' one even where streams are no-ops.
    """
    if type(comm) in (DefaultAllGather, DefaultReduceScatter):
        buffer.untyped_storage().resize_(0)
