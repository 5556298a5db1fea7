"""MoE compute pieces on one GPU (build_index, gather_rows, finalize), bitwise against the NumPy
reference (testing/moe_reference.py), on uploaded arrays and on what a real dispatch left in the
rank-major workspace; then dispatch -> index -> gather -> stand-in expert -> finalize into the
combine input -> combine, checked against a per-token reference; and a CUDA graph replay."""
import numpy as np
import pytest
from common import fresh_rng

pytestmark = pytest.mark.gpu

POISON = 0xA5  # every output byte is set to this before a call: a skipped write cannot pass


def _dev():
    from ep_a2a.driver.device import get_device
    return get_device(0)


def _poison(t):
    from ep_a2a.interop.arrays import copy_from_numpy
    copy_from_numpy(t, np.full(t.nbytes, POISON, np.uint8))


def _poison_index(idx):
    from ep_a2a.interop.tensor import Tensor
    _poison(Tensor(idx._alloc.ptr, (idx.nbytes,), "uint8", device=(2, idx.device.ordinal)))


def _bits(a):
    """Raw bytes of a host copy (bf16 may come back as uint16 or ml_dtypes.bfloat16)."""
    return np.ascontiguousarray(a).view(np.uint8)


ROUTES = ("uniform", "replacement", "local_heavy", "none_here")
JUNK = np.array([-1, -2, 2**31 - 1, -2**31], np.int64)


def _ids(kind, rng, ep, tmax, top_k, num_experts, rank):
    """int32 [ep, T^, top_k] expert ids as dispatch leaves them, for `rank`'s point of view:
    uniform: distinct experts per token (testing.formats.routing); replacement: drawn with replacement
    (repeated experts); local_heavy: mostly `rank`'s experts (several local experts per token);
    none_here: no expert of `rank`. 5% of the entries are -1 or out of range."""
    from ep_a2a.testing import reference as ref
    from ep_a2a.testing.formats import routing
    shape = (ep, tmax, top_k)
    owner = ref.expert_owner(num_experts, ep)
    if kind == "uniform":
        ids = np.stack([routing("uniform", rng, tmax, top_k, num_experts, ep) for _ in range(ep)]).astype(np.int64)
    elif kind == "replacement":
        ids = rng.integers(0, num_experts, shape)
    elif kind == "local_heavy":
        local = np.flatnonzero(owner == rank)
        pool = local if len(local) else np.arange(num_experts)
        ids = np.where(rng.random(shape) < 0.8, rng.choice(pool, shape), rng.integers(0, num_experts, shape))
    else:
        others = np.flatnonzero(owner != rank)
        ids = rng.choice(others, shape) if len(others) else np.full(shape, -1)
    junk = rng.choice(np.append(JUNK, [num_experts, num_experts + 3]), shape)
    return np.where(rng.random(shape) < 0.05, junk, ids).astype(np.int32)


def _check_index(idx, want, msg):
    from ep_a2a.interop.arrays import to_numpy
    total = want.total
    got = {f: to_numpy(getattr(idx, f)) for f in ("counts", "offsets", "rows", "row_weight", "row_of")}
    assert np.array_equal(got["counts"], want.counts), f"{msg}: counts"
    assert np.array_equal(got["offsets"], want.offsets), f"{msg}: offsets"
    assert np.array_equal(got["row_of"], want.row_of.reshape(got["row_of"].shape)), f"{msg}: row_of"
    assert np.array_equal(got["rows"][:total], want.rows), f"{msg}: rows"
    assert np.array_equal(_bits(got["row_weight"][:total]), _bits(want.row_weight)), f"{msg}: row_weight"
    # entries past the total are never written
    assert (_bits(got["rows"][total:]) == POISON).all(), f"{msg}: rows past the total were written"
    assert (_bits(got["row_weight"][total:]) == POISON).all(), f"{msg}: row_weight past the total was written"


def _float_rows(rng, shape, dtype):
    """Random normals in `dtype` (bf16 as uint16 bits)."""
    from ep_a2a.testing import reference as ref
    return ref.from_float32(rng.standard_normal(shape).astype(np.float32), dtype)


def _nan_rows(a, start, dtype):
    """Rows from `start` on become NaN: a finalize reading a row past the total shows up."""
    a[start:] = 0x7FC0 if dtype == "bfloat16" else np.nan
    return a


# -- build_index on uploaded arrays ---------------------------------------------------------------
@pytest.mark.parametrize("tmax", [1, 7, 128, 4096])
@pytest.mark.parametrize("top_k", [1, 8, 22])
@pytest.mark.parametrize("ep", [1, 3, 8])
def test_build_index_uploaded(ep, top_k, tmax):
    from ep_a2a.testing import moe_reference as mref
    from ep_a2a.interop.arrays import from_numpy
    from ep_a2a.driver.stream import Stream
    from ep_a2a.moe import ExpertIndex, build_index
    rng, seed = fresh_rng()
    dev = _dev()
    st = Stream(dev)
    num_experts = {1: 37, 3: 29, 8: 67}[ep]  # uneven blocks: the first ranks own one more
    idx = [ExpertIndex(dev, num_experts=num_experts, ep_size=ep, rank=r, max_tokens_per_rank=tmax, top_k=top_k)
           for r in range(ep)]
    try:
        for kind in ROUTES:
            focus = int(rng.integers(ep))
            ids_h = _ids(kind, rng, ep, tmax, top_k, num_experts, focus)
            w_h = rng.standard_normal(ids_h.shape).astype(np.float32)
            ids_d, w_d = from_numpy(ids_h, dev), from_numpy(w_h, dev)
            for i in idx:
                _poison_index(i)
            dev.synchronize()
            for r in range(ep):
                assert build_index(ids_d, w_d, num_experts=num_experts, ep_size=ep, rank=r, stream=st.handle,
                                   out=idx[r]) is idx[r]
            dev.synchronize()
            for r in range(ep):
                _check_index(idx[r], mref.build_index(ids_h, w_h, num_experts, ep, r),
                             f"{seed} route={kind} focus={focus} rank={r}")
    finally:
        dev.synchronize()
        for i in idx:
            i.close()
        st.close()


@pytest.mark.parametrize("ep,num_experts,top_k,tmax", [
    (1, 1024, 8, 4096), (1, 1024, 8, 7), (1, 256, 22, 300),   # many local experts (small tables per warp)
    (1, 1024, 22, 4096),                                       # tiles past 16 rounds (the table is full)
    (72, 288, 8, 64), (72, 75, 22, 1), (72, 288, 22, 4096),    # a full NVL72 domain
    (8, 3, 2, 16),                                             # ranks 3..7 own no expert
])
def test_build_index_uploaded_shapes(ep, num_experts, top_k, tmax):
    from ep_a2a.testing import moe_reference as mref
    from ep_a2a.interop.arrays import from_numpy
    from ep_a2a.moe import build_index
    rng, seed = fresh_rng()
    dev = _dev()
    ids_h = _ids("replacement", rng, ep, tmax, top_k, num_experts, 0)
    w_h = rng.standard_normal(ids_h.shape).astype(np.float32)
    ids_d, w_d = from_numpy(ids_h, dev), from_numpy(w_h, dev)
    dev.synchronize()
    for r in (range(ep) if ids_h.size < 1 << 20 else (0, 1, ep // 2, ep - 1)):
        # out=None: a new index, on the legacy default stream (the inputs are not ep_a2a views)
        idx = build_index(ids_d, w_d, num_experts=num_experts, ep_size=ep, rank=r)
        dev.synchronize()
        _check_index_written(idx, mref.build_index(ids_h, w_h, num_experts, ep, r), f"{seed} rank={r}")
        idx.close()


def _check_index_written(idx, want, msg):
    """_check_index without the poison check (a fresh index was never poisoned)."""
    from ep_a2a.interop.arrays import to_numpy
    total = want.total
    assert np.array_equal(to_numpy(idx.counts), want.counts), f"{msg}: counts"
    assert np.array_equal(to_numpy(idx.offsets), want.offsets), f"{msg}: offsets"
    assert np.array_equal(to_numpy(idx.row_of).reshape(-1), want.row_of.reshape(-1)), f"{msg}: row_of"
    assert np.array_equal(to_numpy(idx.rows)[:total], want.rows), f"{msg}: rows"
    assert np.array_equal(_bits(to_numpy(idx.row_weight)[:total]), _bits(want.row_weight)), f"{msg}: row_weight"


# -- gather_rows and finalize on uploaded arrays ---------------------------------------------------
@pytest.mark.parametrize("ep,top_k,tmax", [(1, 1, 1), (3, 8, 7), (8, 8, 128), (8, 22, 128), (3, 22, 4096),
                                           (8, 8, 4096)])
def test_gather_and_finalize_uploaded(ep, top_k, tmax):
    from ep_a2a.testing import moe_reference as mref
    from ep_a2a.interop.arrays import copy_from_numpy, empty, from_numpy, to_numpy
    from ep_a2a.driver.stream import Stream
    from ep_a2a.interop.tensor import Tensor, as_dtype
    from ep_a2a.moe import ExpertIndex, build_index, finalize, gather_rows
    rng, seed = fresh_rng()
    dev = _dev()
    st = Stream(dev)
    num_experts = 8 * ep + 3
    rank = int(rng.integers(ep))
    S, cap = ep * tmax, ep * tmax * top_k
    H = 256 if cap <= 1 << 16 else 40
    ids_h = _ids("local_heavy", rng, ep, tmax, top_k, num_experts, rank)
    w_h = rng.standard_normal(ids_h.shape).astype(np.float32)
    idx = ExpertIndex(dev, num_experts=num_experts, ep_size=ep, rank=rank, max_tokens_per_rank=tmax, top_k=top_k)
    want = mref.build_index(ids_h, w_h, num_experts, ep, rank)
    total = want.total
    keep = []

    def shifted(shape, dtype, elems):
        """A tensor whose address is `elems` elements past an allocation's start (narrower vectors)."""
        base = empty((int(np.prod(shape)) + elems,), dtype, dev)
        keep.append(base)
        return Tensor(base.ptr + elems * base.itemsize, shape, dtype, device=(2, dev.ordinal), owner=base)

    try:
        ids_d, w_d = from_numpy(ids_h, dev), from_numpy(w_h, dev)
        dev.synchronize()  # the uploads ran on the legacy stream; st does not wait for it
        build_index(ids_d, w_d, num_experts=num_experts, ep_size=ep, rank=rank, stream=st.handle, out=idx)
        # gather: 16-byte vectors (bf16 hidden), bytes (7-byte rows), the fp32 weights payload,
        # a source 2 bytes off alignment, and a [slots, ...] source
        cases = [("bfloat16", (H,), 0, False), ("uint8", (7,), 0, False), ("float32", (top_k,), 0, False),
                 ("bfloat16", (H,), 1, False), ("float16", (H,), 0, True)]
        for dtype, inner, shift, flat in cases:
            row_bytes = int(np.prod(inner)) * as_dtype(dtype).itemsize
            src_h = rng.integers(0, 256, (S, row_bytes), dtype=np.uint8)  # any bits: the copy is bitwise
            src = shifted((ep, tmax) + inner, dtype, shift) if shift else empty((ep, tmax) + inner, dtype, dev)
            copy_from_numpy(src, src_h)
            out = empty((cap + 3,) + inner, dtype, dev)  # more rows than the capacity is allowed
            _poison(out)
            dev.synchronize()
            gather_rows(idx, src.reshape(S, *inner) if flat else src, out)  # default stream: the build's
            dev.synchronize()
            got = _bits(to_numpy(out)).reshape(cap + 3, -1)
            msg = f"{seed} rank={rank} gather {dtype}{inner} shift={shift}"
            assert np.array_equal(got[:total], mref.gather_rows(want, src_h)), msg
            assert (got[total:] == POISON).all(), f"{msg}: rows past the total were written"
        # finalize: every fc2 / out dtype pair; then odd widths and addresses (narrow vectors)
        pairs = [(i, o, H, 0, False) for i in ("bfloat16", "float16", "float32") for o in ("bfloat16", "float16", "float32")]
        pairs += [("bfloat16", "bfloat16", 6, 0, False), ("float32", "bfloat16", H, 1, True), ("float16", "float32", 1, 0, True)]
        for in_dt, out_dt, h, shift, flat in pairs:
            fc2_h = _nan_rows(_float_rows(rng, (cap, h), in_dt), total, in_dt)
            fc2 = from_numpy(fc2_h, dev, in_dt)
            out = shifted((ep, tmax, h), out_dt, shift) if shift else empty((ep, tmax, h), out_dt, dev)
            _poison(out)
            dev.synchronize()
            finalize(idx, fc2, out.reshape(S, h) if flat else out, stream=st.handle)
            dev.synchronize()
            ref_out = mref.finalize(want, fc2_h, in_dt, out_dt)
            assert np.array_equal(_bits(to_numpy(out)).reshape(S, -1), _bits(ref_out).reshape(S, -1)), \
                f"{seed} rank={rank} finalize {in_dt}->{out_dt} hidden={h} shift={shift}"
    finally:
        dev.synchronize()
        idx.close()
        st.close()


def test_bad_input_rejected_before_launch():
    from ep_a2a.interop.arrays import empty, from_numpy, to_numpy
    from ep_a2a.moe import ExpertIndex, build_index, finalize, gather_rows
    dev = _dev()
    rng, seed = fresh_rng()
    ep, tmax, top_k, E = 2, 4, 3, 8
    idx = ExpertIndex(dev, num_experts=E, ep_size=ep, rank=1, max_tokens_per_rank=tmax, top_k=top_k)
    ids = from_numpy(_ids("replacement", rng, ep, tmax, top_k, E, 1), dev)
    w = from_numpy(np.ones((ep, tmax, top_k), np.float32), dev)
    with pytest.raises(ValueError, match="index: build it"):
        gather_rows(idx, empty((ep, tmax, 4), "uint8", dev), empty((ep * tmax * top_k, 4), "uint8", dev))
    kw = dict(num_experts=E, ep_size=ep, rank=1, out=idx)
    bad_build = [
        (dict(expert_ids=from_numpy(np.ones((ep, tmax, top_k), np.int64), dev)), "expert_ids: dtype"),
        (dict(expert_ids=from_numpy(np.ones((ep + 1, tmax, top_k), np.int32), dev)), "expert_ids: shape"),
        (dict(expert_ids=from_numpy(np.ones((ep, tmax, 23), np.int32), dev)), "expert_ids: shape"),
        (dict(weights=from_numpy(np.ones((ep, tmax, top_k), np.float64), dev)), "weights: dtype"),
        (dict(weights=from_numpy(np.ones((ep, tmax, top_k - 1), np.float32), dev)), "weights: shape"),
        (dict(expert_ids=from_numpy(np.ones((ep, tmax + 1, top_k), np.int32), dev),
              weights=from_numpy(np.ones((ep, tmax + 1, top_k), np.float32), dev)), "exceeds the index"),
        (dict(rank=0), "out: was made for"),
        (dict(expert_ids=np.ones((ep, tmax, top_k), np.int32)), "expert_ids: must be on cuda"),
    ]
    for override, words in bad_build:
        args = dict(expert_ids=ids, weights=w, **kw)
        args.update(override)
        with pytest.raises(ValueError, match=words):
            build_index(**args)
    build_index(ids, w, **kw)
    dev.synchronize()
    _poison_index(idx)
    cap = ep * tmax * top_k
    src = empty((ep, tmax, 8), "bfloat16", dev)
    bad_gather = [
        (dict(src=empty((ep, tmax + 1, 8), "bfloat16", dev)), "src: must be"),
        (dict(out=empty((cap - 1, 8), "bfloat16", dev)), "out: shape"),
        (dict(out=empty((cap, 9), "bfloat16", dev)), "out: shape"),
        (dict(out=empty((cap, 8), "float16", dev)), "out: dtype"),
    ]
    for override, words in bad_gather:
        args = dict(src=src, out=empty((cap, 8), "bfloat16", dev))
        args.update(override)
        with pytest.raises(ValueError, match=words):
            gather_rows(idx, **args)
    bad_finalize = [
        (dict(fc2_out=empty((cap, 8), "uint8", dev)), "fc2_out: dtype"),
        (dict(fc2_out=empty((cap - 1, 8), "float32", dev)), "fc2_out: shape"),
        (dict(fc2_out=empty((cap, 7), "float32", dev)), "fc2_out: shape"),
        (dict(out=empty((ep, tmax, 8), "int32", dev)), "out: dtype"),
        (dict(out=empty((ep, tmax - 1, 8), "bfloat16", dev)), "out: must be"),
    ]
    for override, words in bad_finalize:
        args = dict(fc2_out=empty((cap, 8), "float32", dev), out=empty((ep, tmax, 8), "bfloat16", dev))
        args.update(override)
        with pytest.raises(ValueError, match=words):
            finalize(idx, **args)
    dev.synchronize()
    assert (_bits(to_numpy(idx.row_of)) == POISON).all(), f"{seed}: a rejected call launched a kernel"
    idx.close()


# -- on a real dispatch, end to end -------------------------------------------------------------
def _stand_in(x_bits, experts):
    """The stand-in expert: bf16(x * (1 + (e % 7) / 4)) per row, e its global expert id."""
    from ep_a2a.testing import reference as ref
    scale = (1 + (np.asarray(experts) % 7) * 0.25).astype(np.float32)[:, None]
    return ref.from_float32(ref.to_float32(x_bits, "bfloat16") * scale, "bfloat16")


def _want_combined(ids, w, x, num_experts, ep, cdtype, fp8=False):
    """What one source rank's combine returns: per token, over its target ranks in the order
    of their first selection (combine's tree order), the target's finalize result (sum over
    ascending k of the selections it owns of weight * stand-in, in fp32, rounded to cdtype;
    fp8: then through e4m3 with per-128 scales, reference.q8_roundtrip)."""
    from ep_a2a.testing import reference as ref
    owner = ref.expert_owner(num_experts, ep)
    T, top_k = ids.shape
    H = x.shape[1]
    valid = (ids >= 0) & (ids < num_experts)
    tgt = np.where(valid, owner[np.clip(ids, 0, num_experts - 1)], -1)
    partial = {}
    for t in range(ep):
        acc = np.zeros((T, H), np.float32)
        for k in range(top_k):
            m = tgt[:, k] == t
            if m.any():
                y = ref.to_float32(_stand_in(x[m], ids[m, k]), "bfloat16")
                acc[m] = acc[m] + w[m, k][:, None] * y
        partial[t] = ref.to_float32(ref.from_float32(acc, cdtype), cdtype)
        if fp8:
            partial[t] = ref.q8_roundtrip(partial[t])
    rows = [ref.tree_sum([partial[t][i] for t in ref.targets_of(ids[i], owner)], H) for i in range(T)]
    return ref.from_float32(np.array(rows, np.float32).reshape(T, H), cdtype)


@pytest.mark.parametrize("ep,top_k,tmax,protocol,cdtype,fp8", [
    (1, 1, 1, "fence", "bfloat16", False),
    (3, 8, 7, "fence", "float32", False),
    (3, 22, 128, "fence", "float16", False),
    (8, 8, 128, "fence", "bfloat16", False),
    (8, 22, 7, "sentinel", "bfloat16", False),
    (8, 8, 4096, "fence", "bfloat16", False),
    # finalize straight into the FP8 combine input; combine then skips its quantize pass
    (1, 2, 5, "fence", "bfloat16", True),
    (3, 22, 128, "fence", "float16", True),
    (8, 8, 128, "fence", "bfloat16", True),
    (8, 8, 1024, "fence", "float32", True),
])
def test_dispatch_index_gather_finalize_combine(ep, top_k, tmax, protocol, cdtype, fp8):
    import ep_a2a
    from ep_a2a.testing import reference as ref
    from ep_a2a.testing import moe_reference as mref
    from ep_a2a.testing.formats import payload_formats, routing
    from ep_a2a.interop.arrays import copy_from_numpy, empty, from_numpy, to_numpy
    from ep_a2a.moe import ExpertIndex, build_index, finalize, gather_rows
    rng, seed = fresh_rng()
    H = 384 if fp8 else 128  # (fp8: three 128-value blocks a row, so the block offsets count)
    E = max(4 * ep + 1, top_k, 5)  # ep 3 with top_k 22: every token picks every expert (several per rank)
    group = ep_a2a.LocalGroup([0] * ep)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=top_k, num_experts=E,
                             payloads=payload_formats(H, top_k)["bf16"], combine_hidden_size=H,
                             combine_dtype=cdtype, protocol=protocol, timeout_s=20.0,
                             combine_quant="fp8" if fp8 else None)
    with group, a2a:
        tokens = [int(rng.integers(0, tmax + 1)) for _ in range(ep)]
        tokens[0] = tmax
        if ep > 1:
            tokens[-1] = 0  # a rank that sends nothing
        ids_h = [routing("uniform", rng, tokens[s], top_k, E, ep, invalid_fraction=0.1) for s in range(ep)]
        x_h = [_float_rows(rng, (tokens[s], H), "bfloat16") for s in range(ep)]
        w_h = [rng.standard_normal((tokens[s], top_k)).astype(np.float32) for s in range(ep)]
        devs = [r.device for r in group.ranks]
        dev = devs[0]
        # every allocation and poisoning before the first launch (in-process ranks spin on each other)
        ins = [(from_numpy(ids_h[s], devs[s], "int32"),
                [from_numpy(x_h[s], devs[s], "bfloat16"), from_numpy(w_h[s], devs[s])]) for s in range(ep)]
        idx = [ExpertIndex.for_rank(r) for r in a2a.ranks]
        cap = ep * tmax * top_k
        gathered = [empty((cap, H), "bfloat16", devs[s]) for s in range(ep)]
        fc2 = [empty((cap, H), "bfloat16", devs[s]) for s in range(ep)]
        outs = [empty((tokens[s], H), cdtype, devs[s]) for s in range(ep)]
        for t in idx:
            _poison_index(t)
        for t in gathered + outs:
            _poison(t)
        dev.synchronize()

        views = [r.dispatch(ins[s][0], ins[s][1], tmax) for s, r in enumerate(a2a.ranks)]
        a2a.synchronize()
        for s, r in enumerate(a2a.ranks):
            ids_v, (x_v, w_v) = views[s]
            build_index(ids_v, w_v, num_experts=E, ep_size=ep, rank=r.rank, out=idx[s])  # on dispatch's stream
            gather_rows(idx[s], x_v, gathered[s])
        a2a.synchronize()

        # index and gather against the reference of what this dispatch actually delivered
        # (FENCE fills a region's slots in any order: the reference reads the same slots)
        wants, fc2_h = [], []
        for s, r in enumerate(a2a.ranks):
            ids_v, (x_v, w_v) = views[s]
            got_ids, got_w = to_numpy(ids_v), to_numpy(w_v)
            got_x = _bits(to_numpy(x_v)).view(np.uint16).reshape(ep * tmax, H)
            want = mref.build_index(got_ids, got_w, E, ep, r.rank)
            msg = f"{seed} tokens={tokens} rank={r.rank}"
            _check_index(idx[s], want, msg)
            g = _bits(to_numpy(gathered[s])).view(np.uint16).reshape(cap, H)
            assert np.array_equal(g[:want.total], mref.gather_rows(want, got_x)), f"{msg}: gather"
            assert (_bits(g[want.total:]) == POISON).all(), f"{msg}: gather wrote past the total"
            # the stand-in expert, row by row, knowing a row's expert only from the GPU's offsets
            offsets = to_numpy(idx[s].offsets)
            p = np.arange(want.total)
            experts = idx[s].first_local_expert + np.searchsorted(offsets, p, side="right") - 1
            f = _nan_rows(np.zeros((cap, H), np.uint16), want.total, "bfloat16")
            f[:want.total] = _stand_in(g[:want.total], experts)
            copy_from_numpy(fc2[s], f)
            _poison(r.combine_input(tmax))
            if fp8:
                _poison(r.combine_input(tmax, fp8=True).values)
                _poison(r.combine_input(tmax, fp8=True).scales)
            wants.append(want)
            fc2_h.append(f)
        dev.synchronize()

        for s, r in enumerate(a2a.ranks):  # on the build's stream, into the workspace
            finalize(idx[s], fc2[s], r.combine_input(tmax, fp8=fp8))
        a2a.synchronize()
        for s, r in enumerate(a2a.ranks):
            fin = mref.finalize(wants[s], fc2_h[s], "bfloat16", cdtype)
            want = _bits(fin).reshape(ep * tmax, -1)
            if fp8:  # the e4m3 bytes and scales combine's own quantize pass would make of that
                codes, scales = ref.q8_quantize(ref.to_float32(fin, cdtype).reshape(ep * tmax, -1))
                q = r.combine_input(tmax, fp8=True)
                assert np.array_equal(_bits(to_numpy(q.values)).reshape(ep * tmax, -1), codes), \
                    f"{seed} tokens={tokens} rank={r.rank}: finalize fp8 values"
                got_sc = np.ascontiguousarray(to_numpy(q.scales)).reshape(ep * tmax, -1).view(np.uint32)
                assert np.array_equal(got_sc, scales.view(np.uint32)), \
                    f"{seed} tokens={tokens} rank={r.rank}: finalize fp8 scales"
            else:
                got = _bits(to_numpy(r.combine_input(tmax))).reshape(ep * tmax, -1)
                assert np.array_equal(got, want), f"{seed} tokens={tokens} rank={r.rank}: finalize"

        for s, r in enumerate(a2a.ranks):
            r.combine(r.combine_input(tmax, fp8=fp8), tmax, out=outs[s])
        a2a.synchronize()
        for s in range(ep):
            want = _want_combined(ids_h[s], w_h[s], x_h[s], E, ep, cdtype, fp8)
            assert np.array_equal(_bits(to_numpy(outs[s])), _bits(want)), f"{seed} tokens={tokens}: combine rank {s}"
        for t in idx:
            t.close()


# -- CUDA graph ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ep,top_k,tmax", [(8, 8, 7), (3, 8, 4096)])  # the one-kernel and the three-kernel index
def test_graph_capture_and_replay(ep, top_k, tmax):
    from ep_a2a.testing import moe_reference as mref
    from ep_a2a.interop.arrays import copy_from_numpy, empty, to_numpy
    from ep_a2a.driver.stream import Graph, Stream
    from ep_a2a.moe import ExpertIndex, build_index, finalize, gather_rows
    rng, seed = fresh_rng()
    dev = _dev()
    st = Stream(dev)
    E, rank, H = 4 * ep + 1, ep - 1, 64
    S, cap = ep * tmax, ep * tmax * top_k
    ids_d = empty((ep, tmax, top_k), "int32", dev)
    w_d = empty((ep, tmax, top_k), "float32", dev)
    x_d = empty((ep, tmax, H), "bfloat16", dev)
    fc2_d = empty((cap, H), "float32", dev)
    rows_d = empty((cap, H), "bfloat16", dev)
    out_d = empty((ep, tmax, H), "bfloat16", dev)
    idx = ExpertIndex(dev, num_experts=E, ep_size=ep, rank=rank, max_tokens_per_rank=tmax, top_k=top_k)

    def step():
        build_index(ids_d, w_d, num_experts=E, ep_size=ep, rank=rank, stream=st.handle, out=idx)
        gather_rows(idx, x_d, rows_d)
        finalize(idx, fc2_d, out_d)

    def fresh_inputs(kind):
        ids = _ids(kind, rng, ep, tmax, top_k, E, rank)
        w = rng.standard_normal(ids.shape).astype(np.float32)
        x = rng.integers(0, 1 << 16, (ep, tmax, H), dtype=np.uint16)
        want = mref.build_index(ids, w, E, ep, rank)
        fc2 = _nan_rows(rng.standard_normal((cap, H)).astype(np.float32), want.total, "float32")
        for t, a in ((ids_d, ids), (w_d, w), (x_d, x), (fc2_d, fc2)):
            copy_from_numpy(t, a)
        _poison_index(idx)
        _poison(rows_d)
        _poison(out_d)
        dev.synchronize()
        return want, x, fc2

    fresh_inputs("uniform")
    step()  # eager first, as before any capture
    st.synchronize()
    Graph.begin(st.handle)
    step()
    g = Graph.end(st.handle)
    try:
        for kind in ("local_heavy", "replacement", "none_here"):
            want, x, fc2 = fresh_inputs(kind)
            g.launch(st.handle)
            st.synchronize()
            msg = f"{seed} graph replay route={kind}"
            _check_index(idx, want, msg)
            rows = _bits(to_numpy(rows_d)).view(np.uint16).reshape(cap, H)
            assert np.array_equal(rows[:want.total], mref.gather_rows(want, x.reshape(S, H))), f"{msg}: gather"
            assert (_bits(rows[want.total:]) == POISON).all(), f"{msg}: gather wrote past the total"
            got = _bits(to_numpy(out_d)).reshape(S, -1)
            assert np.array_equal(got, _bits(mref.finalize(want, fc2, "float32", "bfloat16")).reshape(S, -1)), \
                f"{msg}: finalize"
    finally:
        g.close()
        idx.close()
        st.close()
