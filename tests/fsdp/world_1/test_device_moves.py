"""Host/device moves of the accelerator path that CPU cannot take end to end: forward inputs
moved onto the root's device, and the device-to-host copies of CPU offload.

On this CPU-only machine the root's device is the CPU and an offloaded gradient is already on
the host, so the engine skips these moves here. What decides them is tested directly against
torch's FSDP2 (its ``_root_pre_forward`` and ``foreach_reduce``), and the world-size-1 NCCL
cases of the GPU kit (``tools/gpu_kit``: ``cpu_batch``, ``offload_hooks``) run them on a GPU.

Oracles: *compatibility* (torch's rules) and *closed form*.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardweave.fsdp import CPUOffloadPolicy, fully_shard
from shardweave.fsdp._fsdp_common import inputs_to_device, moves_forward_inputs
from shardweave.fsdp.comm._reduction import ReductionSchedule
from tests._dist import WorkerPool

Pair = namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    label: str


@pytest.mark.parametrize(
    ("device_type", "moves"),
    [("cuda", True), ("xpu", True), ("hpu", True), ("mtia", True), ("cpu", False), ("meta", False)],
)
def test_root_moves_inputs_on_the_devices_torch_does(device_type: str, moves: bool) -> None:
    """Oracle: torch's FSDP2 root pre-forward moves inputs for these device types only."""
    assert moves_forward_inputs(torch.device(device_type)) is moves


def test_inputs_to_device_moves_every_tensor_and_keeps_the_structure() -> None:
    """Oracle: closed form (the meta device stands in for an accelerator: a CPU tensor's
    ``.to("meta")`` is a real move; a tensor already there is passed as it is)."""
    meta = torch.device("meta")
    there = torch.empty(2, device=meta)
    args = (torch.ones(2), [torch.zeros(1), 3], Pair(torch.ones(1), "x"), there)
    kwargs = {"batch": Batch(torch.arange(3), "train"), "flag": True}
    moved_args, moved_kwargs = inputs_to_device(args, kwargs, meta)
    assert moved_args[0].device == meta and moved_args[0].shape == (2,)
    assert moved_args[1][0].device == meta and moved_args[1][1] == 3
    assert isinstance(moved_args[2], Pair) and moved_args[2].a.device == meta
    assert moved_args[2].b == "x" and moved_args[3] is there
    batch = moved_kwargs["batch"]
    assert isinstance(batch, Batch) and batch.tokens.device == meta and batch.label == "train"
    assert batch.tokens.dtype == torch.int64 and moved_kwargs["flag"] is True
    assert args[0].device.type == "cpu"  # the caller's tensors are left as they were


def offload_copy_rules(rank: int, world: int) -> dict[str, bool]:
    """Body: when an offloaded gradient's device-to-host copy may be non-blocking."""
    model = nn.Linear(4, 4)
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fsdp_param = model._groups()[0].fsdp_params[0]  # type: ignore[operator]
    results = {"unpinned": fsdp_param.offload_non_blocking(has_hooks=False)}
    # Pinned memory cannot be allocated without an accelerator: only the flag matters here.
    fsdp_param.pin_memory = True
    results["pinned"] = fsdp_param.offload_non_blocking(has_hooks=False)
    results["pinned, optimizer in backward"] = fsdp_param.offload_non_blocking(has_hooks=True)
    fsdp_param.sharded_param.grad = torch.zeros_like(fsdp_param.sharded_param)
    results["pinned, accumulating"] = fsdp_param.offload_non_blocking(has_hooks=False)
    return results


def test_offload_copy_is_blocking_when_the_host_reads_it_in_backward(world1: WorkerPool) -> None:
    """Oracle: torch's FSDP2 (``foreach_reduce``): non-blocking only into pinned memory, and
    never when accumulating or when post-accumulate-grad hooks (an optimizer in backward)
    read the gradient on the host at once."""
    (results,) = world1.run(offload_copy_rules)
    assert results == {
        "unpinned": False,
        "pinned": True,
        "pinned, optimizer in backward": False,
        "pinned, accumulating": False,
    }


class _Event:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def test_end_of_backward_waits_for_every_offload_copy() -> None:
    """Reductions that offload end on different streams (the reduce-scatter stream, the
    all-reduce stream, a hook's stream), so the host waits for each one's event before the
    CPU optimizer reads the gradients, not only the last one's. Oracle: closed form."""
    ctx = ReductionSchedule()
    events = [_Event(), _Event(), _Event()]
    for event in events:
        reduction = SimpleNamespace(
            post_reduce_event=None, all_reduce_buffer=None, offload_event=event
        )
        ctx._finished(reduction)  # type: ignore[arg-type]
    ctx.finish()
    assert [e.synchronized for e in events] == [1, 1, 1]
    ctx.finish()  # each once: the next backward starts with none pending
    assert [e.synchronized for e in events] == [1, 1, 1]
