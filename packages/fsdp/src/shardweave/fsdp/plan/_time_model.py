"""The step-time estimate ``fit`` ranks configurations by (docs/framework_guide.md, "Make it
fit", defines each term): datasheet numbers per device, and the terms of one step.

Design note: the step-time estimate
    compute   = FLOPs of the fake step (forward + backward, a checkpoint's recompute counted,
                from torch's ``flop_registry``) / device FLOP/s for the compute dtype
    comm      = sum over collectives of bus bytes / link bandwidth + latency, a ring's bus
                bytes being ``(n-1)/n`` of the all-gather output or reduce-scatter input
                (``2(n-1)/n`` of an all-reduce's buffer); the shard dimension uses
                ``shard_link`` bandwidth, the HSDP replicate dimension ``replicate_link``; the
                latency is NCCL's ring model (``Device.ring_latency``: a fixed cost plus one
                per ring step, NVLink within a node, the network between nodes)
    exposed   = what the engine's schedule cannot hide behind compute: the root's forward
                all-gather (nothing runs before it) and the last reduction (nothing runs after
                it), plus whatever of the rest exceeds compute (``max(0, comm - compute)``)
    offload   = host<->device bytes (the shards copied to the device for every all-gather,
                sharded gradients copied back) / host link bandwidth, not overlapped
    optimizer = bytes the optimizer step streams (sharded parameters read and written,
                gradients read, states read and written) / device memory bandwidth, or host
                memory bandwidth with offload (the step runs on the CPU); after backward, not
                overlapped
    step      = compute + exposed + offload + optimizer; the term that dominates is named.
    It is an estimate: peak numbers, no kernel efficiency, no contention between links.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from shardweave.fsdp.plan._model import ROOT_KEY

__all__ = ["DEVICES", "STEP_TERMS", "Device", "Links", "time_terms"]


@dataclass(frozen=True)
class Device:
    """Throughput numbers for the time estimate (each default's source is in ``source``)."""

    bf16_flops: float  # dense, tensor cores (also used for fp16)
    fp32_flops: float  # plain FP32 (no TF32): torch's default for float32 matmuls
    intra_node_bytes_per_s: float  # per GPU, one direction
    inter_node_bytes_per_s: float  # per GPU, one direction
    host_bytes_per_s: float  # host <-> device, one direction
    gpus_per_node: int
    source: str
    hbm_bytes_per_s: float = 3.35e12  # device memory: the optimizer step reads and writes it
    host_memory_bytes_per_s: float = 76.8e9  # per GPU: the offloaded optimizer step's
    # NCCL's ring/Simple latency model: a fixed cost per collective plus one per ring step,
    # over NVLink within a node or over the network between nodes (see ``ring_latency``)
    collective_latency_s: float = 8.4e-6
    nvlink_step_latency_s: float = 3.4e-6
    network_step_latency_s: float = 9.6e-6

    def ring_latency(self, ranks: int, nodes: int, all_reduce: bool = False) -> float:
        """Seconds of latency of one ring collective over ``ranks`` on ``nodes`` nodes:
        ``ranks - 1`` steps (twice that for an all-reduce), ``nodes - 1`` of them (twice)
        crossing the network."""
        if ranks <= 1:
            return 0.0
        k = 2 if all_reduce else 1
        steps, network = k * (ranks - 1), k * (max(nodes, 1) - 1)
        return (
            self.collective_latency_s
            + (steps - network) * self.nvlink_step_latency_s
            + network * self.network_step_latency_s
        )


# Vendor datasheet numbers (peak, not achieved): NVIDIA H100 SXM5 datasheet (bf16 dense
# 989.4 TFLOP/s, FP32 66.9 TFLOP/s, NVLink 4 900 GB/s bidirectional = 450 GB/s per direction),
# one ConnectX-7 NDR 400 Gb/s (50 GB/s) per GPU between nodes, PCIe gen5 x16 (64 GB/s per
# direction, 128 GT/s raw). A100 SXM4 datasheet: bf16 dense 312 TFLOP/s, FP32 19.5 TFLOP/s,
# NVLink 3 600 GB/s bidirectional, HDR 200 Gb/s IB, PCIe gen4 x16 32 GB/s. Device memory:
# H100 SXM5 HBM3 3.35 TB/s, A100 SXM4 80 GB HBM2e 2.039 TB/s (datasheets). Host memory per
# GPU: the DGX system's CPU sockets' peak DRAM bandwidth shared by its 8 GPUs (DGX H100: two
# Xeon 8480C, 8 channels of DDR5-4800 each, 614 GB/s; DGX A100: two EPYC 7742, 8 channels of
# DDR4-3200 each, 410 GB/s). Collective latencies: NCCL's tuning model (src/graph/tuning.cc,
# ring with the Simple protocol, which large FSDP collectives use): 8.4 us per collective,
# 3.4 us per ring step over NVLink, 9.6 us per step over the network.
DEVICES: Final[dict[str, Device]] = {
    "h100": Device(
        989.4e12,
        66.9e12,
        450e9,
        50e9,
        64e9,
        8,
        "NVIDIA H100 SXM5 datasheet (bf16 dense, FP32, HBM3), NVLink 4 per direction, "
        "InfiniBand NDR 400 Gb/s per GPU, PCIe gen5 x16, DGX H100 host DRAM per GPU, "
        "NCCL's ring latency model",
        hbm_bytes_per_s=3.35e12,
        host_memory_bytes_per_s=76.8e9,
    ),
    "a100": Device(
        312e12,
        19.5e12,
        300e9,
        25e9,
        32e9,
        8,
        "NVIDIA A100 SXM4 80 GB datasheet (bf16 dense, FP32, HBM2e), NVLink 3 per direction, "
        "InfiniBand HDR 200 Gb/s per GPU, PCIe gen4 x16, DGX A100 host DRAM per GPU, "
        "NCCL's ring latency model",
        hbm_bytes_per_s=2.039e12,
        host_memory_bytes_per_s=51.2e9,
    ),
}

# What a step's estimated time adds up (seconds each; see time_terms).
STEP_TERMS: Final = ("compute", "exposed_comm", "offload", "optimizer")


@dataclass(frozen=True)
class Links:
    """The time model's numbers for one mesh (see ``Device``)."""

    device: Device
    shard_size: int
    replicate_size: int
    shard_bw: float
    repl_bw: float
    intra_bw: float
    host_bw: float

    @classmethod
    def of(
        cls,
        device: Device,
        shard_size: int,
        replicate_size: int,
        shard_link: float | None = None,
        replicate_link: float | None = None,
        host_link: float | None = None,
    ) -> Links:
        """A mesh's links: a shard group within a node talks over NVLink, across nodes over
        the network; the replicate dimension too, over NVLink only when the whole mesh is one
        node. ``*_link`` override single numbers (bytes/s)."""
        intra, inter = device.intra_node_bytes_per_s, device.inter_node_bytes_per_s
        one_node = shard_size * replicate_size <= device.gpus_per_node
        return cls(
            device,
            shard_size,
            replicate_size,
            shard_link or (intra if shard_size <= device.gpus_per_node else inter),
            replicate_link or (intra if one_node else inter),
            shard_link or intra,
            host_link or device.host_bytes_per_s,
        )

    @property
    def shard_nodes(self) -> int:  # a shard group's ranks are consecutive, a node at a time
        return -(-self.shard_size // self.device.gpus_per_node)

    @property
    def repl_nodes(self) -> int:  # replicas on one node: as many as fit beside the shards
        per_node = max(1, self.device.gpus_per_node // self.shard_size)
        return -(-self.replicate_size // per_node)

    def all_gather(self, nbytes: int) -> float:
        """One all-gather (or reduce-scatter) of ``nbytes`` (output, or input) over the shard
        dimension: a ring's ``(n-1)/n`` of the bytes over its link, plus its latency."""
        n = self.shard_size
        if n <= 1:
            return 0.0
        return nbytes * (n - 1) / n / self.shard_bw + self.device.ring_latency(n, self.shard_nodes)

    def all_reduce(self, nbytes: int) -> float:
        n = self.replicate_size
        if n <= 1:
            return 0.0
        lat = self.device.ring_latency(n, self.repl_nodes, all_reduce=True)
        return nbytes * 2 * (n - 1) / n / self.repl_bw + lat

    def node_all_gather(self, nbytes: int, ranks: int) -> float:
        """An int ``reshard_after_forward``'s backward all-gather within groups of ``ranks``."""
        lat = self.device.ring_latency(ranks, 1)
        return nbytes * (ranks - 1) / ranks / self.intra_bw + lat


def time_terms(
    plans: Sequence[Any],
    all_gathers: dict[str, int],
    flops: float,
    flops_per_s: float,
    links: Links,
    offload: bool,
    all_reduce: bool = True,
) -> dict[str, float]:
    """One forward and backward's terms (and the optimizer step's); ``all_reduce=False``: a
    microbatch that skips the HSDP all-reduce (``set_requires_all_reduce(False)``)."""
    comm = first = last = host = 0.0
    trainable = [g for g in plans if g.trainable_numel > 0]
    for g in plans:
        n_ag = all_gathers.get(g.key, 0)
        ag = n_ag * links.all_gather(g.gathered_bytes)
        mode = g.reshard_after_forward
        if n_ag >= 2 and not isinstance(mode, bool) and mode > 1:
            # The backward all-gather of an int reshard_after_forward N gathers the post-forward
            # shards within groups of N ranks (a node when N is the node size): its own link.
            ag += links.node_all_gather(g.gathered_bytes, mode) - links.all_gather(g.gathered_bytes)
        rs = links.all_gather(g.reduce_scatter_bytes) if g.trainable_numel else 0.0
        ar = links.all_reduce(g.all_reduce_bytes) if g.trainable_numel and all_reduce else 0.0
        comm += ag + rs + ar
        if g.key == ROOT_KEY and n_ag:
            first = links.all_gather(g.gathered_bytes)
        if offload:
            host += n_ag * g.sharded_param_bytes / links.host_bw + g.grad_bytes / links.host_bw
    if trainable:
        g = trainable[0]  # the root reduces last (in the final callback)
        last = links.all_gather(g.reduce_scatter_bytes)
        if all_reduce:
            last += links.all_reduce(g.all_reduce_bytes)
    compute = flops / flops_per_s
    exposed = first + last + max(0.0, comm - first - last - compute)
    # The optimizer step streams the sharded parameters (read and written; the sharded
    # gradients share their dtype), the gradients (read) and its states (read and written)
    # through memory: the device's, or with offload the host's (it runs on the CPU).
    streamed = sum(3 * g.grad_bytes + 2 * g.optimizer_state_bytes for g in plans)
    dev = links.device
    optimizer = streamed / (dev.host_memory_bytes_per_s if offload else dev.hbm_bytes_per_s)
    return {
        "compute": compute,
        "comm": comm,
        "exposed_comm": exposed,
        "offload": host,
        "optimizer": optimizer,
        "flops": flops,
    }
