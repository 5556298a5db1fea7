"""Plain device allocations as Tensors, and host <-> device copies (demo, tests, benchmark)."""
from __future__ import annotations

import threading

import numpy as np
from cuda.bindings import driver as _drv

from .device import Device
from .errors import call
from .tensor import CUDA, Tensor, as_dtype as lookup_dtype

# cuMemFree waits for the whole device. In-process ranks spin on each other between the
# first and the last rank's launch of a phase, so a free that lands there (a garbage
# collection running __del__ at any bytecode) blocks the host until a kernel times out.
# While such ranks exist (`hold_frees`), allocations that go away unclosed are queued and
# freed at the next safe point (`release_held`, called by the all-to-all once no rank of
# the process is between its dispatch and its combine; that call then waits for the device).
_lock = threading.Lock()  # __del__ runs on whichever thread drops the last reference
_held_by = 0
_held = []


def hold_frees(on: bool) -> None:
    """Count one more (or one less) owner of in-process ranks; frees queue while any exists."""
    global _held_by
    with _lock:
        _held_by += 1 if on else -1
        last = not _held_by
    if last:
        release_held()


def has_held() -> bool:
    return bool(_held)


def release_held() -> None:
    """Free the queued allocations (call where no rank is waiting for a launch still to come)."""
    while True:
        with _lock:
            if not _held:
                return
            device, p = _held.pop()
        try:
            device.make_current()
            call(_drv.cuMemFree, p)
        except Exception:  # a lost context or interpreter shutdown: as __del__, nothing left to free
            pass


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
            if _held_by and self._p is not None:
                with _lock:
                    _held.append((self.device, self._p))
                self._p = None
            else:
                self.close()
        except Exception:  # interpreter shutdown or a lost context: nothing left to free
            pass


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
