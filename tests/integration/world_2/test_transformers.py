"""Hugging Face transformers' own FSDP2 path with shardweave switched in: ``from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=2))`` calls ``fully_shard`` from
``transformers.distributed.fsdp`` (each decoder layer; for a tied model the input embedding and
the final norm as one group kept gathered; the root) and re-ties ``lm_head.weight`` to the
sharded embedding after loading. The switch is the documented one (docs/use_it_with.md,
"transformers"): that module's ``fully_shard`` pointed at ours before ``from_pretrained``.

Oracles: *compatibility*, the same code on torch's ``fully_shard`` (losses, gradient norms,
parameter shards, gathered weights, saved files bitwise equal), and *reference* for the tied
model, the unsharded model under DDP on the same per-rank batches. Tiny models built from
configs (no downloads): rank 0 saves one with ``save_pretrained``, every rank loads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

import shardweave.fsdp
from tests._dist import WorkerPool, assert_close
from tests.integration._frameworks import (
    assert_same_tensors,
    engine_of,
    local_params,
    no_torch_engine,
)

LR = 3e-4
MAX_NORM = 1.0
VOCAB = 256
CHECKPOINT_STEPS = 2
ENGINE_NAMES = ("torch", "shardweave")


def _llama_config(tie: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=tie,
    )


def _moe_config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )


def _save_initial(config: Any, folder: Path) -> None:
    """Rank 0 writes a freshly initialized model; every rank then loads the same weights."""
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    dist.barrier()


@contextmanager
def _engine(engine: str) -> Iterator[None]:
    """While open, transformers shards with ``engine``: the documented switch for shardweave
    (torch's engine objects cannot be built meanwhile), nothing for torch."""
    import transformers.distributed.fsdp

    with ExitStack() as stack:
        if engine == "shardweave":
            stack.enter_context(
                mock.patch.object(
                    transformers.distributed.fsdp, "fully_shard", shardweave.fsdp.fully_shard
                )
            )
            stack.enter_context(no_torch_engine())
        yield


def _load(folder: Path, **config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model: nn.Module = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(fsdp_size=2, **config)
    )
    model.train()
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, 16), generator=g)


def _local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        out[name] = grad.detach().clone()
    return out


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, clip: bool = True
) -> dict[str, Any]:
    """Adam steps on per-rank batches with transformers' own loss (``labels=``): the losses, the
    clipped total gradient norms, each step's local gradients."""
    losses, norms, grads, dtypes = [], [], [], set()
    for step in steps:
        ids = _batch(step, rank)
        out = model(input_ids=ids, labels=ids)
        loss, dtypes = out.loss, dtypes | {out.logits.dtype}
        loss.backward()
        grads.append(_local_grads(model))
        if clip:  # not across two meshes: torch's norm stacks DTensors of one mesh only
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "grads": grads, "logits": dtypes}


def _full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight gathered whole on every rank."""
    options = StateDictOptions(full_state_dict=True)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}


def _sharded_run(
    engine: str, folder: Path, steps: int, rank: int, clip: bool = True, **config: Any
) -> dict[str, Any]:
    with _engine(engine):
        model = _load(folder, **config)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        out: dict[str, Any] = _train(model, opt, range(steps), rank, clip)
    out["params"] = local_params(model)
    out["full"] = _full_weights(model)
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight  # type: ignore[union-attr]
    out["tied"] = head is embed
    out["engines"] = {name: engine_of(m) for name, m in model.named_modules()}
    out["meshes"] = {
        name: (p.device_mesh.mesh_dim_names, p.placements)
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    return out


def _assert_same_steps(ours: dict[str, Any], theirs: dict[str, Any], tag: str) -> None:
    """Step by step, so that a failure names the first step that differs."""
    assert len(ours["losses"]) == len(theirs["losses"]) > 0, tag
    for step, (mine, other) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
        where = f"{tag} step {step}"
        assert ours["losses"][step] == theirs["losses"][step], (
            where,
            ours["losses"],
            theirs["losses"],
        )
        assert_same_tensors(mine, other, f"{where} grads")
    assert ours["norms"] == theirs["norms"], (tag, ours["norms"], theirs["norms"])


def _assert_same_runs(ours: dict[str, Any], theirs: dict[str, Any], tag: str) -> None:
    _assert_same_steps(ours, theirs, tag)
    assert_same_tensors(ours["params"], theirs["params"], f"{tag} shards")
    assert_same_tensors(ours["full"], theirs["full"], f"{tag} full weights")
    assert ours["tied"] == theirs["tied"], tag
    assert ours["logits"] == theirs["logits"], (tag, ours["logits"], theirs["logits"])
    assert ours["meshes"] == theirs["meshes"], (tag, ours["meshes"], theirs["meshes"])
    # the same modules sharded, each by the engine the switch selected
    wrapped = {name for name, e in theirs["engines"].items() if e == "torch"}
    assert len(wrapped) >= 3, theirs["engines"]
    assert ours["engines"] == {
        name: "shardweave" if name in wrapped else "none" for name in theirs["engines"]
    }, ours["engines"]


def _ddp_run(folder: Path, steps: int, rank: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    out: dict[str, Any] = _train(ddp, opt, range(steps), rank)
    out["full"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def llama_parity(rank: int, world: int, root: str, tie: bool, steps: int) -> list[float]:
    folder = Path(root) / "init"
    _save_initial(_llama_config(tie), folder)
    runs = {engine: _sharded_run(engine, folder, steps, rank) for engine in ENGINE_NAMES}
    ours, theirs = runs["shardweave"], runs["torch"]
    _assert_same_runs(ours, theirs, f"rank {rank} tie={tie}")
    assert ours["tied"] is tie, f"tie={tie}: lm_head.weight is embed_tokens.weight: {ours['tied']}"
    if tie:
        ref = _ddp_run(folder, steps, rank)
        assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]))
        assert_close(torch.tensor(ours["norms"]), torch.tensor(ref["norms"]))
        for key, value in ref["full"].items():
            assert_close(ours["full"][key], value, msg=f"rank {rank} {key} vs DDP")
    norms: list[float] = ours["norms"]
    return norms


def test_llama_untied(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracle: compatibility (transformers on torch's fully_shard, bitwise)."""
    norms = world2.run(llama_parity, str(tmp_path), False, 3, timeout=180)
    assert norms[0] == norms[1], norms  # the clipped norm is global: every rank sees the same


def test_llama_tied(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracles: compatibility (torch's fully_shard, bitwise) and reference (DDP, unsharded)."""
    norms = world2.run(llama_parity, str(tmp_path), True, 5, timeout=180)
    assert norms[0] == norms[1], norms


def _dtensor_params_plugin() -> None:
    """Our engine takes DTensor parameters (the experts, ``Shard(0)`` on the EP mesh) through
    shardweave-extensions' ``param_kinds`` plugin. The integration session installs the
    packages, so it is found by its entry point; from a source checkout (PYTHONPATH, no entry
    points) register the same kind here. The pool restores the registry after the body."""
    from shardweave.extensions.tensor_parallel import dtensor_kind
    from shardweave.mesh.extension_points import PARAM_KINDS

    if PARAM_KINDS.find_for_type(DTensor) is None:
        PARAM_KINDS.register("dtensor", dtensor_kind())


def moe_parity(rank: int, world: int, root: str, steps: int) -> dict[str, Any]:
    _dtensor_params_plugin()
    folder = Path(root) / "init"
    _save_initial(_moe_config(), folder)
    runs = {
        engine: _sharded_run(engine, folder, steps, rank, clip=False, ep_size=2)
        for engine in ENGINE_NAMES
    }
    ours, theirs = runs["shardweave"], runs["torch"]
    _assert_same_runs(ours, theirs, f"rank {rank} moe")
    # the experts on transformers' expert mesh: whole experts split over "ep", FSDP over "efsdp"
    experts = {name: mesh for name, mesh in ours["meshes"].items() if ".experts." in name}
    assert len(experts) == 4 and all(m[0] == ("efsdp", "ep") for m in experts.values()), experts
    dense = {name: mesh for name, mesh in ours["meshes"].items() if ".experts." not in name}
    assert dense and all(m[0] == ("fsdp",) for m in dense.values()), dense
    return {engine: runs[engine]["losses"] for engine in ENGINE_NAMES}


def test_moe_expert_parallel(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracle: compatibility (torch's fully_shard on the same EP + FSDP layout, bitwise)."""
    world2.run(moe_parity, str(tmp_path), 3, timeout=180)


def mixed_precision_parity(rank: int, world: int, root: str, steps: int) -> dict[str, Any]:
    folder = Path(root) / "init"
    _save_initial(_llama_config(True), folder)
    runs = {
        engine: _sharded_run(engine, folder, steps, rank, fsdp_mixed_precision=True)
        for engine in ENGINE_NAMES
    }
    ours, theirs = runs["shardweave"], runs["torch"]
    _assert_same_runs(ours, theirs, f"rank {rank} bf16")
    assert ours["logits"] == {torch.bfloat16}, ours["logits"]  # the policy took effect
    assert ours["tied"], "lm_head is not embed_tokens after loading"
    return {engine: runs[engine]["losses"] for engine in ENGINE_NAMES}


def test_bf16_mixed_precision(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracle: compatibility (torch's fully_shard, the same bf16 policy, bitwise)."""
    world2.run(mixed_precision_parity, str(tmp_path), 3, timeout=180)


TIED_SHARE_MEMORY = "refused: tied weights share memory"


def _save_distributed(model: nn.Module, directory: Path) -> str:
    """``save_pretrained(distributed_checkpoint=True)``, or, where safetensors refuses the
    state dict's tied weights for sharing memory, the same DCP save with the tied key's value
    copied (the loader reads both keys into the one tied parameter). Returns which happened.

    On CPU, DCP hands safetensors each local tensor as it is when its storage is exactly its
    size: then the tied weights' entries share memory and safetensors raises, as for an
    unsharded tied model saved by one rank (``_plain_tied_save``). Each shard of ours is such
    a storage, as torch allocates shards; torch's engine gets past it here only because on CPU
    transformers' loading leaves its shards views of whole-size tensors, which DCP copies
    first. On an accelerator DCP copies every tensor to the host, and neither engine meets it
    (not checked here: no GPU)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        model.save_pretrained(directory, distributed_checkpoint=True)
        return "saved"
    except CheckpointException as e:
        if "share memory" not in str(e):
            raise
    state = get_model_state_dict(model)
    state["lm_head.weight"] = state["lm_head.weight"].clone()  # tied to the embedding
    writer = HuggingFaceStorageWriter(
        path=str(directory), save_distributed=True, enable_consolidation=False
    )
    dcp.save(state, storage_writer=writer)
    model.config.save_pretrained(directory)  # what save_pretrained writes beside the shards
    return TIED_SHARE_MEMORY


def _plain_tied_save(directory: Path) -> str:
    """What an unsharded model with tied weights gets from DCP's safetensors writer on CPU,
    saved by one rank (with more, DCP hands each rank one of the two keys)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    model = nn.Sequential(nn.Embedding(13, 6), nn.Linear(6, 13, bias=False))
    model[1].weight = model[0].weight
    alone, _ = dist.new_subgroups(group_size=1)
    writer = HuggingFaceStorageWriter(
        path=str(directory / f"rank{dist.get_rank()}"),
        save_distributed=True,
        enable_consolidation=False,
    )
    try:
        dcp.save(model.state_dict(), storage_writer=writer, process_group=alone)
    except CheckpointException as e:
        return TIED_SHARE_MEMORY if "share memory" in str(e) else str(e)
    return "saved"


def _checkpoint_run(engine: str, folder: Path, root: Path, rank: int) -> dict[str, Any]:
    """Train, save three ways, keep training; then a model reloaded from the gathered files
    (fresh optimizer) and one resumed from DCP (model and optimizer) take the same steps."""
    from safetensors.torch import load_file
    from transformers.distributed.checkpoint import (
        load_optimizer_distributed,
        save_optimizer_distributed,
    )

    full_dir, dcp_dir, optim_dir = (root / f"{engine}-{kind}" for kind in ("full", "dcp", "optim"))
    later = range(CHECKPOINT_STEPS, CHECKPOINT_STEPS + 2)
    out: dict[str, Any] = {}
    with _engine(engine):
        model = _load(folder)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        _train(model, opt, range(CHECKPOINT_STEPS), rank)
        out["saved"], out["saved_full"] = local_params(model), _full_weights(model)
        model.save_pretrained(full_dir)  # gathered: rank 0 writes model.safetensors
        out["dcp_save"] = _save_distributed(model, dcp_dir)  # DCP, a file per rank
        save_optimizer_distributed(model, opt, str(optim_dir))  # DCP
        out["kept_on"] = _train(model, opt, later, rank)

        reloaded = _load(full_dir)
        out["reloaded"] = local_params(reloaded)
        reloaded_opt = torch.optim.Adam(reloaded.parameters(), lr=LR)
        out["reloaded_on"] = _train(reloaded, reloaded_opt, later, rank)

        resumed = _load(dcp_dir)
        out["resumed"] = local_params(resumed)
        resumed_opt = torch.optim.Adam(resumed.parameters(), lr=LR)
        load_optimizer_distributed(resumed, resumed_opt, str(optim_dir))
        out["resumed_on"] = _train(resumed, resumed_opt, later, rank)
    out["ties"] = [
        m.lm_head.weight is m.model.embed_tokens.weight  # type: ignore[union-attr]
        for m in (reloaded, resumed)
    ]
    out["files"] = load_file(full_dir / "model.safetensors")
    return out


def checkpoint_round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    folder = Path(root) / "init"
    _save_initial(_llama_config(True), folder)
    runs = {engine: _checkpoint_run(engine, folder, Path(root), rank) for engine in ENGINE_NAMES}
    for engine, run in runs.items():
        tag = f"rank {rank} {engine}"
        assert run["ties"] == [True, True], (tag, run["ties"])
        # the gathered file holds the full weights as they were when saved
        files, full = run["files"], run["saved_full"]
        assert "model.embed_tokens.weight" in files and set(files) <= set(full), sorted(files)
        assert_same_tensors(files, {k: full[k] for k in files}, f"{tag} model.safetensors")
        assert_same_tensors(run["reloaded"], run["saved"], f"{tag} reloaded shards")
        assert_same_tensors(run["resumed"], run["saved"], f"{tag} resumed shards")
        # resumed with its optimizer from DCP: the same steps as the run that kept going
        _assert_same_steps(run["resumed_on"], run["kept_on"], f"{tag} resumed")
    ours, theirs = runs["shardweave"], runs["torch"]
    tag = f"rank {rank} shardweave vs torch"
    # The distributed save of the tied model: ours as an unsharded model's (see
    # _save_distributed); torch's shards are views of whole-size tensors here.
    plain = _plain_tied_save(Path(root) / "plain-tied")
    assert (ours["dcp_save"], theirs["dcp_save"], plain) == (
        TIED_SHARE_MEMORY,
        "saved",
        TIED_SHARE_MEMORY,
    ), (tag, ours["dcp_save"], theirs["dcp_save"], plain)
    assert_same_tensors(ours["files"], theirs["files"], f"{tag} model.safetensors")
    for key in ("kept_on", "reloaded_on", "resumed_on"):
        _assert_same_steps(ours[key], theirs[key], f"{tag} {key}")
    return {key: ours[key]["losses"] for key in ("kept_on", "reloaded_on", "resumed_on")}


def test_save_and_reload(world2: WorkerPool, tmp_path: Path) -> None:
    """Oracles: compatibility (torch's fully_shard: the saved files and every later step
    bitwise) and the run itself (reloaded weights are the saved ones, a DCP resume continues
    bitwise)."""
    world2.run(checkpoint_round_trip, str(tmp_path), timeout=180)
