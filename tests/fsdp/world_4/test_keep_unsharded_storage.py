"""``set_keep_unsharded_storage`` with an int ``reshard_after_forward`` (needs 4 ranks: the
post-forward shards live on groups of 2).

Oracle: torch's ``fully_shard`` with the same settings where its ``FSDPModule`` has the method
(bitwise losses, sharded parameters and gradients), else ours with ``keep=False``; closed form
for the data pointers: the kept storage is refilled in place also when the backward regathers
from the post-forward shards.
"""

from __future__ import annotations

from tests._dist import WorkerPool
from tests.fsdp._keep_storage import keep_storage_case


def test_keep_unsharded_storage_with_int_reshard_after_forward(world4: WorkerPool) -> None:
    world4.run(keep_storage_case, {"reshard_after_forward": 2})
