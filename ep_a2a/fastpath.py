"""The repeat fast path: a phase call with the very arguments of the last one skips their
checks, and the step planner's memo (RankAlltoAll._run) skips the planning, because the
launch would come out byte for byte the same.

Engines call with the same buffers every step. A call repeats the last one when it gets
the same ep_a2a Tensor objects (same address, shape, strides, dtype and device) for every
tensor argument, the same T^ (an int) and stream (None or an int handle). What else the
launch depends on (PDL's trigger before it, the protocol setting, the active-rank tag, the
first steps' timeouts) is the planner's state, and the memo is keyed on it. A Tensor whose
`stream` names another stream than the call's takes the full path, which orders that
stream's work first (as_tensor). Framework tensors always take the full path (their DLPack
exchange orders streams).

A caller that fills the very Tensor objects of the last call itself, and so knows whether it
changed any of their fields, may skip the geometry compare: dispatch_same / combine_same
take the record that call left and check the rest (ops/torch_views.py).
"""
from __future__ import annotations

import weakref

from .interop.tensor import Tensor

REPEAT_FAST_PATH = True  # (False: every call takes the full path; the CPU tests compare both)


class Repeat:
    """A phase call that an identical next call may repeat (see the module docstring)."""
    __slots__ = ("refs", "geometry", "runtime_max", "stream", "handle", "call", "extra")

    @classmethod
    def of(cls, stream, runtime_max, tensors, handle, call, extra):
        """The record of a call just made (`call`: what it asked the planner; `extra`: its results
        besides the launch), or None when a later call could not repeat it."""
        if not REPEAT_FAST_PATH or not (stream is None or type(stream) is int):
            return None
        if any(t is not None and type(t) is not Tensor for t in tensors):
            return None
        r = cls()
        r.refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        r.geometry = tuple(None if t is None else (t.ptr, t.shape, t.strides, t.dtype, t.device) for t in tensors)
        r.runtime_max, r.stream, r.handle, r.call, r.extra = runtime_max, stream, handle, call, extra
        return r

    def same_call(self, runtime_max, stream) -> bool:
        """The call's T^ and stream are the recorded call's."""
        return (type(runtime_max) is int and runtime_max == self.runtime_max and type(stream) is type(self.stream)
                and stream == self.stream)

    def matches(self, first, rest, runtime_max, stream) -> bool:
        if not self.same_call(runtime_max, stream):
            return False
        refs, geo = self.refs, self.geometry
        if type(rest) not in (list, tuple) or len(rest) + 1 != len(refs):
            return False
        # (hot path: `first`, then `rest` by index, without building the tuple of both)
        handle, i, t = self.handle, 0, first
        while True:
            ref = refs[i]
            if ref is None:
                if t is not None:
                    return False
            elif t is None or ref() is not t or (t.ptr, t.shape, t.strides, t.dtype, t.device) != geo[i] \
                    or (t.stream is not None and t.stream != handle):
                return False  # (a dead ref reads None; a tensor changed in place takes the full path's checks)
            if i == len(rest):
                return True
            t = rest[i]
            i += 1
