"""What a user with only shardweave-fsdp (and mesh) installed sees.

Oracle: *closed form* — the import graph, and the error a DTensor parameter gets without the
tensor-parallel plugin.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tests._dist import WorkerPool


@pytest.mark.parametrize("pkg", ["mesh", "fsdp", "replicate", "extensions"])
def test_fsdp_package_never_loads_torch_fsdp(pkg: str) -> None:
    """Package code builds its own engine: importing it must not load torch's FSDP."""
    code = (
        "import sys, importlib\n"
        f"importlib.import_module('shardweave.{pkg}')\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('torch.distributed.fsdp', "
        "'torch.distributed._composable.fsdp', 'torch.distributed._composable.replicate_with_fsdp', "
        "'torch.distributed.tensor.parallel.fsdp')))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0 and "ModuleNotFoundError" in result.stderr:
        pytest.skip(f"shardweave.{pkg} is not installed in this environment")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"shardweave.{pkg} loaded {result.stdout.strip()}"


class TP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        mesh = init_device_mesh("cpu", (1,))
        self.w = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))


def dtensor_param_without_plugin(rank: int, world: int) -> str:
    from shardweave.fsdp import fully_shard
    from shardweave.mesh import MissingExtensionError
    from shardweave.mesh.extension_points import PARAM_KINDS

    if PARAM_KINDS.find_for_type(DTensor) is not None:
        return "plugin installed"
    with pytest.raises(MissingExtensionError) as err:
        fully_shard(TP(), mesh=init_device_mesh("cpu", (1,)))
    return str(err.value)


def test_fsdp_dtensor_param_without_plugin(world1: WorkerPool) -> None:
    """Without shardweave-extensions, a DTensor parameter names the package to install."""
    (message,) = world1.run(dtensor_param_without_plugin)
    if message == "plugin installed":
        pytest.skip("a DTensor parameter-kind plugin is installed")
    assert "pip install shardweave-extensions" in str(message), message
    assert "TP.w" in str(message), message  # names the parameter
