"""shardweave.mesh: data-parallel mesh info types and the typed plugin registry.

The other shardweave packages meet here: the FSDP engine reads mesh infos and looks up
extension points; plugins (``shardweave-extensions``, or your own package) implement them.
"""

from shardweave.mesh._dims import (
    ArgumentTypeError,
    MeshValidationError,
    as_own_mesh_info,
    check_mesh_argument,
    default_mesh,
    mesh_device,
    resolve_mesh_info,
)
from shardweave.mesh._mesh_info import (
    DataParallelMeshDims,
    DataParallelMeshInfo,
    DDPMeshInfo,
    FSDPMeshInfo,
    HSDPMeshInfo,
)
from shardweave.mesh._registry import (
    ExtensionLoadError,
    ExtensionPoint,
    MissingExtensionError,
    RegistrySnapshot,
)
from shardweave.mesh._version import __version__

__all__ = [
    "ArgumentTypeError",
    "DDPMeshInfo",
    "DataParallelMeshDims",
    "DataParallelMeshInfo",
    "ExtensionLoadError",
    "ExtensionPoint",
    "FSDPMeshInfo",
    "HSDPMeshInfo",
    "MeshValidationError",
    "MissingExtensionError",
    "RegistrySnapshot",
    "__version__",
    "as_own_mesh_info",
    "check_mesh_argument",
    "default_mesh",
    "mesh_device",
    "resolve_mesh_info",
]
