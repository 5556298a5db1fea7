"""Kernel launches with the argument block packed once and updated in place.

Packing arguments per call from Python costs ~14 µs a launch (GUIDE.md); here the
kernelParams array of pointers is built once, callers mutate the ctypes objects it points
to, and each launch is one cuLaunchKernelEx with a prebuilt CUlaunchConfig.

The launch itself calls the driver's cuLaunchKernelEx through a ctypes function pointer
(from cuGetProcAddress) on the addresses of the prebuilt config and argument block: the
cuda-bindings wrapper converts and validates its four arguments on every call, which is
most of a decode step's host time. The wrapper stays the fallback (`DIRECT = False`).
"""
from __future__ import annotations

import ctypes
import os

from cuda.bindings import driver as _drv

from .device import Device
from .errors import check

DIRECT = True  # launch through the driver's function pointer (False: the cuda-bindings wrapper)
_direct_fn = None


def _direct_launch():
    """The driver's cuLaunchKernelEx as a ctypes function, or None where it cannot be had."""
    global _direct_fn
    if _direct_fn is None:
        # the stream semantics cuda-bindings itself picks (legacy default stream unless asked)
        per_thread = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
        flags = (_drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM if per_thread
                 else _drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM)
        err, pfn, _status = _drv.cuGetProcAddress(b"cuLaunchKernelEx", 12000, flags)
        fn = int(pfn) if err == _drv.CUresult.CUDA_SUCCESS and pfn else 0
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        _direct_fn = proto(fn) if fn else False
    return _direct_fn or None


class Launch:
    """`kernel` with fixed launch shape and argument objects (ctypes instances).

    `args` stay owned here: change their fields (or `.value`) between launches. With
    `pdl=True` (sm_90+) the launch allows programmatic dependent launch: the kernel may
    start while the previous one in the stream finishes, and must `griddepcontrol.wait`
    before reading what that one wrote.
    """

    def __init__(self, device: Device, function, args, grid, block, shared_bytes: int = 0, pdl: bool = False):
        self.device, self.function, self.args = device, function, list(args)
        self._ptrs = (ctypes.c_void_p * max(1, len(self.args)))(*[ctypes.addressof(a) for a in self.args])
        self.params_address = ctypes.addressof(self._ptrs)
        self.pdl = bool(pdl) and device.compute_capability[0] >= 9
        cfg = _drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (grid, 1, 1) if isinstance(grid, int) else grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (block, 1, 1) if isinstance(block, int) else block
        cfg.sharedMemBytes = shared_bytes
        if self.pdl:
            attr = _drv.CUlaunchAttribute()
            attr.id = _drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
        else:
            cfg.numAttrs = 0
        self.config = cfg
        self._stream, self._grid = None, cfg.gridDimX
        self._config_address, self._function_address = cfg.getPtr(), int(function)

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
        fn = _direct_fn if DIRECT else False
        if fn is None:
            fn = _direct_launch()
        if fn:
            err = fn(self._config_address, self._function_address, self.params_address, None)
            if err:
                check((_drv.CUresult(err),), "cuLaunchKernelEx")
            return
        err, = _drv.cuLaunchKernelEx(self.config, self.function, self.params_address, 0)
        if err != _drv.CUresult.CUDA_SUCCESS:
            check((err,), "cuLaunchKernelEx")


def occupancy(function, block: int, shared_bytes: int = 0) -> int:
    """Resident blocks per SM of `function` at `block` threads."""
    return check(_drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, block, shared_bytes),
                 "cuOccupancyMaxActiveBlocksPerMultiprocessor")


def launch_once(device: Device, function, args, grid, block, stream: int, shared_bytes: int = 0) -> None:
    """A one-off launch (tests, initialisation): packs `args` (ctypes instances) for this call only."""
    Launch(device, function, args, grid, block, shared_bytes)(stream)
