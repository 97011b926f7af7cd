"""The loop each spawned worker runs; started by :class:`tests._dist.pool.WorkerPool`."""

from __future__ import annotations

import faulthandler
import importlib
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

# Messages from worker to pool: (kind, payload)
READY: str = "ready"
INIT_ERROR: str = "init-error"
OK: str = "ok"
ERROR: str = "error"
# Message from pool to worker that ends the loop.
SHUTDOWN: bytes = b"shutdown"


def worker_main(
    rank: int,
    world_size: int,
    store_path: str,
    stack_dump_path: str,
    repo_root: str,
    conn: Connection,
) -> None:
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    # On SIGUSR1 write every thread's Python stack: the pool asks for it when a body times out,
    # so a hang report shows the line each rank is blocked on.
    dump_file = open(stack_dump_path, "w")  # noqa: SIM115  (lives as long as the process)
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        resetter = _StateResetter()
    except BaseException:
        conn.send((INIT_ERROR, traceback.format_exc()))
        return
    conn.send((READY, None))

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the pool is gone
            break
        if data == SHUTDOWN:
            break
        kind, payload = _run_body(data, rank, world_size)
        try:
            message = pickle.dumps((kind, payload))
        except Exception:
            message = pickle.dumps(
                (ERROR, "the body's return value cannot be pickled:\n" + traceback.format_exc())
            )
        if kind == OK and not dist.is_initialized():
            message = pickle.dumps(
                (ERROR, "the body destroyed the default process group; the pool needs it")
            )
        resetter.reset()
        try:
            conn.send_bytes(message)
        except (BrokenPipeError, OSError):
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_body(data: bytes, rank: int, world_size: int) -> tuple[str, Any]:
    import torch
    import torch.distributed as dist

    from tests._dist.seeding import seed_everything

    try:
        fn, args = pickle.loads(data)
        seed_everything(0)
        # All ranks start together. Not dist.barrier(): gloo's barrier first waits on every
        # work its worker threads still hold and rethrows a failed one without joining, so a
        # collective an earlier test made fail on purpose could surface here on one rank only
        # and leave the ranks out of step. An all-reduce waits on nothing earlier.
        dist.all_reduce(torch.zeros(1))
        return OK, fn(rank, world_size, *args)
    except BaseException:  # SystemExit and KeyboardInterrupt in a body are failures too
        return ERROR, traceback.format_exc()


class _StateResetter:
    """Undo process-global state a body may have changed, so nothing depends on test order.

    Registries: every ``ExtensionPoint`` in ``shardweave.mesh.extension_points`` (when that
    package is installed) is snapshotted when the worker starts, before any discovery, and
    restored after every body with its own ``snapshot()``/``restore()``, so a body's
    ``register()`` never leaks into the next body.

    Process groups: every group but the default one is destroyed after each body (see
    ``_release_process_groups``).
    """

    def __init__(self) -> None:
        import torch

        self._default_dtype = torch.get_default_dtype()
        self._deterministic = torch.are_deterministic_algorithms_enabled()
        self._registries: list[tuple[Any, Any]] = []
        try:
            mesh = importlib.import_module("shardweave.mesh")
            points = importlib.import_module("shardweave.mesh.extension_points")
            point_type = mesh.ExtensionPoint
        except Exception:  # shardweave-mesh not installed (harness self-tests) or incomplete
            return
        for point in vars(points).values():
            if isinstance(point, point_type) and hasattr(point, "snapshot"):
                self._registries.append((point, point.snapshot()))

    def reset(self) -> None:
        import torch

        torch.set_default_dtype(self._default_dtype)
        torch.use_deterministic_algorithms(self._deterministic)
        torch.set_grad_enabled(True)
        for point, snapshot in self._registries:
            point.restore(snapshot)
        _release_process_groups()


# Groups a body asked the worker to keep (``keep_process_group``): never destroyed.
_KEPT: list[Any] = []


def keep_process_group(group: Any) -> None:
    """Keep ``group`` after the body instead of destroying it: for a group a fault test may
    leave with a collective that never completes. Destroying such a group ends it when its
    last reference goes, on whichever thread drops that (the watchdog's, say), and gloo's
    destructor then waits for the stuck collective until the group's timeout, holding that
    thread (a world-4 watchdog test saw the faulty rank's heartbeat stop)."""
    _KEPT.append(group)


def _release_process_groups() -> None:
    """Destroy every process group but the default one, and DTensor's sharding caches with
    them. A body's meshes build their own groups (an HSDP mesh; an int
    ``reshard_after_forward``, per call with torch's engine), which no later body uses, and
    each gloo group keeps a TCP loop thread that wakes while idle: kept, they grew to about
    470 groups (1,400 threads) per world-4 worker by the end of a run, and to more than a
    core of idle CPU on a 2-core machine (4 workers after the world-4 catalogue's
    ``reshard_after_forward=2`` body: 0.6 cores). DTensor's caches compare meshes by
    equality, so without the clear a later body could be handed an equal mesh whose groups
    are gone. The garbage collection ends the groups kept alive by cyclic garbage (without
    it 187 of 583 threads stayed in that measurement; with it 25)."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    default = c10d._get_default_group()
    groups = [g for g in c10d._world.pg_map if g is not default and not any(g is k for k in _KEPT)]
    if not groups:
        return
    from torch.distributed.tensor import DTensor, debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)  # both caches, where it exists
    if clear is not None:
        clear()
    else:
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # type: ignore[no-untyped-call]
    for group in groups:
        dist.destroy_process_group(group)
    gc.collect()
