"""Tensor-subclass all-gather on 4 ranks: a 2 x 2 HSDP mesh (port of torch's GPU-only
``test_all_gather_extension_hsdp_mesh``) and an int ``reshard_after_forward``.

Oracles: *compatibility* (torch's ``fully_shard`` on the same mesh trains an identical
``TwoTensor`` model: bitwise losses, shards, grads and hook calls at every Adam step; the same
exception type for the unsupported int ``reshard_after_forward``) and *closed form* (the
pre-hook gets the 1-D shard mesh of 2 ranks, never the 2-D mesh; 6 parameters x 3 steps x 2
unshards).
"""

from __future__ import annotations

from tests._dist import WorkerPool
from tests.extensions._subclass_gather import int_reshard_after_forward_errors, two_tensor_hsdp


def test_hsdp_pre_all_gather_gets_shard_mesh(world4: WorkerPool) -> None:
    counts = world4.run(two_tensor_hsdp)
    assert counts == [{"pre": 36, "post": 6, "post_out": 30}] * 4


def test_int_reshard_after_forward_is_not_implemented(world4: WorkerPool) -> None:
    """Oracle: compatibility. An all-gather extension under ``reshard_after_forward=2`` raises
    ``NotImplementedError`` on every rank with both engines (ours in the forward, at the
    post-forward reshard; torch's at the backward's unshard)."""
    assert world4.run(int_reshard_after_forward_errors) == [["NotImplementedError"] * 2] * 4
