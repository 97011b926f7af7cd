"""torchtitan itself as a client: its ``llama3_debugmodel`` built, parallelized and trained by
torchtitan's own code (``parallelize_llama`` -> ``apply_fsdp_to_decoder`` -> ``fully_shard``),
with both of its SPMD backends: ``spmd_types`` (its default: plain parameters annotated by the
``spmd_types`` package, ``fully_shard(..., dp_mesh_dims=...)``), also with its
``debug.spmd_typechecking`` on (every forward op type-checked: FSDP must put the annotations
back on the parameters it unshards), and ``partial_dtensor``; and its ``deepseek_v3`` debug
model with expert parallelism over both ranks (``partial_dtensor``), where torchtitan hands
``fully_shard`` torch's own ``ShardPlacementResult`` and mesh infos.

The loop is torchtitan's ``Trainer`` without its data, tokenizer, checkpointer and metrics (the
package ships no tokenizer or dataset): the model, optimizer, learning-rate schedule, loss,
``set_spmd_backend``, the SPMD context, the global token count and ``dist_utils.clip_grad_norm_``
all come from torchtitan's config, in the order ``Trainer.__init__`` and ``Trainer.train_step``
use them, as do the input annotations of the ``spmd_types`` backend
(``annotate_input_spmd_types``) and backward outside type checking; the batches (one document
per row, with its positions) are made here.

CPU workarounds, all in this harness (torchtitan's files are not touched):

* torchtitan falls back to the device type "cuda" when no accelerator is found
  (``torchtitan.tools.utils.device_type``, which ``parallel_dims`` and ``distributed.utils``
  imported by name): the harness points those names at "cpu" while it runs, so the meshes are
  CPU meshes, and builds the model on CPU;
* its default attention (``flex``) has no CPU backward, and ``model_registry`` refuses
  ``attn_backend="sdpa"`` for language models: each layer's ``inner_attention`` config is set
  to ``ScaledDotProductAttention.Config()`` (one causal document per row here);
* gloo has no ``PREMUL_SUM``: every ``FSDPModule`` is switched to summed gradients
  (``set_force_sum_reduction_for_comms(True)``) on both engines, as torchtitan does off CUDA;
* activation checkpointing and compile off (torch's engine takes the same path either way).

Our engine runs through the documented switch: torchtitan's module that imported
``fully_shard`` (``torchtitan.distributed.fsdp``) has that name pointed at ours while it
parallelizes. torchtitan's ``isinstance(m, FSDPModule)`` finds our modules.

Oracle: *compatibility*. The same steps with torch's ``fully_shard``: losses and gradient
norms bitwise equal, and so are the parameter shards after the last step.

torchtitan 0.3.0 needs torch >= 2.14 for its ``spmd_types`` backend (torch 2.13's
``fully_shard`` rejects plain parameters with ``dp_mesh_dims``) and imports triton (which CPU
torch wheels do not bring): the test skips on older torch, without triton and where torchtitan
is not installed, so CI's integration session (torch 2.13.0+cpu) does not install torchtitan.
It runs in ``nox -s compat`` on torch 2.14.1 and 2.15 (see noxfile.py).
"""

from __future__ import annotations

import importlib.util
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from shardweave.fsdp._torch_compat import TORCH_RELEASE
from tests._dist import WorkerPool
from tests.integration._frameworks import assert_same_tensors, local_params, no_torch_engine

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None,
        reason="torchtitan 0.3.0's llama3 model imports its MoE kernels, which import triton "
        "(CPU torch wheels do not bring it)",
    ),
    pytest.mark.skipif(
        TORCH_RELEASE < (2, 14),
        reason="torchtitan 0.3.0's spmd_types backend needs torch >= 2.14 "
        f"(installed: {torch.__version__})",
    ),
]

STEPS = 3
SEQ_LEN = 32
LOCAL_BATCH = 2
IGNORE_INDEX = -100
# "+typecheck": torchtitan's debug.spmd_typechecking, spmd_types checking every forward op
BACKENDS = ("spmd_types", "spmd_types+typecheck", "partial_dtensor")


def _config(model: str, backend: str) -> Any:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    if model == "llama3":
        config = llama3_debugmodel()
    else:  # expert parallelism over both ranks: its fully_shard gets torch's mesh infos
        config = deepseek_v3_debugmodel()
        config.parallelism.expert_parallel_degree = 2
    # flex attention has no CPU backward, and model_registry refuses "sdpa" for language
    # models (it cannot read per-document positions); this loop has one causal document
    # per row, which torch's scaled_dot_product_attention computes on CPU
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.parallelism.spmd_backend = backend
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = LOCAL_BATCH
    config.training.steps = STEPS
    config.compile.enable = False
    config.activation_checkpoint = None
    return config


def _batch(step: int, rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (LOCAL_BATCH, SEQ_LEN + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].clone()
    labels[torch.rand(labels.shape, generator=g) < 0.2] = IGNORE_INDEX  # padding
    return inputs, labels


_PARALLEL_DIMS: dict[str, Any] = {}


def _on_cpu() -> ExitStack:
    """torchtitan's "cuda" fallback device type, pointed at "cpu" where it was imported."""
    import torchtitan.distributed.parallel_dims
    import torchtitan.distributed.utils
    import torchtitan.tools.utils

    stack = ExitStack()
    for module in (
        torchtitan.tools.utils,
        torchtitan.distributed.parallel_dims,
        torchtitan.distributed.utils,
    ):
        stack.enter_context(mock.patch.object(module, "device_type", "cpu"))
    return stack


def _run(engine: str, variant: str, rank: int) -> dict[str, Any]:
    model, _, rest = variant.partition(":")
    backend, _, typecheck = rest.partition("+")
    with _on_cpu():
        return _train(engine, model, backend, rank, typecheck=bool(typecheck))


def _train(
    engine: str, model_name: str, backend: str, rank: int, *, typecheck: bool
) -> dict[str, Any]:
    import spmd_types as spmd
    import torchtitan.distributed.fsdp as titan_fsdp
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.tools import utils as titan_utils

    import shardweave.fsdp

    config = _config(model_name, backend)
    spec = config.model_spec
    device = torch.device("cpu")
    # One ParallelDims (so one set of meshes) per backend and process: torch's fully_shard
    # checks an spmd_types parameter's storage mesh by identity, and with a second, equal mesh
    # built later in the process DTensor's caches may hand back the first (seen with 2.14.1;
    # docs/migration.md, "meshes compared by equality, not identity")
    key = f"{model_name}:{backend}"
    parallel_dims = _PARALLEL_DIMS.get(key)
    if parallel_dims is None:
        parallel_dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
        _PARALLEL_DIMS[key] = parallel_dims
    dist_utils.set_spmd_backend(backend)
    torch.manual_seed(0)
    model_config = spec.model
    model_config.update_from_config(config=config)
    with (
        torch.device("meta"),
        titan_utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]),
    ):
        model = model_config.build()
    loss_fn = config.loss.build(compile_config=config.compile)
    ours = engine == "shardweave"
    with mock.patch.object(
        titan_fsdp, "fully_shard", shardweave.fsdp.fully_shard if ours else titan_fsdp.fully_shard
    ):
        model = spec.parallelize_fn(
            model,
            parallel_dims=parallel_dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=config.activation_checkpoint,
            dump_folder=config.dump_folder,
        )
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn.set_lm_head(model.lm_head)  # ChunkedLossWrapper, as the Trainer sets it
    model._skip_lm_head = True
    switched = 0
    for module in model.modules():
        if isinstance(module, torch.distributed.fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
            switched += 1
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(
        optimizers=optimizers, training_steps=config.training.steps
    )
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=typecheck)
    batch_mesh = parallel_dims.get_mesh("batch")
    vocab = model_config.vocab_size
    losses, norms = [], []
    for step in range(STEPS):
        optimizers.zero_grad()
        inputs, labels = _batch(step, rank, vocab)
        local_tokens = (labels != IGNORE_INDEX).sum()
        global_tokens = dist_utils.dist_sum_tensor(local_tokens, batch_mesh)
        # one document per row: positions restart at 0 on each row, as its dataloader sends
        extra: dict[str, Any] = {"positions": torch.arange(SEQ_LEN).expand(LOCAL_BATCH, -1)}
        if backend == "spmd_types":  # the Trainer's post_dataloading_process
            inputs, labels, extra = annotate_input_spmd_types(parallel_dims, inputs, labels, extra)
        with context():
            pred = model(inputs, **extra)
            loss, _ = loss_fn(pred, labels, global_tokens, positions=extra["positions"])
            del pred
            with spmd.no_typecheck():  # as the Trainer: type checking covers forward only
                loss.backward()
        norm = dist_utils.clip_grad_norm_(
            list(model.parameters()),
            config.training.max_norm,
            foreach=True,
            pp_mesh=parallel_dims.get_optional_mesh("pp"),
            ep_enabled=parallel_dims.ep_enabled,
        )
        optimizers.step()
        schedulers.step()
        losses.append(float(loss.detach()))
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return {"losses": losses, "norms": norms, "params": local_params(model), "switched": switched}


def titan_parity(rank: int, world: int, variant: str) -> list[float]:
    _PARALLEL_DIMS.clear()  # the worker destroys a body's process groups after it
    theirs = _run("torch", variant, rank)
    with no_torch_engine():
        ours = _run("shardweave", variant, rank)
    assert theirs["switched"] > 0, theirs["switched"]
    assert ours["switched"] == theirs["switched"], (ours["switched"], theirs["switched"])
    assert ours["losses"] == theirs["losses"], (rank, ours["losses"], theirs["losses"])
    assert ours["norms"] == theirs["norms"], (rank, ours["norms"], theirs["norms"])
    assert_same_tensors(ours["params"], theirs["params"], f"rank {rank} {variant}")
    return ours["norms"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchtitan_llama3_debugmodel(world2: WorkerPool, backend: str) -> None:
    """Oracle: compatibility (torchtitan's own loop on torch's fully_shard, bitwise)."""
    norms = world2.run(titan_parity, f"llama3:{backend}", timeout=600)
    assert norms[0] == norms[1], norms  # the norm is global: every rank sees the same


def test_torchtitan_deepseek_v3_expert_parallel(world2: WorkerPool) -> None:
    """Oracle: compatibility. deepseek_v3's debug model with expert parallelism over both ranks
    (``partial_dtensor``): torchtitan builds torch's mesh infos with torch's ``_get_mesh_info``
    and returns torch's ``ShardPlacementResult`` from ``shard_placement_fn``; bitwise equal.
    (Its ``spmd_types`` backend dispatches tokens with uneven all-to-alls, which gloo lacks.)"""
    norms = world2.run(titan_parity, "deepseek_v3_ep2:partial_dtensor", timeout=600)
    assert norms[0] == norms[1], norms
