"""The Python path of the jit calls (the fallback where the native library, jax_ffi.py, is
absent): jax.experimental.buffer_callback on XLA's stream.

XLA calls the callback on the host when its thunk comes up, with XLA's CUDA stream and the
operands and results as device buffers (no host copy). The callback launches our kernels on
that stream, or, when several in-process ranks share the GPU, forks to the ranks' own
streams with events and joins them back, so that the ranks' kernels (which spin on each
other) run concurrently and everything XLA queues afterwards waits for all of them.

This path needs nothing compiled for the installed jaxlib: buffer_callback is an FFI custom
call whose handler, jaxlib's own, calls back into Python, which runs the eager dispatch and
combine (their checks, planning and launches) per call. Its cost is that Python on XLA's host
thread per call; the native path (jax_plan.py, jax_ffi.py) plans while tracing instead and
leaves the call to C++. Both declare the calls pure (has_side_effect=True would lose JAX's C++
dispatch fast path), their order coming from data dependencies (dispatch hands combine a
ticket array).

Command buffers (XLA's CUDA graphs): these callbacks are registered
command_buffer_compatible=False, so XLA runs them as ordinary thunks between its command
buffers: the eager calls they make keep host state per step (the phase check, the PDL trigger
history, the repeat fast path) that a replay would leave behind. (The native handler keeps
none and is captured.)
"""
from __future__ import annotations

from ..driver.memory import pointer_device
from ..driver.stream import Event
from ..interop.dlpack import Capsule
from ..interop.tensor import CUDA, Tensor

_CAI_DTYPES = set()  # dtypes whose buffers gave a CUDA Array Interface (cheaper than a DLPack capsule)


def buffer_ptr(buf) -> int:
    """The device address of a buffer_callback Buffer (its CUDA Array Interface where jaxlib
    gives one for the dtype, else its DLPack capsule, read and left to its own destructor)."""
    dt = buf.dtype
    if dt in _CAI_DTYPES:
        return buf.__cuda_array_interface__["data"][0]
    try:
        ptr = buf.__cuda_array_interface__["data"][0]
    except Exception:  # noqa: BLE001  (jaxlib raises its own error types for dtypes without a typestr)
        return Capsule(buf.__dlpack__()).ptr
    _CAI_DTYPES.add(dt)
    return ptr


class Slot:
    """One tensor argument position of one rank: a Tensor kept from call to call, whose
    address is updated in place. XLA usually hands the same buffers to the same call site, so
    a step repeats the last one with the same Tensor objects and takes dispatch's and
    combine's repeat fast path (a changed address takes the full path: fastpath.py)."""
    __slots__ = ("tensor", "empty_ptr")

    def __init__(self, shape, dtype, ordinal: int, empty_ptr: int):
        # a zero-size buffer may have no address: an aligned address of ours that nothing reads
        self.empty_ptr = empty_ptr
        self.tensor = Tensor(empty_ptr, shape, dtype, device=(CUDA, ordinal))

    def at(self, buf) -> Tensor:
        t = self.tensor
        t.ptr = buffer_ptr(buf) if t.numel else self.empty_ptr
        return t


class DeviceRanks:
    """The ranks of one all-to-all that live on one GPU, with the events that fork XLA's
    stream to their streams and join them back."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.device = self.ranks[0].device
        self.streams = [r.default_stream for r in self.ranks]
        self._fork = Event(self.device) if len(self.ranks) > 1 else None
        self._joins = [Event(self.device) for _ in self.ranks] if len(self.ranks) > 1 else []
        self.slots = {}  # (call site, rank position, argument) -> Slot

    def slot(self, key, shape, dtype, i: int) -> Slot:
        s = self.slots.get(key)
        if s is None:
            s = self.slots[key] = Slot(shape, dtype, self.device.ordinal, self.ranks[i].base)
        return s

    def run(self, xla_stream: int, body) -> None:
        """body(streams) launches every rank's work, rank i's on streams[i]. One rank: XLA's
        own stream. Several: each rank's stream first waits for what XLA queued so far (so no
        rank's spinning kernel holds SMs XLA's earlier work needs), and XLA's stream then
        waits for every rank (so nothing after this call overlaps or outlives it)."""
        if self._fork is None:
            body([xla_stream])
            return
        self.device.make_current()
        self._fork.record(xla_stream)
        for s in self.streams:
            self._fork.wait_on(s)
        try:
            body(self.streams)
        finally:  # (also after an error: XLA frees its buffers after whatever was launched)
            for ev, s in zip(self._joins, self.streams):
                ev.record(s).wait_on(xla_stream)

    def native_events(self) -> tuple:
        """(the fork CUevent, [each rank's join CUevent]) for the native handler, which records
        and waits on them as run() does; (None, [None] * ranks) for a rank alone on its GPU."""
        if self._fork is None:
            return None, [None] * len(self.ranks)
        return self._fork.handle, [j.handle for j in self._joins]

    def close(self) -> None:
        for ev in ([self._fork] if self._fork else []) + self._joins:
            ev.close()
        self._fork, self._joins = None, []


class RanksByDevice:
    """Every local rank of an all-to-all grouped by GPU; a callback finds its GPU from the
    address of a buffer XLA gave it (under shard_map each device runs the same callback)."""

    def __init__(self, ranks):
        by = {}
        for r in ranks:
            by.setdefault(r.device.ordinal, []).append(r)
        counts = {len(v) for v in by.values()}
        if len(counts) != 1:
            raise ValueError(f"a2a: every GPU must hold the same number of this process's ranks for jit calls "
                             f"(one call per GPU takes one list of them), got "
                             f"{ {o: len(v) for o, v in by.items()} }")
        self.per_device = counts.pop()
        self.devices = {o: DeviceRanks(v) for o, v in by.items()}
        self._ordinal_of = {}  # XLA's device id -> CUDA ordinal

    def for_buffer(self, buf) -> DeviceRanks:
        key = buf.__dlpack_device__()[1]
        ordinal = self._ordinal_of.get(key)
        if ordinal is None:
            ordinal = self._ordinal_of[key] = pointer_device(buffer_ptr(buf))
        got = self.devices.get(ordinal)
        if got is None:
            raise RuntimeError(f"this jit call runs on cuda:{ordinal}, where the all-to-all has no rank "
                               f"(its ranks live on {sorted(self.devices)})")
        return got

    def close(self) -> None:
        for d in self.devices.values():
            d.close()
