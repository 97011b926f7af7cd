"""Use a plugin from a separate distribution: ``examples/plugin_package``.

That package declares ``int8_kind`` (a ``ParamKind`` whose ``all_gather`` part is
``Int8AllGather``) in the ``shardweave.param_kinds`` entry-point group; this script never
imports the plugin. It looks the extension point up by the tensor's type
(``PARAM_KINDS.get_for_type``), which discovers installed plugins on first use, and runs the
kind's all-gather protocol around a real all-gather: ``pre_all_gather`` (int8 data + scale) ->
``all_gather_into_tensor`` per input -> ``post_all_gather`` (dequantize).

Note: ``fully_shard`` itself picks a kind's ``AllGatherExtension`` up at the root's lazy init, for a
sharded local tensor of its class; here the all-gather is driven by hand to show the protocol.
A tensor subclass that defines torch's own ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
methods is used by ``fully_shard`` directly.

Run on 2 CPU processes::

    pip install ./examples/plugin_package
    torchrun --standalone --nproc-per-node 2 examples/plugin_usage.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardweave.mesh.extension_points import PARAM_KINDS, AllGatherExtension


def gather(
    local: torch.Tensor, mesh: DeviceMesh, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """All-gather every rank's ``local`` shard (dim 0, equal shapes) through the all-gather of
    the kind that handles ``type(local)``; raises ``MissingExtensionError`` naming what to
    install if none."""
    kind = PARAM_KINDS.get_for_type(type(local), what="the local shard")
    if kind.all_gather is None:
        raise LookupError(f"the {kind.handled_type.__name__} kind has no all-gather part")
    extension: AllGatherExtension = kind.all_gather
    inputs, meta = extension.pre_all_gather(local, mesh)
    group = mesh.get_group()
    outs = []
    for tensor in inputs:
        flat = tensor.reshape(-1).contiguous()
        out = flat.new_empty(group.size() * flat.numel())
        dist.all_gather_into_tensor(out, flat, group=group)
        outs.append(out)
    return extension.post_all_gather(outs, meta, dtype)


def run(rows: int = 3, cols: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather a rank-dependent shard through the ``Int8Tensor`` plugin.

    Returns (this rank's plain shard, the gathered full tensor). Needs an initialized process
    group (``main`` makes one) and the plugin distribution installed.
    """
    from shardweave_example_plugin import Int8Tensor  # the marker type only, not the plugin

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(dist.get_rank())
    shard = torch.randn(rows, cols, generator=g)
    return shard, gather(shard.as_subclass(Int8Tensor), mesh)


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """Use the caller's process group, or make a gloo one (torchrun) for the duration."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> None:
    with process_group():
        shard, full = run()
        if dist.get_rank() == 0:
            print("plugins:", dict(PARAM_KINDS.registered()))
            print("gathered shape:", tuple(full.shape), "rank 0 rows max error:",
                  (full[: shard.size(0)] - shard).abs().max().item())  # fmt: skip


if __name__ == "__main__":
    main()
