"""Driver initialisation, devices and their primary contexts."""
from __future__ import annotations

import functools
import os
import threading

from cuda.bindings import driver as _drv

from .errors import CudaError, ForkedProcessError, NoDriverError, call

_A = _drv.CUdevice_attribute
_init_lock = threading.Lock()
_initialized = False
_bound = threading.local()  # the context this thread last bound through make_current
_forked_after_init = False  # this process is a fork of one that had initialised CUDA
_FORKED = ("this process was forked from one that had initialised CUDA (through ep_a2a or a framework); "
           "the CUDA driver cannot be used in such a child: start worker processes with the 'spawn' or "
           "'forkserver' multiprocessing context, or fork before the first CUDA call")


def _after_fork_in_child() -> None:
    """A forked child inherits our state but not a usable driver: every later call must say
    so instead of reaching into the parent's contexts."""
    global _initialized, _forked_after_init
    if _initialized:
        _initialized, _forked_after_init = False, True
        _bound.ctx = None  # the next make_current takes the checked path


os.register_at_fork(after_in_child=_after_fork_in_child)


def init() -> None:
    """cuInit once; turn 'no libcuda' and 'no GPU' into one clear NoDriverError."""
    global _initialized
    if _initialized:
        return
    if _forked_after_init:
        raise ForkedProcessError(_FORKED)
    with _init_lock:
        if _initialized:
            return
        try:
            err, = _drv.cuInit(0)
        except (RuntimeError, OSError, ImportError) as e:  # cuda.bindings cannot dlopen libcuda.so.1
            raise NoDriverError(f"no CUDA driver: libcuda.so.1 could not be loaded ({type(e).__name__}: {e})") from None
        except Exception as e:  # cuda.pathfinder raises its own DynamicLibNotFoundError
            if "libcuda" in str(e) or "driver" in str(e).lower() or "cuda" in type(e).__name__.lower():
                raise NoDriverError(f"no CUDA driver: libcuda.so.1 could not be loaded ({type(e).__name__}: {e})") from None
            raise
        if err == _drv.CUresult.CUDA_ERROR_NO_DEVICE:
            raise NoDriverError("the CUDA driver is present but reports no GPU (CUDA_ERROR_NO_DEVICE)")
        if err != _drv.CUresult.CUDA_SUCCESS:
            raise NoDriverError(f"cuInit failed: {CudaError('cuInit', err)}")
        _initialized = True


def driver_version() -> int:
    """cuDriverGetVersion: 1000 * major + 10 * minor of the CUDA version the driver supports."""
    init()
    return call(_drv.cuDriverGetVersion)


def device_count() -> int:
    """Number of visible GPUs; 0 (not an exception) when there is no driver or no GPU."""
    try:
        init()
    except NoDriverError:
        return 0
    return call(_drv.cuDeviceGetCount)


def available() -> bool:
    return device_count() > 0


class Device:
    """One GPU and its retained primary context (shared with PyTorch, CuPy and JAX)."""

    def __init__(self, ordinal: int):
        init()
        n = call(_drv.cuDeviceGetCount)
        if not 0 <= ordinal < n:
            raise ValueError(f"device ordinal {ordinal} out of range: this machine has {n} GPU(s)")
        self.ordinal = ordinal
        self.handle = call(_drv.cuDeviceGet, ordinal)
        self.context = call(_drv.cuDevicePrimaryCtxRetain, self.handle)
        self.name = call(_drv.cuDeviceGetName, 256, self.handle).split(b"\0")[0].decode()
        self.compute_capability = (self.attribute(_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                   self.attribute(_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.sm_count = self.attribute(_A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.pci_bus_id = call(_drv.cuDeviceGetPCIBusId, 32, self.handle).split(b"\0")[0].decode()

    def attribute(self, attr) -> int:
        return call(_drv.cuDeviceGetAttribute, attr, self.handle)

    def make_current(self) -> None:
        """Bind this device's primary context to the calling thread.

        Hot path (every dispatch/combine): skip the driver when this thread's last bind was
        ours. Frameworks bind the same primary context, so their binds do not invalidate it."""
        if getattr(_bound, "ctx", None) is self.context:
            return
        if _forked_after_init:
            raise ForkedProcessError(_FORKED)
        call(_drv.cuCtxSetCurrent, self.context)
        _bound.ctx = self.context

    def synchronize(self) -> None:
        self.make_current()
        call(_drv.cuCtxSynchronize)

    def free_memory(self) -> int:
        """Free bytes as this GPU's context sees them (cuMemGetInfo: a MIG instance's own memory,
        not the whole card's as NVML would report)."""
        self.make_current()
        return int(call(_drv.cuMemGetInfo)[0])

    def __repr__(self) -> str:
        return f"Device({self.ordinal}, {self.name!r}, sm_{self.compute_capability[0]}{self.compute_capability[1]})"


@functools.lru_cache(maxsize=None)
def get_device(ordinal: int) -> Device:
    """The process-wide Device object of a GPU ordinal (its primary context retained once)."""
    return Device(ordinal)
