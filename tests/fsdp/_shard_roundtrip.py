"""The shard round-trip property, shared by the world_2 and world_4 tests (``run_roundtrip``).

Property: shard -> unshard -> reshard and state-dict round trips are exact for any shape,
shard dim and dtype.

Hypothesis runs *inside* one spawned body per world size. Every rank draws the same examples
(``derandomize=True``, no database, no shrinking, health checks off so no rank stops early),
and the ranks all-gather each drawn example before touching a collective, so a divergence is
reported instead of hanging. Local checks are collected rather than raised, then all-gathered,
so every rank fails on the same example and the ranks never leave lockstep.

Oracles: *closed form* (``torch.chunk`` semantics padded to the world size with empty chunks:
this rank's chunk is its local shard, chunk 0's size is the padded size; unshard returns the
original tensor bitwise) and *compatibility* (torch's ``fully_shard`` on the same parameter
gives the same local shard, bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardweave.fsdp import fully_shard
from tests._dist import WorkerPool

DTYPES: Final = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_BITS: Final = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
MAX_EXAMPLES: Final = 25


@dataclass(frozen=True)
class Example:
    shape: tuple[int, ...]
    dim: int  # the shard dim, normalized
    how: str  # "default" (no shard_placement_fn), "positive" Shard(dim) or "negative" Shard(dim - ndim)
    dtype: torch.dtype
    seed: int
    async_op: bool

    def tensor(self, salt: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + salt)
        wide = torch.float64 if self.dtype == torch.float64 else torch.float32
        return torch.randn(self.shape, generator=g, dtype=wide).to(self.dtype)

    def placement_fn(self) -> Any:
        if self.how == "default":
            return None
        d = self.dim if self.how == "positive" else self.dim - len(self.shape)
        return lambda param: Shard(d)


@st.composite
def examples(draw: st.DrawFn, world: int) -> Example:
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = []
    for i in range(ndim):
        if i == dim and dim > 0:
            # a non-zero shard dim must split evenly (torch's rule)
            shape.append(world * draw(st.integers(1, 3)))
        elif dim > 0:
            # Zero-numel parameters sharded on a dim > 0 are left out: torch's unshard rejects
            # them ("Shard(1) requires even sharding"), and so does ours (less clearly).
            shape.append(draw(st.integers(1, 2 * world + 1)))
        else:
            # sizes below the world size leave some ranks with empty shards; 0 is allowed
            shape.append(draw(st.integers(0, 2 * world + 1)))
    how = draw(
        st.sampled_from(
            ("default", "positive", "negative") if dim == 0 else ("positive", "negative")
        )
    )
    return Example(
        tuple(shape),
        dim,
        how,
        draw(st.sampled_from(DTYPES)),
        draw(st.integers(0, 2**31 - 1)),
        draw(st.booleans()),
    )


def expected_chunks(full: torch.Tensor, world: int, dim: int) -> list[torch.Tensor]:
    """``torch.chunk`` padded with empty chunks to ``world`` entries (FSDP2's layout)."""
    chunks = list(torch.chunk(full, world, dim))
    empty_size = list(full.shape)
    empty_size[dim] = 0
    while len(chunks) < world:
        chunks.append(full.new_empty(empty_size))
    return chunks


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS[a.dtype]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


class Holder(nn.Module):
    def __init__(self, p: torch.Tensor) -> None:
        super().__init__()
        self.p = nn.Parameter(p)


def _full_tensor_supported(ex: Example) -> bool:
    # DTensor's own redistribute (torch 2.13) rejects a zero-numel tensor whose shard dim is
    # non-empty (e.g. (4, 0) on dim 0); torch's fully_shard state dict fails there the same way.
    return not (0 in ex.shape and ex.shape[ex.dim] > 0)


def check_example(ex: Example, rank: int, world: int, mesh: DeviceMesh) -> list[str]:
    """Run the round trips; every rank issues the same collectives. Returns what went wrong."""
    problems: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    full = ex.tensor()
    chunks = expected_chunks(full, world, ex.dim)
    model = Holder(full.clone())
    fully_shard(model, mesh=mesh, shard_placement_fn=ex.placement_fn())
    ref = Holder(full.clone())
    torch_fully_shard(ref, mesh=mesh, shard_placement_fn=ex.placement_fn())

    # sharded: this rank's chunk, unpadded, with the original global shape
    p = model.p
    expect(isinstance(p, DTensor), f"sharded param is {type(p).__name__}, not DTensor")
    expect(tuple(p.placements) == (Shard(ex.dim),), f"placements {p.placements}")
    expect(p.shape == full.shape, f"global shape {tuple(p.shape)}")
    local = p.to_local()
    expect(same_bits(local, chunks[rank]), f"local shard {tuple(local.shape)} != chunk {rank}")
    expect(same_bits(local, ref.p.to_local()), "local shard differs from torch's")
    fsdp_param = model._get_fsdp_state()._fsdp_param_groups[0].fsdp_params[0]  # type: ignore[operator]
    expect(
        fsdp_param.padded_sharded_size == chunks[0].size(),
        f"padded size {tuple(fsdp_param.padded_sharded_size)} != chunk 0 {tuple(chunks[0].shape)}",
    )

    # unshard: the full tensor, bitwise, as a plain parameter
    if ex.async_op:
        handle = model.unshard(async_op=True)  # type: ignore[operator]
        handle.wait()
    else:
        model.unshard()  # type: ignore[operator]
    expect(not isinstance(model.p, DTensor), "unsharded param is still a DTensor")
    expect(same_bits(model.p.detach(), full), "unsharded param != original")

    # reshard: the same shard again
    model.reshard()  # type: ignore[operator]
    expect(isinstance(model.p, DTensor), "resharded param is not a DTensor")
    expect(same_bits(model.p.to_local(), chunks[rank]), "local shard changed by the round trip")

    if _full_tensor_supported(ex):
        # state dict: full_tensor() rebuilds the original; loading new values reshards them
        state = model.state_dict()
        expect(same_bits(state["p"].full_tensor(), full), "state_dict full_tensor != original")
        new = ex.tensor(salt=1)
        model.load_state_dict({"p": distribute_tensor(new, mesh, [Shard(ex.dim)])})
        new_chunk = expected_chunks(new, world, ex.dim)[rank]
        expect(same_bits(model.p.to_local(), new_chunk), "loaded shard != chunk of new values")
        model.unshard()  # type: ignore[operator]
        expect(same_bits(model.p.detach(), new), "unshard after load != loaded values")
        model.reshard()  # type: ignore[operator]
    return problems


def _gather(obj: object, world: int) -> list[object]:
    out: list[object] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def roundtrip(rank: int, world: int, max_examples: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    seen: list[str] = []

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        # no shrinking: a failure is reported as drawn, the same on every rank
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(examples(world))
    @example(Example((1,), 0, "default", torch.float32, 1, False))  # ranks > 0 hold nothing
    @example(Example((0, 3), 0, "positive", torch.bfloat16, 2, True))  # no elements at all
    @example(Example((3, 2 * world), 1, "negative", torch.float16, 3, False))
    def check(ex: Example) -> None:
        drawn = _gather(repr(ex), world)
        if len(set(drawn)) != 1:  # every rank sees the same list, so every rank raises
            raise AssertionError(f"ranks drew different examples: {drawn}")
        problems = check_example(ex, rank, world, mesh)
        report = [f"rank {r}: {p}" for r, ps in enumerate(_gather(problems, world)) for p in ps]  # type: ignore[attr-defined]
        assert not report, f"{ex}:\n" + "\n".join(report)
        seen.append(repr(ex))

    check()
    return seen


def run_roundtrip(pool: WorkerPool) -> None:
    runs = pool.run(roundtrip, MAX_EXAMPLES, timeout=110)
    assert all(r == runs[0] for r in runs), "ranks ran different example sequences"
    assert len(runs[0]) >= MAX_EXAMPLES, f"only {len(runs[0])} examples ran"  # type: ignore[arg-type]
