"""What several sections share: where the checkout is, how a subprocess of the kit finds the
packages, and the two process groups the sections run in (world 1 on NCCL or gloo; ranks as
threads of one process)."""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

KIT_DIR = Path(__file__).resolve().parent  # tools/gpu_kit: ``python <KIT_DIR>`` runs the kit
ROOT = KIT_DIR.parents[1]
PACKAGE_SRCS = [
    str(ROOT / "packages" / p / "src") for p in ("mesh", "fsdp", "replicate", "extensions")
]


def subprocess_env(*front: str) -> dict[str, str]:
    """This process's environment with ``front`` and the four ``src`` folders first on
    PYTHONPATH: a subprocess of the kit imports the checkout's packages, never installed ones."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*front, *PACKAGE_SRCS, env.get("PYTHONPATH", "")])
    return env


def init_world1(device_type: str) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(0)
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def run_threads(world: int, body: Callable[[int], None], timeout: float = 120.0) -> None:
    """``body(rank)`` on ``world`` threads joined in torch's threaded process group (which
    replaces the process's default group while they run)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    # Each thread registers its groups under the same names: c10d keeps them per thread then.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    multi_threaded_pg._install_threaded_pg()
    store = dist.HashStore()
    errors: list[str] = []

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            body(rank)
        except BaseException as exc:
            errors.append(f"rank {rank}:\n{traceback.format_exc()}")
            multi_threaded_pg.ProcessLocalGroup.exception_handle(exc)  # wake the others
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if any(t.is_alive() for t in threads):
            errors.append(f"threads still running after {timeout:.0f} s")
    finally:
        multi_threaded_pg.ProcessLocalGroup.reset()
        multi_threaded_pg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise RuntimeError("\n".join(errors))
