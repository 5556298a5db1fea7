"""The benchmark's arithmetic, apart from any GPU: per-round times from two graph lengths,
the bytes each phase moves and its floor's row lists, the phase split read from device
timestamps, and how host time is taken (bench.py measures, bench_floors.py runs the floor and
timestamp kernels)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from ..testing import hooks

VEC = 16  # bytes of one vector of the floor kernels: rows start 16-byte aligned


def per_round(t_short: float, t_long: float, rounds: int) -> tuple:
    """(µs per round, µs outside the rounds) from the replay times of a graph of `rounds`
    rounds and one of 2 * rounds: what both graphs share (the graph launch, the fork and
    join of the rank streams, a host barrier's release skew before the first round) cancels
    in the difference, and the rest is the intercept."""
    if not (isinstance(rounds, int) and rounds >= 1):
        raise ValueError(f"rounds: must be an int >= 1, got {rounds!r}")
    per = (t_long - t_short) / rounds
    return per, t_short - rounds * per


def host_time_us(body, iters: int, warmup: int, settle, indexed: bool = False) -> float:
    """µs of host time per call of `body` (body(i) when indexed) over `iters` calls, after
    `warmup` calls. settle() runs before the timed calls and after them (a synchronize: what
    one loop queued on the device is never the next loop's host time; nothing synchronizes
    inside a loop, as in an engine's step)."""
    for i in range(warmup):
        body(i) if indexed else body()
    settle()
    t0 = time.perf_counter()
    for i in range(iters):
        body(i) if indexed else body()
    t1 = time.perf_counter()
    settle()
    return (t1 - t0) / iters * 1e6


def eager_step(ranks, inputs, partials, T: int) -> None:
    """One eager dispatch + combine of every rank in this process with ep_a2a Tensors (the
    body the host figures time): inputs[i] = (ids, [payloads]), partials[i] its combine input."""
    for (ids, pays), r in zip(inputs, ranks):
        r.dispatch(ids, pays, T)
    for c, r in zip(partials, ranks):
        r.combine(c, T)


def bare_launches(ranks) -> None:
    """Two launches of each rank's prepacked empty kernel: what the driver and its Python
    bindings cost without us, beside the host figures."""
    for r in ranks:
        hooks.launch_empty(r)
        hooks.launch_empty(r)


def interleaved_medians(measures: dict, repeats: int, warmup: int = 1) -> tuple:
    """Every measure (name -> a call returning one figure) `repeats` times, taken in turn
    (a, b, c, a, b, c, ...), and each figure's median: a host's speed drifts within a run
    (its clock, cold caches, the interpreter specializing the first calls), and a figure
    always taken first or last would carry that drift alone. `warmup` rounds in the same
    order come first and are dropped: on the H200 the first size a run measured read ~50%
    slower in every torch figure than the same size measured again later in that run.
    Returns (name -> median, name -> the samples in order, warm-up rounds left out)."""
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats: must be an int >= 1, got {repeats!r}")
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"warmup: must be an int >= 0, got {warmup!r}")
    samples = {name: [] for name in measures}
    for k in range(warmup + repeats):
        for name, measure in measures.items():
            x = measure()
            if k >= warmup:
                samples[name].append(x)
    return {name: statistics.median(v) for name, v in samples.items()}, samples


def ratio(a, b, scale: float = 1.0):
    """scale * a / b, or None where a is None or b is not positive (a per-round difference of
    two noisy medians can come out at or below zero for a tiny phase, most of all on a
    time-sliced GPU: no figure rather than a division error or a negative bandwidth)."""
    return None if a is None or b is None or not b > 0 else scale * a / b


def padded(nbytes: int) -> int:
    """The row stride of the floor kernels for rows of `nbytes`: the next multiple of 16."""
    return -(-int(nbytes) // VEC) * VEC


def row_offsets(targets) -> np.ndarray:
    """int32 [T + 1]: token t's k destination rows (dispatch floor) or partial rows
    (combine floor) are rows offsets[t] .. offsets[t + 1], k = len(targets[t]), its
    distinct target ranks."""
    return np.concatenate([[0], np.cumsum([len(t) for t in targets], dtype=np.int64)]).astype(np.int32)


def phase_bytes(targets, row_bytes: int, partial_bytes: int, out_bytes: int) -> dict:
    """Bytes one source rank's phases move: dispatch reads each token's row once and writes
    it k times; combine reads k partial rows and writes one output row per token."""
    T, sends = len(targets), sum(len(t) for t in targets)
    return dict(dispatch_read=T * row_bytes, dispatch_written=sends * row_bytes,
                combine_read=sends * partial_bytes, combine_written=T * out_bytes)


def scatter_reference(src: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """What ep_floor_scatter writes: row t of src (uint8 [T, row_bytes]) at each of its rows."""
    return np.repeat(src, np.diff(offsets), axis=0)


def gather_reference(partials: np.ndarray, offsets: np.ndarray, out_bytes: int) -> np.ndarray:
    """What ep_floor_gather writes (uint8 [T, out_bytes]) from partials (uint8 [rows,
    in_bytes]): output vector j is vector j's seed (j as a little-endian u32, then zeros)
    XOR vector j of each of token t's partial rows (where the partials have a vector j);
    output tail byte b is b XOR tail byte b of each partial row (where they have one)."""
    in_bytes, T = partials.shape[1], len(offsets) - 1
    in_nv, out_nv, in_tail, out_tail = in_bytes // VEC, out_bytes // VEC, in_bytes % VEC, out_bytes % VEC
    seed = np.zeros((out_nv, VEC), np.uint8)
    seed[:, :4] = np.arange(out_nv, dtype="<u4").view(np.uint8).reshape(out_nv, 4)
    out = np.zeros((T, out_bytes), np.uint8)
    n = min(in_nv, out_nv) * VEC
    for t in range(T):
        rows = partials[offsets[t]:offsets[t + 1]]
        x = np.bitwise_xor.reduce(rows, axis=0) if len(rows) else np.zeros(in_bytes, np.uint8)
        out[t, :out_nv * VEC] = seed.reshape(-1)
        out[t, :n] ^= x[:n]
        tail = np.arange(out_tail, dtype=np.uint8)
        m = min(in_tail, out_tail)
        tail[:m] ^= x[in_nv * VEC:in_nv * VEC + m]
        out[t, out_nv * VEC:] = tail
    return out


def stamp_split(stamps: np.ndarray) -> dict:
    """The phase times read from device timestamps.

    stamps: uint64 ns [replays, ranks, 2 * rounds + 1]: per rank stream, a stamp before the
    first dispatch and one after every kernel of the protocol (dispatch, combine, dispatch,
    ...), each taken once the kernel before it has completed. Dispatch of round i on a rank
    is stamps[2i + 1] - stamps[2i] (from the end of the previous combine, or of the stream
    fork, to the end of the dispatch), combine stamps[2i + 2] - stamps[2i + 1]. Round 0 is
    left out when there are more (it holds the fork of the streams and, between processes,
    the host barrier's skew). Means over the other rounds and replays, then over ranks
    (means, not medians: the timer ticks coarser than these phases on some GPUs, and a mean
    of many ticks is unbiased where a median is not). µs."""
    s = np.asarray(stamps, np.int64)
    if s.ndim != 3 or s.shape[2] < 3 or s.shape[2] % 2 != 1:
        raise ValueError(f"stamps: expected [replays, ranks, 2 * rounds + 1] with rounds >= 1, got {s.shape}")
    d = (s[:, :, 1::2] - s[:, :, 0:-1:2]).astype(np.float64)
    c = (s[:, :, 2::2] - s[:, :, 1::2]).astype(np.float64)
    if (d < 0).any() or (c < 0).any():
        raise ValueError("stamps: a stamp earlier than the one before it on its stream (not one GPU's clock?)")
    first = 1 if d.shape[2] > 1 else 0
    d, c = d[:, :, first:], c[:, :, first:]
    steps = np.diff(s, axis=2)
    return dict(dispatch_us=float(d.mean(axis=(0, 2)).mean() / 1e3), combine_us=float(c.mean(axis=(0, 2)).mean() / 1e3),
                rounds_used=int(d.shape[2]), samples=int(d.size),
                smallest_step_ns=int(steps[steps > 0].min()) if (steps > 0).any() else 0)


def split_round_trip(round_trip_us: float, stamped_dispatch_us: float, stamped_combine_us: float) -> tuple:
    """(dispatch µs, combine µs): the round trip measured without stamps, divided in the
    proportion the stamps measured (the stamp kernels' own cost stays out of both)."""
    total = stamped_dispatch_us + stamped_combine_us
    if not total > 0:
        raise ValueError(f"stamped phases sum to {total} µs: nothing to split by")
    d = round_trip_us * stamped_dispatch_us / total
    return d, round_trip_us - d
