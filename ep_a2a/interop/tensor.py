"""Tensors: a pointer, a shape, a dtype and a device, shared zero-copy with any framework.

`Tensor` is how ep_a2a buffers reach users (`__dlpack__`, `__cuda_array_interface__`) and how
users' arrays reach ep_a2a (`as_tensor`). It never copies and never allocates: `owner` keeps
the memory alive (our allocation, or a producer's managed tensor), `stream` says on which
CUDA stream the data is still being produced (None: complete).
"""
from __future__ import annotations

import math
import operator
import warnings

import numpy as np

from . import dlpack as _dl
from ..driver.device import get_device, init
from ..driver.memory import pointer_device
from ..driver.stream import Event, stream_handle, synchronize_stream

try:  # optional: gives bfloat16 / float8 a NumPy dtype for to_numpy(); never required
    import ml_dtypes as _ml
except ImportError:
    _ml = None

_T, _D = _dl.DLDataTypeCode, _dl.DLDeviceType
CPU, CUDA, CUDA_HOST, CUDA_MANAGED = _D.kDLCPU, _D.kDLCUDA, _D.kDLCUDAHost, _D.kDLCUDAManaged
_DEVICE_NAMES = {CPU: "cpu", CUDA: "cuda", CUDA_HOST: "cuda_host", CUDA_MANAGED: "cuda_managed"}
_ON_GPU = (CUDA, CUDA_MANAGED)  # device types whose data is ordered by CUDA streams
_ON_HOST = (CPU, CUDA_HOST)  # device types NumPy can read


class DType:
    """One element type: its DLPack (code, bits, lanes), CUDA Array Interface typestr (None where
    that protocol has none) and NumPy dtype (None where NumPy has none and ml_dtypes is absent)."""
    __slots__ = ("name", "itemsize", "dlpack", "typestr", "numpy")

    def __init__(self, name: str, code: int, bits: int, typestr: str | None, np_dtype):
        self.name, self.itemsize, self.dlpack = name, bits // 8, (int(code), bits, 1)
        self.typestr, self.numpy = typestr, None if np_dtype is None else np.dtype(np_dtype)

    def __repr__(self) -> str:
        return self.name


def _ml_dtype(name):
    return getattr(_ml, name) if _ml is not None else None


bfloat16 = DType("bfloat16", _T.kDLBfloat, 16, None, _ml_dtype("bfloat16"))
float16 = DType("float16", _T.kDLFloat, 16, "<f2", np.float16)
float32 = DType("float32", _T.kDLFloat, 32, "<f4", np.float32)
float64 = DType("float64", _T.kDLFloat, 64, "<f8", np.float64)
float8_e4m3fn = DType("float8_e4m3fn", _T.kDLFloat8_e4m3fn, 8, None, _ml_dtype("float8_e4m3fn"))
float8_e5m2 = DType("float8_e5m2", _T.kDLFloat8_e5m2, 8, None, _ml_dtype("float8_e5m2"))
uint8 = DType("uint8", _T.kDLUInt, 8, "|u1", np.uint8)
int8 = DType("int8", _T.kDLInt, 8, "|i1", np.int8)
uint16 = DType("uint16", _T.kDLUInt, 16, "<u2", np.uint16)
int16 = DType("int16", _T.kDLInt, 16, "<i2", np.int16)
uint32 = DType("uint32", _T.kDLUInt, 32, "<u4", np.uint32)
int32 = DType("int32", _T.kDLInt, 32, "<i4", np.int32)
int64 = DType("int64", _T.kDLInt, 64, "<i8", np.int64)
uint64 = DType("uint64", _T.kDLUInt, 64, "<u8", np.uint64)  # peer address tables
bool_ = DType("bool", _T.kDLBool, 8, "|b1", np.bool_)

DTYPES = {d.name: d for d in (bfloat16, float16, float32, float64, float8_e4m3fn, float8_e5m2,
                              uint8, int8, uint16, int16, uint32, int32, int64, uint64, bool_)}
_BY_DLPACK = {d.dlpack: d for d in DTYPES.values()}
_BY_NUMPY = {d.numpy: d for d in DTYPES.values() if d.numpy is not None}


def as_dtype(x) -> DType:
    """A DType from a DType, its name ("bfloat16"), a NumPy dtype / scalar type / typestr, an
    ml_dtypes type (jnp.bfloat16) or a framework dtype object (torch.bfloat16), else a TypeError."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in DTYPES:
        return DTYPES[x]
    if x is None or isinstance(x, (bool, int, float)):  # (np.dtype(None) would read float64)
        raise TypeError(f"dtype {x!r} is not supported: use one of {', '.join(DTYPES)}")
    name = str(x)  # framework dtype objects print their name: torch.bfloat16 -> "torch.bfloat16"
    if type(x).__module__.split(".")[0] == "torch" and name.startswith("torch.") and name[6:] in DTYPES:
        return DTYPES[name[6:]]
    try:
        with warnings.catch_warnings():  # (NumPy's deprecated aliases, e.g. "a": refused below anyway)
            warnings.simplefilter("ignore", DeprecationWarning)
            npd = np.dtype(x)
    except (TypeError, ValueError, SyntaxError):  # np.dtype("01") raises SyntaxError
        npd = None
    # (by name too: ml_dtypes' bfloat16 / float8 types, where this module's table has no NumPy dtype)
    d = None if npd is None else _BY_NUMPY.get(npd) or (DTYPES.get(npd.name) if npd.kind == "V" else None)
    if d is None:
        raise TypeError(f"dtype {x!r} is not supported: use one of {', '.join(DTYPES)}")
    return d


def dtype_from_dlpack(code: int, bits: int, lanes: int) -> DType:
    d = _BY_DLPACK.get((code, bits, lanes))
    if d is None:
        try:
            code_name = _T(code).name
        except ValueError:
            code_name = f"unknown code {code}"
        rule = "vector types (lanes != 1) are not supported" if lanes != 1 else \
            "ep_a2a handles " + ", ".join(f"{n} {d.dlpack[:2]}" for n, d in DTYPES.items())
        raise TypeError(f"DLPack dtype ({code_name}, bits={bits}, lanes={lanes}) is not supported: {rule}")
    return d


def _check_device(device, what: str) -> tuple:
    kind, ordinal = int(device[0]), int(device[1])
    if kind not in _DEVICE_NAMES:
        try:
            name = _D(kind).name
        except ValueError:
            name = f"code {kind}"
        raise ValueError(f"{what}: device type {name} is not supported: ep_a2a handles "
                         f"{', '.join(d.name for d in _DEVICE_NAMES)} memory only")
    return _D(kind), ordinal


def _device_str(device) -> str:
    return f"{_DEVICE_NAMES[device[0]]}:{device[1]}"


def contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _as_stream(stream):
    if stream is None:
        return None
    s = stream_handle(stream)
    # 0 is the NULL stream, i.e. the legacy default stream for the driver API; DLPack and the
    # CUDA Array Interface forbid 0 as ambiguous and spell that stream 1.
    return 1 if s == 0 else s


def _wait(consumer: int, producer: int, device_id: int) -> None:
    """Make `consumer` wait, on the GPU, for all work queued so far on `producer`."""
    ev = Event(get_device(device_id))  # DISABLE_TIMING: the cheap kind of event
    try:
        ev.record(producer).wait_on(consumer)
    finally:
        ev.close()


def order_after(consumer, producer, device_id: int) -> None:
    """DLPack's stream rule, the one definition ep_a2a follows: a consumer stream waits for the
    work queued so far on the producer stream, unless they are one stream or either is None
    (complete, or not known) or the consumer is -1 (the caller orders)."""
    if producer is not None and consumer is not None and consumer != -1 and consumer != producer:
        _wait(consumer, producer, device_id)


class _HostArray:
    """Carries the __array_interface__ NumPy wraps, and keeps the Tensor (hence owner) alive."""
    __slots__ = ("tensor", "__array_interface__")


class Tensor:
    """A strided view of memory; strides are in elements, device is DLPack's (device_type, id)."""
    __slots__ = ("ptr", "shape", "dtype", "strides", "device", "owner", "stream", "read_only", "__weakref__")

    def __init__(self, ptr: int, shape, dtype, *, device, strides=None, owner=None, stream=None,
                 read_only: bool = False):
        self.ptr = operator.index(ptr)
        self.shape = tuple(operator.index(n) for n in shape)
        self.dtype = as_dtype(dtype)
        self.strides = contiguous_strides(self.shape) if strides is None else tuple(operator.index(s) for s in strides)
        if len(self.strides) != len(self.shape):
            raise ValueError(f"Tensor: {len(self.strides)} strides for {len(self.shape)} dimensions")
        if any(n < 0 for n in self.shape):
            raise ValueError(f"Tensor: negative extent in shape {self.shape}")
        if any(s < 0 for s in self.strides):  # kernels address every tensor upward from ptr
            raise ValueError(f"Tensor: negative strides {self.strides} are not supported: ep_a2a addresses "
                             "memory upward from the data pointer (make a copy with positive strides)")
        self.device = _check_device(device, "Tensor")
        self.owner, self.stream, self.read_only = owner, _as_stream(stream), bool(read_only)

    # -- geometry ---------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (numel * itemsize)."""
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        """Row-major with no gaps (extent-1 dimensions may carry any stride, as in DLPack)."""
        if self.numel == 0:
            return True
        step = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != step:
                return False
            step *= n
        return True

    def data_ptr(self) -> int:
        """The device address of the first element (as torch.Tensor.data_ptr)."""
        return self.ptr

    def view(self, offset: int = 0, shape=None, dtype=None) -> "Tensor":
        """Contiguous sub-view of bytes [offset, offset + its nbytes): same owner, device and stream.

        shape None: every remaining byte, 1-D. This is how a workspace is carved into regions."""
        if not self.is_contiguous:
            raise ValueError("view: needs a contiguous tensor (it addresses bytes from ptr)")
        dt = self.dtype if dtype is None else as_dtype(dtype)
        offset = operator.index(offset)
        if not 0 <= offset <= self.nbytes:
            raise ValueError(f"view: offset {offset} outside the tensor's {self.nbytes} bytes")
        if shape is None:
            rest = self.nbytes - offset
            if rest % dt.itemsize:
                raise ValueError(f"view: {rest} remaining bytes are not a whole number of {dt.name}")
            shape = (rest // dt.itemsize,)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        end = offset + math.prod(shape) * dt.itemsize
        if end > self.nbytes:
            raise ValueError(f"view: bytes [{offset}, {end}) exceed the tensor's {self.nbytes}")
        if (self.ptr + offset) % dt.itemsize:  # misaligned loads fault on the GPU
            raise ValueError(f"view: address {self.ptr + offset:#x} is not aligned to {dt.name} ({dt.itemsize} B)")
        return Tensor(self.ptr + offset, shape, dt, device=self.device, owner=self.owner, stream=self.stream,
                      read_only=self.read_only)

    def reshape(self, *shape) -> "Tensor":
        """Same bytes, new shape (one extent may be -1); contiguous tensors only."""
        shape = list(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        if shape.count(-1) > 1:
            raise ValueError(f"reshape: at most one -1 in {tuple(shape)}")
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            if known == 0 or self.numel % known:
                raise ValueError(f"reshape: cannot infer -1 in {tuple(shape)} for {self.numel} elements")
            shape[shape.index(-1)] = self.numel // known
        if math.prod(shape) != self.numel:
            raise ValueError(f"reshape: {tuple(shape)} does not hold {self.numel} elements of shape {self.shape}")
        return self.view(0, shape)

    # -- exchange -----------------------------------------------------------------------------
    def _order_for(self, consumer) -> None:
        """Make the data safe for a consumer stream, following DLPack's stream rules."""
        if consumer is not None and (not isinstance(consumer, int) or isinstance(consumer, bool)):
            raise TypeError(f"__dlpack__(stream={consumer!r}): stream must be an int stream handle or None")
        if self.device[0] in _ON_GPU:
            if consumer == 0:
                raise BufferError("__dlpack__(stream=0): 0 is ambiguous and DLPack disallows it "
                                  "(1 = legacy default stream, 2 = per-thread default stream, -1 = no sync)")
            if consumer is None:  # DLPack: no stream given means the legacy default stream
                consumer = 1
        if self.device[0] in _ON_GPU:
            order_after(consumer, self.stream, self.device[1])
        elif self.stream is not None and consumer != -1 and consumer != self.stream:
            synchronize_stream(self.stream)  # host memory is read by the host: nothing short of completion makes it safe

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("__dlpack__(copy=True): ep_a2a tensors are shared, never copied "
                              "(call with copy=None or False and copy on your side)")
        device = self.device
        if dl_device is not None and (int(dl_device[0]), int(dl_device[1])) != device:
            if device[0] == CUDA_HOST and (int(dl_device[0]), int(dl_device[1])) == (CPU, 0):
                device = (CPU, 0)  # pinned memory is CPU memory: no move needed, so DLPack allows it
            else:
                raise BufferError(f"__dlpack__(dl_device={tuple(dl_device)}): this tensor lives on "
                                  f"{_device_str(device)} and ep_a2a never moves data between devices")
        self._order_for(stream)
        versioned = max_version is not None and tuple(max_version)[0] >= 1
        return _dl.export(self.ptr, self.shape, self.strides, device, self.dtype.dlpack, self,
                          versioned=versioned, read_only=self.read_only)

    def __dlpack_device__(self) -> tuple:
        return self.device

    @property
    def __cuda_array_interface__(self) -> dict:
        # AttributeError (not TypeError): consumers probe with hasattr and then fall back to DLPack.
        if self.device[0] not in _ON_GPU:
            raise AttributeError(f"__cuda_array_interface__: only CUDA device memory has one; this tensor is "
                                 f"on {_device_str(self.device)} (use DLPack or to_numpy())")
        if self.dtype.typestr is None:
            raise AttributeError(f"__cuda_array_interface__: {self.dtype.name} has no typestr in the CUDA "
                                 "Array Interface; use DLPack (__dlpack__)")
        return {"shape": self.shape, "typestr": self.dtype.typestr, "data": (self.ptr, self.read_only),
                "strides": None if self.is_contiguous else tuple(s * self.itemsize for s in self.strides),
                "stream": self.stream, "version": 3}

    def to_numpy(self) -> np.ndarray:
        """A NumPy array over the same host memory (no copy); it keeps this tensor alive."""
        if self.device[0] not in _ON_HOST:
            raise TypeError(f"to_numpy: only host memory (cpu, cuda_host) can be wrapped; this tensor is on "
                            f"{_device_str(self.device)} (copy it to the host first)")
        if self.dtype.numpy is None:
            raise TypeError(f"to_numpy: NumPy has no {self.dtype.name} dtype (install ml_dtypes, or "
                            "view(dtype=uint8/uint16) to get the raw bits)")
        if self.stream is not None:  # the host reads it next
            synchronize_stream(self.stream)
        if self.numel == 0:
            return np.empty(self.shape, self.dtype.numpy)
        h = _HostArray()
        # Wrapped as unsigned ints of the same width, then viewed: works for ml_dtypes types too.
        h.tensor, h.__array_interface__ = self, {
            "shape": self.shape, "typestr": f"<u{self.itemsize}", "data": (self.ptr, self.read_only), "version": 3,
            "strides": None if self.is_contiguous else tuple(s * self.itemsize for s in self.strides)}
        return np.asarray(h).view(self.dtype.numpy)

    def __repr__(self) -> str:
        extra = "" if self.is_contiguous else f", strides={self.strides}"
        extra += "" if self.stream is None else f", stream={self.stream:#x}"
        return (f"Tensor(shape={self.shape}, dtype={self.dtype.name}, device={_device_str(self.device)}, "
                f"ptr={self.ptr:#x}{extra})")


def _call_dlpack(obj, stream):
    """`obj.__dlpack__`, newest protocol first: producers older than DLPack 1.0 reject
    max_version, and some host-only producers reject the stream keyword."""
    try:
        return obj.__dlpack__(stream=stream, max_version=_dl.MAX_VERSION)
    except TypeError:
        pass
    try:
        return obj.__dlpack__(stream=stream)
    except TypeError:
        if stream is not None:  # dropping it would silently drop the ordering we were asked for
            raise
    return obj.__dlpack__()


def _from_dlpack(obj, stream, what: str) -> Tensor:
    device = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else None
    if device is not None:  # refuse early, before the producer does any work
        device = _check_device(device, what)
    on_gpu = device is None or device[0] in _ON_GPU
    ask = _as_stream(stream) if on_gpu else None  # DLPack: host producers take no stream
    capsule = _call_dlpack(obj, ask)
    try:
        cap = _dl.Capsule(capsule)
        on_gpu = cap.device[0] in _ON_GPU
        # The producer made the data safe on the stream we asked for (None: the legacy default).
        produced_on = (1 if ask is None else None if ask == -1 else ask) if on_gpu else None
        t = Tensor(cap.ptr, cap.shape, dtype_from_dlpack(*cap.dtype), device=cap.device, strides=cap.strides,
                   stream=produced_on, read_only=cap.read_only)
    except (TypeError, ValueError) as e:  # unclaimed: the producer's capsule destructor frees it
        raise type(e)(f"{what}: {str(e).removeprefix('Tensor: ')}") from None
    t.owner = cap.claim()
    return t


def _from_cai(obj, cai: dict, stream, what: str) -> Tensor:
    if cai.get("mask") is not None:
        raise ValueError(f"{what}: masked arrays (__cuda_array_interface__ 'mask') are not supported")
    try:
        dt = as_dtype(cai["typestr"])
    except TypeError as e:
        raise TypeError(f"{what}: {e}") from None
    ptr, read_only = cai["data"]
    strides = cai.get("strides")
    if strides is not None:
        if any(s % dt.itemsize for s in strides):
            raise ValueError(f"{what}: byte strides {tuple(strides)} are not multiples of {dt.name}'s "
                             f"{dt.itemsize} B (ep_a2a strides count elements)")
        strides = tuple(s // dt.itemsize for s in strides)
    producer = cai.get("stream")
    if producer == 0:
        raise ValueError(f"{what}: __cuda_array_interface__ stream 0 is disallowed by the interface (ambiguous)")
    init()
    ordinal = pointer_device(ptr) if ptr else 0
    consumer = _as_stream(stream)
    if consumer not in (None, -1) and producer is not None and consumer != producer:
        order_after(consumer, producer, ordinal)
        producer = consumer
    try:
        return Tensor(ptr, cai["shape"], dt, device=(CUDA, ordinal), strides=strides, owner=obj,
                      stream=producer, read_only=read_only)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {str(e).removeprefix('Tensor: ')}") from None


def as_tensor(obj, *, stream=None) -> Tensor:
    """A Tensor over `obj`'s memory, never a copy.

    obj: a Tensor (returned as is), anything with `__dlpack__` (PyTorch, JAX, CuPy, NumPy) or with
    `__cuda_array_interface__` (Numba, CuPy). stream: the CUDA stream the caller will use the
    data on; the producer orders its pending work before it, and the result's `stream` is it
    (None: the legacy default stream, per DLPack; -1: no ordering, the caller's job).
    A Tensor is returned as is; with a stream, the work pending on the Tensor's own `stream`
    is ordered before that stream first (as its __dlpack__ does).
    """
    if isinstance(obj, Tensor):
        if stream is not None and stream != -1:
            obj._order_for(_as_stream(stream))  # (a driver handle: 0, the NULL stream, is DLPack's 1)
        return obj
    what = f"as_tensor({type(obj).__name__})"
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, stream, what)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai, stream, what)
    raise TypeError(f"{what}: expected an ep_a2a Tensor or an object implementing __dlpack__ or "
                    "__cuda_array_interface__ (a PyTorch, JAX, CuPy or NumPy array)")


def from_numpy(array: np.ndarray) -> Tensor:
    """A host Tensor over a NumPy array's memory (no copy; the array stays alive)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_numpy: expected a numpy.ndarray, got {type(array).__name__}")
    return as_tensor(array)
