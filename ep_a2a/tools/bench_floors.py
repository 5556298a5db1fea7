"""The benchmark's byte floors and phase stamps on the GPU (kernels/floors.cu).

ByteFloors: for the ranks of this process, buffers and launches that move exactly the bytes
of dispatch (each token's row read once, written to its k target rows) and of combine (k
partial rows read, one output row written), one kernel per rank on its stream, as the
protocols launch theirs; bench.py captures and times them like the protocols, each phase
alone and the two in turn (round_trip). Like the protocols' buffers, the four of a rank are
distinct: in turn, combine's floor reads partial rows that dispatch's did not just write, so
it pays, as combine does, for dispatch's rows still dirty in L2.
Stamps: one-thread kernels that write %globaltimer into a buffer once the kernel before
them has completed; launched between the phases of a captured round trip, they split it
into dispatch and combine where dispatch cannot be replayed alone (SENTINEL).
"""
from __future__ import annotations

import ctypes

import numpy as np

from .bench_method import VEC, padded, row_offsets

THREADS = 256  # per block of the floor kernels
STAMP_THREADS = 32


def _grid(device, function, items: int, ranks_on_gpu: int) -> int:
    """Blocks of one rank's floor kernel: one item per thread, at most this rank's share of
    the blocks the GPU holds at once (the ranks' kernels run side by side)."""
    from ..driver.launch import occupancy
    cap = max(1, device.sm_count * occupancy(function, THREADS) // max(1, ranks_on_gpu))
    return max(1, min(cap, -(-items // THREADS)))


class ByteFloors:
    """Dispatch's and combine's bytes for the ranks `ranks` (ep_a2a Rank objects of this
    process, all on `device`), whose tokens go to `targets[rank.rank]` (per token, its
    distinct target ranks). row_bytes: a dispatched token's bytes (payloads and ids);
    partial_bytes: a partial result combine pulls; out_bytes: an output row it writes."""

    def __init__(self, ranks, targets, row_bytes: int, partial_bytes: int, out_bytes: int, *, pdl: bool):
        from ..driver.launch import Launch
        from ..driver.module import load
        from ..interop.arrays import empty, from_numpy
        # per rank: (token rows, k rows, partial rows, output rows, row offsets); the strides
        self.buffers, self.scatters, self.gathers, self.streams = [], [], [], []
        self.strides = (padded(row_bytes), padded(partial_bytes), padded(out_bytes))
        for r in ranks:
            dev, tg = r.device, targets[r.rank]
            T, sends = len(tg), sum(map(len, tg))
            d_stride, p_stride, o_stride = padded(row_bytes), padded(partial_bytes), padded(out_bytes)
            if T * max(d_stride, p_stride, o_stride) // VEC >= 2 ** 31:
                raise ValueError(f"byte floors: {T} tokens of up to {max(row_bytes, partial_bytes, out_bytes)} bytes "
                                 "exceed the kernels' 32-bit item index")
            mod = load("floors", dev)
            scatter, gather = mod.function("ep_floor_scatter"), mod.function("ep_floor_gather")
            # dispatch's source and destinations, combine's partials and output
            tok = empty((max(1, T) * d_stride,), "uint8", dev)
            rows = empty((max(1, sends) * d_stride,), "uint8", dev)
            parts = empty((max(1, sends) * p_stride,), "uint8", dev)
            out = empty((max(1, T) * o_stride,), "uint8", dev)
            offs = from_numpy(row_offsets(tg), dev)
            self.buffers.append((tok, rows, parts, out, offs))
            n = getattr(r, "ranks_on_device", len(ranks))  # this process's ranks on this GPU
            self.scatters.append(Launch(dev, scatter, [
                ctypes.c_uint64(tok.ptr), ctypes.c_uint64(rows.ptr), ctypes.c_uint64(offs.ptr), ctypes.c_int(T),
                ctypes.c_int(row_bytes), ctypes.c_int(d_stride), ctypes.c_int(d_stride)],
                _grid(dev, scatter, T * -(-row_bytes // VEC), n), THREADS, pdl=pdl))
            self.gathers.append(Launch(dev, gather, [
                ctypes.c_uint64(parts.ptr), ctypes.c_uint64(out.ptr), ctypes.c_uint64(offs.ptr), ctypes.c_int(T),
                ctypes.c_int(partial_bytes), ctypes.c_int(out_bytes), ctypes.c_int(p_stride), ctypes.c_int(o_stride)],
                _grid(dev, gather, T * -(-max(partial_bytes, out_bytes) // VEC), n), THREADS, pdl=pdl))
            self.streams.append(r.stream.handle)

    def dispatch(self) -> None:
        """One dispatch floor: every rank's scatter on its stream."""
        for k, s in zip(self.scatters, self.streams):
            k(s)

    def combine(self) -> None:
        """One combine floor: every rank's gather on its stream."""
        for k, s in zip(self.gathers, self.streams):
            k(s)

    def round_trip(self) -> None:
        """Both floors in turn, as a round trip runs its phases."""
        self.dispatch()
        self.combine()

    def close(self) -> None:
        for bufs in self.buffers:
            for b in bufs:
                b.owner.close()
        self.buffers = []


class Stamps:
    """Timestamp slots for the ranks `ranks` of this process: mark(i) launches a stamp on
    rank i's stream into its next slot (slots count from 0 again after reset())."""

    def __init__(self, ranks, slots: int, *, pdl: bool):
        from ..driver.launch import Launch
        from ..driver.module import load
        from ..interop.arrays import empty
        self.slots, self._next = slots, [0] * len(ranks)
        self.bufs = [empty((slots,), "uint64", r.device) for r in ranks]
        self.streams = [r.stream.handle for r in ranks]
        self._launches = [Launch(r.device, load("floors", r.device).function("ep_timestamp"), [ctypes.c_uint64(b.ptr)],
                                 1, STAMP_THREADS, pdl=pdl) for r, b in zip(ranks, self.bufs)]

    def reset(self) -> None:
        self._next = [0] * len(self._next)

    def mark(self, i: int) -> None:
        slot = self._next[i]
        if slot >= self.slots:
            raise IndexError(f"stamps: rank {i} has used all {self.slots} slots")
        k = self._launches[i]
        k.args[0].value = self.bufs[i].ptr + 8 * slot  # a captured launch keeps the value it had
        k(self.streams[i])
        self._next[i] = slot + 1

    def poison(self) -> None:
        """Every slot to all ones, so a stamp that never ran cannot pass for a time."""
        from ..interop.arrays import copy_from_numpy
        for b in self.bufs:
            copy_from_numpy(b, np.full(self.slots, np.iinfo(np.uint64).max, np.uint64))

    def read(self) -> np.ndarray:
        """uint64 ns [ranks, slots] (the streams must have finished)."""
        from ..interop.arrays import to_numpy
        out = np.stack([to_numpy(b) for b in self.bufs])
        if (out == np.iinfo(np.uint64).max).any():
            raise RuntimeError("stamps: a slot was never written (a stamp kernel did not run)")
        return out

    def close(self) -> None:
        for b in self.bufs:
            b.owner.close()
        self.bufs = []
