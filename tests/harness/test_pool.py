"""Self-tests of the spawn pool in tests/_dist: results, failures, hangs and recovery."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import GRACE_PERIOD_S, WorkerError, WorkerPool


def _all_reduce_sum(rank: int, world_size: int) -> tuple[int, list[float]]:
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return rank, t.tolist()


def _all_gather_ranks(rank: int, world_size: int, width: int) -> list[float]:
    out = [torch.empty(width) for _ in range(world_size)]
    dist.all_gather(out, torch.full((width,), float(rank)))
    return torch.cat(out).tolist()


def _random_draws(rank: int, world_size: int) -> list[float]:
    return torch.rand(4).tolist()


def _consume_rng(rank: int, world_size: int) -> None:
    torch.rand(100)


def _raise_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks: rank 1 never joins


def _raise_everywhere(rank: int, world_size: int) -> None:
    raise RuntimeError(f"distinct failure on rank {rank}")


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.recv(torch.empty(1), src=1)  # rank 1 never sends
    else:
        threading.Event().wait()


def _change_global_state(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)


def _global_state(rank: int, world_size: int) -> tuple[torch.dtype, bool, bool]:
    return (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_grad_enabled(),
    )


def _unregister_demo_plugin(rank: int, world_size: int) -> None:
    from shardweave.mesh.extension_points import PARAM_KINDS

    PARAM_KINDS.unregister("demo")
    assert "demo" not in PARAM_KINDS.registered()


def _param_kind_plugins(rank: int, world_size: int) -> list[str]:
    from shardweave.mesh.extension_points import PARAM_KINDS

    return sorted(PARAM_KINDS.registered())


def _make_groups(rank: int, world_size: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "b"))  # kept by no one
    whole = dist.new_group(list(range(world_size)))
    t = torch.ones(1)
    dist.all_reduce(t, group=whole)  # used, then left behind
    return len(dist.distributed_c10d._world.pg_map)


def _live_groups(rank: int, world_size: int) -> tuple[int, int]:
    threads = sum(1 for _ in os.scandir("/proc/self/task")) if os.path.isdir("/proc") else 0
    return len(dist.distributed_c10d._world.pg_map), threads


def _die_on_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize("pool_name", ["world2", "world4"])
def test_all_reduce_closed_form(pool_name: str, request: pytest.FixtureRequest) -> None:
    """Closed form: all-reducing rank+1 gives W(W+1)/2 on every rank, results in rank order."""
    pool: WorkerPool = request.getfixturevalue(pool_name)
    w = pool.world_size
    expected = float(w * (w + 1) // 2)
    assert pool.run(_all_reduce_sum) == [(r, [expected] * 3) for r in range(w)]


def test_args_are_passed(world4: WorkerPool) -> None:
    """Closed form: all-gathering rank-filled tensors gives 0..W-1 each repeated `width` times."""
    expected = [float(r) for r in range(4) for _ in range(2)]
    assert world4.run(_all_gather_ranks, 2) == [expected] * 4


def test_rng_reset_between_bodies(world2: WorkerPool) -> None:
    first = world2.run(_random_draws)
    world2.run(_consume_rng)
    assert world2.run(_random_draws) == first
    assert first[0] == first[1]  # one seed on every rank


def test_global_state_reset_between_bodies(world2: WorkerPool) -> None:
    before = world2.run(_global_state)
    world2.run(_change_global_state)
    assert world2.run(_global_state) == before == [(torch.float32, False, True)] * 2


def test_registries_reset_between_bodies(world2: WorkerPool) -> None:
    pytest.importorskip("shardweave.mesh.extension_points")
    pytest.importorskip("shardweave_test_plugin")  # installed by `nox -s tests`
    from shardweave.mesh.extension_points import PARAM_KINDS

    assert "demo" in PARAM_KINDS.registered()
    world2.run(_unregister_demo_plugin)
    assert world2.run(_param_kind_plugins) == [sorted(PARAM_KINDS.registered())] * 2


def test_process_groups_released_between_bodies(world4: WorkerPool) -> None:
    """A body's process groups (each gloo group holds threads that wake while idle) are
    destroyed after it; the default group stays, and so do those a fault test kept
    (``keep_process_group``)."""
    (before, threads), *_ = world4.run(_live_groups)
    made = world4.run(_make_groups)
    assert made == [before + 3] * 4  # the mesh's two dims and the new group
    for _ in range(3):
        world4.run(_make_groups)
    after = world4.run(_live_groups)
    assert [groups for groups, _ in after] == [before] * 4, (before, after)
    if threads:  # each group's gloo threads ended with it (a few may be the backend's own)
        assert all(n <= threads + 4 for _, n in after), (threads, after)


def test_failure_on_one_rank_is_reported_fast(world2: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        world2.run(_raise_on_rank1, timeout=120.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1 raised" in message
    assert "ValueError: boom from rank 1" in message
    assert "rank 0 raised" not in message
    assert "did not finish" in message  # rank 0 was stuck in all_reduce
    assert "_raise_on_rank1" in message
    assert elapsed < 30.0, f"took {elapsed:.1f} s; the grace period is {GRACE_PERIOD_S} s"
    assert world2.run(_all_reduce_sum)[0] == (0, [3.0] * 3)  # restarted and usable


def test_every_failing_rank_is_reported(world2: WorkerPool) -> None:
    with pytest.raises(WorkerError) as info:
        world2.run(_raise_everywhere)
    for rank in range(2):
        assert f"rank {rank} raised" in str(info.value)
        assert f"RuntimeError: distinct failure on rank {rank}" in str(info.value)
    assert world2.run(_all_reduce_sum)[1] == (1, [3.0] * 3)


def test_timeout_names_ranks_and_recovers(world2: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        world2.run(_hang, timeout=3.0)
    assert time.monotonic() - start < 30.0
    message = str(info.value)
    assert "timed out after 3 s" in message
    assert "rank(s) [0, 1] did not finish" in message
    assert "_hang" in message  # the stacks show where each rank was stuck
    assert world2.run(_all_reduce_sum) == [(r, [3.0] * 3) for r in range(2)]


def test_dead_worker_is_reported(world2: WorkerPool) -> None:
    with pytest.raises(WorkerError, match=r"rank 0 died \(exit code 3\)"):
        world2.run(_die_on_rank0)
    assert world2.run(_all_reduce_sum)[0] == (0, [3.0] * 3)


def test_unpicklable_body_is_rejected_before_sending(world2: WorkerPool) -> None:
    def local_body(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="module-level functions"):
        world2.run(local_body)
