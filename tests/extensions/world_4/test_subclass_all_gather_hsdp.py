"""Tensor-subclass all-gather on a 2 x 2 HSDP mesh (port of torch's GPU-only
``test_all_gather_extension_hsdp_mesh``).

Oracles: *compatibility* (torch's ``fully_shard`` on the same mesh trains an identical
``TwoTensor`` model: bitwise losses, shards, grads and hook calls at every Adam step) and
*closed form* (the pre-hook gets the 1-D shard mesh of 2 ranks, never the 2-D mesh).
"""

from __future__ import annotations

from tests._dist import WorkerPool
from tests.extensions._subclass_gather import two_tensor_hsdp


def test_hsdp_pre_all_gather_gets_shard_mesh(world4: WorkerPool) -> None:
    counts = world4.run(two_tensor_hsdp)
    assert counts == [{"pre": 36, "post": 6, "post_out": 30}] * 4
