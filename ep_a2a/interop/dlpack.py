"""The DLPack C ABI through ctypes: making capsules for consumers and taking capsules from producers.

Only the ABI lives here (structs, capsule names, deleters, lifetimes); which dtypes and
devices ep_a2a accepts is decided by `tensor.py`. Spec: dmlc/dlpack `include/dlpack/dlpack.h`
(1.1) and the Python `__dlpack__` protocol of the array API standard.

Lifetimes. An exported capsule points at a DLManagedTensor(Versioned) that lives in a ctypes
object held in `_live` together with whatever must outlive the consumer's use (our Tensor).
Exactly one of two parties calls the deleter: the consumer, after renaming the capsule to
"used_...", or, if nobody consumed it, the capsule's destructor. The deleter drops the
`_live` entry. An imported capsule is the mirror image: `Capsule.claim()` renames it and
returns a `Borrowed` whose release (or garbage collection) calls the producer's deleter once.
"""
from __future__ import annotations

import ctypes
import enum
import sys
from ctypes import (POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64,
                    c_void_p)

# Versions we write into versioned capsules and the newest major version we can read.
VERSION = (1, 0)
MAX_VERSION = (1, 1)  # what we ask producers for: we read every 1.1 dtype code

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1
FLAG_IS_SUBBYTE_TYPE_PADDED = 1 << 2


class DLDeviceType(enum.IntEnum):
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14
    kDLWebGPU = 15
    kDLHexagon = 16
    kDLMAIA = 17
    kDLTrn = 18


class DLDataTypeCode(enum.IntEnum):
    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLOpaqueHandle = 3
    kDLBfloat = 4
    kDLComplex = 5
    kDLBool = 6
    kDLFloat8_e3m4 = 7
    kDLFloat8_e4m3 = 8
    kDLFloat8_e4m3b11fnuz = 9
    kDLFloat8_e4m3fn = 10
    kDLFloat8_e4m3fnuz = 11
    kDLFloat8_e5m2 = 12
    kDLFloat8_e5m2fnuz = 13
    kDLFloat8_e8m0fnu = 14
    kDLFloat6_e2m3fn = 15
    kDLFloat6_e3m2fn = 16
    kDLFloat4_e2m1fn = 17


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


# Both deleters take a pointer to their own struct; c_void_p lets one callback serve both.
DELETER = ctypes.CFUNCTYPE(None, c_void_p)


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", DELETER)]


class DLManagedTensorVersioned(Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", DELETER),
                ("flags", c_uint64), ("dl_tensor", DLTensor)]


# Capsule names must outlive their capsules: module-level bytes never die.
NAME, USED_NAME = b"dltensor", b"used_dltensor"
NAME_VERSIONED, USED_NAME_VERSIONED = b"dltensor_versioned", b"used_dltensor_versioned"

# A private handle on the C API, so our argtypes never clash with other users of ctypes.pythonapi.
_py = ctypes.PyDLL(None)
_capsule_new = _py.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [c_void_p, c_char_p, c_void_p]
_capsule_is_valid = _py.PyCapsule_IsValid
_capsule_is_valid.restype, _capsule_is_valid.argtypes = c_int, [c_void_p, c_char_p]
_capsule_get_pointer = _py.PyCapsule_GetPointer
_capsule_get_pointer.restype, _capsule_get_pointer.argtypes = c_void_p, [c_void_p, c_char_p]
_capsule_set_name = _py.PyCapsule_SetName
_capsule_set_name.restype, _capsule_set_name.argtypes = c_int, [ctypes.py_object, c_char_p]
_capsule_get_name = _py.PyCapsule_GetName
_capsule_get_name.restype, _capsule_get_name.argtypes = c_char_p, [ctypes.py_object]


# CPython may run a capsule destructor or a consumer may run our deleter while an exception is
# already set (C code that fails, then drops the capsule). Python code in a ctypes callback
# cannot work in that state (the first ctypes call fails on the stale error, so the deleter
# would never run and the export would leak). So the callbacks first take the pending error
# out of the thread state, do their work, then re-raise it, which ctypes reports as
# "Exception ignored" (a ctypes callback has no way to hand an error back to its C caller).
if sys.version_info >= (3, 12):
    _take_error, _decref = _py.PyErr_GetRaisedException, _py.Py_DecRef
    _take_error.restype, _take_error.argtypes = c_void_p, []  # a new reference, or NULL (the usual case)
    _decref.restype, _decref.argtypes = None, [c_void_p]

    def _exception_safe(body):
        def callback(arg):
            pending = _take_error()
            if pending:
                pending, p = ctypes.cast(pending, ctypes.py_object).value, pending
                _decref(p)  # the cast took its own reference
            try:
                body(arg)
            finally:
                if pending is not None:
                    raise pending
        return callback
else:  # 3.11: PyErr_Fetch into static slots (two threads failing at once could race; 3.12+ cannot)
    _fetch, _restore = _py.PyErr_Fetch, _py.PyErr_Restore
    _fetch.restype = _restore.restype = None
    _restore.argtypes = [c_void_p] * 3
    _slots = (c_void_p(), c_void_p(), c_void_p())
    _slot_refs = tuple(ctypes.byref(s) for s in _slots)  # no argtypes: byref args need no converter call

    def _exception_safe(body):
        def callback(arg):
            _fetch(*_slot_refs)
            pending = (_slots[0].value, _slots[1].value, _slots[2].value)
            try:
                body(arg)
            finally:
                if pending[0]:
                    _restore(*pending)  # raises it here, as a PYTHONAPI call with an error set does
        return callback


class _Export:
    """One exported managed tensor: the C struct, its shape/strides arrays, and what it keeps alive."""
    __slots__ = ("managed", "shape", "strides", "keepalive")


_live: dict[int, _Export] = {}  # address of the managed struct -> its _Export
_stats = {"exported": 0, "deleted": 0, "unknown_deletes": 0}


def _delete(address: int) -> None:
    entry = _live.pop(address, None)
    if entry is None:  # a second call, or a pointer that is not ours: count it, never crash
        _stats["unknown_deletes"] += 1
    else:
        _stats["deleted"] += 1


# Module level so the C function pointers stay valid for as long as any capsule may exist.
_deleter = DELETER(_exception_safe(_delete))


def _destroy_capsule(capsule: int) -> None:
    # An unchanged name means no consumer took the capsule: the deleter is ours to call.
    for name in (NAME_VERSIONED, NAME):
        if _capsule_is_valid(capsule, name):
            _delete(_capsule_get_pointer(capsule, name))
            return


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, c_void_p)
_capsule_destructor = _CAPSULE_DESTRUCTOR(_exception_safe(_destroy_capsule))
_capsule_destructor_ptr = ctypes.cast(_capsule_destructor, c_void_p).value


def export(ptr: int, shape, strides, device: tuple[int, int], dtype: tuple[int, int, int], keepalive, *,
           versioned: bool, read_only: bool = False):
    """A new "dltensor_versioned" (DLPack 1.0) or legacy "dltensor" capsule describing the memory.

    `strides` are in elements; `keepalive` is held until the consumer calls the deleter.
    """
    ndim = len(shape)
    e = _Export()
    e.managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    e.shape, e.strides = (c_int64 * ndim)(*shape), (c_int64 * ndim)(*strides)
    e.keepalive = keepalive
    m = e.managed
    if versioned:
        m.version = DLPackVersion(*VERSION)
        m.flags = FLAG_READ_ONLY if read_only else 0
    t = m.dl_tensor
    t.data, t.device, t.ndim = ptr, DLDevice(*device), ndim
    t.dtype, t.shape, t.strides, t.byte_offset = DLDataType(*dtype), e.shape, e.strides, 0
    address = ctypes.addressof(m)
    m.manager_ctx, m.deleter = address, _deleter
    _live[address] = e
    try:
        capsule = _capsule_new(address, NAME_VERSIONED if versioned else NAME, _capsule_destructor_ptr)
    except BaseException:
        del _live[address]
        raise
    _stats["exported"] += 1
    return capsule


def stats() -> dict:
    """Export bookkeeping, for leak checks: live = exported and not yet deleted."""
    return dict(_stats, live=len(_live))


class Borrowed:
    """A producer's managed tensor that we hold: the producer's deleter runs exactly once,
    on `release()` or when this object is collected."""
    __slots__ = ("_address", "_deleter", "__weakref__")

    def __init__(self, address: int, deleter):
        self._address, self._deleter = address, deleter

    def release(self) -> None:
        deleter, self._deleter = self._deleter, None
        if deleter:  # a NULL deleter is legal: the producer has nothing to free
            deleter(self._address)

    def __del__(self):
        try:
            self.release()
        except Exception:  # at interpreter exit ctypes may already be gone; nothing useful to do
            pass


class Capsule:
    """What a producer's capsule describes, read without taking ownership.

    Validate first, then `claim()`: a capsule that is never claimed stays the producer's, and
    its own destructor frees it (the consumer rule of the DLPack spec for refused capsules).
    """

    def __init__(self, capsule):
        if _capsule_is_valid(id(capsule), NAME_VERSIONED):
            self.versioned = True
        elif _capsule_is_valid(id(capsule), NAME):
            self.versioned = False
        else:
            name = (_capsule_get_name(capsule) or b"").decode() if type(capsule).__name__ == "PyCapsule" else None
            used = " (already consumed: a capsule can be consumed once)" if name and name.startswith("used_") else ""
            raise ValueError(f"capsule: expected a DLPack capsule named 'dltensor' or 'dltensor_versioned', got a "
                             f"{type(capsule).__name__} named {name!r}{used}")
        self._capsule = capsule
        self.address = _capsule_get_pointer(id(capsule), NAME_VERSIONED if self.versioned else NAME)
        m = (DLManagedTensorVersioned if self.versioned else DLManagedTensor).from_address(self.address)
        self._managed = m
        if self.versioned:
            self.version = (m.version.major, m.version.minor)
            if self.version[0] != MAX_VERSION[0]:  # the layout after `flags` is unknown: touch nothing else
                raise ValueError(f"capsule: DLPack version {self.version[0]}.{self.version[1]} is not supported "
                                 f"(this reader knows major version {MAX_VERSION[0]})")
            self.flags = m.flags
        else:
            self.version, self.flags = None, 0
        t = m.dl_tensor
        self.device = (t.device.device_type, t.device.device_id)
        self.dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        # NULL strides: legal before DLPack 1.0 and means compact row-major.
        self.strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
        self.ptr = (t.data or 0) + t.byte_offset
        self.read_only = bool(self.flags & FLAG_READ_ONLY)

    def claim(self) -> Borrowed:
        """Take ownership: rename the capsule so its producer's destructor stands down, and return
        the object whose release calls the producer's deleter."""
        if _capsule_set_name(self._capsule, USED_NAME_VERSIONED if self.versioned else USED_NAME):
            raise RuntimeError("PyCapsule_SetName failed")
        self._capsule = None
        return Borrowed(self.address, self._managed.deleter)
