"""``llama``: a transformers ``LlamaForCausalLM`` at world 1, ours against torch's engine run
twice (the control), judged only where torch's engine agrees with itself."""

from __future__ import annotations

from typing import Any

from ._common import init_world1
from ._training import apply_engine, compare

# (tied embeddings, bf16 compute, CPU offload): every combination.
LLAMA_VARIANTS = tuple(
    f"{'tied' if tied else 'untied'}-{dtype}{'-offload' if offload else ''}"
    for tied in (True, False)
    for dtype in ("bf16", "fp32")
    for offload in (False, True)
)
# (hidden, layers, heads, kv heads, vocab, batch, sequence)
LLAMA_SIZES = {"cuda": (256, 4, 8, 4, 1024, 4, 128), "cpu": (32, 2, 4, 2, 64, 2, 8)}


def _llama(variant: str, engine: str, device_type: str) -> Any:
    """A small ``LlamaForCausalLM`` sharded per decoder layer and at the root by ``engine``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, vocab, _, seq = LLAMA_SIZES[device_type]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        tie_word_embeddings=variant.startswith("tied"),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device_type)
    cfg: dict[str, Any] = {"offload": variant.endswith("offload")}
    if "-bf16" in variant:
        cfg.update(mp=True)
    model.blocks = model.model.layers  # what ``apply_engine`` shards one by one
    apply_engine(engine, model, cfg, device_type)
    del model.blocks
    return model


def _train_llama(model: Any, device_type: str, steps: int = 3) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    _, _, _, _, vocab, batch, seq = LLAMA_SIZES[device_type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device_type)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        if step < steps - 1:
            opt.zero_grad(set_to_none=True)
    params = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        params.append((name, local.detach().cpu(), None if grad is None else grad.cpu()))
    return {"losses": [x.item() for x in losses], "params": params, "state": []}


def llama_verdict(
    torch_a: dict[str, Any], torch_b: dict[str, Any], ours: dict[str, Any]
) -> dict[str, Any]:
    """Ours against torch's engine, judged only where torch's engine agrees with itself (two
    runs, bitwise): elsewhere the variant is nondeterministic on this device and not judged."""
    control = compare(torch_b, torch_a)
    result = compare(ours, torch_a)
    result["torch_agrees_with_itself"] = control["bitwise"]
    result["judged"] = control["bitwise"]
    result["ok"] = result["bitwise"] or not control["bitwise"]
    return result


def section_llama(device_type: str) -> dict[str, Any]:
    """A transformers ``LlamaForCausalLM`` at world 1, each variant of ``LLAMA_VARIANTS``: torch's
    engine twice (the control) and ours once, on the same batches. Skipped without
    transformers."""
    import torch.distributed as dist

    try:
        import transformers
    except ModuleNotFoundError:
        return {"skipped": "transformers is not installed"}
    init_world1(device_type)
    results: dict[str, Any] = {"transformers": transformers.__version__}
    try:
        for variant in LLAMA_VARIANTS:
            runs = [
                _train_llama(_llama(variant, engine, device_type), device_type)
                for engine in ("torch", "torch", "shardweave")
            ]
            results[variant] = llama_verdict(*runs)
    finally:
        dist.destroy_process_group()
    results["ok"] = all(results[v]["ok"] for v in LLAMA_VARIANTS)
    results["differs"] = [v for v in LLAMA_VARIANTS if not results[v]["ok"]]
    results["not_judged"] = [v for v in LLAMA_VARIANTS if not results[v]["judged"]]
    return results
