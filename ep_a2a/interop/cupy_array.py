"""CuPy arrays as the repeat fast path reads them (interop/readers.py): geometry through
CuPy's own attributes, and CuPy's current stream, which its DLPack export orders before the
consumer's stream (the NULL stream read as the legacy one, as CuPy does). cupy is imported
only when one of these runs."""
from __future__ import annotations

from .tensor import CUDA, Tensor, as_dtype

_LEGACY = 1  # CU_STREAM_LEGACY: what CuPy's current stream 0 stands for in its DLPack export


def geometry(a) -> tuple:
    """What an array's conversion to an ep_a2a Tensor depends on: address, shape, byte strides,
    dtype and device (a write into its values changes none of it)."""
    data = a.data
    return data.ptr, a.shape, a.strides, a.dtype, data.device_id


def device_ordinal(a) -> int:
    return a.data.device_id


def current_stream(ordinal: int) -> int:
    import cupy
    return cupy.cuda.get_current_stream().ptr or _LEGACY


def standing_tensor(a) -> Tensor:
    """An ep_a2a Tensor over the array's memory that owns nothing (the caller holds the array)."""
    d = as_dtype(a.dtype)
    return Tensor(a.data.ptr, a.shape, d, device=(CUDA, a.data.device_id),
                  strides=tuple(s // d.itemsize for s in a.strides))
