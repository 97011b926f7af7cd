"""``outside_typecheck``: FSDP's hooks run under ``spmd_types.no_typecheck()`` once that package
is loaded (where torch converts its annotations), and cost nothing before.

Oracle: *closed form*, in a fresh interpreter (the switch wraps engine methods for the rest
of the process): a stand-in ``spmd_types`` module counts the hooks entering
``no_typecheck``; before it is loaded the engine's methods are the plain functions.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

BODY = textwrap.dedent(
    """
    import contextlib, os, sys, types
    import torch, torch.distributed as dist
    from torch import nn
    import shardweave.fsdp.core._spmd_types as st
    from shardweave.fsdp import fully_shard
    from shardweave.fsdp.core._param_group import FSDPParamGroup

    st.SPMD_TYPES_PARAMS = True  # as on torch 2.14+, whatever this torch is
    plain = FSDPParamGroup.unshard
    assert not hasattr(plain, "__wrapped__"), "wrapped before spmd_types was loaded"

    entered = []
    import importlib.machinery
    fake = types.ModuleType("spmd_types")
    fake.__spec__ = importlib.machinery.ModuleSpec("spmd_types", None)  # torch 2.15 looks
    @contextlib.contextmanager
    def no_typecheck():
        entered.append(1)
        yield
    fake.no_typecheck = no_typecheck
    fake.get_local_type = lambda t: None  # no parameter is annotated
    fake.register_local_autograd_function = lambda cls: None
    sys.modules["spmd_types"] = fake

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    assert FSDPParamGroup.unshard.__wrapped__ is plain
    model(torch.randn(3, 4)).sum().backward()
    print("entered", len(entered))
    dist.destroy_process_group()
    """
)


def test_hooks_run_outside_typecheck_once_loaded() -> None:
    env_path = [
        str(ROOT / "packages" / p / "src") for p in ("mesh", "fsdp", "replicate", "extensions")
    ]
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([*env_path, os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", BODY, str(port)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    entered = int(done.stdout.split("entered")[-1])
    # every group's unshard, wait, reshard, post-backward, the states' forward and backward
    # hooks and the final callback: more than one per group and step
    assert entered >= 3 * 3, done.stdout
