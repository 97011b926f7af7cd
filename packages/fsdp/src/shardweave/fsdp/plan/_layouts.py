"""The shapes ``fit`` searches for N devices and a global batch: the layout (FSDP over all ranks,
or HSDP: ``R`` replicas of an ``S``-rank shard group, the shard group within a node first) and
the microbatch (a local batch of ``b`` samples per rank, ``a`` accumulation steps, ``b x a x N``
the global batch).

Design note: layouts and microbatches
    Every rank of either layout takes its own data, so the per-rank batch is ``G / N`` for a
    global batch ``G`` on ``N`` ranks whatever the layout. A layout changes only bytes and
    links: the shards are ``1/S`` of the parameters, gradients and optimizer state, each group's
    all-gather and reduce-scatter run over the ``S`` ranks of a shard group (NVLink while it is
    within a node), and HSDP adds an all-reduce of the reduced shards over the ``R`` replicas
    (NVLink only when the whole mesh is one node, else the network). So a layout is one more
    replay of a fake step's recorded calls, with no fake step of its own. A microbatch changes
    the activations: one fake step per local batch. Accumulation runs ``a`` forwards and
    backwards per optimizer step, each reduce-scattered (gradients accumulate sharded; under
    HSDP the all-reduce runs on the last microbatch only, ``set_requires_all_reduce``): the
    planned peak is the last microbatch's, which holds the accumulated sharded gradients from
    its start and runs every collective (the replay with ``set_to_none=False``); the time is
    ``a`` microbatches' compute and communication (the all-reduce once) and one optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from shardweave.fsdp.plan._model import PlanError
from shardweave.fsdp.plan._time_model import Device, Links

__all__ = ["ACCUMULATION_CHOICES", "Layout", "layouts", "microbatches", "sample_of"]

# Accumulation steps tried for a global batch (each dividing the per-rank batch): more steps
# cost more collectives and latency for less activation memory.
ACCUMULATION_CHOICES: Final = (1, 2, 4, 8)


@dataclass(frozen=True)
class Layout:
    """One mesh shape: ``dims`` is ``(N,)`` (FSDP) or ``(R, S)`` (HSDP), with its links."""

    dims: tuple[int, ...]
    links: Links

    @property
    def shard(self) -> int:
        return self.dims[-1]

    @property
    def replicate(self) -> int:
        return self.dims[0] if len(self.dims) == 2 else 1

    @property
    def label(self) -> str:
        kind = "HSDP" if len(self.dims) == 2 else "FSDP"
        return f"{'x'.join(map(str, self.dims))} ({kind})"


def layouts(
    dims: tuple[int, ...], device: Device, search: bool, links: dict[str, float | None]
) -> tuple[Layout, ...]:
    """The mesh given (``search`` False, or a 2-D mesh), else FSDP over all ``N`` ranks and the
    HSDP shapes ``(N/S, S)``: shard groups within a node first (``S`` = the node's devices,
    then halves of it, down to one rank), then across nodes (twice the node, four times, ...)."""

    def layout(shape: tuple[int, ...]) -> Layout:
        shard, replicate = shape[-1], (shape[0] if len(shape) == 2 else 1)
        return Layout(
            shape,
            Links.of(device, shard, replicate, links["shard"], links["replicate"], links["host"]),
        )

    if not search or len(dims) == 2:
        return (layout(dims),)
    n, node = dims[0], device.gpus_per_node
    within = [node >> k for k in range(node.bit_length()) if node >> k >= 1]
    across = [node << k for k in range(1, max(n, 1).bit_length())]
    shards = [s for s in (*within, *across) if s < n and n % s == 0]
    return (layout((n,)), *(layout((n // s, s)) for s in dict.fromkeys(shards)))


def microbatches(
    global_batch: int | None,
    world: int,
    sample: Any,
    choices: Sequence[int] = ACCUMULATION_CHOICES,
) -> tuple[tuple[int, int], ...]:
    """``(local batch, accumulation steps)`` pairs for ``global_batch`` on ``world`` ranks; with
    no global batch, ``((0, 1),)``: the sample input as given, no accumulation."""
    if global_batch is None:
        return ((0, 1),)
    if global_batch < 1 or global_batch % world:
        raise PlanError(
            f"fit: global_batch {global_batch} is not a positive multiple of the {world} ranks "
            "(every rank of FSDP or HSDP takes its own samples)"
        )
    if not (isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[1], torch.dtype)):
        raise PlanError(
            "fit: with global_batch, pass sample_input as (shape, dtype): its first dimension "
            "is the batch, which fit chooses"
        )
    per_rank = global_batch // world
    found = [(per_rank // a, a) for a in sorted(set(choices)) if a >= 1 and per_rank % a == 0]
    if not found:
        raise PlanError(f"fit: no accumulation choice in {tuple(choices)} divides {per_rank}")
    return tuple(found)


def sample_of(sample: Any, local_batch: int) -> Any:
    """The sample input with its batch dimension set to ``local_batch`` (0: as given)."""
    if not local_batch:
        return sample
    shape, dtype = sample
    return ((local_batch, *tuple(shape)[1:]), dtype)
