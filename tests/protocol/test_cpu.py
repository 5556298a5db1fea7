"""CPU suite: layout math, generated header, cubins, reference model, API errors without a driver."""
import ctypes
import subprocess

import numpy as np
import pytest

from ep_a2a import layout
from ep_a2a.testing import reference as ref
from ep_a2a.driver import module


def test_layout_sections_aligned_disjoint_and_combine_offset_fixed():
    land = (0, layout.landing_bytes(14336, layout.KIND_F16), layout.landing_bytes(32, layout.KIND_RAW16))
    L = layout.WorkspaceLayout.build(8, 4096, 8, (32, 14336, 32), 14336, sentinel=True, landing=land)
    assert L.landing_bytes[1:] == (14336, 64)
    spans = [(L.off_dispatch_flags, 128), (L.off_combine_flags, 32), (L.off_epoch, 4),
             (L.off_done, 4), (L.off_counters, 32), (L.off_records, 4096 * 8 * 4)]
    spans += [(o, 8 * 4096 * b) for o, b in zip(L.off_recv, L.payload_bytes)]
    spans += [(L.off_combine, 8 * 4096 * 14336), (L.off_id_slots, 2 * 8 * 4096 * 4 * 9),
              (L.off_combine_slots, 4096 * 8 * 14336)]
    spans += [(o, 8 * 4096 * b) for o, b in zip(L.off_landing[1:], L.landing_bytes[1:])]
    spans += [(L.off_abort, 4), (L.off_dropped, 4)]
    spans.sort()
    for (o1, n1), (o2, _) in zip(spans, spans[1:]):
        assert o1 % layout.ALIGN == 0 and o1 + n1 <= o2
    assert spans[-1][0] + spans[-1][1] <= L.size
    # the combine section depends only on construction arguments (never on runtime max)
    assert L.off_combine == layout.WorkspaceLayout.build(8, 4096, 8, (32, 14336, 32), 14336, sentinel=True).off_combine
    assert L.expert_major_bytes(32) > L.size


def test_generated_header_matches_ctypes(tmp_path):
    hdr = layout.c_header()
    assert f"static_assert(sizeof(A2AParams) == {ctypes.sizeof(layout.A2AParams)}" in hdr
    # the header compiles and its asserts hold under nvcc's host compiler
    src = tmp_path / "t.cu"
    (tmp_path / "generated").mkdir()
    (tmp_path / "generated" / "params.cuh").write_text(hdr)
    src.write_text('#include "generated/params.cuh"\nint main(){return 0;}\n')
    r = subprocess.run(["nvcc", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "t.o")], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_cubins_built_with_expected_symbols():
    built = module.built_cubins()
    for stem in ("fence", "util"):
        assert built.get(stem) == [90, 100, 103], built
    for arch in (90, 100, 103):
        data = (module.CUBIN_DIR / f"fence.sm_{arch}.cubin").read_bytes()
        for sym in (b"fence_dispatch", b"fence_combine_bf16", b"fence_combine_f16", b"fence_combine_f32",
                    b"fence_combine_q8_bf16", b"fence_combine_q8_f16", b"fence_combine_q8_f32"):
            assert sym in data
        assert b"ep_empty" in (module.CUBIN_DIR / f"util.sm_{arch}.cubin").read_bytes()


def test_expert_owner_contiguous_first_ranks_own_more():
    o = ref.expert_owner(10, 4)
    assert o.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert ref.expert_owner(3, 8).tolist() == [0, 1, 2]


def test_reference_dispatch_dedup_and_records():
    ids = [np.array([[0, 1], [2, 3], [-1, 2]], np.int32), np.array([[3, 0]], np.int32)]
    pay = [[np.arange(6, dtype=np.float32).reshape(3, 2)], [np.array([[9, 9]], np.float32)]]
    rcv, rec = ref.dispatch(ids, pay, ep_size=2, num_experts=4, runtime_max_tokens_per_rank=3)
    assert rcv[0]["counts"].tolist() == [1, 1] and rcv[1]["counts"].tolist() == [2, 1]
    assert rec[0][0].tolist() == [[0, 0], [-1, -1]]          # both experts on rank 0: one slot
    assert rec[0][2].tolist() == [[-1, -1], [1, 1]]          # invalid id sends nothing
    assert rec[1][0].tolist() == [[1, 0], [0, 0]]
    assert (rcv[1]["expert_ids"][0, 2] == -1).all()          # past the count


def test_tree_sum_order_and_bf16_rounding():
    rng = np.random.default_rng()
    v = [rng.standard_normal(5).astype(np.float32) for _ in range(11)]
    g1 = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
    g2 = ((v[8] + v[9]) + (v[10] + 0)) + ((np.float32(0) + 0) + (0 + 0))
    assert np.array_equal(ref.tree_sum(v, 5), g1 + g2)
    x = rng.standard_normal(1000).astype(np.float32)
    b = ref.from_float32(x, "bfloat16")
    back = ref.to_float32(b, "bfloat16")
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -8)  # RNE to 8 significant bits
    assert ref.from_float32(np.float32([1 + 2 ** -8, 1 + 3 * 2 ** -8]), "bfloat16").tolist() == [0x3F80, 0x3F82]


def test_no_driver_gives_clear_error():
    from ep_a2a.driver import device
    if device.available():
        pytest.skip("a GPU is present: the no-driver path cannot be exercised here")
    import ep_a2a
    with pytest.raises(ep_a2a.NoDriverError, match="no CUDA driver|no GPU"):
        ep_a2a.LocalGroup([0])


def test_payload_spec_bytes():
    from ep_a2a import PayloadSpec
    assert PayloadSpec("h", (7168,), "bfloat16").bytes_per_token == 14336
    assert PayloadSpec("s", (7168 // 32,), "uint8").bytes_per_token == 224
    assert PayloadSpec("fp8", (7,), "float8_e4m3fn").bytes_per_token == 7


def test_sentinel_escape_rule():
    from ep_a2a.layout import KIND_F16, KIND_F32, KIND_F8, KIND_RAW16, sentinel_kind
    assert [sentinel_kind(n) for n in ("bfloat16", "float16", "float32", "float8_e4m3fn", "uint8", "int32")] == \
        [KIND_F16, KIND_F16, KIND_F32, KIND_F8, KIND_RAW16, KIND_RAW16]
    rng = np.random.default_rng()
    x = rng.integers(0, 2**16, (5, 6), dtype=np.uint64).astype(np.uint16)
    x[0, 0:2] = 0xFFFF          # a whole word of all-ones NaNs: rewritten
    x[1, 2] = 0xFFFF            # one NaN half: the word is not the sentinel, kept
    x[2, 4:6] = 0xFFFF
    y = ref.sentinel_escape(x, KIND_F16)
    assert y[0, 0] == y[0, 1] == 0x7FFF and y[2, 4] == y[2, 5] == 0x7FFF and y[1, 2] == 0xFFFF
    mask = np.ones_like(x, bool)
    mask[0, 0:2] = mask[2, 4:6] = False
    assert np.array_equal(y[mask], x[mask])
    b = np.full((2, 7), 0xFF, np.uint8)   # 7 bytes: the tail word is zero-padded, never the sentinel
    e = ref.sentinel_escape(b, KIND_F8)
    assert e[:, :4].tolist() == [[0x7F] * 4] * 2 and e[:, 4:].tolist() == [[0xFF] * 3] * 2
    assert np.array_equal(ref.sentinel_escape(b, KIND_RAW16), b)
    f = np.full((3,), 0xFFFFFFFF, np.uint32).view(np.float32).reshape(3, 1)
    assert (ref.sentinel_escape(f, KIND_F32).view(np.uint32) == 0x7FFFFFFF).all()


def test_bench_crossover_and_crossover_override(monkeypatch):
    from ep_a2a.tools.bench_report import crossover
    from ep_a2a import config, schedule
    rows = [dict(protocol=p, tokens_per_rank=t, round_trip_us=v) for p, t, v in
            [("fence", 1, 10), ("sentinel", 1, 8), ("fence", 2, 11), ("sentinel", 2, 10), ("fence", 4, 12),
             ("sentinel", 4, 13)]]
    assert crossover(rows) == 2
    assert crossover([r for r in rows if r["protocol"] == "fence"]) is None
    monkeypatch.setenv("EP_A2A_SENTINEL_MAX_TOKENS", "64")
    assert config.sentinel_max_tokens() == 64
    monkeypatch.delenv("EP_A2A_SENTINEL_MAX_TOKENS")
    assert config.sentinel_max_tokens() == schedule.SENTINEL_MAX_TOKENS_H200


def test_check_harness_routing_shapes():
    from ep_a2a.testing.formats import routing
    rng = np.random.default_rng()
    for kind in ("uniform", "zipf", "perfect"):
        ids = routing(kind, rng, 33, 6, 40, 8, source=3)
        assert ids.shape == (33, 6) and ids.dtype == np.int32 and ((ids >= 0) & (ids < 40)).all()
        if kind != "perfect":
            assert all(len(set(row)) == 6 for row in ids)   # distinct experts per token
    owner = ref.expert_owner(40, 8)
    perfect = routing("perfect", rng, 8, 6, 40, 8, source=0)
    assert all(len(set(owner[row])) == 6 for row in perfect)  # six consecutive ranks


def test_e4m3_round_matches_ml_dtypes_where_finite():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (the float8 oracle) not installed")
    rng = np.random.default_rng()
    y = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 2.6, 20000),
                        np.array([0.0, -0.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 448.0, -448.0, 15.5, 0.01953125])])
    y = y[np.abs(y) <= 448].astype(np.float32)
    want = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = ref.e4m3_round(y)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), y[got != want][:5]


def test_e4m3_round_saturates():
    assert list(ref.e4m3_round(np.array([500.0, -1e9, 449.0], np.float32))) == [448.0, -448.0, 448.0]


def test_q8_roundtrip_error_bound_and_combine_bound():
    """The stated bound: each dequantized value is within 1/16 of its 128-block's amax; so a
    combined value is within the sum of its partials' block amax / 16 (plus output rounding)."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((64, 512)) * rng.uniform(0.01, 100, (64, 1))).astype(np.float32)
    x[3, :128] = 0.0                                          # an all-zero block
    d = ref.q8_roundtrip(x)
    amax = np.abs(x.reshape(64, 4, 128)).max(axis=-1, keepdims=True)
    err = np.abs(d - x).reshape(64, 4, 128)
    assert (err <= amax / 16).all()
    assert (d[3, :128] == 0).all()
    parts = [x[8 * k:8 * k + 8] for k in range(8)]            # 8 partial results of 8 tokens
    exact = sum(p.astype(np.float64) for p in parts)
    q = sum(ref.q8_roundtrip(p).astype(np.float64) for p in parts)
    bound = sum(np.repeat(np.abs(p.reshape(8, 4, 128)).max(axis=-1), 128, axis=-1) for p in parts) / 16
    assert (np.abs(q - exact) <= bound + 1e-6).all()


def test_e4m3_round_against_the_format_definition():
    """Every finite e4m3fn value (decoded from its 256 bit patterns) maps to itself; every
    midpoint between neighbours goes to the one with an even mantissa; beyond 448 saturates."""
    vals = []
    for b in range(128):
        e, m = b >> 3, b & 7
        if b == 0x7F:
            continue                                          # NaN
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    vals = np.array(sorted(vals), np.float32)
    assert np.array_equal(ref.e4m3_round(vals), vals) and np.array_equal(ref.e4m3_round(-vals), -vals)
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    got = ref.e4m3_round(mids)
    codes = {float(v): i for i, v in enumerate(vals)}          # index parity = mantissa parity
    assert all(codes[float(g)] % 2 == 0 for g in got)
    assert all(lo <= g <= hi for g, lo, hi in zip(got, vals[:-1], vals[1:]))


def test_vec_is_the_widest_vector_dividing_size_and_addresses():
    from ep_a2a.schedule import vector_bytes
    rng = np.random.default_rng()
    for _ in range(5000):
        n = int(rng.integers(0, 1 << 20)) * int(rng.choice([1, 2, 4, 8, 16, 32]))
        addrs = [int(rng.integers(0, 1 << 40)) * int(rng.choice([1, 2, 4, 8, 16, 256])) for _ in range(int(rng.integers(0, 3)))]
        want = next((w for w in (16, 8, 4, 2) if n % w == 0 and all(a % w == 0 for a in addrs)), 1)
        assert vector_bytes(n, *addrs) == want, (n, addrs)


def test_fp8_combine_sections_only_when_asked():
    plain = layout.WorkspaceLayout.build(4, 64, 8, (32, 512), 512, sentinel=False)
    q8 = layout.WorkspaceLayout.build(4, 64, 8, (32, 512), 512, sentinel=False, q8_hidden=256)
    assert plain.off_combine_q == plain.off_combine_scales == 0
    assert q8.off_combine_q >= q8.off_combine + 4 * 64 * 512
    assert q8.off_combine_scales >= q8.off_combine_q + 4 * 64 * 256
    assert q8.size >= q8.off_combine_scales + 4 * 64 * (256 // layout.Q8_BLOCK) * 4
    assert q8.off_combine == plain.off_combine


def _record(kind, observed=0, expected=0, phase=1, peer=2):
    rec = layout.ErrorRecord()
    rec.kind, rec.rank, rec.phase, rec.peer, rec.epoch = kind, 0, phase, peer, 7
    rec.observed, rec.expected = observed, expected
    return rec


def test_error_records_decode_into_the_documented_errors():
    from ep_a2a import errors
    B = layout.TAG_TMAX_BITS
    assert errors.error_from_record(_record(0)) is None
    e = errors.error_from_record(_record(layout.ERR_TIMEOUT, 6, 7))
    assert isinstance(e, errors.PeerTimeoutError) and (e.peer, e.phase, e.epoch) == (2, "dispatch", 7)
    e = errors.error_from_record(_record(layout.ERR_PEER_ABORTED, phase=4, peer=5))
    assert isinstance(e, errors.PeerAbortedError) and e.peer == 5 and "rank 5 gave up" in str(e)
    # step tags: same T^, different mask hash -> active-set mismatch; different T^ -> T^ mismatch
    e = errors.error_from_record(_record(layout.ERR_TMAX_MISMATCH, 16 | 3 << B, 16 | 9 << B))
    assert isinstance(e, errors.ActiveRanksMismatchError)
    e = errors.error_from_record(_record(layout.ERR_TMAX_MISMATCH, 8 | 3 << B, 16 | 3 << B))
    assert isinstance(e, errors.RuntimeMaxMismatchError) and "used 16" in str(e) and "used 8" in str(e)
    # claim taken, kind not written (the context was lost first): reported only for a trap's
    # launch failure, and only when no record is complete
    class Lost(Exception):
        code = errors.LAUNCH_FAILED
    half = _record(0, observed=layout.SENTINEL_IDS, phase=3, peer=4)
    half.claim = 1
    assert errors.error_from_record(half) is None and errors.error_from_records(half) is None
    e = errors.error_from_records(half, (), Lost())
    assert type(e) is errors.PeerError and (e.rank, e.peer, e.phase, e.epoch) == (0, 4, "sentinel-dispatch", 7)
    assert "0x88888888" in str(e) and "context was lost" in str(e)
    assert errors.error_from_records(half, (), ValueError()) is None  # not a lost context
    whole = _record(layout.ERR_TIMEOUT, phase=4, peer=6)
    assert isinstance(errors.error_from_records(half, [half, whole], Lost()), errors.PeerTimeoutError)  # a complete one wins
    assert errors.error_from_records(half, [whole], ValueError()) is None  # others' records only for a lost context
    blank = _record(0, phase=0)
    blank.claim = 1
    assert "none of its fields arrived" in str(errors.error_from_records(blank, (), Lost()))


def test_reference_dispatch_drops_inactive_ranks_and_counts_them():
    rng = np.random.default_rng()
    ep, E, K, T = 4, 16, 4, 9
    ids = [rng.integers(-1, E, (T, K)).astype(np.int32) for _ in range(ep)]
    pay = [[rng.standard_normal((T, 3)).astype(np.float32)] for _ in range(ep)]
    owner = ref.expert_owner(E, ep)
    active = {0, 1, 3}
    rcv, rec = ref.dispatch(ids, pay, ep, E, T, active)
    assert not rcv[2]["counts"].any()                         # nothing reaches the inactive rank
    for s in range(ep):
        t = rec[s][..., 0]
        assert not (t == 2).any()
        kept = [(i, k) for i in range(T) for k in range(K) if 0 <= ids[s][i, k] < E and owner[ids[s][i, k]] in active]
        assert all(t[i, k] >= 0 or owner[ids[s][i, k]] in [t[i, j] for j in range(k)] for i, k in kept)
    want = sum(int(((ids[s] >= 0) & (owner[np.clip(ids[s], 0, E - 1)] == 2)).sum()) for s in range(ep))
    assert ref.dropped_selections(ids, E, ep, active) == want


def _present_only_group(vals: list) -> np.ndarray:
    """The kernels' shortcut for a group of m < 8 present members: the pairwise tree over the
    present prefix alone (a node whose right half is absent is its left half), then + 0."""
    def tree(lo: int, n: int):
        if n == 1:
            return vals[lo]
        if lo + n // 2 >= len(vals):
            return tree(lo, n // 2)
        return tree(lo, n // 2) + tree(lo + n // 2, n // 2)
    t = tree(0, 8)
    return t if len(vals) == 8 else t + np.float32(0)


def test_skipping_absent_members_is_the_same_tree_bit_for_bit():
    """The identity combine's reduction relies on: summing only the m present members of a
    group (+0 once when m < 8) gives the bits of the 8-member tree with +0 members, signed
    zeros, infinities, NaN and cancellations included."""
    rng = np.random.default_rng()
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 2.0 ** -140, -(2.0 ** -140)])
    for _ in range(200):
        m = int(rng.integers(1, 9))
        w = 64
        vals = [rng.choice(specials, w) if rng.random() < 0.7 else rng.standard_normal(w).astype(np.float32)
                for _ in range(m)]
        vals[0][:8] = -0.0                                     # all-negative-zero columns
        for v in vals:
            v[:8] = -0.0
        with np.errstate(invalid="ignore", over="ignore"):
            want = ref.tree_sum(vals, w)
            got = _present_only_group(vals)
        same = (want.view(np.uint32) == got.view(np.uint32)) | (np.isnan(want) & np.isnan(got))
        assert same.all(), (m, want[~same], got[~same])
        if m < 8:
            assert (want[:8].view(np.uint32) == 0).all()       # -0 members: the padded tree gives +0


def test_grid_after_an_early_trigger_returns_to_the_full_share():
    """A small step triggers its successor early; the launch after it is held to half the
    rank's share. Held, it triggers early only when its successor is small too: otherwise
    large steps after it would stay at half the grid (an early trigger used to be an
    absorbing state), and at small batches the early trigger keeps hiding the next launch."""
    import dataclasses
    from types import SimpleNamespace
    from ep_a2a.schedule import Schedule
    r = SimpleNamespace(params=SimpleNamespace(), early=False,
                        sch=Schedule(8, 8, 256, 7168, 14336, False, pdl=True, max_grid=66))

    def grid(want, succ, fills=False):  # the rank's side: it carries the trigger into the next launch
        g, r.early = r.sch.grid(want, succ, r.early, fills)
        r.params.trigger_early = int(r.early)
        return g
    assert grid(1, 1) == 1 and r.params.trigger_early == 1          # small: early
    assert grid(1000, 1000) == 33 and r.params.trigger_early == 0   # held to half, large successor: late
    assert grid(1000, 1000) == 66 and r.params.trigger_early == 0   # whole share again
    assert grid(1000, 1000) == 66 and r.params.trigger_early == 0
    assert grid(20, 66) == 20 and r.params.trigger_early == 1       # small, unheld: early
    assert grid(66, 20) == 33 and r.params.trigger_early == 1       # held, small successor: early
    assert grid(20, 66) == 20 and r.params.trigger_early == 1
    # a successor that fills its grid (a quantizing FP8 combine) is never halved for our trigger
    fills = lambda want, succ: grid(want, succ, True)  # noqa: E731
    assert grid(1000, 1000) == 33 and fills(1000, 1000) == 66           # (back to the whole share)
    assert fills(16, 128) == 16 and r.params.trigger_early == 0         # unheld, large filling successor: late
    assert grid(128, 16) == 66 and r.params.trigger_early == 0          # so it gets the whole share
    assert fills(16, 8) == 16 and r.params.trigger_early == 1           # a filling successor that fits: early
    r.sch = dataclasses.replace(r.sch, pdl=False)
    assert grid(5, 5) == 5 and r.params.trigger_early == 0
    assert grid(1000, 1000) == 66


def test_q8_quantize_bytes_decode_to_the_roundtrip():
    """The byte-level model (what the GPU writes: e4m3 codes and scales) decodes to exactly
    q8_roundtrip's values, signed zeros, saturation and NaN included; every byte decodes."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((16, 512)) * rng.uniform(1e-3, 1e3, (16, 1))).astype(np.float32)
    x[0, :128] = 0.0
    x[1, :128] = -0.0
    x[2, 5] = np.nan
    x[3, :128] = rng.choice(np.float32([448.0, -448.0, 1e-30, -1e-30, 3.0]), 128)
    codes, scales = ref.q8_quantize(x)
    assert codes.dtype == np.uint8 and scales.shape == (16, 4)
    back = (ref.e4m3_decode(codes).reshape(16, 4, 128) * scales[..., None]).reshape(16, 512)
    want = ref.q8_roundtrip(x)
    nan = np.isnan(want)
    assert nan[2, 5] and np.array_equal(np.isnan(back), nan)
    assert np.array_equal(back[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert (codes[1, :128] == 0x80).all() and (codes[0, :128] == 0).all()
    every = ref.e4m3_decode(np.arange(256, dtype=np.uint8))
    assert np.isnan(every[[0x7F, 0xFF]]).all() and every[0x7E] == 448 and every[1] == 2.0 ** -9
    finite = ~np.isnan(every)
    assert np.array_equal(ref.e4m3_encode(every[finite]), np.arange(256)[finite].astype(np.uint8))


def test_q8_tiny_blocks_stay_finite():
    """Blocks whose largest magnitude is tiny: 448 / amax overflows below ~1.3e-36 (the rule
    divides by the scale there instead of multiplying by inf, which made NaN of zeros), and
    amax / 448 underflows below ~6e-43 (scale 1: the values round to signed zeros)."""
    x = np.zeros((4, 256), np.float32)
    x[0, :3] = [1e-37, 3e-38, -2e-38]          # factor would overflow
    x[1, :2] = [1e-44, -1e-45]                 # scale would underflow
    x[2, :2] = [1e-30, 5e-31]                  # small but ordinary
    x[3, 128:130] = [3.0, -1e-37]              # one ordinary block beside an empty one
    d = ref.q8_roundtrip(x)
    codes, scales = ref.q8_quantize(x)
    assert np.isfinite(d).all() and np.isfinite(scales).all() and ((codes & 0x7F) != 0x7F).all()
    amax = np.abs(x.reshape(4, 2, 128)).max(axis=-1, keepdims=True)
    err = np.abs(d - x).reshape(4, 2, 128)
    # the stated 1/16-of-amax bound needs a normal scale (amax >= 448 * 2**-126); below
    # that the scale's subnormal precision and the underflow to scale 1 give at most amax
    normal = amax >= 448 * 2.0 ** -126
    assert (err <= np.where(normal, amax / 16, amax)).all()
    assert not normal[0, 0, 0] and abs(d[0, 0] - x[0, 0]) <= 1e-37 / 16
    assert d[0, 3] == 0 and not np.signbit(d[0, 3])
    assert scales[1, 0] == 1 and d[1, 0] == 0 and np.signbit(d[1, 1])


def test_dispatch_splits_spread_small_batches_within_half_the_share():
    """FENCE splits a token's pushes over blocks only at small batches: while the earlier
    tokens' ids fit one warp-wide load, within half the rank's share (the grid keeps PDL's
    early trigger), with at least MIN_SPLIT_GROUPS 16-byte groups per block, and only for
    tokens that move in 16-byte groups. At T^ <= CLUSTER_TOKENS, where clusters always find
    room (clusters_fit), the grid is one cluster of CLUSTER_BLOCKS."""
    from types import SimpleNamespace
    from ep_a2a import schedule
    from ep_a2a.schedule import Schedule
    groups = (7168 * 2 + 8 * 4 + 8 * 4) // 16  # deepseek-v3 bf16: hidden states, ids, weights
    V16, V8 = [16] * 3, [16, 8]
    cap = min(schedule.MAX_DISPATCH_SPLITS, groups // schedule.MIN_SPLIT_GROUPS)
    for clusters in (True, False):
        s = Schedule(8, 8, 256, 7168, 14336, False, pdl=True, max_grid=66, push_groups=groups, clusters=clusters)
        for T in (1, 2, 3, 4, 5, 6, 8, 16, 128):
            n = s.dispatch_splits(T, T, V16)
            if clusters and T <= schedule.CLUSTER_TOKENS:  # the grid one cluster of 8
                assert n == 8 // T and s.dispatch_cluster(T, T, n, T * n) == 8, (T, n)
            else:
                assert s.dispatch_cluster(T, T, n, T * n) == 0
                assert n == (max(1, min(33 // T, cap)) if T <= 5 else 1), (T, n)  # (T - 1) * 8 ids in one load of 32
            assert T * n <= 33 or n == 1
            assert s.dispatch_want(T, T, "fence", n) == max(T * n, -(-8 * T * 8 // 2048))
            assert s.grid(s.dispatch_want(T, T, "fence", n), 1, False)[1] == (T <= 33), T  # early trigger kept
        n = s.dispatch_splits(1, 4, V16)  # T < T^: T^ decides, as on every rank
        assert n == max(1, min(33, cap)) and s.dispatch_cluster(1, 4, n, n) == 0
    assert s.dispatch_splits(1, 1, V16) > 1
    assert s.dispatch_splits(1, 1, V8) == 1 and s.dispatch_splits(0, 1, V16) == 1
    assert s.dispatch_cluster(1, 1, 8, 8) == 0  # (clusters=False)
    wide = Schedule(8, 22, 256, 7168, 14336, False, pdl=True, max_grid=66, push_groups=groups)
    assert wide.dispatch_splits(2, 2, V16) > 1 and wide.dispatch_splits(3, 3, V16) == 1  # 22 ids a load
    small = Schedule(8, 8, 256, 7168, 14336, False, pdl=True, max_grid=66, push_groups=schedule.MIN_SPLIT_GROUPS - 1)
    assert small.dispatch_splits(1, 1, V16) == 1
    assert Schedule(8, 8, 256, 7168, 14336, False, pdl=True, max_grid=66).dispatch_splits(1, 1, V16) == 1  # no groups


def test_clusters_only_where_one_always_finds_room():
    """H200: 132 SMs, 4 blocks of 256 threads each (528 slots). At T^ = 1 a rank holds at most
    2 * 8 slots (its one-cluster dispatch and one PDL successor, the combine capped at 8), so
    8 ranks hold 128: 400 slots free against 16 * 7 (blocks of a cluster sharing SMs), and at
    most 32 SMs full against 132 - 8 * 7 (blocks on SMs of their own). 16 ranks (256 held)
    still fit, 32 ranks (512) do not, nor 8 ranks at one block per SM. A dispatch whose id
    sanitizing needs more blocks than the cluster counts those."""
    from ep_a2a.schedule import Schedule
    s = Schedule(8, 8, 256, 7168, 14336, True, pdl=True, max_grid=66, push_groups=900)
    assert s.clusters_fit(4, 132, 1) and s.clusters_fit(4, 132, 8) and s.clusters_fit(4, 132, 16)
    assert not s.clusters_fit(4, 132, 32) and not s.clusters_fit(1, 132, 8)
    wide = Schedule(512, 32, 32, 7168, 14336, False, pdl=True, max_grid=66, push_groups=900)  # 64 sanitizing blocks
    assert wide.dispatch_want(0, 1, "fence") == 64
    assert wide.clusters_fit(4, 132, 1) and not wide.clusters_fit(4, 132, 4)
    on = Schedule(8, 8, 256, 7168, 14336, True, pdl=True, max_grid=66, push_groups=900, clusters=True)
    # the combine at T^ = 1 held to one cluster's blocks (a quantizing FP8 one wants ep_size * T^ blocks)
    assert on.combine_want(1, 1, "fence", 1)[0] == 8 and on.combine_want(1, 2, "fence", 1)[0] > 8
    big = Schedule(16, 8, 256, 7168, 14336, True, pdl=True, max_grid=66, push_groups=900, clusters=True)
    from dataclasses import replace
    assert big.combine_want(1, 1, "fence", 16)[0] == 8 and replace(big, clusters=False).combine_want(1, 1, "fence", 16)[0] == 16
