"""CUDA virtual memory management: physical allocations, their VA mappings, exports and imports.

The explicit VMM steps (create, reserve, map, set access) are what make symmetric memory
possible: a peer imports our physical allocation and maps it into its own address space.
Each step that fails halfway undoes the steps before it, then re-raises.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from typing import Sequence, Union

import numpy as np
from cuda.bindings import driver as _drv

from . import lifetime
from .device import Device, get_device
from .errors import CudaError, call

_H = _drv.CUmemAllocationHandleType
POSIX_FD = int(_H.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
FABRIC = int(_H.CU_MEM_HANDLE_TYPE_FABRIC)
_A = _drv.CUdevice_attribute
_DEVICE_LOC = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
_FABRIC_FALLBACK = (_drv.CUresult.CUDA_ERROR_NOT_PERMITTED, _drv.CUresult.CUDA_ERROR_NOT_SUPPORTED)

DeviceLike = Union[Device, int]


@dataclasses.dataclass(frozen=True)
class VmmOptions:
    """fabric: also request a FABRIC handle (multi-node NVLink; falls back to POSIX fd only
    where the device or the IMEX channel setup does not allow it).
    access_devices: extra devices granted read/write access to mappings, besides the local one
    (in-process groups spanning several GPUs)."""
    fabric: bool = False
    access_devices: tuple = ()


_KINDS = ("allocations", "mappings")


def live_counts() -> dict:
    """Allocations and mappings created and not yet closed in this process (for leak tests)."""
    return lifetime.live_counts(*_KINDS)


def round_up(n: int, g: int) -> int:
    if g <= 0:
        raise ValueError(f"granularity must be positive, got {g}")
    return -(-n // g) * g


def _device(d: DeviceLike) -> Device:
    return d if isinstance(d, Device) else get_device(int(d))


def _ordinal(d: DeviceLike) -> int:
    # A raw int is passed through unchecked on purpose: the driver is the judge of access lists.
    return d.ordinal if isinstance(d, Device) else int(d)


def _alloc_prop(ordinal: int, handle_types: int) -> _drv.CUmemAllocationProp:
    prop = _drv.CUmemAllocationProp()
    prop.type = _drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = _DEVICE_LOC
    prop.location.id = ordinal
    # requestedHandleTypes is a bitmask in C, but the binding's setter only takes single enum
    # members (POSIX_FD | FABRIC = 9 is rejected), so write the field at its ABI offset
    # (after `CUmemAllocationType type`, both 32-bit).
    ctypes.c_uint32.from_address(prop.getPtr() + 4).value = handle_types
    return prop


def granularity(device: DeviceLike, handle_types: int = POSIX_FD) -> int:
    """Recommended granularity for device allocations with these handle types; sizes, offsets
    and VA alignments are rounded to it."""
    device = _device(device)
    device.make_current()
    return call(_drv.cuMemGetAllocationGranularity, _alloc_prop(device.ordinal, handle_types),
                _drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)


class _Resource(lifetime.Owned):
    """An Owned VMM object: also freed (with a ResourceWarning) when collected unclosed,
    unless the interpreter is shutting down (the driver module may already be gone then;
    the OS reclaims everything at exit)."""
    _close_on_collect = True

    def __repr__(self) -> str:
        where = f" at {self.ptr:#x}" if hasattr(self, "ptr") else ""
        size = getattr(self, "size", getattr(self, "nbytes", "?"))
        return f"{type(self).__name__}({size} B{where} on {getattr(self, 'device', '?')}, {'closed' if self._closed else 'open'})"


class Allocation(_Resource):
    """Physical memory on one device (cuMemCreate), or imported from a peer's shareable handle.

    `device` is the local device: the owner for created memory, the importing device for
    imported memory. `size` is a multiple of the granularity. `handle_types` is the bitmask of
    POSIX_FD / FABRIC the allocation can be exported as.
    """
    _kind = "allocations"

    def __init__(self, size: int, device: DeviceLike, options: VmmOptions = VmmOptions()):
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        device = _device(device)
        device.make_current()
        types = POSIX_FD if device.attribute(_A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) else 0
        if options.fabric and device.attribute(_A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED):
            try:
                self._create(size, device, types | FABRIC)
                return
            except CudaError as e:  # no IMEX channel / not enabled: POSIX fd still serves one node
                if e.code not in _FABRIC_FALLBACK:
                    raise
        self._create(size, device, types)

    def _create(self, size: int, device: Device, types: int) -> None:
        g = granularity(device, types)
        size = round_up(size, g)
        handle = call(_drv.cuMemCreate, size, _alloc_prop(device.ordinal, types), 0)
        self._set(handle, size, device, types, g)

    def _set(self, handle, size: int, device: Device, types: int, g: int) -> None:
        self.handle, self.size, self.device, self.handle_types, self.granularity = handle, size, device, types, g
        self._opened()

    @classmethod
    def _adopt(cls, handle, size: int, device: Device, types: int) -> "Allocation":
        self = cls.__new__(cls)
        with _UndoStack() as undo:
            undo.push(_drv.cuMemRelease, handle)
            g = granularity(device, types)
        self._set(handle, size, device, types, g)
        return self

    def _release(self) -> None:
        self.device.make_current()
        call(_drv.cuMemRelease, self.handle)

    release = _Resource.close

    def export_fd(self) -> int:
        """A new POSIX fd for this allocation; the caller owns it and must close it (an open fd
        keeps the physical memory alive after every handle is released)."""
        if not self.handle_types & POSIX_FD:
            raise ValueError("allocation cannot be exported as a POSIX fd (not supported on this device)")
        self.device.make_current()
        return call(_drv.cuMemExportToShareableHandle, self.handle, _H.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)

    def export_fabric(self) -> bytes:
        """The 64 opaque bytes of a CUmemFabricHandle (valid across nodes of one NVLink domain)."""
        if not self.handle_types & FABRIC:
            raise ValueError("allocation has no FABRIC handle (not requested, or not supported or "
                             "not permitted here: the POSIX fd fallback was used)")
        self.device.make_current()
        fh = call(_drv.cuMemExportToShareableHandle, self.handle, _H.CU_MEM_HANDLE_TYPE_FABRIC, 0)
        return bytes(fh.data)

    @classmethod
    def import_fd(cls, fd: int, size: int, device: DeviceLike) -> "Allocation":
        """Import a peer's POSIX fd. `size` is the exporter's `Allocation.size`. The fd stays
        open: the caller must close it once imported (an open fd pins the memory); see
        `import_fd_and_close`."""
        device = _device(device)
        device.make_current()
        handle = call(_drv.cuMemImportFromShareableHandle, fd, _H.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return cls._adopt(handle, size, device, POSIX_FD)

    @classmethod
    def import_fd_and_close(cls, fd: int, size: int, device: DeviceLike) -> "Allocation":
        """`import_fd`, then close the fd whatever happened (the usual case: it came over SCM_RIGHTS)."""
        try:
            return cls.import_fd(fd, size, device)
        finally:
            os.close(fd)

    @classmethod
    def import_fabric(cls, data: bytes, size: int, device: DeviceLike) -> "Allocation":
        if len(data) != 64:
            raise ValueError(f"a fabric handle is 64 bytes, got {len(data)}")
        device = _device(device)
        device.make_current()
        fh = _drv.CUmemFabricHandle()
        fh.data = bytes(data)
        # the binding takes osHandle as a raw pointer; `fh` stays referenced across the call
        handle = call(_drv.cuMemImportFromShareableHandle, fh.getPtr(), _H.CU_MEM_HANDLE_TYPE_FABRIC)
        return cls._adopt(handle, size, device, FABRIC)



class Mapping(_Resource):
    """A VA range of this process mapped onto a whole Allocation, read/write for the local
    device and `access_devices`. Keeps the allocation object alive; does not own it."""
    _kind = "mappings"

    def __init__(self, allocation: Allocation, access_devices: Sequence[DeviceLike] = ()):
        if allocation.closed:
            raise ValueError("cannot map a released allocation")
        self.allocation, self.device, self.size = allocation, allocation.device, allocation.size
        ordinals = list(dict.fromkeys([self.device.ordinal, *map(_ordinal, access_devices)]))
        self.device.make_current()
        with _UndoStack() as undo:
            ptr = call(_drv.cuMemAddressReserve, self.size, allocation.granularity, 0, 0)
            undo.push(_drv.cuMemAddressFree, ptr, self.size)
            call(_drv.cuMemMap, ptr, self.size, 0, allocation.handle, 0)
            undo.push(_drv.cuMemUnmap, ptr, self.size)
            descs = [_access_desc(o) for o in ordinals]
            call(_drv.cuMemSetAccess, ptr, self.size, descs, len(descs))
        self.ptr, self.access_ordinals = int(ptr), tuple(ordinals)
        self._opened()

    def _release(self) -> None:
        self.device.make_current()
        call(_drv.cuMemUnmap, self.ptr, self.size)  # the range must be unmapped before it is freed
        call(_drv.cuMemAddressFree, self.ptr, self.size)



def _access_desc(ordinal: int) -> _drv.CUmemAccessDesc:
    d = _drv.CUmemAccessDesc()
    d.location.type = _DEVICE_LOC
    d.location.id = ordinal
    d.flags = _drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return d


class _UndoStack:
    """The undo steps of a construction so far: if the block raises, they run newest first
    (each one's own failure swallowed: the original error is the one worth raising); if it
    completes, none runs (the object now owns what was made)."""

    def __init__(self):
        self._steps = []

    def push(self, fn, *args) -> None:
        self._steps.append((fn, args))

    def __enter__(self) -> "_UndoStack":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        steps, self._steps = self._steps, []
        if exc_type is not None:
            for fn, args in reversed(steps):
                try:
                    fn(*args)
                except Exception:
                    pass
        return False


class DeviceBuffer(_Resource):
    """A fresh local Allocation with one Mapping: `ptr` is usable by kernels on the local
    device and on `options.access_devices`."""

    def __init__(self, nbytes: int, device: DeviceLike, options: VmmOptions = VmmOptions()):
        with _UndoStack() as undo:
            self.allocation = Allocation(nbytes, device, options)
            undo.push(self.allocation.close)
            self.mapping = Mapping(self.allocation, options.access_devices)
        self.ptr, self.size, self.device = self.mapping.ptr, self.allocation.size, self.allocation.device
        self._opened()

    def _release(self) -> None:
        try:
            self.mapping.close()
        finally:
            self.allocation.close()



class HostMapped(_Resource):
    """Pinned host memory mapped into the device's address space (zeroed). Kernels write error
    records here through `device_ptr`; the host reads them through `array()` even after a
    device trap has made the context unusable for copies."""

    def __init__(self, nbytes: int, device: DeviceLike):
        if nbytes <= 0:
            raise ValueError(f"size must be positive, got {nbytes}")
        self.device = _device(device)
        self.device.make_current()
        self.nbytes = nbytes
        with _UndoStack() as undo:
            self.host_ptr = int(call(_drv.cuMemHostAlloc, nbytes, _drv.CU_MEMHOSTALLOC_DEVICEMAP | _drv.CU_MEMHOSTALLOC_PORTABLE))
            undo.push(_drv.cuMemFreeHost, self.host_ptr)
            self.device_ptr = int(call(_drv.cuMemHostGetDevicePointer, self.host_ptr, 0))
        ctypes.memset(self.host_ptr, 0, nbytes)
        self._opened()

    def array(self, dtype, shape, offset: int = 0) -> np.ndarray:
        """A numpy view of the host side. It keeps this object alive, but is dangling after close()."""
        if self._closed:
            raise ValueError("HostMapped is closed")
        dtype, shape = np.dtype(dtype), (tuple(shape) if np.iterable(shape) else (int(shape),))
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"view of {nbytes} B at offset {offset} exceeds {self.nbytes} B")
        raw = (ctypes.c_char * nbytes).from_address(self.host_ptr + offset)
        raw._owner = self  # the view must not outlive the pinned memory through garbage collection
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    def _release(self) -> None:
        self.device.make_current()
        call(_drv.cuMemFreeHost, self.host_ptr)

