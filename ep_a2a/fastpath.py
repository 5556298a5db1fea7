"""The repeat fast path: a phase call with the very arguments of the last one skips their
checks, and the step planner's memo (RankAlltoAll._run) skips the planning, because the
launch would come out byte for byte the same.

Engines call with the same buffers every step. A call repeats the last one when it gets
the same tensor objects for every tensor argument, each with the geometry it had then, the
same T^ (an int) and stream (None or an int handle). What else the launch depends on
(PDL's trigger before it, the protocol setting, the active-rank tag, the first steps'
timeouts) is the planner's state, and the memo is keyed on it.

The geometry of an ep_a2a Tensor is its fields (address, shape, strides, dtype, device); one
whose `stream` names another stream than the call's takes the full path, which orders that
stream's work first (as_tensor). A framework tensor with a reader (interop/readers.py:
torch's) is held by a weak reference too, and its geometry read through the framework's own
accessors; a repeat then orders the framework's current stream before the call's
(order_producers), which is what its DLPack exchange did on the full path. Only geometry
is compared: a write into a tensor's values changes nothing the launch depends on. (A
combine's framework `out` comes back as the Tensor the full path made over it, which holds
it: the record keeps that `out` alive until the next combine's record replaces it.)

A caller that fills the very Tensor objects of the last call itself, and so knows whether it
changed any of their fields, may skip the geometry compare: dispatch_same / combine_same
take the record that call left and check the rest (ops/torch_views.py).
"""
from __future__ import annotations

import weakref

from .interop.readers import reader_of
from .interop.tensor import Tensor, order_after

REPEAT_FAST_PATH = True  # (False: every call takes the full path; the CPU tests compare both)


class Repeat:
    """A phase call that an identical next call may repeat (see the module docstring)."""
    __slots__ = ("refs", "geometry", "readers", "producers", "first", "runtime_max", "stream", "handle", "call",
                 "extra")

    @classmethod
    def of(cls, stream, runtime_max, tensors, handle, call, extra):
        """The record of a call just made (`call`: what it asked the planner; `extra`: its results
        besides the launch), or None when a later call could not repeat it."""
        if not REPEAT_FAST_PATH or not (stream is None or type(stream) is int):
            return None
        readers = tuple(None if t is None or type(t) is Tensor else reader_of(t) for t in tensors)
        if any(reader is None and t is not None and type(t) is not Tensor for reader, t in zip(readers, tensors)):
            return None
        r = cls()
        try:
            r.refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        except TypeError:  # (a framework type without weak references)
            return None
        r.geometry = tuple(None if t is None else (t.ptr, t.shape, t.strides, t.dtype, t.device) if reader is None
                           else reader.geometry(t) for t, reader in zip(tensors, readers))
        framework = [(reader, t) for reader, t in zip(readers, tensors) if reader is not None]
        r.readers = readers if framework else None
        # (each framework's current stream, on each device its tensors are on: read at every repeat)
        r.producers = tuple({(reader.producer, reader.ordinal(t)) for reader, t in framework})
        r.first = readers[0].tensor(tensors[0]) if readers[0] is not None else None  # (dispatch's host id check)
        r.runtime_max, r.stream, r.handle, r.call, r.extra = runtime_max, stream, handle, call, extra
        return r

    def same_call(self, runtime_max, stream) -> bool:
        """The call's T^ and stream are the recorded call's."""
        return (type(runtime_max) is int and runtime_max == self.runtime_max and type(stream) is type(self.stream)
                and stream == self.stream)

    def matches(self, first, rest, runtime_max, stream) -> bool:
        if not self.same_call(runtime_max, stream):
            return False
        refs, geo, readers = self.refs, self.geometry, self.readers
        if type(rest) not in (list, tuple) or len(rest) + 1 != len(refs):
            return False
        # (hot path: `first`, then `rest` by index, without building the tuple of both)
        handle, i, t = self.handle, 0, first
        while True:
            ref = refs[i]
            if ref is None:
                if t is not None:
                    return False
            elif t is None or ref() is not t:
                return False  # (a dead ref reads None)
            elif readers is not None and readers[i] is not None:
                if readers[i].geometry(t) != geo[i]:
                    return False  # (a framework tensor moved, resized, ... in place: the full path)
            elif (t.ptr, t.shape, t.strides, t.dtype, t.device) != geo[i] or (t.stream is not None and t.stream != handle):
                return False  # (a tensor changed in place takes the full path's checks)
            if i == len(rest):
                return True
            t = rest[i]
            i += 1

    def order_producers(self) -> None:
        """Before a repeat's launch: the work each framework queued so far on its current stream
        (read now: the caller may have switched streams since) is ordered before the call's
        stream, unless it is that stream, as the framework's DLPack export on the full path
        does (interop.tensor.order_after)."""
        for producer, ordinal in self.producers:
            order_after(self.handle, producer(ordinal), ordinal)
