"""One exception family for every driver failure, and the one `check()` all calls go through."""
from __future__ import annotations

from cuda.bindings import driver as _drv


class EpA2AError(RuntimeError):
    """Base of every error raised by ep_a2a."""


class CudaError(EpA2AError):
    """A CUDA driver call failed; `call` names it and `code` is the CUresult."""

    def __init__(self, call: str, code, detail: str = ""):
        self.call, self.code = call, code
        name = _error_name(code)
        super().__init__(f"{call} failed: {name}" + (f" ({detail})" if detail else ""))


class NoDriverError(EpA2AError):
    """No usable CUDA driver (libcuda.so.1 missing) or no GPU on this machine."""


class ForkedProcessError(EpA2AError):
    """This process was forked from one that had initialised CUDA; CUDA cannot be used here."""


class UnsupportedDeviceError(EpA2AError):
    """No cubin was built for this GPU's architecture."""


class DriverTooOldError(EpA2AError):
    """The installed NVIDIA driver cannot load cubins of the toolkit that built ours."""


def _error_name(code) -> str:
    try:
        err, name = _drv.cuGetErrorName(code)
        err2, text = _drv.cuGetErrorString(code)
        if err == _drv.CUresult.CUDA_SUCCESS:
            return f"{name.decode()}: {text.decode()}" if err2 == _drv.CUresult.CUDA_SUCCESS else name.decode()
    except Exception:  # the driver itself may be unusable (that is often why we are here)
        pass
    return str(code)


def check(result, call: str = "CUDA driver call"):
    """Unpack a cuda.bindings return tuple `(CUresult, *values)`; raise CudaError on failure.

    Returns None, the single value, or a tuple of values.
    """
    code = result[0]
    if code != _drv.CUresult.CUDA_SUCCESS:
        raise CudaError(call, code)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def call(fn, *args):
    """`check(fn(*args))`, naming `fn` in the error: the one way to call the driver."""
    return check(fn(*args), fn.__name__)
