"""NumPy reference model of dispatch and combine: the oracle of the tests and the CPU
fallback of the demo. Plain loops over tokens, written for clarity, not speed."""
from __future__ import annotations

import numpy as np

from ..layout import Q8_BLOCK, SENTINEL_IDS


def expert_owner(num_experts: int, ep_size: int) -> np.ndarray:
    """Rank of every expert: contiguous blocks, the first num_experts % ep_size ranks own one more."""
    base, rem = divmod(num_experts, ep_size)
    sizes = [base + (1 if r < rem else 0) for r in range(ep_size)]
    return np.repeat(np.arange(ep_size, dtype=np.int32), sizes)


def targets_of(ids_row: np.ndarray, owner: np.ndarray) -> list:
    """Distinct target ranks of one token, in the order of their first selection."""
    out = []
    for e in ids_row:
        if 0 <= e < len(owner) and owner[e] not in out:
            out.append(int(owner[e]))
    return out


def dropped_selections(expert_ids, num_experts: int, ep_size: int, active) -> int:
    """Selections whose expert lives on a rank outside `active` (what dispatch drops)."""
    owner = expert_owner(num_experts, ep_size)
    out = set(range(ep_size)) - set(active)
    return int(sum(sum(1 for e in row if 0 <= e < num_experts and int(owner[e]) in out)
                   for ids in expert_ids for row in ids))


def dispatch(expert_ids, payloads, ep_size: int, num_experts: int, runtime_max_tokens_per_rank: int,
             active=None):
    """expert_ids[s]: int32 [T_s, top_k]; payloads[s]: list of arrays [T_s, ...] of rank s.

    Returns (received, records):
      received[t] = {"expert_ids": int32 [ep, T^, top_k] (-1 past each count),
                     "payloads": [arrays [ep, T^, ...] (zeros past each count)],
                     "counts": int [ep], "tokens": [list of source token indices per region]}
      records[s] = int [T_s, top_k, 2]: (target rank, slot) of each selection, (-1, -1)
      where it sends nothing (invalid id or a rank the token already reaches).
    Slot j of region s on rank t is the j-th token of s (in token order) that reaches t:
    SENTINEL's order when every token is sent; FENCE fills the same set in any order.
    active: ranks taking part (default all); selections of other ranks' experts are dropped.
    """
    owner = expert_owner(num_experts, ep_size)
    runtime_max = runtime_max_tokens_per_rank
    top_k = expert_ids[0].shape[1]
    received = []
    for t in range(ep_size):
        received.append({
            "expert_ids": np.full((ep_size, runtime_max, top_k), -1, np.int32),
            "payloads": [np.zeros((ep_size, runtime_max) + p.shape[1:], p.dtype) for p in payloads[0]],
            "counts": np.zeros(ep_size, np.int64),
            "tokens": [[] for _ in range(ep_size)],
        })
    records = []
    for s in range(ep_size):
        ids = expert_ids[s]
        assert ids.shape[0] <= runtime_max, "more tokens than runtime_max_tokens_per_rank"
        rec = np.full(ids.shape + (2,), -1, np.int64)
        for i, row in enumerate(ids):
            seen = {}
            for k, e in enumerate(row):
                if not 0 <= e < num_experts:
                    continue
                t = int(owner[e])
                if t in seen or (active is not None and t not in active):
                    continue
                r = received[t]
                slot = int(r["counts"][s])
                r["counts"][s] += 1
                r["tokens"][s].append(i)
                r["expert_ids"][s, slot] = row
                for q, p in enumerate(payloads[s]):
                    r["payloads"][q][s, slot] = p[i]
                seen[t] = slot
                rec[i, k] = (t, slot)
        records.append(rec)
    return received, records


def tree_sum(vectors: list, width: int) -> np.ndarray:
    """fp32 sum in the kernels' order: pairwise trees over groups of 8 (absent members +0),
    group sums added in order. An empty list sums to zeros."""
    acc = np.zeros(width, np.float32)
    for c in range(0, max(len(vectors), 1), 8):
        g = [np.asarray(v, np.float32) for v in vectors[c:c + 8]]
        g += [np.zeros(width, np.float32)] * (8 - len(g))
        while len(g) > 1:
            g = [g[j] + g[j + 1] for j in range(0, len(g), 2)]
        acc = g[0] if c == 0 else acc + g[0]
    return acc


def combine(partials, records, dtype, in_dtype=None) -> list:
    """partials[t]: [ep, T^, hidden] partial results on target t (numpy, any float dtype,
    bfloat16 given as uint16 bits with dtype='bfloat16'; in_dtype when they differ from the
    output's, e.g. float32 after q8_roundtrip); records from dispatch().
    Returns, per source rank, its [T_s, hidden] output in `dtype` (uint16 bits for bf16)."""
    out = []
    for s, rec in enumerate(records):
        T = rec.shape[0]
        hidden = partials[0].shape[-1]
        res = np.zeros((T, hidden), np.float32)
        for i in range(T):
            vecs = [to_float32(partials[t][s, slot], in_dtype or dtype) for t, slot in rec[i] if t >= 0]
            res[i] = tree_sum(vecs, hidden)
        out.append(from_float32(res, dtype))
    return out


def e4m3_round(y: np.ndarray) -> np.ndarray:
    """fp32 -> the nearest float8 e4m3fn value (ties to even), saturated at +-448, as fp32
    (the value of cvt.rn.satfinite.e4m3x2.f32). NaN stays NaN."""
    y = np.asarray(y, np.float32)
    a = np.abs(y)
    _, e = np.frexp(a)                                   # a = m * 2**e, m in [0.5, 1)
    quantum = np.where(a >= 2.0 ** -6, np.ldexp(np.float32(1), e - 4), np.float32(2.0 ** -9)).astype(np.float32)
    q = np.minimum(np.rint(a / quantum) * quantum, np.float32(448)).astype(np.float32)
    return np.copysign(q, y).astype(np.float32)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes -> their values as fp32 (0x7F and 0xFF are NaN)."""
    c = np.asarray(codes, np.uint8).astype(np.int32)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, np.ldexp(m.astype(np.float32), -9),
                   np.ldexp((8 + m).astype(np.float32), e - 10)).astype(np.float32)
    mag = np.where((c & 0x7F) == 0x7F, np.float32(np.nan), mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


def e4m3_encode(y: np.ndarray) -> np.ndarray:
    """The byte of each fp32 value that is exactly an e4m3fn value (e4m3_round's output).
    NaN -> 0x7F whatever its sign (the sign of a NaN byte is not modelled: it decodes as NaN
    either way, and the tests compare bytes only where the values are finite)."""
    table = e4m3_decode(np.arange(128, dtype=np.uint8))[:127]  # +0 .. 448, ascending
    y = np.asarray(y, np.float32)
    a = np.abs(y)
    nan = np.isnan(a)
    code = np.searchsorted(table, np.where(nan, 0, a)).astype(np.uint8)
    assert np.array_equal(table[code][~nan], a[~nan]), "e4m3_encode: a value is not e4m3"
    code = (code | np.where(np.signbit(y), np.uint8(0x80), np.uint8(0))).astype(np.uint8)
    return np.where(nan, np.uint8(0x7F), code).astype(np.uint8)


def _q8_blocks(x: np.ndarray, block: int) -> tuple:
    """The quantization rule, per block of `block` values of rows x (fp32 [..., hidden]):
    scale = amax / 448 and factor = 448 / amax (NaNs ignored by amax, as fmaxf does), both 1
    when amax is 0 or so small that amax / 448 underflows to 0; q = e4m3(x * factor), or
    e4m3(x / scale) where factor overflows to inf (amax below ~1.3e-36: x * inf would make
    NaN of zeros). Every step is one exactly rounded fp32 operation, as on the GPU.
    Returns (q as fp32 [..., hidden / block, block], scale [..., hidden / block, 1])."""
    x = np.asarray(x, np.float32)
    b = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    amax = np.fmax.reduce(np.abs(b), axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = (amax / np.float32(448)).astype(np.float32)
        zero = ~(scale > 0)
        factor = np.where(zero, np.float32(1), np.float32(448) / amax).astype(np.float32)
        scale = np.where(zero, np.float32(1), scale).astype(np.float32)
        y = np.where(np.isinf(factor), b / scale, b * factor).astype(np.float32)
        return e4m3_round(y), scale


def q8_quantize(x: np.ndarray, block: int = Q8_BLOCK) -> tuple:
    """What combine's FP8 pass (and finalize into an Fp8Partial) writes for rows x (fp32
    [..., hidden]): (e4m3 bytes [..., hidden], fp32 scales [..., hidden / block]); the rule
    is _q8_blocks'. e4m3_decode(bytes) * scale gives q8_roundtrip's values."""
    x = np.asarray(x, np.float32)
    q, scale = _q8_blocks(x, block)
    return e4m3_encode(q).reshape(x.shape), scale[..., 0]


def q8_roundtrip(x: np.ndarray, block: int = Q8_BLOCK) -> np.ndarray:
    """What the FP8 combine delivers of partial rows x (fp32 [..., hidden]): e4m3 values with
    one fp32 scale per `block` values (_q8_blocks), dequantized: q * scale, in fp32."""
    x = np.asarray(x, np.float32)
    q, scale = _q8_blocks(x, block)
    with np.errstate(invalid="ignore", over="ignore"):
        return (q * scale).astype(np.float32).reshape(x.shape)


def to_float32(x: np.ndarray, dtype) -> np.ndarray:
    if str(dtype) == "bfloat16":
        return (np.asarray(x, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(x).astype(np.float32)


def from_float32(x: np.ndarray, dtype) -> np.ndarray:
    """fp32 -> dtype with round-to-nearest-even (bf16 as uint16 bits, like __float2bfloat16_rn)."""
    x = np.asarray(x, np.float32)
    if str(dtype) == "bfloat16":
        b = x.view(np.uint32)
        rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        nan = np.isnan(x)
        return np.where(nan, (b >> 16) | 0x40, rounded).astype(np.uint16)
    return x.astype(np.dtype(dtype))


def sentinel_ids(ids: np.ndarray) -> np.ndarray:
    """What SENTINEL delivers for int32 expert ids: an id equal to the id slots' sentinel
    (layout.SENTINEL_IDS, negative, so invalid) arrives as -1; every other id as sent."""
    return np.where(ids.view(np.uint32) == SENTINEL_IDS, np.int32(-1), ids).astype(np.int32)


def sentinel_escape(x: np.ndarray, kind: int) -> np.ndarray:
    """What SENTINEL delivers for payload rows `x` [rows, ...] of a given layout.KIND_*:
    every 32-bit word (row bytes zero-padded to whole words) equal to 0xFFFFFFFF becomes the
    kind's NaN word; KIND_RAW16 payloads arrive unchanged."""
    from ..layout import KIND_F16, KIND_F32, KIND_RAW16
    if kind == KIND_RAW16 or x.shape[0] == 0:
        return x
    rows = np.ascontiguousarray(x).view(np.uint8).reshape(x.shape[0], -1)
    n = rows.shape[1]
    padded = np.zeros((rows.shape[0], -(-n // 4) * 4), np.uint8)
    padded[:, :n] = rows
    words = padded.view(np.uint32)
    repl = {KIND_F16: 0x7FFF7FFF, KIND_F32: 0x7FFFFFFF}.get(kind, 0x7F7F7F7F)
    words[words == 0xFFFFFFFF] = repl
    return padded[:, :n].copy().view(x.dtype).reshape(x.shape)
