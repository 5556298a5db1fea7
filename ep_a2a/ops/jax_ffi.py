"""The native library JAX calls through the XLA FFI (native/ffi/ep_a2a_ffi.cc; docs/jax.md).

kernels/build.py compiles it beside the cubins where jaxlib is installed at build time
(manifest.json's "jax_ffi" names that jaxlib). It has no Python ABI: ctypes loads it, its
handler reaches JAX as a capsule (jax.ffi.pycapsule), and its plans are registered through
plain C calls. Where it is absent or does not load, the jit calls run through Python
callbacks (jax_calls.py) and the first JaxAlltoAll says so in one warning.

  EP_A2A_JAX_NATIVE=0             the Python callbacks even where the library is present
  EP_A2A_JAX_COMMAND_BUFFERS=0    the handler that XLA never captures in its command buffers
  EP_A2A_JAX_OWN_GRAPHS=0         a call XLA does not capture launches kernel by kernel instead of
                                  replaying the handler's own CUDA graph (read when a plan registers)
"""
from __future__ import annotations

import ctypes
import json
import os
import warnings
from pathlib import Path

import numpy as np

CUBINS = Path(__file__).resolve().parent.parent / "cubins"
LIBRARY = CUBINS / "libep_a2a_jax.so"
TARGETS = {True: ("ep_a2a_run", "ep_a2a_ffi_run"), False: ("ep_a2a_run_uncaptured", "ep_a2a_ffi_run_uncaptured")}
SYMBOLS = ("ep_a2a_ffi_run", "ep_a2a_ffi_run_uncaptured", "ep_a2a_ffi_register", "ep_a2a_ffi_release",
           "ep_a2a_ffi_calls", "ep_a2a_ffi_own_graph", "ep_a2a_ffi_plan_version", "ep_a2a_ffi_api_version")

_lib, _why, _registered, _warned = None, None, set(), False


def built_for() -> dict:
    """What manifest.json says the library was built against ({} where it says nothing)."""
    try:
        return dict(json.loads((CUBINS / "manifest.json").read_text()).get("jax_ffi") or {})
    except (OSError, ValueError):
        return {}


def library(path: Path = LIBRARY):
    """The library as a ctypes.CDLL with its C entry points typed, or None (then why() says why)."""
    global _lib, _why
    if _lib is not None or _why is not None:
        return _lib
    if not path.is_file():
        _why = f"{path.name} was not built (no jaxlib where kernels/build.py ran: `python3 kernels/build.py --ffi-only`)"
        return None
    try:
        lib = ctypes.CDLL(str(path))
        missing = [s for s in SYMBOLS if not hasattr(lib, s)]
        if missing:
            raise OSError(f"it lacks {', '.join(missing)}")
    except OSError as e:
        _why = f"{path.name} does not load ({e}): rebuild it with `python3 kernels/build.py --ffi-only`"
        return None
    lib.ep_a2a_ffi_register.restype = ctypes.c_int64
    lib.ep_a2a_ffi_register.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_uint64]
    lib.ep_a2a_ffi_release.argtypes = [ctypes.c_int64]
    lib.ep_a2a_ffi_calls.restype = ctypes.c_uint64
    lib.ep_a2a_ffi_calls.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.ep_a2a_ffi_own_graph.restype = ctypes.c_uint64
    lib.ep_a2a_ffi_own_graph.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.ep_a2a_ffi_plan_version.restype = ctypes.c_uint64
    lib.ep_a2a_ffi_api_version.restype = ctypes.c_int
    from .jax_plan import VERSION
    if lib.ep_a2a_ffi_plan_version() != VERSION:
        _why = (f"{path.name} reads plans of version {lib.ep_a2a_ffi_plan_version()}, this package writes {VERSION}: "
                "rebuild it with `python3 kernels/build.py --ffi-only`")
        return None
    _lib = lib
    return lib


def why() -> str | None:
    """Why the library is not in use (None where it is)."""
    if os.environ.get("EP_A2A_JAX_NATIVE", "1") == "0":
        return "EP_A2A_JAX_NATIVE=0"
    library()
    return _why


def command_buffers() -> bool:
    return os.environ.get("EP_A2A_JAX_COMMAND_BUFFERS", "1") != "0"


def handler_settings() -> dict:
    """This process's handler settings, as benchmarks record them."""
    return {"xla_may_capture": command_buffers(), "own_graphs": os.environ.get("EP_A2A_JAX_OWN_GRAPHS", "1") != "0"}


def target() -> str:
    """The FFI target of this process's setting, registered with JAX on first use."""
    captured = command_buffers()
    name, symbol = TARGETS[captured]
    if name not in _registered:
        import jax
        # (XLA takes the traits given here; the handler reports the same ones in its metadata)
        kw = {}
        try:
            from jaxlib.xla_client import CustomCallTargetTraits
            kw["traits"] = CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE if captured else CustomCallTargetTraits.DEFAULT
        except ImportError:
            pass
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library(), symbol)), platform="CUDA", **kw)
        _registered.add(name)
    return name


def native_or_warn() -> bool:
    """Whether jit calls take the native path; the first time they cannot, one warning says why."""
    global _warned
    reason = why()
    if reason is None:
        return True
    if not _warned and reason != "EP_A2A_JAX_NATIVE=0":
        warnings.warn(f"ep_a2a: JAX calls run through Python callbacks (host-bound): {reason}", RuntimeWarning,
                      stacklevel=3)
        _warned = True
    return False


def info_line() -> str:
    """`python -m ep_a2a --info`: whether the library is present and which jaxlib built it."""
    built = built_for()
    lib = library()
    if lib is None:
        return f"JAX native library: absent ({_why})"
    api = lib.ep_a2a_ffi_api_version()
    return (f"JAX native library: present ({LIBRARY.name}, built for jaxlib {built.get('jaxlib', '?')}, "
            f"XLA FFI API {api // 1000}.{api % 1000})")


class Plan:
    """One registered launch plan; release() frees it (after the calls using it completed)."""

    def __init__(self, words: np.ndarray):
        lib = library()
        words = np.ascontiguousarray(words, np.uint64)
        msg = ctypes.create_string_buffer(256)
        self.id = lib.ep_a2a_ffi_register(words.ctypes.data, words.size, msg, len(msg))
        if self.id < 0:
            raise RuntimeError(f"ep_a2a: the native library refused a launch plan: {msg.value.decode()}")

    def calls(self, ordinal: int, graphed: bool = False) -> int:
        """Calls this plan served on cuda:`ordinal` (tests: the native path ran); `graphed`: those
        its own CUDA graph served (calls XLA did not capture)."""
        if self.id < 0:
            return 0
        lib = library()
        return int(lib.ep_a2a_ffi_own_graph(self.id, ordinal, 0) if graphed else lib.ep_a2a_ffi_calls(self.id, ordinal))

    def node_updates(self, ordinal: int) -> int:
        """Kernel nodes of its own graph that this plan's calls on cuda:`ordinal` re-set because
        XLA's buffers (or the first-steps timeout) changed."""
        return int(library().ep_a2a_ffi_own_graph(self.id, ordinal, 1)) if self.id >= 0 else 0

    def release(self) -> None:
        if self.id >= 0:
            library().ep_a2a_ffi_release(self.id)
            self.id = -1
