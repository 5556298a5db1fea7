"""Kernel launches with the argument block packed once and updated in place.

Packing arguments per call from Python costs more than the launch itself; here the
kernelParams array of pointers is built once, callers mutate the ctypes objects it points
to, and each launch is one cuLaunchKernelEx with a prebuilt CUlaunchConfig.
"""
from __future__ import annotations

import ctypes

from cuda.bindings import driver as _drv

from .device import Device
from .errors import CudaError, check


class Launch:
    """`kernel` with fixed launch shape and argument objects (ctypes instances).

    `args` stay owned here: change their fields (or `.value`) between launches. With
    `pdl=True` (sm_90+) the launch allows programmatic dependent launch: the kernel may
    start while the previous one in the stream finishes, and must `griddepcontrol.wait`
    before reading what that one wrote.
    """

    def __init__(self, device: Device, function, args, grid, block, shared_bytes: int = 0, pdl: bool = False,
                 cluster: int = 1):
        self.device, self.function, self.args = device, function, list(args)
        self._ptrs = (ctypes.c_void_p * max(1, len(self.args)))(*[ctypes.addressof(a) for a in self.args])
        self.params_address = ctypes.addressof(self._ptrs)
        self.pdl = bool(pdl) and device.compute_capability[0] >= 9
        cfg = _drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (grid, 1, 1) if isinstance(grid, int) else grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (block, 1, 1) if isinstance(block, int) else block
        cfg.sharedMemBytes = shared_bytes
        attrs = []
        if self.pdl:
            attr = _drv.CUlaunchAttribute()
            attr.id = _drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if cluster > 1:  # blocks in clusters of `cluster` (sm_90+; the grid must be a multiple)
            attr = _drv.CUlaunchAttribute()
            attr.id = _drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
            attrs.append(attr)
        if attrs:
            cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        self.config = cfg
        self._stream, self._grid = None, cfg.gridDimX
        # bumped by an owner each time it rewrites the arguments (moe.py): a caller that kept
        # (launch, stamp) may relaunch it as it was while the stamp is unchanged
        self.stamp = 0

    @property
    def grid(self) -> int:
        return self.config.gridDimX

    @grid.setter
    def grid(self, n: int) -> None:
        if n != self._grid:
            self.config.gridDimX = self._grid = n

    def __call__(self, stream: int) -> None:
        if stream != self._stream:  # a property set on the bound config costs more than the compare
            self.config.hStream = self._stream = stream
        err, = _drv.cuLaunchKernelEx(self.config, self.function, self.params_address, 0)
        if err != _drv.CUresult.CUDA_SUCCESS:
            check((err,), "cuLaunchKernelEx")


def prefer_max_shared(function):
    """`function` with the largest shared-memory carveout as its preference, returned.

    An SM changes its split of L1 and shared memory only once it has drained, so a kernel
    that spins on a kernel of another stream must run in the configuration that every other
    kernel fits: otherwise a kernel between the phases that asks for more shared memory (a
    GEMM, or any block of fewer than four warps) waits for SMs that never drain."""
    check(_drv.cuFuncSetAttribute(function, _drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                  int(_drv.CUshared_carveout.CU_SHAREDMEM_CARVEOUT_MAX_SHARED)), "cuFuncSetAttribute")
    return function


def occupancy(function, block: int, shared_bytes: int = 0) -> int:
    """Resident blocks per SM of `function` at `block` threads."""
    return check(_drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, block, shared_bytes),
                 "cuOccupancyMaxActiveBlocksPerMultiprocessor")


def max_active_clusters(launch: Launch) -> int:
    """Clusters of `launch`'s shape (a Launch made with cluster > 1) that fit on its GPU at once."""
    return check(_drv.cuOccupancyMaxActiveClusters(launch.function, launch.config), "cuOccupancyMaxActiveClusters")


def cluster_launch(device: Device, function, args, cluster: int, block, pdl: bool, at_once: int):
    """A Launch of one cluster of `cluster` blocks, or None where fewer than `at_once` such
    clusters fit on the idle GPU, or where the driver cannot tell (no cluster occupancy, as
    under MIG or MPS may be: the caller's kernels then go without clusters)."""
    launch = Launch(device, function, args, cluster, block, pdl=pdl, cluster=cluster)
    try:
        return launch if max_active_clusters(launch) >= at_once else None
    except CudaError:
        return None


def launch_once(device: Device, function, args, grid, block, stream: int, shared_bytes: int = 0) -> None:
    """A one-off launch (tests, initialisation): packs `args` (ctypes instances) for this call only."""
    Launch(device, function, args, grid, block, shared_bytes)(stream)
