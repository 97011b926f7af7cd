"""FSDPParam: one parameter's life between its sharded, post-forward and unsharded forms."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from shardweave.fsdp._fsdp_api import MixedPrecisionPolicy
from shardweave.fsdp._fsdp_common import (
    ShardedState,
    alloc_storage,
    chunk_with_empty,
    contiguous_strides,
    free_storage,
    own_storage,
)
from shardweave.fsdp._sharding_rules import (
    grad_made_in,
    padded_shard_size,
    resolve_dtypes,
    shard_size,
)
from shardweave.fsdp._torch_compat import has_grad_dtype_override
from shardweave.fsdp.core._param_handler import resolve_param_handler
from shardweave.fsdp.core._spmd_types import SpmdTypesHandler, as_storage_param
from shardweave.fsdp.core._subclass_gather import detect_subclass_all_gather
from shardweave.mesh import FSDPMeshInfo

if TYPE_CHECKING:
    from shardweave.mesh import DataParallelMeshInfo
    from shardweave.mesh.extension_points import ParamHandler

__all__ = ["FSDPParam", "ParamModuleInfo"]

# Identifies an original parameter across groups even after FSDP replaced it (a tied weight
# that two fully_shard calls both claim must be reported, not silently sharded twice).
_UID_ATTR = "_shardweave_param_uid"
_uids = itertools.count()


@dataclass
class ParamModuleInfo:
    """Where a parameter is registered: its first (module, name) plus every alias (tied weights)."""

    module: nn.Module
    param_name: str
    shared_modules: list[nn.Module] = field(default_factory=list)
    shared_param_names: list[str] = field(default_factory=list)


def _dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    # Not from_local: that is differentiable and re-checks metadata on every call. Not
    # DTensor(...) either, which runs DTensor.__init__ after __new__: it does nothing (Tensor's
    # __init__) but behind dynamo's disable and export's constructor marker, twice the cost of
    # building the tensor (this runs for every sharded gradient each step, in eager hooks).
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def _local_tensor(param: torch.Tensor) -> torch.Tensor:
    return cast(DTensor, param)._local_tensor


def _set_local_tensor(param: torch.Tensor, local: torch.Tensor) -> None:
    # The registered Parameter *is* the DTensor (nn.Parameter of a subclass keeps its type):
    # re-pointing its local tensor keeps the object users and optimizers hold.
    cast(DTensor, param)._local_tensor = local


def _setattr_on_module(module: nn.Module, name: str, param: nn.Parameter) -> None:
    # Writing _parameters directly skips nn.Module.__setattr__'s checks, which cost real time
    # with thousands of parameters; modules overriding __setattr__ keep it.
    if type(module).__setattr__ is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)


class _AllGatherStrategy(Protocol):
    """How one parameter travels through its group's all-gather and comes back unsharded."""

    is_extension: bool  # inputs of its own making (the group's one-op copy-in does not apply)

    def inputs(self, param: FSDPParam) -> list[torch.Tensor]: ...

    def alloc_outputs(self, param: FSDPParam) -> list[torch.Tensor]: ...

    def unsharded(self, param: FSDPParam, current: nn.Parameter | None) -> torch.Tensor | None:
        """A new unsharded tensor, or None when ``current`` stays (refilled or still valid)."""
        ...

    def free(self) -> None:
        """Release what only this strategy holds (at reshard)."""
        ...


class _FlatAllGather:
    """The default: the padded shard goes in, ``all_gather_output`` comes back, and the
    unsharded parameter is a view of it, rebuilt by the parameter's handler."""

    is_extension = False

    def inputs(self, param: FSDPParam) -> list[torch.Tensor]:
        return [param.all_gather_input()]

    def alloc_outputs(self, param: FSDPParam) -> list[torch.Tensor]:
        return [param.alloc_all_gather_output()]

    def unsharded(self, param: FSDPParam, current: nn.Parameter | None) -> torch.Tensor | None:
        # See Design note: storage resize (FSDPParam): the view stays valid across unshards.
        return param.unsharded_view() if current is None else None

    def free(self) -> None:
        pass  # all_gather_output belongs to FSDPParam, which frees it


_FLAT_ALL_GATHER: _AllGatherStrategy = _FlatAllGather()


class FSDPParam:
    """One parameter managed by a group.

    It owns the lifecycle; what differs between parameter kinds it asks of two objects, with
    no branch per kind here: its ``ParamHandler`` (see ``_param_handler``: plain tensors, a
    plugin's DTensor, a user's kind) and its all-gather strategy (flat, or a tensor
    subclass's own: see ``_subclass_gather``).

    Design note: storage resize
        The unsharded parameter is created once, as a view of its all-gather output buffer.
        Resharding frees that buffer's storage (resize to 0 bytes) and the next unshard
        re-allocates and refills it in place, so the parameter object, the autograd graph's
        references to it and any user reference stay valid across iterations.

        ``keep_unsharded_storage`` (``FSDPModule.set_keep_unsharded_storage``) skips the free:
        the storage stays allocated while sharded (or post-forward sharded), so every unshard
        refills the same bytes at the same address (what CUDA graph capture needs), at the
        cost of holding the unsharded parameters between uses. Only the copy-out writes that
        storage, on the compute stream, which already ran every earlier reader of it (forward
        and backward ops, the post-forward clone): no wait is added for it (see Design note:
        stream ordering, ``comm/_streams``, the kept unsharded storage row).

    Design note: tied after fully_shard
        A framework may tie a weight *after* sharding (transformers builds untied, shards, loads,
        then sets ``lm_head.weight = embed_tokens.weight``): the module of this parameter then
        holds another FSDPParam's sharded DTensor. At lazy init this parameter *adopts* it
        (``adopt_tied``): the owner keeps the one shard storage, this one reads it through the
        owner at every all-gather, never copies or re-points it, and adds its reduced gradient
        to the same ``.grad``. Both groups gather the current values, and the gradient is the
        sum of both uses, as in the unsharded model. (A copy would train one of the two on a
        stale shard; re-pointing the shared DTensor from both groups would leave whichever
        group re-pointed first gathering a buffer the optimizer no longer writes.)
    """

    orig_dtype: torch.dtype
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    # The sharded gradients' dtype: an explicit ``Parameter.grad_dtype`` (torch 2.15), else the
    # parameter's own dtype. ``has_grad_dtype_override`` says which; see ``_capture_grad_dtype``.
    sharded_grad_dtype: torch.dtype
    has_grad_dtype_override: bool
    sharded_param: nn.Parameter
    _unsharded_param: nn.Parameter | None
    all_gather_output: torch.Tensor  # 1D, every rank's padded shard, rank-major
    _sharded_param_data: torch.Tensor  # 1D, padded: this rank's shard plus zero padding
    _sharded_post_forward_data: torch.Tensor | None  # 1D, this rank's 1/k of the padded full
    _handler: ParamHandler  # what is particular to the parameter's kind (_param_handler)
    _template: object  # the handler's memo of the original parameter
    # The handler's reduce_grad may reduce the gradient over a non-data-parallel dim (a
    # tensor-parallel Partial): see set_unsharded_grad_dtype.
    may_reduce_grad_outside_dp: bool
    _all_gather: _AllGatherStrategy  # flat, or the tensor subclass's own (from lazy init)

    def __init__(
        self,
        param: nn.Parameter,
        module_info: ParamModuleInfo,
        mesh_info: DataParallelMeshInfo,
        post_forward_mesh_info: FSDPMeshInfo | None,
        device: torch.device,
        shard_placement: Shard | None,
        offload_to_cpu: bool,
        pin_memory: bool,
    ) -> None:
        self._module_info = module_info
        self.mesh_info = mesh_info
        self.post_forward_mesh_info = post_forward_mesh_info
        # A replicate-only (DDP) mesh shards over nothing: every rank holds the whole tensor.
        if isinstance(mesh_info, FSDPMeshInfo):
            self.shard_world_size, self.shard_rank = (
                mesh_info.shard_mesh_size,
                mesh_info.shard_mesh_rank,
            )
        else:
            self.shard_world_size, self.shard_rank = 1, 0
        self.device = device
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = pin_memory
        self.param_fqn = f"{type(module_info.module).__name__}.{module_info.param_name}"
        self.param_dtype = None
        self.reduce_dtype = None
        # The group's policy as it applies to this parameter (its param_dtype resolved through
        # param_dtype_override_fn, at fully_shard time); the group sets it after construction.
        self.mp_policy = MixedPrecisionPolicy()
        self._unsharded_param = None
        self._sharded_post_forward_data = None
        self._sharded_post_forward_param: nn.Parameter | None = None
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        self.sharded_state = ShardedState.SHARDED
        self._all_gather = _FLAT_ALL_GATHER
        self._aliases_shard = False  # see alias_sharded_storage
        self._storage_owner: FSDPParam | None = None  # see Design note: tied after fully_shard
        # See Design note: storage resize. torch's name; set per group by the module's setter.
        self.keep_unsharded_storage = False
        if not hasattr(param, _UID_ATTR):
            setattr(param, _UID_ATTR, next(_uids))
        self.orig_param_uid: int = getattr(param, _UID_ATTR)
        self._init_sharded_param(param, shard_placement)

    # --- construction -------------------------------------------------------------------------
    def _init_sharded_param(self, param: nn.Parameter, placement: Shard | None) -> None:
        # FSDP shards the handler's local tensor; the handler says how the result is placed
        # and rebuilt. A DTensor parameter without its plugin raises MissingExtensionError
        # naming the package to install (see Design note: handler resolution).
        # A plain parameter annotated by spmd_types (torch 2.14+, torchtitan's default backend)
        # is stored as the DTensor its annotation describes (see _spmd_types).
        self._spmd_types: SpmdTypesHandler | None = None
        converted = as_storage_param(param, self.mesh_info, self.param_fqn)
        if converted is not None:
            param, info = converted
        self._handler = resolve_param_handler(param, self.mesh_info, self.param_fqn)
        if converted is not None:
            self._handler = self._spmd_types = SpmdTypesHandler(self._handler, info)
        data = self._handler.local_tensor(param)
        self._template = self._handler.template(param, self.mesh_info)
        self.may_reduce_grad_outside_dp = self._handler.may_reduce_grad_outside_dp(self._template)
        shard_dim = self._checked_shard_dim(param, data, placement)
        world, rank = self.shard_world_size, self.shard_rank
        self.shard_dim = shard_dim
        self.fsdp_placement = Shard(shard_dim)
        self.orig_size = data.size()  # what is gathered: the TP-local size for a DTensor
        self.orig_dtype = param.dtype
        self.has_grad_dtype_override = False
        self.sharded_grad_dtype = param.dtype
        self._capture_grad_dtype(param)
        chunks = chunk_with_empty(data.detach(), world, shard_dim)
        # The sizes come from the rules the planner predicts with (_sharding_rules).
        self.sharded_size = shard_size(data.size(), world, rank, shard_dim)
        self.padded_sharded_size = padded_shard_size(data.size(), world, shard_dim)
        self.padded_sharded_numel = self.padded_sharded_size.numel()
        self._padded_strides = contiguous_strides(self.padded_sharded_size)  # see _local_view
        self.sharded_numel = self.sharded_size.numel()
        padded = data.new_zeros(self.padded_sharded_size, device=data.device)
        if chunks[rank].numel() > 0:
            padded.narrow(shard_dim, 0, chunks[rank].size(shard_dim)).copy_(chunks[rank])
        if self.offload_to_cpu and padded.device.type != "meta":
            padded = padded.cpu()
            if self.pin_memory:
                padded = padded.pin_memory()
        self._sharded_param_data = padded.view(-1)
        mesh, placements = self._handler.sharded_spec(param, self.mesh_info, shard_dim)
        self._sharding_spec = DTensorSpec(
            mesh,
            placements,
            tensor_meta=TensorMeta(param.size(), param.stride(), param.dtype),
        )
        sharded = nn.Parameter(
            _dtensor(self._local_view(padded.view(-1)), self._sharding_spec),
            requires_grad=param.requires_grad,
        )
        self.sharded_param = sharded
        self._apply_grad_dtype(sharded)
        self._setattr_on_modules(sharded)
        self._installed_local: torch.Tensor = _local_tensor(sharded)

    def _checked_shard_dim(
        self, param: nn.Parameter, data: torch.Tensor, placement: Shard | None
    ) -> int:
        """The dim of ``data`` (the handler's local tensor) to shard, once ``param`` is known to
        be one FSDP can shard there; else torch's error, naming the parameter and the remedy."""
        if param.ndim == 0:
            raise ValueError(
                f"fully_shard does not support 0-dim parameters: '{self.param_fqn}' has shape (). "
                f"Change {self._module_info.param_name} to a 1D tensor with numel equal to 1."
            )
        if param.device != self.device and param.device.type != "meta":
            raise AssertionError(
                f"fully_shard: expected '{self.param_fqn}' on {self.device} but it is on "
                f"{param.device}"
            )
        if not data.is_contiguous():
            # starts with torch 2.13's sentence, which users and torch's tests match on
            raise NotImplementedError(
                "FSDP does not support non-contiguous parameters yet: "
                f"param.shape={param.shape} param.stride()={param.stride()}; fully_shard "
                f"needs '{self.param_fqn}' contiguous (it is e.g. channels_last): call "
                "module.to(memory_format=torch.contiguous_format) first"
            )
        shard_dim = 0 if placement is None else placement.dim
        if shard_dim < 0:
            shard_dim += data.ndim
        if not 0 <= shard_dim < data.ndim:
            raise AssertionError(
                f"Shard dim {shard_dim} is invalid for {data.ndim}D tensor '{self.param_fqn}'"
            )
        world = self.shard_world_size
        if shard_dim > 0 and data.numel() == 0:
            raise NotImplementedError(
                f"fully_shard cannot shard the empty parameter '{self.param_fqn}' (shape "
                f"{tuple(data.shape)}) on dim {shard_dim}; shard it on dim 0 (the default)"
            )
        if shard_dim > 0 and data.size(shard_dim) % world != 0:
            raise NotImplementedError(
                f"fully_shard does not support uneven sharding on dim {shard_dim}: "
                f"'{self.param_fqn}' has size {data.size(shard_dim)} there and the shard group "
                f"has {world} ranks; shard on dim 0 or pick a dim divisible by {world}"
            )
        return shard_dim

    # --- an explicit grad_dtype (torch 2.15) ----------------------------------------------------
    def _capture_grad_dtype(self, param: torch.Tensor) -> None:
        """Adopt ``param.grad_dtype`` when it was set explicitly (torch 2.15's flag; never
        before). Only an explicit setting counts: a parameter rebuilt by ``.to()`` or
        ``load_state_dict(assign=True)`` has lost it, and keeps the one captured before."""
        if has_grad_dtype_override(param):
            if param.grad_dtype is None:
                raise NotImplementedError(
                    f"fully_shard: '{self.param_fqn}' has an explicit grad_dtype=None (torch "
                    "2.15: gradients kept in whatever dtype they are computed in), which "
                    "shardweave does not support yet; leave grad_dtype unset or set a dtype"
                )
            self.has_grad_dtype_override = True
            self.sharded_grad_dtype = param.grad_dtype

    def _apply_grad_dtype(self, sharded: nn.Parameter) -> None:
        """The sharded parameter accepts gradients of the explicit dtype (autograd checks a
        ``.grad``'s dtype against ``grad_dtype``)."""
        if self.has_grad_dtype_override and not has_grad_dtype_override(sharded):
            sharded.grad_dtype = self.sharded_grad_dtype

    def _local_view(self, padded_flat: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """This rank's unpadded shard as a view of a flat padded buffer (from element
        ``offset`` of ``padded_flat``, which may hold other parameters' shards around it).

        Runs for every gradient at every reduction: one ``as_strided`` (the strides of the
        padded shape, cut to this rank's size on the shard dim) costs a third of the
        ``narrow(...).view(padded_size).narrow(...)`` it equals. An empty or non-contiguous
        buffer takes that spelling, which also says what the fast one computes.
        """
        numel = self.padded_sharded_numel
        if numel > 0 and padded_flat.is_contiguous():
            return padded_flat.as_strided(
                self.sharded_size, self._padded_strides, padded_flat.storage_offset() + offset
            )
        padded = padded_flat.narrow(0, offset, numel).view(self.padded_sharded_size)
        return padded.narrow(self.shard_dim, 0, self.sharded_size[self.shard_dim])

    # --- dtypes -------------------------------------------------------------------------------
    def init_dtype_attrs(self, mp_policy: MixedPrecisionPolicy) -> None:
        """Resolve compute/reduce dtypes from the *current* sharded dtype (casts are allowed
        between ``fully_shard`` and the first forward)."""
        self.orig_dtype = self.sharded_param.dtype
        self._capture_grad_dtype(self.sharded_param)
        if not self.has_grad_dtype_override:
            self.sharded_grad_dtype = self.orig_dtype
        reduce = mp_policy.reduce_dtype
        if reduce is None and self.has_grad_dtype_override:
            reduce = self.sharded_grad_dtype  # torch 2.15: the gradient's own dtype policy
        self.param_dtype, self.reduce_dtype = resolve_dtypes(
            self.orig_dtype, mp_policy.param_dtype, reduce
        )

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    # --- sharded storage ----------------------------------------------------------------------
    @property
    def sharded_param_data(self) -> torch.Tensor:
        """1D, padded: this rank's shard plus zero padding (the owner's when tied)."""
        owner = self._storage_owner
        return self._sharded_param_data if owner is None else owner.sharded_param_data

    @property
    def storage_owner(self) -> FSDPParam | None:
        """The FSDPParam whose shard this one adopted (Design note: tied after fully_shard)."""
        return self._storage_owner

    def registered_param(self) -> torch.Tensor | None:
        """What the parameter's first module holds under its name now."""
        info = self._module_info
        return info.module._parameters.get(info.param_name)

    def adopt_tied(self, owner: FSDPParam) -> None:
        """Share ``owner``'s sharded parameter and storage (Design note: tied after
        fully_shard). The two must be sharded alike, or gathering one through the other would
        be wrong: anything else raises, naming both."""
        mine = (self.orig_size, self.shard_dim, self.offload_to_cpu, self.device)
        theirs = (owner.orig_size, owner.shard_dim, owner.offload_to_cpu, owner.device)
        spec, owner_spec = self._sharding_spec, owner._sharding_spec
        same_mesh = spec.mesh == owner_spec.mesh and spec.placements == owner_spec.placements
        if owner.storage_owner is not None:
            raise AssertionError(f"'{owner.param_fqn}' shares another parameter's storage")
        if mine != theirs or not same_mesh:
            raise ValueError(
                f"fully_shard: '{self.param_fqn}' was tied to '{owner.param_fqn}' after "
                f"fully_shard, but the two are sharded differently ((size, shard dim, offload, "
                f"device) {mine} vs {theirs}, or another mesh); tie them before fully_shard and "
                "pass both modules to one call: fully_shard([module_a, module_b])"
            )
        self._drop_alias()
        self._storage_owner = owner
        self._follow_owner()

    def _follow_owner(self) -> None:
        # What the owner's module holds now, which the owner adopts at its own lazy init
        # (its ``sharded_param`` may still be the one a load replaced).
        owner = self._storage_owner
        assert owner is not None
        shared = owner.registered_param()
        assert isinstance(shared, DTensor) and isinstance(shared, nn.Parameter)
        self.sharded_param = shared
        self._sharding_spec = shared._spec
        self._setattr_on_modules(shared)

    def _install_local(self, local: torch.Tensor) -> None:
        """Make ``local`` the sharded parameter's local tensor, remembering it: for a wrapper
        subclass (no storage to compare) identity is how ``reset_sharded_param`` tells it
        unchanged."""
        _set_local_tensor(self.sharded_param, local)
        self._installed_local = local

    def reset_sharded_param(self) -> bool:
        """Adopt what is registered on the module now (after ``to_empty``, ``.to(dtype)``,
        ``load_state_dict(assign=True)``); returns True if the shard moved to new storage."""
        registered = self.registered_param()
        owner = self._storage_owner
        if owner is not None:
            if registered is owner.registered_param():
                self._follow_owner()
                return False  # the owner adopts any change to the shared storage
            # Untied again: this parameter gets storage of its own below (a copy, never a
            # view of the owner's).
            self._storage_owner = None
            self._sharded_param_data = owner.sharded_param_data.new_empty(0)
        if not isinstance(registered, DTensor) or not isinstance(registered, nn.Parameter):
            raise AssertionError(
                f"fully_shard: '{self.param_fqn}' was replaced by a plain tensor; load sharded "
                "values as DTensors (distribute_tensor or torch.distributed.checkpoint)"
            )
        self._capture_grad_dtype(self.sharded_param)
        if registered is not self.sharded_param:
            self._capture_grad_dtype(registered)
            self.sharded_param = registered
            self._apply_grad_dtype(registered)
            self._setattr_on_modules(registered)
        if not self.has_grad_dtype_override:
            # A dtype conversion (model.double()) after the first forward: the gradients
            # follow the parameter's new dtype, as in torch 2.15 (see FSDPParamGroup
            # .reset_sharded_params).
            self.sharded_grad_dtype = self.sharded_param.dtype
        local = _local_tensor(self.sharded_param)
        self._sharding_spec = cast(DTensor, self.sharded_param)._spec
        current = self._sharded_param_data
        if (
            type(local) is not torch.Tensor
            and local is self._installed_local
            and local.device.type != "meta"
        ):
            # A wrapper subclass has no storage of its own to compare; unchanged means the
            # very local tensor this class installed last.
            return False
        if (
            type(local) is torch.Tensor
            and local.device == current.device
            and local.dtype == current.dtype
            and local.untyped_storage().data_ptr() == current.untyped_storage().data_ptr()
            and local.storage_offset() == current.storage_offset()
            and local.device.type != "meta"
        ):
            return False  # already a view of our padded shard
        if local.size() != self.sharded_size:
            raise AssertionError(
                f"fully_shard: '{self.param_fqn}' local shard has size {tuple(local.size())}, "
                f"expected {tuple(self.sharded_size)}"
            )
        padded = local.new_zeros(self.padded_sharded_size)
        if local.numel() > 0:
            padded.narrow(self.shard_dim, 0, local.size(self.shard_dim)).copy_(local)
        if self.offload_to_cpu and padded.device.type != "meta":
            padded = padded.cpu()
            if self.pin_memory and not padded.is_pinned():
                padded = padded.pin_memory()
        self._sharded_param_data = padded.view(-1)
        self._drop_alias()
        self._install_local(self._local_view(self._sharded_param_data))
        self.orig_dtype = self.sharded_param.dtype
        return True

    # --- all-gather ---------------------------------------------------------------------------
    def detect_extension(self, mp_policy: MixedPrecisionPolicy, renew: bool = False) -> None:
        """Pick the all-gather: the sharded local tensor's own (torch's fsdp_pre/post_all_gather
        protocol, or the ``all_gather`` part of its class's ``PARAM_KINDS`` kind), else the flat
        one. Called at lazy init, so hooks patched on after ``to_empty`` count; ``renew``: again
        for a shard given new storage after it (an assign-load), dropping what the previous
        all-gather built (the next unshard builds the unsharded parameter anew)."""
        if renew:
            self._all_gather.free()
            self._unsharded_param = None
        info = self.post_forward_mesh_info
        found = detect_subclass_all_gather(
            self,
            self.sharded_local_tensor(),
            mp_policy,
            int_reshard=info is not None and info != self.mesh_info,
        )
        self._all_gather = found or _FLAT_ALL_GATHER

    @property
    def gathers_padded_shard(self) -> bool:
        """Whether this parameter's all-gather input is its own padded shard (cast at most),
        so a group may copy such shards into its all-gather input in one op, casting as it
        copies; a parameter whose all-gather its kind provides makes its own inputs."""
        return not self._all_gather.is_extension

    def gathers_rows_of_shard_dim(self, post_forward: bool) -> bool:
        """Whether the gathered rows of this parameter are chunks along a dim other than 0,
        to be concatenated along ``shard_dim`` into the unsharded layout after the copy-out (a
        kind's own all-gather lays out its outputs itself; the post-forward shard is flat)."""
        return self.shard_dim != 0 and not post_forward and not self._all_gather.is_extension

    @property
    def module(self) -> nn.Module:
        """The module the parameter is first registered on."""
        return self._module_info.module

    def sharded_local_tensor(self) -> torch.Tensor:
        """This rank's shard, as registered (the sharded DTensor's local tensor)."""
        return _local_tensor(self.sharded_param)

    def shard_mesh(self) -> DeviceMesh:
        """The 1D mesh this parameter is sharded over."""
        mesh = self.mesh_info.mesh
        if mesh.ndim == 1 or self.mesh_info.shard_mesh_dim is None:
            return mesh
        names = mesh.mesh_dim_names
        assert names is not None
        return mesh[names[self.mesh_info.shard_mesh_dim]]

    def all_gather_inputs(self) -> list[torch.Tensor]:
        """This rank's 1D contributions to the group's all-gather (usually one)."""
        return self._all_gather.inputs(self)

    def alloc_all_gather_outputs(self) -> list[torch.Tensor]:
        """The 1D output buffers, one per all-gather input, storage allocated."""
        return self._all_gather.alloc_outputs(self)

    def all_gather_source(self) -> torch.Tensor:
        """What this rank contributes to the group's all-gather, as it is stored (1D, padded;
        not cast, not moved to the device): the post-forward shard, else the sharded one."""
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            assert self._sharded_post_forward_data is not None
            return self._sharded_post_forward_data
        return self.sharded_param_data

    def all_gather_input(self) -> torch.Tensor:
        """This rank's 1D contribution to the group's all-gather (cast/moved as needed)."""
        data = self.all_gather_source()
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            return data
        if data.device != self.device:
            data = data.to(self.device, non_blocking=True)
        if self.param_dtype is not None and data.dtype != self.param_dtype:
            data = data.to(self.param_dtype)
        return data

    def _drop_alias(self) -> None:
        if self._aliases_shard:
            self._aliases_shard = False
            del self.all_gather_output
            self._unsharded_param = None

    def alias_sharded_storage(self) -> None:
        """With one rank per shard the shard *is* the full parameter: let the unsharded
        parameter view the sharded storage instead of a gathered copy (no all-gather, no
        copy, nothing to free at reshard). Idempotent; redone after the storage moves."""
        data = self._sharded_param_data
        current = getattr(self, "all_gather_output", None)
        if self._aliases_shard and current is data:
            return
        self.all_gather_output = data
        self._aliases_shard = True
        self._unsharded_param = None  # rebuilt over the (new) storage at init_unsharded_param

    def alloc_all_gather_output(self) -> torch.Tensor:
        """The 1D output buffer (padded full parameter), storage allocated."""
        if self._aliases_shard:
            return self.all_gather_output
        out: torch.Tensor | None = getattr(self, "all_gather_output", None)
        dtype = self.param_dtype or self.orig_dtype  # unsharded_dtype, without the property
        if out is None:
            out = self.all_gather_output = torch.empty(
                self.shard_world_size * self.padded_sharded_numel, dtype=dtype, device=self.device
            )
        elif out.dtype != dtype:
            # The dtype changed since the last unshard (a cast before the first forward).
            out = self.all_gather_output = torch.empty_like(out, dtype=dtype)
            self._unsharded_param = None
        else:
            alloc_storage(out)
        return out

    def init_unsharded_param(self) -> None:
        """Create the unsharded parameter once; later unshards refill its storage in place."""
        unsharded = self._all_gather.unsharded(self, self._unsharded_param)
        if unsharded is not None:
            self._unsharded_param = nn.Parameter(
                unsharded, requires_grad=self.sharded_param.requires_grad
            )

    def unsharded_view(self) -> torch.Tensor:
        """The unsharded parameter over ``all_gather_output``, as the handler rebuilds it."""
        out = self.all_gather_output  # the padded shard itself when aliasing
        unsharded = out.as_strided(
            self.orig_size, contiguous_strides(self.orig_size), out.storage_offset()
        )
        return self._handler.unsharded(self._template, unsharded)

    def restore_spmd_types(self) -> None:
        """An annotated parameter's ``spmd_types`` annotation back on its unsharded parameter
        (only while type checking is on; see _spmd_types)."""
        if self._spmd_types is not None and self._unsharded_param is not None:
            self._spmd_types.restore(self._unsharded_param)

    @property
    def unsharded_param(self) -> nn.Parameter:
        if self._unsharded_param is None:
            raise AssertionError(f"'{self.param_fqn}' has not been unsharded yet")
        return self._unsharded_param

    @property
    def has_unsharded_param(self) -> bool:
        return self._unsharded_param is not None

    # --- state transitions --------------------------------------------------------------------
    # to_unsharded and to_sharded run for every parameter at every unshard and reshard: they
    # write only what changes.
    def to_unsharded(self) -> None:
        param = self.unsharded_param
        requires_grad = self.sharded_param.requires_grad
        if param.requires_grad != requires_grad:
            param.requires_grad_(requires_grad)
        self._setattr_on_modules(param)
        self._free_post_forward_data()
        self.sharded_state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        self._setattr_on_modules(self.sharded_param)
        self._free_post_forward_data()
        if not self.keep_unsharded_storage:  # see Design note: storage resize
            if not self._aliases_shard:
                out: torch.Tensor | None = getattr(self, "all_gather_output", None)
                if out is not None:
                    free_storage(out)
            self._all_gather.free()
        self.sharded_state = ShardedState.SHARDED

    def to_sharded_post_forward(self) -> None:
        """Keep only this rank's 1/k of the padded full parameter (int reshard_after_forward)."""
        info = self.post_forward_mesh_info
        if info is None:
            raise AssertionError("to_sharded_post_forward needs a post-forward mesh")
        if self.sharded_state != ShardedState.UNSHARDED:
            raise AssertionError(f"expected UNSHARDED, got {self.sharded_state}")
        if isinstance(self.unsharded_param, DTensor):
            # The post-forward shard is a slice placed on the post-forward mesh; an unsharded
            # parameter that is itself a DTensor would need its own placements there too.
            raise NotImplementedError(
                f"an int reshard_after_forward is not supported for DTensor parameter "
                f"'{self.param_fqn}' (tensor parallel); pass True or False"
            )
        if self._all_gather.is_extension:
            # The post-forward shard is a slice of the flat all-gather output, which an
            # fsdp_pre/post_all_gather parameter does not have (torch does not support it
            # either); raised here, in forward, on every rank alike.
            raise NotImplementedError(
                f"'{self.param_fqn}': fsdp_pre_all_gather extensions are not supported with "
                "an int reshard_after_forward; pass True or False"
            )
        numel = self.all_gather_output.numel() // info.shard_mesh_size
        self._sharded_post_forward_data = self.all_gather_output.narrow(
            0, numel * info.shard_mesh_rank, numel
        ).clone()
        placements = (Replicate(), Shard(0))
        spec = DTensorSpec(
            info.mesh,
            placements,
            tensor_meta=TensorMeta(
                self.orig_size, contiguous_strides(self.orig_size), self.unsharded_dtype
            ),
        )
        local = self._sharded_post_forward_local()
        self._sharded_post_forward_param = nn.Parameter(
            _dtensor(local, spec), requires_grad=self.sharded_param.requires_grad
        )
        self._setattr_on_modules(self._sharded_post_forward_param)
        if not self.keep_unsharded_storage:  # see Design note: storage resize
            free_storage(self.all_gather_output)
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def _sharded_post_forward_local(self) -> torch.Tensor:
        # Rows of the padded full parameter this rank keeps, clipped to the real size so the
        # registered DTensor's metadata is valid (padding rows are kept in the flat buffer).
        info = self.post_forward_mesh_info
        assert info is not None and self._sharded_post_forward_data is not None
        row = self.orig_size[1:].numel() if len(self.orig_size) > 1 else 1
        rows_each = self._sharded_post_forward_data.numel() // max(row, 1)
        start = rows_each * info.shard_mesh_rank
        keep = max(0, min(rows_each, self.orig_size[0] - start))
        return self._sharded_post_forward_data.narrow(0, 0, keep * row).view(
            keep, *self.orig_size[1:]
        )

    def _free_post_forward_data(self) -> None:
        self._sharded_post_forward_data = None
        self._sharded_post_forward_param = None

    def _setattr_on_modules(self, param: nn.Parameter) -> None:
        # Runs for every parameter at every unshard and reshard: the common case (one module,
        # no tied aliases) builds no tuple and no zip.
        info = self._module_info
        _setattr_on_module(info.module, info.param_name, param)
        if info.shared_modules:
            for module, name in zip(info.shared_modules, info.shared_param_names, strict=True):
                _setattr_on_module(module, name, param)

    # --- gradients ----------------------------------------------------------------------------
    def accumulate_unsharded_grad_if_needed(self) -> None:
        """Fold a new unsharded grad into the reduce-dtype accumulator (no-sync microbatches)."""
        if (
            self.unsharded_accumulated_grad is not None
            and self._unsharded_param is not None
            and self._unsharded_param.grad is not None
        ):
            self.unsharded_accumulated_grad += self._unsharded_param.grad
            self._unsharded_param.grad = None

    def set_unsharded_grad_dtype(self, sync: bool) -> None:
        """torch 2.15 (``REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE``): the dtype autograd makes this
        parameter's unsharded gradient in, set at every backward's start (pre-backward) as
        torch 2.15 sets it.

        The target is the dtype the gradient is reduced or kept in: the policy's
        ``reduce_dtype``, else an explicit ``grad_dtype``, else the original dtype. Where it
        is wider than the compute dtype, a backward with sync, or onto an accumulated
        gradient, leaves the gradient in the compute dtype (the copy-in or the accumulation
        casts it); only a first gradient without sync is made wide, so that the uses of a
        parameter used twice (tied) are summed there. Otherwise every gradient is made in the
        target: the same dtype, a narrower one (microbatches then accumulate in it), or a
        gradient that a tensor-parallel reduction sums first (``may_reduce_grad_outside_dp``:
        that all-reduce runs in the target too)."""
        param = self._unsharded_param
        if param is None or not param.requires_grad:
            return
        compute = self.unsharded_dtype
        if not (self.orig_dtype.is_floating_point and compute.is_floating_point):
            return
        explicit = self.sharded_grad_dtype if self.has_grad_dtype_override else None
        accumulated = param.grad is not None or self.unsharded_accumulated_grad is not None
        widen = self.may_reduce_grad_outside_dp or not (sync or accumulated)
        made = grad_made_in(
            self.orig_dtype, compute, self.mp_policy.reduce_dtype, explicit, widen=widen
        )
        # None, not the compute dtype, where a wider target is deferred: autograd then adds
        # the gradient onto a wider accumulated one as it is, as torch 2.15 leaves it.
        target = self.mp_policy.reduce_dtype or explicit or self.orig_dtype
        param.grad_dtype = made if made == target else None

    def to_accumulated_grad_if_needed(self) -> None:
        """Keep accumulating in ``reduce_dtype`` rather than the (lower) compute dtype."""
        if (
            self.reduce_dtype is None
            or self._unsharded_param is None
            or self._unsharded_param.grad is None
            or self._unsharded_param.grad.dtype == self.reduce_dtype
        ):
            return
        grad = self._unsharded_param.grad
        self._unsharded_param.grad = None
        self.unsharded_accumulated_grad = grad.to(self.reduce_dtype)

    def take_unsharded_grad(self, zero_if_unused: bool) -> torch.Tensor | None:
        """Pop this parameter's pending unsharded gradient, as the local tensor to reduce."""
        param = self._unsharded_param
        if param is None:
            return None
        grad = self.unsharded_accumulated_grad
        if grad is not None:
            self.unsharded_accumulated_grad = None
        elif param.grad is not None:
            grad, param.grad = param.grad, None
        if grad is not None:
            return self._handler.reduce_grad(self._template, grad)
        if zero_if_unused and param.requires_grad:
            # Made local already: there is no parameter-kind layout to undo. In the dtype
            # autograd would have made it in (torch 2.15's grad_dtype; the compute dtype before).
            dtype = getattr(param, "grad_dtype", None) or self.unsharded_dtype
            return torch.zeros(self.orig_size, dtype=dtype, device=self.device)
        return None

    def grad_for_reduce_scatter(self, grad: torch.Tensor, world_size: int) -> torch.Tensor:
        """Lay out a dim-d sharded gradient so its per-rank chunks are dim-0 chunks."""
        if self.shard_dim == 0 or world_size == 1:
            return grad
        return torch.cat(torch.chunk(grad, world_size, dim=self.shard_dim), dim=0)

    def offload_non_blocking(self, has_hooks: bool) -> bool:
        """Whether this parameter's device-to-host gradient copy may run behind the host.

        Only into pinned memory, and only when nothing on the host reads the copy before the
        end of backward synchronizes its event: accumulating adds to ``.grad`` on the host at
        once, and a post-accumulate-grad hook (an optimizer in backward) reads it at once, so
        either would see pinned memory still being written (torch's FSDP2 decides the same).
        """
        return self.pin_memory and self.sharded_param.grad is None and not has_hooks

    def assign_sharded_grad(self, reduce_output: torch.Tensor, offset: int) -> bool:
        """Set or accumulate ``sharded_param.grad`` from this param's slot of the reduce
        output (its padded shard, from element ``offset``).

        Returns whether it issued a non-blocking device-to-host copy (CPU offload into pinned
        memory), which the caller must order with an event before the CPU optimizer runs.
        """
        sharded = self.sharded_param
        # Post-accumulate-grad hooks (optimizer-in-backward) fire on the sharded parameter,
        # which autograd never sees, so they run below.
        hooks = getattr(sharded, "_post_accumulate_grad_hooks", None)
        non_blocking = False
        to_host = self.offload_to_cpu and reduce_output.device.type != "cpu"
        if sharded.grad is None and not to_host:
            # The padded slot over a storage of its own (see own_storage: what users hold),
            # the gradient a view of it from element 0, as the sharded parameter is of its
            # padded shard.
            slot = own_storage(reduce_output.narrow(0, offset, self.padded_sharded_numel))
            local = self._local_view(slot)
        else:
            local = self._local_view(reduce_output, offset)
        if to_host:
            non_blocking = self.offload_non_blocking(bool(hooks))
            local = local.to("cpu", non_blocking=non_blocking)
        if sharded.grad is None:
            sharded.grad = _dtensor(local, self._sharding_spec)
        else:
            _local_tensor(sharded.grad).add_(local)
        if hooks:
            for hook in hooks.values():
                hook(sharded)
        return non_blocking

    def __repr__(self) -> str:
        return f"FSDPParam(fqn={self.param_fqn}, orig_size={tuple(self.orig_size)})"
