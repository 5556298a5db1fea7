"""Streams (ours, raw handles, framework streams), events and graph capture."""
from __future__ import annotations

from cuda.bindings import driver as _drv
from cuda.bindings.utils import get_cuda_native_handle

from .device import Device
from .lifetime import Owned
from .errors import call


def native(handle) -> int:
    """The integer value of a driver handle (CUstream, CUevent, CUdeviceptr, ...)."""
    return handle if isinstance(handle, int) else int(get_cuda_native_handle(handle))


def synchronize_stream(handle: int) -> None:
    """Wait on the host for everything queued on a raw stream handle."""
    call(_drv.cuStreamSynchronize, handle)


def stream_handle(stream) -> int:
    """A raw CUstream from what callers pass: an int, a CUstream, an object with
    `__cuda_stream__` (CUDA stream protocol), torch.cuda.Stream, cupy Stream, or our Stream."""
    if stream is None:
        raise TypeError("stream: expected a CUDA stream, got None")
    if isinstance(stream, int):
        return stream
    if isinstance(stream, _drv.CUstream):
        return native(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        ver_handle = proto() if callable(proto) else proto
        return int(ver_handle[1])
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, cupy, our own
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError(f"stream: cannot get a CUDA stream handle from {type(stream).__name__} "
                    "(pass an int handle, a CUstream, or an object with __cuda_stream__)")


class Stream(Owned):
    """A non-blocking stream of ours on one device."""
    _kind = "streams"

    def __init__(self, device: Device):
        device.make_current()
        self.device = device
        self._s = call(_drv.cuStreamCreate, _drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.handle = native(self._s)
        self._opened()

    def __cuda_stream__(self):
        return (0, self.handle)

    def synchronize(self) -> None:
        call(_drv.cuStreamSynchronize, self.handle)

    def _release(self) -> None:
        self.device.make_current()
        s, self._s = self._s, None
        call(_drv.cuStreamDestroy, s)


class Event(Owned):
    _kind = "events"

    def __init__(self, device: Device, timing: bool = False):
        device.make_current()
        flags = _drv.CUevent_flags.CU_EVENT_DEFAULT if timing else _drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._e = call(_drv.cuEventCreate, flags)
        self._opened()

    @property
    def handle(self):
        """The CUevent, for native code that records or waits on it (the JAX FFI handler)."""
        return self._e

    def record(self, stream: int) -> "Event":
        call(_drv.cuEventRecord, self._e, stream)
        return self

    def wait_on(self, stream: int) -> None:
        """Make `stream` wait for this event."""
        call(_drv.cuStreamWaitEvent, stream, self._e, 0)

    def synchronize(self) -> None:
        call(_drv.cuEventSynchronize, self._e)

    def elapsed_ms(self, end: "Event") -> float:
        return call(_drv.cuEventElapsedTime, self._e, end._e)

    def _release(self) -> None:
        e, self._e = self._e, None
        call(_drv.cuEventDestroy, e)


class Graph(Owned):
    """A CUDA graph captured from one stream (other streams join through events)."""
    _kind = "graphs"

    def __init__(self, exec_handle, graph_handle):
        self._exec, self._graph = exec_handle, graph_handle
        self._opened()

    @staticmethod
    def begin(stream: int) -> None:
        call(_drv.cuStreamBeginCapture, stream, _drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)

    @classmethod
    def end(cls, stream: int) -> "Graph":
        g = call(_drv.cuStreamEndCapture, stream)
        ex = call(_drv.cuGraphInstantiate, g, 0)
        return cls(ex, g)

    def launch(self, stream: int) -> None:
        call(_drv.cuGraphLaunch, self._exec, stream)

    def _release(self) -> None:
        ex, g, self._exec, self._graph = self._exec, self._graph, None, None
        call(_drv.cuGraphExecDestroy, ex)
        call(_drv.cuGraphDestroy, g)


def is_capturing(stream: int) -> bool:
    status = call(_drv.cuStreamIsCapturing, stream)
    return status != _drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
