"""ep_a2a: one-sided expert-parallel all-to-all (MoE dispatch/combine) over NVLink
symmetric memory, with the FENCE and SENTINEL synchronization protocols (paper: NVLinkOneSided).

The public names load on first use (PEP 562), so that importing a submodule that needs only
the standard library (`ep_a2a.layout`, which the build runs to generate the kernels' header)
does not import cuda.bindings or NumPy."""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

__version__ = "0.1.0"   # the one version number: pyproject.toml reads it from here

_EXPORTS = {
    ".errors": ["CudaError", "EpA2AError", "NoDriverError", "DriverTooOldError", "UnsupportedDeviceError", "ForkedProcessError",
                "StateError", "HalvesOrderError", "ArgumentTypeError", "PeerError", "PeerTimeoutError", "PeerAbortedError",
                "PeerRejectedError", "RuntimeMaxMismatchError", "ActiveRanksMismatchError", "BootstrapError",
                "BootstrapTimeout", "TopologyError"],
    ".group": ["LocalGroup", "ProcessGroup", "Rank"],
    ".alltoall": ["MoeAlltoAll"],
    ".config": ["PayloadSpec", "Fp8Partial"],
    ".bootstrap": ["UnixSocketBootstrap", "TorchDistributedBootstrap", "MpiBootstrap"],
    ".interop.tensor": ["Tensor", "as_tensor"],
    ".moe": ["ExpertIndex", "build_index", "gather_rows", "finalize"],
    ".moe_experts": ["expert_fc1", "expert_fc2"],
}
if TYPE_CHECKING:  # (the names as type checkers and editors see them; at run time __getattr__ loads them)
    from .alltoall import MoeAlltoAll
    from .bootstrap import MpiBootstrap, TorchDistributedBootstrap, UnixSocketBootstrap
    from .config import Fp8Partial, PayloadSpec
    from .errors import (ActiveRanksMismatchError, ArgumentTypeError, BootstrapError, BootstrapTimeout, CudaError,
                         DriverTooOldError, EpA2AError, ForkedProcessError, HalvesOrderError, NoDriverError,
                         PeerAbortedError, PeerError, PeerRejectedError, PeerTimeoutError, RuntimeMaxMismatchError,
                         StateError, TopologyError, UnsupportedDeviceError)
    from .group import LocalGroup, ProcessGroup, Rank
    from .interop.tensor import Tensor, as_tensor
    from .moe import ExpertIndex, build_index, finalize, gather_rows
    from .moe_experts import expert_fc1, expert_fc2

_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_HOME)


def __getattr__(name: str):
    """A public name, imported from its module on first use (PEP 562), or a submodule."""
    module = _HOME.get(name)
    if module is None:  # a submodule, e.g. ep_a2a.bootstrap.UnixSocketBootstrap
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'ep_a2a' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    """The module's names and every public name (loaded or not), for dir() and completion."""
    return sorted(set(globals()) | set(__all__))
