"""Plain device allocations as Tensors, and host <-> device copies (demo, tests, benchmark)."""
from __future__ import annotations

import numpy as np
from cuda.bindings import driver as _drv

from .device import Device
from .errors import call
from .tensor import Tensor, as_dtype as lookup_dtype

_CUDA = 2


class DeviceAllocation:
    """cuMemAlloc'd bytes, freed when the last tensor viewing them goes away (or on close)."""

    def __init__(self, device: Device, nbytes: int):
        device.make_current()
        self.device, self.nbytes = device, max(1, int(nbytes))
        self._p = call(_drv.cuMemAlloc, self.nbytes)
        self.ptr = int(self._p)

    def close(self) -> None:
        if self._p is not None:
            self.device.make_current()
            call(_drv.cuMemFree, self._p)
            self._p = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown or a lost context: nothing left to free
            pass


def empty(shape, dtype, device: Device) -> Tensor:
    dt = lookup_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    alloc = DeviceAllocation(device, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
    return Tensor(alloc.ptr, shape, dt, device=(_CUDA, device.ordinal), owner=alloc)


def from_numpy(array: np.ndarray, device: Device, dtype=None) -> Tensor:
    """Copy a host array to a new device tensor; `dtype` reinterprets its bytes (bfloat16
    from uint16 bits, float8 from uint8)."""
    a = np.ascontiguousarray(array)
    t = empty(a.shape, dtype or a.dtype, device)
    assert t.nbytes == a.nbytes, "dtype must have the itemsize of the array"
    device.make_current()
    if a.nbytes:
        call(_drv.cuMemcpyHtoD, t.ptr, a.ctypes.data, a.nbytes)
    return t


def copy_from_numpy(dst: Tensor, array: np.ndarray) -> None:
    a = np.ascontiguousarray(array)
    if a.nbytes != dst.nbytes:
        raise ValueError(f"array has {a.nbytes} bytes, tensor {dst.nbytes}")
    if a.nbytes:
        call(_drv.cuMemcpyHtoD, dst.ptr, a.ctypes.data, a.nbytes)


def to_numpy(t: Tensor, np_dtype=None) -> np.ndarray:
    """Copy a contiguous device tensor to the host (bfloat16 comes back as uint16 bits)."""
    dt = np.dtype(np_dtype) if np_dtype is not None else (t.dtype.numpy or np.dtype(f"u{t.dtype.itemsize}"))
    out = np.empty(t.shape, dt)
    if out.nbytes:
        call(_drv.cuMemcpyDtoH, out.ctypes.data, t.ptr, out.nbytes)
    return out
