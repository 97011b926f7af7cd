"""``dp_mesh_dims``: FSDP on a full SPMD mesh whose parameters are already DTensors on it.

Oracles: *compatibility* (torch's ``fully_shard`` with the same ``dp_mesh_dims`` on an
identical copy: sharded placements and meshes, local shards and gradients bitwise, the same
exception types for misuse) and *reference* (an unsharded model on the global batch:
``full_tensor()`` of gradients and of parameters after an SGD step).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

try:  # the oracle: torch's own DataParallelMeshDims, which torch 2.11 and 2.12 do not have
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
except ImportError:
    pytest.skip(
        f"torch {torch.__version__} has no DataParallelMeshDims to compare with",
        allow_module_level=True,
    )
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from shardweave.fsdp import DataParallelMeshDims, fully_shard
from tests._dist import WorkerPool, assert_close

DIM = 8


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


Layout = dict[str, tuple[Placement, ...]]


def _tp_layout(n: int) -> Layout:
    """Column-parallel ``up``, row-parallel ``down`` on the last mesh dim; the other ``n - 1``
    dims are data parallel (Replicate)."""
    dp: tuple[Placement, ...] = (Replicate(),) * (n - 1)
    return {
        "up.weight": (*dp, Shard(0)),
        "up.bias": (*dp, Shard(0)),
        "down.weight": (*dp, Shard(1)),
        "down.bias": (*dp, Replicate()),
    }


def _replicated_layout(n: int) -> Layout:
    return {name: (Replicate(),) * n for name in _tp_layout(n)}


_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # One mesh (and set of process groups) per layout per body, shared by its cases: the
    # worker destroys a body's process groups after it (tests/_dist/_worker.py).
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def _build(mesh: DeviceMesh, layout: Layout) -> nn.Module:
    torch.manual_seed(0)
    model = TwoLayer()
    for fqn, placements in layout.items():
        owner, name = fqn.split(".")
        module = model.get_submodule(owner)
        param = getattr(module, name)
        new = nn.Parameter(distribute_tensor(param.detach(), mesh, placements))
        # nn.Parameter detaches through DTensor's sharding-propagation cache, which may hand
        # back an equal mesh object built earlier in this worker; torch's fully_shard (the
        # oracle) insists on the very mesh object passed to it (see spmd_misuse).
        new._spec = DTensorSpec(mesh, placements, tensor_meta=new._spec.tensor_meta)  # type: ignore[attr-defined]
        setattr(module, name, new)
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _local_loss(out: torch.Tensor, batch_placements: tuple[Placement, ...]) -> torch.Tensor:
    # Each data-parallel rank's loss is the sum over its own rows, as in plain FSDP tests.
    assert isinstance(out, DTensor)
    return out.redistribute(placements=batch_placements).to_local().sum()


def _run_case(
    mesh: DeviceMesh,
    layout: Layout,
    dims: DataParallelMeshDims,
    tdims: TorchDims,
    batch_placements: tuple[Placement, ...],
    dp_ranks: int,
    dp_rank: int,
    expect: Callable[[dict[str, DTensor]], None],
) -> None:
    model, tmodel = _build(mesh, layout), _build(mesh, layout)
    for p in (*model.parameters(), *tmodel.parameters()):
        assert p.device_mesh is mesh  # type: ignore[attr-defined]
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    torch_fully_shard(tmodel, mesh=mesh, dp_mesh_dims=tdims)
    torch.manual_seed(0)
    ref = TwoLayer()
    ours = dict(model.named_parameters())
    expect(ours)  # type: ignore[arg-type]
    for (name, p), tp in zip(ours.items(), tmodel.parameters(), strict=True):
        assert isinstance(p, DTensor) and isinstance(tp, DTensor), name
        assert p.placements == tp.placements, (name, p.placements, tp.placements)
        assert p.device_mesh.mesh.tolist() == tp.device_mesh.mesh.tolist(), name
        assert p.device_mesh.mesh_dim_names == tp.device_mesh.mesh_dim_names, name
        assert torch.equal(p.to_local(), tp.to_local()), name
        assert torch.equal(p.full_tensor(), dict(ref.named_parameters())[name]), name
    for step in range(2):
        xs = [_batch(step, r) for r in range(dp_ranks)]
        losses = []
        for m in (model, tmodel):
            x = DTensor.from_local(xs[dp_rank], mesh, batch_placements)
            loss = _local_loss(m(x), batch_placements)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
        (sum(ref(x).sum() for x in xs) / dp_ranks).backward()  # type: ignore[union-attr]
        for (name, p), tp in zip(model.named_parameters(), tmodel.parameters(), strict=True):
            grad, tgrad = p.grad, tp.grad
            assert isinstance(grad, DTensor) and isinstance(tgrad, DTensor), name
            assert grad.placements == p.placements, (name, grad.placements)
            assert torch.equal(grad.to_local(), tgrad.to_local()), (step, name)
            assert_close(grad.full_tensor(), dict(ref.named_parameters())[name].grad, msg=name)  # type: ignore[arg-type]
        for m in (model, tmodel, ref):
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)  # type: ignore[operator]
            m.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            assert_close(p.full_tensor(), dict(ref.named_parameters())[name], msg=name)  # type: ignore[attr-defined]


def spmd_dp_tp(rank: int, world: int) -> None:
    """(dp=2, tp=2), shard="dp": TP-sharded params gain a DP Shard, strided on TP's dim."""
    mesh = _mesh((2, 2), ("dp", "tp"))

    def expect(params: dict[str, DTensor]) -> None:
        assert params["up.weight"].placements == (_StridedShard(0, split_factor=2), Shard(0))
        assert params["down.weight"].placements == (Shard(0), Shard(1))
        assert params["down.bias"].placements == (Shard(0), Replicate())
        assert params["up.weight"].device_mesh == mesh

    _run_case(
        mesh,
        _tp_layout(2),
        DataParallelMeshDims(shard="dp"),
        TorchDims(shard="dp"),
        (Shard(0), Replicate()),
        2,
        mesh.get_local_rank("dp"),
        expect,
    )


def spmd_3d(rank: int, world: int) -> None:
    """(dp_replicate=1, dp_shard=2, tp=2): HSDP + TP on one mesh, the issue's example layout."""
    mesh = _mesh((1, 2, 2), ("dp_replicate", "dp_shard", "tp"))

    def expect(params: dict[str, DTensor]) -> None:
        assert params["down.weight"].placements == (Replicate(), Shard(0), Shard(1))

    _run_case(
        mesh,
        _tp_layout(3),
        DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"),
        TorchDims(shard="dp_shard", replicate="dp_replicate"),
        (Shard(0), Shard(0), Replicate()),
        2,
        mesh.get_local_rank("dp_shard"),
        expect,
    )


def spmd_hsdp(rank: int, world: int) -> None:
    """(r=2, s=2) with replicate="r", shard="s": parameters (Replicate(), Shard(0))."""
    mesh = _mesh((2, 2), ("r", "s"))

    def expect(params: dict[str, DTensor]) -> None:
        assert all(p.placements == (Replicate(), Shard(0)) for p in params.values())

    _run_case(
        mesh,
        _replicated_layout(2),
        DataParallelMeshDims(shard="s", replicate="r"),
        TorchDims(shard="s", replicate="r"),
        (Shard(0), Shard(0)),
        4,
        rank,
        expect,
    )


def spmd_flattened(rank: int, world: int) -> None:
    """shard=("r", "s"): both dims act as one 4-way shard dim on a flattened mesh."""
    mesh = _mesh((2, 2), ("r", "s"))

    def expect(params: dict[str, DTensor]) -> None:
        for p in params.values():
            assert p.placements == (Shard(0),), p.placements
            assert p.device_mesh.mesh.tolist() == [0, 1, 2, 3]

    _run_case(
        mesh,
        _replicated_layout(2),
        DataParallelMeshDims(shard=("r", "s")),
        TorchDims(shard=("r", "s")),
        (Shard(0), Shard(0)),
        4,
        rank,
        expect,
    )


def spmd_replicate_only(rank: int, world: int) -> None:
    """replicate="dp" only: data parallelism without sharding, TP placements untouched."""
    mesh = _mesh((2, 2), ("dp", "tp"))

    def expect(params: dict[str, DTensor]) -> None:
        assert params["up.weight"].placements == (Replicate(), Shard(0))
        assert params["down.bias"].placements == (Replicate(), Replicate())

    _run_case(
        mesh,
        _tp_layout(2),
        DataParallelMeshDims(replicate="dp"),
        TorchDims(replicate="dp"),
        (Shard(0), Replicate()),
        2,
        mesh.get_local_rank("dp"),
        expect,
    )


CASES = {
    "dp_tp": spmd_dp_tp,
    "3d": spmd_3d,
    "hsdp": spmd_hsdp,
    "flattened": spmd_flattened,
    "replicate_only": spmd_replicate_only,
}


def spmd_cases(rank: int, world: int, names: list[str]) -> None:
    _MESHES.clear()
    for name in names:
        CASES[name](rank, world)


def test_spmd_mesh_training_matches_torch_and_reference(world4: WorkerPool) -> None:
    """Oracles: compatibility (torch's fully_shard with the same dp_mesh_dims: placements,
    meshes, local shards, losses and grads bitwise) and reference (full tensors)."""
    world4.run(spmd_cases, list(CASES))


def spmd_misuse(rank: int, world: int) -> None:
    _MESHES.clear()
    mesh = _mesh((2, 2), ("dp", "tp"))
    other = _mesh((2, 2), ("a", "b"))
    shard_dp: tuple[Placement, ...] = (Shard(0), Replicate())
    cases: list[tuple[str, Callable[[], nn.Module], dict[str, object], str]] = [
        ("plain tensor", TwoLayer, {}, "must be DTensors"),
        ("other mesh", lambda: _build(other, _tp_layout(2)), {}, "same"),
        (
            "sharded on dp",
            lambda: _build(mesh, {**_tp_layout(2), "down.bias": shard_dp}),
            {},
            "Expected Replicate\\(\\) on DP shard dim 'dp'",
        ),
        ("int reshard", lambda: _build(mesh, _tp_layout(2)), {"reshard_after_forward": 2}, "int"),
    ]
    for what, factory, extra, pattern in cases:
        errors: list[type[BaseException]] = []
        for api, dims in (
            (torch_fully_shard, TorchDims(shard="dp")),
            (fully_shard, DataParallelMeshDims(shard="dp")),
        ):
            with pytest.raises(Exception) as info:
                api(factory(), mesh=mesh, dp_mesh_dims=dims, **extra)  # type: ignore[operator]
            errors.append(info.type)
        assert errors[0] is errors[1], (what, errors)
        with pytest.raises(errors[1], match=pattern):
            fully_shard(
                factory(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"), **extra
            )  # type: ignore[arg-type]
    # Difference from torch (a fix): parameters built on an equal mesh from a second
    # init_device_mesh call are accepted. torch checks identity, and whether it raises then
    # depends on which of the equal mesh objects DTensor's caches hand back.
    twin = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert twin is not mesh and twin == mesh

    def on_twin() -> nn.Module:
        model = _build(mesh, _tp_layout(2))
        for module in (model.up, model.down):
            for name, p in list(module.named_parameters()):
                local = DTensor.from_local(p.to_local(), twin, p.placements)  # type: ignore[attr-defined]
                setattr(module, name, nn.Parameter(local))
        return model

    model = on_twin()
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    model(
        DTensor.from_local(_batch(0, rank), mesh, (Shard(0), Replicate()))
    ).to_local().sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    with pytest.raises(ValueError, match="shard_placement_fn"):
        fully_shard(
            _build(mesh, _tp_layout(2)),
            mesh=mesh,
            dp_mesh_dims=DataParallelMeshDims(replicate="dp"),
            shard_placement_fn=lambda p: Shard(0),
        )


def test_spmd_mesh_misuse_raises_like_torch(world4: WorkerPool) -> None:
    """Oracle: compatibility (torch raises the same exception types for the same misuse)."""
    world4.run(spmd_misuse)
