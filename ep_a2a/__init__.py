"""ep_a2a: one-sided expert-parallel all-to-all (MoE dispatch/combine) over NVLink
symmetric memory, with the FENCE and SENTINEL synchronization protocols (paper: NVLinkOneSided)."""
__version__ = "0.1.0"

from .driver.errors import CudaError, EpA2AError, NoDriverError  # noqa: E402
from .errors import (ActiveRanksMismatchError, PeerAbortedError, PeerError, PeerTimeoutError,  # noqa: E402
                     RuntimeMaxMismatchError)
from .group import LocalGroup, ProcessGroup, Rank  # noqa: E402
from .alltoall import Fp8Partial, MoeAlltoAll, PayloadSpec, StateError  # noqa: E402
from .bootstrap import MpiBootstrap, TorchDistributedBootstrap, UnixSocketBootstrap  # noqa: E402
from .driver.tensor import Tensor, as_tensor  # noqa: E402
from .moe import ExpertIndex, build_index, finalize, gather_rows  # noqa: E402,F401

__all__ = ["CudaError", "EpA2AError", "NoDriverError", "PeerError", "PeerTimeoutError", "PeerAbortedError", "RuntimeMaxMismatchError",
           "ActiveRanksMismatchError",
           "LocalGroup", "ProcessGroup", "Rank", "MoeAlltoAll", "PayloadSpec", "Fp8Partial", "StateError",
           "UnixSocketBootstrap", "TorchDistributedBootstrap", "MpiBootstrap", "Tensor", "as_tensor",
           "ExpertIndex", "build_index", "gather_rows", "finalize"]
