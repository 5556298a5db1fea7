"""Tensor, DType and the DLPack ABI: host-memory round trips with NumPy (no GPU needed), plus
zero-copy round trips through PyTorch, CuPy and JAX on a GPU (marked `gpu`)."""
import ctypes
import gc
import weakref

import numpy as np
import pytest

from ep_a2a.interop import dlpack as dl
from ep_a2a.interop import tensor as T
from ep_a2a.interop.tensor import Tensor, as_tensor, from_numpy

rng = np.random.default_rng()

# The oracle, typed in from dlpack.h (DLDataTypeCode), independent of the code under test.
DLPACK_CODES = {"bfloat16": (4, 16), "float16": (2, 16), "float32": (2, 32), "float64": (2, 64),
                "float8_e4m3fn": (10, 8), "float8_e5m2": (12, 8), "uint8": (1, 8), "int8": (0, 8),
                "uint16": (1, 16), "int16": (0, 16), "uint32": (1, 32), "int32": (0, 32), "int64": (0, 64),
                "uint64": (1, 64), "bool": (6, 8)}
NUMPY_DTYPES = [n for n in DLPACK_CODES if n != "bfloat16" and not n.startswith("float8")]

_py = ctypes.PyDLL(None)
_py.PyCapsule_GetName.restype, _py.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
_py.PyCapsule_New.restype = ctypes.py_object
_py.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def capsule_name(cap) -> str:
    return _py.PyCapsule_GetName(cap).decode()


def random_array(dtype, shape=(7, 13)):
    """Fresh random values (random bytes for floats, NaN patterns excepted; bools from random bits)."""
    if dtype == "bool":
        a = rng.integers(0, 2, size=shape).astype(bool)
        a.flat[0], a.flat[1] = True, False
        return a
    itemsize = np.dtype(dtype).itemsize
    raw = rng.integers(1, 256, size=int(np.prod(shape)) * itemsize, dtype=np.uint8)
    a = raw.view(dtype).reshape(shape)
    if a.dtype.kind == "f":  # NaN != NaN: np.array_equal would call identical memory different
        nan = np.isnan(a)
        a[nan] = rng.uniform(1.0, 2.0, size=int(nan.sum()))
    return a


def host_tensor(nbytes=4096):
    base = rng.integers(1, 256, size=nbytes, dtype=np.uint8)
    return base, Tensor(base.ctypes.data, (nbytes,), "uint8", device=(T.CPU, 0), owner=base)


def producer(make_capsule, device=None, style="modern"):
    """An object implementing __dlpack__ in one of the three historical signatures."""
    calls, ns = [], {}
    if style == "modern":
        def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
            calls.append(dict(stream=stream, max_version=max_version))
            return make_capsule(max_version)
    elif style == "no_max_version":
        def __dlpack__(self, *, stream=None):
            calls.append(dict(stream=stream))
            return make_capsule(None)
    else:  # "no_stream"
        def __dlpack__(self):
            calls.append({})
            return make_capsule(None)
    ns["__dlpack__"] = __dlpack__
    if device is not None:
        ns["__dlpack_device__"] = lambda self: device
    obj = type("FakeProducer", (), ns)()
    obj.calls = calls
    return obj


class ForeignManaged:
    """A managed tensor made by a "foreign producer" (this test), with a deleter that counts its calls."""

    def __init__(self, array, *, versioned, byte_offset=0, version=(1, 0), device=(1, 0), strides=True):
        self.array, self.deletes = array, 0
        self.deleter = dl.DELETER(self._delete)
        ndim = array.ndim
        self.shape = (ctypes.c_int64 * ndim)(*array.shape)
        self.strides = (ctypes.c_int64 * ndim)(*(s // array.itemsize for s in array.strides))
        self.m = dl.DLManagedTensorVersioned() if versioned else dl.DLManagedTensor()
        if versioned:
            self.m.version = dl.DLPackVersion(*version)
        t = self.m.dl_tensor
        t.data, t.byte_offset = array.ctypes.data - byte_offset, byte_offset
        t.device, t.ndim = dl.DLDevice(*device), ndim
        code, bits = DLPACK_CODES[T.as_dtype(array.dtype).name]
        t.dtype = dl.DLDataType(code, bits, 1)
        t.shape, t.strides = self.shape, (self.strides if strides else None)
        self.m.deleter = self.deleter
        # No capsule destructor: if nobody claims it, it simply leaks (test objects only).
        self.capsule = _py.PyCapsule_New(ctypes.addressof(self.m),
                                         dl.NAME_VERSIONED if versioned else dl.NAME, None)

    def _delete(self, address):
        assert address == ctypes.addressof(self.m)
        self.deletes += 1


def settle():
    gc.collect()
    return dl.stats()


# -- NumPy round trips -------------------------------------------------------------------------
@pytest.mark.parametrize("name", NUMPY_DTYPES)
def test_numpy_round_trip_is_zero_copy(name):
    a = random_array(name)
    t = as_tensor(a)
    assert (t.ptr, t.shape, t.strides, t.device) == (a.ctypes.data, a.shape, (13, 1), (T.CPU, 0))
    assert t.dtype is T.DTYPES[name] and t.dtype.numpy == a.dtype and t.nbytes == a.nbytes and t.is_contiguous
    b = np.from_dlpack(t)
    assert b.ctypes.data == a.ctypes.data and b.dtype == a.dtype and b.tobytes() == a.tobytes()
    b[3, 4] = a[0, 0] if name == "bool" else a[1, 2]  # zero copy both ways: a write shows through
    a[0, 0] = a[5, 5]
    assert b.tobytes() == a.tobytes() == t.to_numpy().tobytes()
    assert t.to_numpy().ctypes.data == a.ctypes.data


def test_strided_numpy_views_keep_strides():
    a = random_array("float32", (8, 10))
    v = a[1::2, 3:9:2]
    t = as_tensor(v)
    assert t.ptr == v.ctypes.data and t.shape == (4, 3) and t.strides == (20, 2) and not t.is_contiguous
    assert np.array_equal(np.from_dlpack(t), v) and np.array_equal(t.to_numpy(), v)
    assert "strides=(20, 2)" in repr(t)


def test_read_only_flag_travels():
    a = random_array("int32")
    a.flags.writeable = False
    t = as_tensor(a)
    assert t.read_only
    b = np.from_dlpack(t)  # NumPy asks for a versioned capsule, which carries the flag
    assert not b.flags.writeable and np.array_equal(a, b)


def test_from_numpy_and_zero_dim_and_empty():
    s = np.array(rng.integers(1, 1000), dtype=np.int64)
    t = from_numpy(s)
    assert t.shape == () and t.numel == 1 and np.from_dlpack(t) == s
    e = np.empty((0, 5), np.float32)
    assert from_numpy(e).numel == 0 and from_numpy(e).to_numpy().shape == (0, 5)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        from_numpy([1, 2])


# -- capsules, versions and deleters -----------------------------------------------------------
@pytest.mark.parametrize("max_version,name", [((1, 0), "dltensor_versioned"), ((1, 1), "dltensor_versioned"),
                                              ((2, 0), "dltensor_versioned"), (None, "dltensor"),
                                              ((0, 8), "dltensor")])
def test_capsule_versions_and_claim(max_version, name):
    a = random_array("float32", (6, 4))
    t = as_tensor(a)
    before = settle()
    cap = t.__dlpack__(max_version=max_version)
    assert capsule_name(cap) == name
    c = dl.Capsule(cap)
    assert c.versioned == (name == "dltensor_versioned")
    assert c.version == ((1, 0) if c.versioned else None) and c.flags == 0
    assert (c.ptr, c.shape, c.strides, c.device, c.dtype) == (a.ctypes.data, (6, 4), (4, 1), (1, 0), (2, 32, 1))
    owner = c.claim()
    assert capsule_name(cap) == "used_" + name
    with pytest.raises(ValueError, match="already consumed"):
        dl.Capsule(cap)
    del cap
    assert settle()["live"] == before["live"] + 1  # renamed: the destructor left it to us
    owner.release()
    owner.release()
    del owner
    after = settle()
    assert after["deleted"] == before["deleted"] + 1 and after["unknown_deletes"] == before["unknown_deletes"]
    assert after["live"] == before["live"]


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_unconsumed_capsule_calls_deleter_once(max_version):
    t = as_tensor(random_array("int16"))
    before = settle()
    cap = t.__dlpack__(max_version=max_version)
    assert settle()["live"] == before["live"] + 1
    del cap
    after = settle()
    assert after["live"] == before["live"] and after["deleted"] == before["deleted"] + 1
    assert after["unknown_deletes"] == before["unknown_deletes"]


def test_numpy_consumer_calls_deleter_once():
    t = as_tensor(random_array("uint32"))
    before = settle()
    b = np.from_dlpack(t)
    mid = settle()
    assert mid["exported"] == before["exported"] + 1 and mid["live"] == before["live"] + 1
    del b
    after = settle()
    assert after["deleted"] == before["deleted"] + 1 and after["live"] == before["live"]
    assert after["unknown_deletes"] == before["unknown_deletes"]


def test_capsule_keeps_the_tensor_alive():
    a = random_array("float64")
    t = Tensor(a.ctypes.data, a.shape, "float64", device=(T.CPU, 0), owner=a)
    alive = weakref.ref(t)
    cap = t.__dlpack__(max_version=(1, 0))
    del t
    assert settle() and alive() is not None  # the export holds it until the deleter runs
    b = np.from_dlpack(producer(lambda mv: cap, device=(1, 0)))
    del cap
    assert alive() is not None and np.array_equal(b, a)
    del b
    gc.collect()
    assert alive() is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_capsule_dropped_with_an_exception_pending_is_still_freed():
    # NumPy refuses a CUDA capsule after taking it and drops it with its error already set: our
    # destructor must still run the deleter (no leak). The error itself is reported as unraisable.
    t = Tensor(0x10000, (4,), "float32", device=(T.CUDA, 0))
    before = settle()
    with pytest.raises(Exception):
        np.from_dlpack(t)
    after = settle()
    assert after["live"] == before["live"] and after["deleted"] == before["deleted"] + 1


@pytest.mark.parametrize("versioned", [True, False])
def test_foreign_capsule_deleter_called_once(versioned):
    a = random_array("int32", (9, 5))
    f = ForeignManaged(a, versioned=versioned)
    t = as_tensor(producer(lambda mv: f.capsule, device=(1, 0)))
    assert capsule_name(f.capsule) == ("used_dltensor_versioned" if versioned else "used_dltensor")
    assert t.ptr == a.ctypes.data and np.array_equal(t.to_numpy(), a)
    v = t.view(20, (5,), "int32")  # views share the owner: the deleter waits for them too
    del t
    gc.collect()
    assert f.deletes == 0 and np.array_equal(v.to_numpy(), a.reshape(-1)[5:10])
    del v
    gc.collect()
    assert f.deletes == 1
    gc.collect()
    assert f.deletes == 1


def test_foreign_byte_offset_and_null_strides():
    a = random_array("float32", (3, 8))
    f = ForeignManaged(a, versioned=False, byte_offset=64, strides=False)
    t = as_tensor(producer(lambda mv: f.capsule))
    assert t.ptr == a.ctypes.data and t.strides == (8, 1) and np.array_equal(t.to_numpy(), a)


@pytest.mark.parametrize("style", ["modern", "no_max_version", "no_stream"])
def test_old_producer_signatures(style):
    a = random_array("uint16")
    made = []

    def make(mv):
        made.append(ForeignManaged(a, versioned=mv is not None))
        return made[-1].capsule

    p = producer(make, device=(1, 0), style=style)
    t = as_tensor(p)
    assert np.array_equal(t.to_numpy(), a)
    assert made[-1].m.__class__ is (dl.DLManagedTensorVersioned if style == "modern" else dl.DLManagedTensor)
    assert p.calls[-1].get("stream") is None  # host producers are never given a stream
    if style == "modern":
        assert tuple(p.calls[-1]["max_version"]) >= (1, 0)


# -- dtypes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DLPACK_CODES))
@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_every_dtype_dlpack_code_round_trip(name, max_version):
    dt = T.DTYPES[name]
    assert dt.dlpack == (*DLPACK_CODES[name], 1) and dt.itemsize * 8 == DLPACK_CODES[name][1]
    assert T.as_dtype(name) is dt and T.as_dtype(dt) is dt and T.dtype_from_dlpack(*dt.dlpack) is dt
    if dt.numpy is not None:
        assert T.as_dtype(dt.numpy) is dt
    base, raw = host_tensor(64 * 8)
    t = raw.view(0, (4, 64 * 8 // 4 // dt.itemsize), dt)
    cap = t.__dlpack__(max_version=max_version)
    assert dl.Capsule(cap).dtype == dt.dlpack
    u = as_tensor(producer(lambda mv: cap, device=(1, 0)))
    assert u.dtype is dt and u.ptr == base.ctypes.data and u.shape == t.shape
    assert u.view(dtype="uint8").to_numpy().tobytes() == base.tobytes()


def test_low_precision_with_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        base, raw = host_tensor(256)
        t = raw.view(0, None, name)
        assert np.array_equal(t.to_numpy().view(np.uint8), base)
        assert t.to_numpy().dtype == np.dtype(getattr(ml, name))


def test_low_precision_without_a_numpy_dtype():
    if T.bfloat16.numpy is not None:
        pytest.skip("ml_dtypes is installed: bfloat16 has a NumPy dtype here")
    base, raw = host_tensor(256)
    t = raw.view(0, None, "bfloat16")
    with pytest.raises(TypeError, match="ml_dtypes"):
        t.to_numpy()
    assert np.array_equal(t.view(0, None, "uint16").to_numpy(), base.view(np.uint16))  # raw bits still reachable


def test_cuda_array_interface_of_device_tensors():
    t = Tensor(0x7000_0000, (4, 6), "float16", device=(T.CUDA, 1))
    cai = t.__cuda_array_interface__
    assert cai == {"shape": (4, 6), "typestr": "<f2", "data": (0x7000_0000, False), "strides": None,
                   "stream": None, "version": 3}
    s = Tensor(0x7000_0000, (4, 3), "int32", device=(T.CUDA, 0), strides=(6, 2), stream=0x1234)
    assert s.__cuda_array_interface__["strides"] == (24, 8) and s.__cuda_array_interface__["stream"] == 0x1234
    assert Tensor(0x7000_0000, (4,), "int32", device=(T.CUDA, 0), stream=0).stream == 1  # 0 is spelled 1
    assert t.__dlpack_device__() == (2, 1)
    with pytest.raises(AttributeError, match="DLPack"):
        Tensor(0x7000_0000, (4,), "bfloat16", device=(T.CUDA, 0)).__cuda_array_interface__
    host = as_tensor(random_array("float32"))
    assert not hasattr(host, "__cuda_array_interface__")
    with pytest.raises(AttributeError, match="only CUDA device memory"):
        host.__cuda_array_interface__


def test_device_tensor_capsule_without_a_gpu():
    # With no pending stream nothing touches the driver: the capsule only describes the memory.
    t = Tensor(0x7000_0000, (2, 8), "int64", device=(T.CUDA, 3))
    for mv in (None, (1, 0)):
        for stream in (None, 1, 2, -1, 0x55):
            c = dl.Capsule(t.__dlpack__(stream=stream, max_version=mv))
            assert c.device == (2, 3) and c.ptr == 0x7000_0000 and c.shape == (2, 8)
    with pytest.raises(TypeError, match="host"):
        t.to_numpy()


def test_pinned_host_tensor_reads_as_cpu():
    a = random_array("int32")
    t = Tensor(a.ctypes.data, a.shape, "int32", device=(T.CUDA_HOST, 0), owner=a)  # as pinned memory would be
    assert np.array_equal(t.to_numpy(), a) and np.array_equal(np.from_dlpack(t), a)
    assert dl.Capsule(t.__dlpack__(dl_device=(1, 0))).device == (1, 0)
    assert not hasattr(t, "__cuda_array_interface__")


# -- views -------------------------------------------------------------------------------------
def test_views_and_reshape():
    base, t = host_tensor(4096)
    v = t.view(128, (16, 8), "int32")
    assert v.ptr == base.ctypes.data + 128 and v.owner is base and v.nbytes == 512
    assert np.array_equal(v.to_numpy(), base[128:640].view(np.int32).reshape(16, 8))
    assert np.array_equal(np.from_dlpack(v), v.to_numpy())
    w = t.view(64, dtype="float32")
    assert w.shape == ((4096 - 64) // 4,)
    r = v.reshape(-1, 32)
    assert r.shape == (4, 32) and r.ptr == v.ptr
    assert v.reshape(128).shape == (128,) and v.reshape((8, 16)).shape == (8, 16)
    with pytest.raises(ValueError, match="aligned"):
        t.view(2, (4,), "int32")
    with pytest.raises(ValueError, match="exceed"):
        t.view(4000, (100,), "uint8")
    with pytest.raises(ValueError, match="outside"):
        t.view(5000)
    with pytest.raises(ValueError, match="whole number"):
        t.view(2, None, "int32")
    with pytest.raises(ValueError, match="contiguous"):
        as_tensor(random_array("int32", (4, 4))[:, ::2]).view(0)
    with pytest.raises(ValueError, match="does not hold"):
        v.reshape(5, 5)
    assert "dtype=int32" in repr(v) and "cpu:0" in repr(v)


# -- error paths -------------------------------------------------------------------------------
def test_errors_name_the_rule():
    a = random_array("float32")
    t = as_tensor(a)
    with pytest.raises(BufferError, match=r"copy=True.*never copied"):
        t.__dlpack__(copy=True)
    assert capsule_name(t.__dlpack__(copy=False)) == "dltensor"
    with pytest.raises(BufferError, match="never moves"):
        t.__dlpack__(dl_device=(2, 0))
    assert dl.Capsule(t.__dlpack__(dl_device=(1, 0))).device == (1, 0)
    with pytest.raises(ValueError, match=r"as_tensor\(ndarray\): negative strides"):
        as_tensor(a[::-1])
    with pytest.raises(ValueError, match="negative strides"):
        Tensor(a.ctypes.data, (4,), "float32", device=(T.CPU, 0), strides=(-1,))
    with pytest.raises(ValueError, match="kDLROCM is not supported"):
        Tensor(0x1000, (4,), "float32", device=(10, 0))
    with pytest.raises(TypeError, match=r"kDLComplex.*not supported"):
        as_tensor(np.ones(3, np.complex64))
    with pytest.raises(TypeError, match=r"dtype 'complex64' is not supported"):
        Tensor(0x1000, (4,), "complex64", device=(T.CPU, 0))
    with pytest.raises(TypeError, match="__dlpack__ or __cuda_array_interface__"):
        as_tensor(42)
    g = Tensor(0x7000_0000, (4,), "float32", device=(T.CUDA, 0))
    with pytest.raises(BufferError, match="0 is ambiguous"):
        g.__dlpack__(stream=0)
    with pytest.raises(TypeError, match="int stream handle"):
        g.__dlpack__(stream=1.5)


def test_refused_capsules_stay_with_their_producer():
    before = settle()
    rocm = producer(lambda mv: dl.export(0x1000, (4,), (1,), (10, 0), (2, 32, 1), None, versioned=mv is not None))
    with pytest.raises(ValueError, match=r"as_tensor\(FakeProducer\): device type kDLROCM is not supported"):
        as_tensor(rocm)
    lanes = producer(lambda mv: dl.export(0x1000, (4,), (1,), (1, 0), (2, 32, 4), None, versioned=True))
    with pytest.raises(TypeError, match=r"lanes != 1"):
        as_tensor(lanes)
    odd = producer(lambda mv: dl.export(0x1000, (4,), (1,), (1, 0), (2, 24, 1), None, versioned=True))
    with pytest.raises(TypeError, match=r"bits=24"):
        as_tensor(odd)
    after = settle()  # never renamed, so our own capsule destructor freed each of them
    assert after["live"] == before["live"] and after["deleted"] == before["deleted"] + 3
    early = producer(lambda mv: pytest.fail("__dlpack__ must not be called"), device=(10, 0))
    with pytest.raises(ValueError, match="kDLROCM"):
        as_tensor(early)
    f = ForeignManaged(random_array("int8"), versioned=True, version=(2, 0))
    with pytest.raises(ValueError, match="version 2.0 is not supported"):
        as_tensor(producer(lambda mv: f.capsule))
    assert capsule_name(f.capsule) == "dltensor_versioned"  # left for its producer to free
    with pytest.raises(ValueError, match="expected a DLPack capsule"):
        as_tensor(producer(lambda mv: object()))


# -- GPU: zero-copy through frameworks ---------------------------------------------------------
def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int32",
                                  "int64", "uint8", "int8", "bool"])
def test_torch_round_trip_zero_copy(name):
    torch = _torch_cuda()
    tdt = getattr(torch, name)
    raw = torch.randint(1, 256, (64 * 24,), dtype=torch.uint8, device="cuda")
    if name == "bool":
        raw = raw % 2
    x = raw.view(tdt).view(8, -1)
    t = as_tensor(x)
    assert t.ptr == x.data_ptr() and t.dtype is T.DTYPES[name] and t.shape == tuple(x.shape)
    assert t.device == (T.CUDA, x.device.index)
    y = torch.from_dlpack(t)  # versioned capsule
    z = torch.utils.dlpack.from_dlpack(t.__dlpack__())  # legacy capsule
    for u in (y, z):
        assert u.data_ptr() == x.data_ptr() and u.dtype == tdt
        assert torch.equal(u.view(torch.uint8), x.view(torch.uint8))
    y.view(torch.uint8)[0, 0] = 1 if name == "bool" else 77
    torch.cuda.synchronize()
    assert x.view(torch.uint8)[0, 0].item() == (1 if name == "bool" else 77)
    s = x[1::2, 8:]
    ts = as_tensor(s)
    assert ts.ptr == s.data_ptr() and ts.strides == tuple(s.stride())
    assert torch.equal(torch.from_dlpack(ts).view(torch.uint8), s.view(torch.uint8))


@pytest.mark.gpu
def test_torch_consumer_stream_is_honoured():
    torch = _torch_cuda()
    producer_stream = torch.cuda.Stream()
    x = torch.rand(1 << 22, device="cuda") + 1.0
    value = float(rng.integers(2, 1000))
    torch.cuda.synchronize()
    with torch.cuda.stream(producer_stream):
        torch.cuda._sleep(200_000_000)  # the fill lands long after the consumer would have read
        x.fill_(value)
    t = Tensor(x.data_ptr(), tuple(x.shape), "float32", device=(T.CUDA, x.device.index), owner=x,
               stream=producer_stream.cuda_stream)
    y = torch.from_dlpack(t)  # torch passes its current stream: it must wait for the fill
    copied = y.clone()
    torch.cuda.synchronize()
    assert bool((copied == value).all())


@pytest.mark.gpu
def test_as_tensor_passes_our_stream_to_torch():
    torch = _torch_cuda()
    ours = torch.cuda.Stream()
    x = torch.rand(1 << 22, device="cuda") + 1.0
    value = float(rng.integers(2, 1000))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    x.fill_(value)  # on torch's current stream
    t = as_tensor(x, stream=ours.cuda_stream)
    assert t.stream == ours.cuda_stream and t.ptr == x.data_ptr()
    with torch.cuda.stream(ours):
        copied = torch.from_dlpack(t).clone()
    torch.cuda.synchronize()
    assert bool((copied == value).all())


@pytest.mark.gpu
def test_gpu_export_leaves_no_live_capsules():
    torch = _torch_cuda()
    x = torch.randint(1, 100, (1000,), device="cuda", dtype=torch.int32)
    before = settle()
    ys = [torch.from_dlpack(as_tensor(x)) for _ in range(10)]
    del ys
    after = settle()
    assert after["live"] == before["live"] and after["unknown_deletes"] == before["unknown_deletes"]


@pytest.mark.gpu
def test_cupy_round_trip_zero_copy():
    cp = pytest.importorskip("cupy")
    for dtype in (cp.float32, cp.float16, cp.int32, cp.uint8):
        a = cp.asarray(rng.integers(1, 120, size=(32, 33)).astype(dtype))
        t = as_tensor(a)
        assert t.ptr == a.data.ptr and t.device == (T.CUDA, a.device.id)
        b = cp.from_dlpack(t)
        assert b.data.ptr == a.data.ptr and bool(cp.array_equal(a, b))
        c = cp.asarray(t)  # through __cuda_array_interface__
        assert c.data.ptr == a.data.ptr and bool(cp.array_equal(a, c))
        s = a[:, 1::2]
        assert as_tensor(s).strides == tuple(n // s.itemsize for n in s.strides)

    class CaiOnly:
        def __init__(self, arr):
            self.__cuda_array_interface__ = arr.__cuda_array_interface__

    a = cp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
    t = as_tensor(CaiOnly(a[:, ::2]))
    assert t.ptr == a.data.ptr and t.strides == (8, 2) and t.device == (T.CUDA, a.device.id)
    assert bool(cp.array_equal(cp.from_dlpack(t), a[:, ::2]))
    with cp.cuda.Stream() as s:
        t2 = as_tensor(a, stream=s.ptr)
        assert t2.stream == s.ptr and t2.ptr == a.data.ptr


@pytest.mark.gpu
def test_jax_round_trip_zero_copy():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend")
    for dtype in (jnp.float32, jnp.bfloat16, jnp.int32):
        x = jax.device_put(jnp.asarray(rng.integers(1, 120, size=(64, 32)), dtype=dtype), dev)
        x.block_until_ready()
        t = as_tensor(x)
        assert t.ptr == x.unsafe_buffer_pointer() and t.dtype.name == jnp.dtype(dtype).name
        y = jax.dlpack.from_dlpack(t)
        assert y.unsafe_buffer_pointer() == t.ptr
        assert np.array_equal(np.asarray(y).view(np.uint8), np.asarray(x).view(np.uint8))


def test_frees_wait_for_a_safe_point_while_in_process_ranks_exist(monkeypatch):
    """An allocation dropped while in-process ranks may spin is freed at release_held(),
    never inside __del__ (cuMemFree would wait for kernels waiting on the host)."""
    from ep_a2a.driver import memory as M
    freed = []
    monkeypatch.setattr(M, "call", lambda fn, p: freed.append(p))

    class Dev:
        def make_current(self):
            pass

    def alloc(p):
        a = object.__new__(M.DeviceAllocation)
        a.device, a.nbytes, a._p, a.ptr = Dev(), 1, p, p
        return a

    M.hold_frees(True)
    try:
        a = alloc(0x1000)
        del a
        gc.collect()
        assert freed == [] and [p for _, p in M._held] == [0x1000]
        M.release_held()
        assert freed == [0x1000] and not M._held
        b = alloc(0x2000)
        b.close()  # an explicit close frees at once (its caller chose the moment)
        assert freed == [0x1000, 0x2000]
        c = alloc(0x3000)
        del c
    finally:
        M.hold_frees(False)  # the last holder going away frees what is queued
    assert freed == [0x1000, 0x2000, 0x3000] and M._held_by == 0
    d = alloc(0x4000)
    del d  # no holder: freed at once
    assert freed[-1] == 0x4000

