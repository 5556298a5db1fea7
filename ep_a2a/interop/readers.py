"""Framework tensors that the repeat fast path (fastpath.py) recognises without a DLPack
exchange: per framework, how to read what a tensor's conversion to an ep_a2a Tensor depends
on (its geometry) and the stream that framework queues the tensor's work on.

Only geometry is read, never the values: a write into a tensor's values changes nothing the
launch depends on (the kernels read the values on the device when they run), while a
tensor moved to other memory, resized, restrided or retyped reads differently, and its
call takes the full path (the DLPack exchange and every check). torch tensors and CuPy
arrays (exactly torch.Tensor and cupy.ndarray: a subclass may export differently) have a
reader; other frameworks take the full path unless one is registered (JAX's export waits
for an array's own ready event, which no current stream stands for).
"""
from __future__ import annotations

import sys
from typing import Callable, NamedTuple


class Reader(NamedTuple):
    geometry: Callable  # tensor -> a tuple, equal for two reads exactly when the conversions would be
    ordinal: Callable   # tensor -> its CUDA device ordinal
    producer: Callable  # ordinal -> the raw stream the framework queues work on now (its DLPack export orders it)
    tensor: Callable    # tensor -> an ep_a2a Tensor over its memory that owns nothing


_READERS = {}  # type -> its Reader, or None where it has none (decided once per type)


def register(kind: type, reader: Reader) -> None:
    """Give tensors of exactly type `kind` a reader."""
    _READERS[kind] = reader


def reader_of(obj):
    """The Reader of `obj`'s type, or None (then a call with it always takes the full path)."""
    kind = type(obj)
    try:
        return _READERS[kind]
    except KeyError:
        reader = _READERS[kind] = _builtin(kind)
        return reader


def _builtin(kind):
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")  # (their tensors exist only once imported)
    if torch is not None and kind is torch.Tensor:
        from . import torch_tensor as tt
        return Reader(tt.geometry, tt.device_ordinal, tt.current_stream, tt.standing_tensor)
    if cupy is not None and kind is cupy.ndarray:
        from . import cupy_array as ca
        return Reader(ca.geometry, ca.device_ordinal, ca.current_stream, ca.standing_tensor)
    return None
