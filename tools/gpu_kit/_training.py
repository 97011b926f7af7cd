"""The model, the two engines and the training loop every comparing section runs (parity,
delayed, mutants, csan, bench), and the bitwise comparison of two runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_model(dim: int, blocks: int, device: Any, seed: int = 0) -> Any:
    """Residual MLP blocks (LayerNorm, up, GELU, down) and an output layer, seeded: the same
    weights for every engine and every rank."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.out = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    torch.manual_seed(seed)
    return Net().to(device)


# Each case as a scenario of the tests' vocabulary (tests/fsdp/_stream_order.py), so the
# ``mutants`` section can run the tests' own mutation scenarios through the same code.
CASES: dict[str, dict[str, Any]] = {
    "fsdp": {},
    "cpu_batch": {},
    "bf16": {"mp": True},
    "offload": {"offload": True},
    "offload_hooks": {"offload": True},
    "replicate": {"replicate": True},
    "replicate_bf16_reduce": {"replicate": True, "mp": True, "reduce_dtype": "bfloat16"},
    "hsdp_1x1": {"hsdp": True},
    "hsdp_2x2": {"hsdp": True},
    "hsdp_2x2_bf16_reduce": {"hsdp": True, "mp": True, "reduce_dtype": "bfloat16"},
}


def apply_engine(engine: str, model: Any, case: str | dict[str, Any], device_type: str) -> None:
    """Shard ``model`` per block and at the root with ``engine`` ("torch" or "shardweave"),
    as ``case`` (a name of ``CASES`` or a scenario dict) says."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    cfg = CASES[case] if isinstance(case, str) else case
    if engine == "torch":
        from torch.distributed.fsdp import (  # noqa: TID251 (the oracle)
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )
    else:
        from shardweave.fsdp import (  # type: ignore[assignment]
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )
    kwargs: dict[str, Any] = {}
    if cfg.get("mp"):
        reduce_dtype = cfg.get("reduce_dtype", torch.float32)
        if isinstance(reduce_dtype, str):
            reduce_dtype = getattr(torch, reduce_dtype)
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype
        )
    if cfg.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    if cfg.get("hsdp"):
        import torch.distributed as dist

        world = dist.get_world_size()
        shape = (1, 1) if world == 1 else (2, world // 2)
        kwargs["mesh"] = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    if cfg.get("replicate"):
        if engine == "torch":
            from torch.distributed._composable.replicate_with_fsdp import (  # noqa: TID251
                replicate,
            )
        else:
            from shardweave.replicate import replicate  # type: ignore[assignment]
        for block in model.blocks:
            replicate(block, **kwargs)
        replicate(model, **kwargs)
        return
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def optimizers(model: Any, case: str) -> list[Any]:
    """AdamW over the model; with ``offload_hooks``, one per parameter stepped from its
    post-accumulate-grad hook (optimizer in backward), as users of CPU offload do."""
    import torch

    if case != "offload_hooks":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)]
    opts = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}

    def step(param: Any) -> None:
        opts[param].step()
        opts[param].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    return []


def train(
    model: Any,
    case: str,
    device: Any,
    steps: int,
    rank: int = 0,
    before_optimizer: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Losses and final local shards (params and grads), as plain Python for comparison.

    The losses are read after the last step: a ``.item()`` per step would make the host wait
    for the compute stream each step and hide what a host running ahead exposes.
    ``before_optimizer`` runs just before each optimizer step (the consumer-side delays).
    """
    import torch
    from torch.distributed.tensor import DTensor

    opts = optimizers(model, case)
    loss_tensors: list[Any] = []
    dim = model.out.in_features
    for step in range(steps):
        if case != "cpu_batch" and device.type == "cuda":
            # Drawn on the device: a copy from host memory (pageable, or pinned memory newly
            # allocated) makes the host wait for the stream, i.e. for the last step's
            # optimizer, which would hide an all-gather that does not wait for it.
            gen = torch.Generator(device).manual_seed(1000 * step + rank)
            x = torch.randn(4, 8, dim, generator=gen, device=device)
        else:
            x = torch.randn(4, 8, dim, generator=torch.Generator().manual_seed(1000 * step + rank))
            x = x if case == "cpu_batch" else x.to(device)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        loss_tensors.append(loss.detach())
        if before_optimizer is not None and opts:
            before_optimizer()
        for opt in opts:
            opt.step()
            if step < steps - 1:
                opt.zero_grad(set_to_none=True)
    losses = [loss.item() for loss in loss_tensors]
    params = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        grad = p.grad
        grad_local = grad.to_local() if isinstance(grad, DTensor) else grad
        params.append(
            (name, local.detach().cpu(), None if grad_local is None else grad_local.cpu())
        )
    state: list[Any] = []
    if case == "offload_hooks":
        state = sorted((k, v.cpu()) for k, v in full_state_dict(model).items())
    return {"losses": losses, "params": params, "state": state}


def full_state_dict(model: Any) -> dict[str, Any]:
    """The full state dict on CPU: torch's helper for torch's engine, ours for ours."""
    from shardweave.fsdp import FSDPModule, get_full_state_dict

    if isinstance(model, FSDPModule):  # ours (torch's modules are not instances of ours)
        return get_full_state_dict(model, cpu_offload=True)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    import torch

    mismatched: list[str] = []
    max_diff = 0.0
    for (name, p, g), (_, q, h) in zip(ours["params"], theirs["params"], strict=True):
        for what, a, b in (("param", p, q), ("grad", g, h)):
            if a is None or b is None:
                if (a is None) != (b is None):
                    mismatched.append(f"{name} {what}: one side has none")
                continue
            if not torch.equal(a, b):
                mismatched.append(f"{name} {what}")
                max_diff = max(max_diff, (a.double() - b.double()).abs().max().item())
    for (name, a), (other, b) in zip(ours["state"], theirs["state"], strict=True):
        if name != other or not torch.equal(a, b):
            mismatched.append(f"full state dict {name}")
    same_losses = ours["losses"] == theirs["losses"]
    return {
        "bitwise": same_losses and not mismatched,
        "losses": {"shardweave": ours["losses"], "oracle": theirs["losses"]},
        "mismatched": mismatched[:10],
        "max_abs_diff": max_diff,
        "state_dict_entries": len(ours["state"]),
    }
