"""A barrier for test bodies that does not trip over an earlier test's failed collective."""

from __future__ import annotations

import torch
import torch.distributed as dist


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` (default: the world) reaches this point before any leaves it.

    Not ``dist.barrier()``: gloo's barrier first waits on every work its worker threads still
    hold and rethrows a failed one without joining, so a collective an earlier test made fail
    on purpose (the fault and watchdog tests do) could surface in a later test on one rank only
    and leave the ranks out of step. An all-reduce waits on nothing earlier (the pool syncs its
    bodies the same way, see ``_worker``).
    """
    dist.all_reduce(torch.zeros(1), group=group)
