"""Device tensors from shapes and host arrays, and back: demo, tests, benchmark."""
from __future__ import annotations

import numpy as np

from ..driver.device import Device
from ..driver.memory import DeviceAllocation, copy_dtoh, copy_htod
from .tensor import CUDA, Tensor, as_dtype as lookup_dtype


def empty(shape, dtype, device: Device) -> Tensor:
    dt = lookup_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    alloc = DeviceAllocation(device, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
    return Tensor(alloc.ptr, shape, dt, device=(CUDA, device.ordinal), owner=alloc)


def from_numpy(array: np.ndarray, device: Device, dtype=None) -> Tensor:
    """Copy a host array to a new device tensor; `dtype` reinterprets its bytes (bfloat16
    from uint16 bits, float8 from uint8)."""
    a = np.ascontiguousarray(array)
    t = empty(a.shape, dtype or a.dtype, device)
    assert t.nbytes == a.nbytes, "dtype must have the itemsize of the array"
    device.make_current()
    copy_htod(t.ptr, a.ctypes.data, a.nbytes)
    return t


def copy_from_numpy(dst: Tensor, array: np.ndarray) -> None:
    a = np.ascontiguousarray(array)
    if a.nbytes != dst.nbytes:
        raise ValueError(f"array has {a.nbytes} bytes, tensor {dst.nbytes}")
    copy_htod(dst.ptr, a.ctypes.data, a.nbytes)


def to_numpy(t: Tensor, np_dtype=None) -> np.ndarray:
    """Copy a contiguous device tensor to the host (bfloat16 comes back as uint16 bits)."""
    dt = np.dtype(np_dtype) if np_dtype is not None else (t.dtype.numpy or np.dtype(f"u{t.dtype.itemsize}"))
    out = np.empty(t.shape, dt)
    copy_dtoh(out.ctypes.data, t.ptr, out.nbytes)
    return out
