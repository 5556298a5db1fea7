"""Plain device allocations and raw copies (the Tensor-shaped helpers are in interop/arrays.py)."""
from __future__ import annotations

import threading

from cuda.bindings import driver as _drv

from .device import Device
from .errors import call

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


def copy_dtoh(host_ptr: int, src: int, nbytes: int) -> None:
    """Synchronous device -> host copy of raw bytes (waits for prior work on the context)."""
    if nbytes:
        call(_drv.cuMemcpyDtoH, host_ptr, src, nbytes)


def copy_htod(dst: int, host_ptr: int, nbytes: int) -> None:
    if nbytes:
        call(_drv.cuMemcpyHtoD, dst, host_ptr, nbytes)


def copy_dtod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Device -> device (or peer) copy of raw bytes, queued on `stream`."""
    call(_drv.cuMemcpyDtoDAsync, dst, src, nbytes, stream)


def memset_d8_async(dst: int, value: int, nbytes: int, stream: int) -> None:
    call(_drv.cuMemsetD8Async, dst, value, nbytes, stream)


def pointer_device(ptr: int) -> int:
    """The ordinal of the GPU that owns device pointer `ptr`."""
    return call(_drv.cuPointerGetAttribute, _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
