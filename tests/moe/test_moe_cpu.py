"""CPU suite of the MoE compute pieces: properties of the NumPy reference (testing/moe_reference.py),
the launch plan of the index and argument checks that run before any device is touched."""
import ctypes
import os
import re

import numpy as np
import pytest
from common import ROOT, fresh_rng, kernel_ptx, kernels_build

from ep_a2a import moe, moe_experts as mx
from ep_a2a.testing import moe_reference as mref, reference as ref



def _random_ids(rng, shape, num_experts):
    """With replacement (duplicates, several experts of one rank per token), plus -1 and
    out-of-range ids."""
    ids = rng.integers(0, num_experts, shape).astype(np.int64)
    junk = rng.choice(np.array([-1, -2, num_experts, num_experts + 5, 2**31 - 1, -2**31]), shape)
    return np.where(rng.random(shape) < 0.15, junk, ids).astype(np.int32)


def _check_properties(ids, w, num_experts, ep, rank, msg):
    idx = mref.build_index(ids, w, num_experts, ep, rank)
    top_k = ids.shape[-1]
    flat = ids.reshape(-1, top_k)
    local = mref.local_experts(num_experts, ep, rank)
    is_local = np.isin(flat, local)
    total = idx.total
    # counts: one row per local selection, per expert; offsets are their exclusive prefix
    assert idx.counts.sum() == is_local.sum() == total == len(idx.rows), msg
    assert idx.counts.tolist() == [int((flat == e).sum()) for e in local], msg
    assert idx.offsets[0] == 0 and np.array_equal(np.diff(idx.offsets), idx.counts), msg
    # row_of is a bijection from the local selections onto 0..total-1, -1 elsewhere
    assert np.array_equal(idx.row_of >= 0, is_local), msg
    assert np.array_equal(np.sort(idx.row_of[is_local]), np.arange(total)), msg
    # rows and row_of are inverse: row p comes from slot rows[p], and that slot's k points back at p
    s, k = np.nonzero(is_local)
    p = idx.row_of[s, k]
    assert np.array_equal(idx.rows[p], s), msg
    assert np.array_equal(idx.row_weight[p].view(np.uint32), w.reshape(-1, top_k)[s, k].view(np.uint32)), msg
    # expert-major, then ascending (slot, k) inside each expert
    for e_local, e in enumerate(local):
        lo, hi = idx.offsets[e_local], idx.offsets[e_local + 1]
        js = [int(np.flatnonzero(idx.row_of.reshape(-1) == q)[0]) for q in range(lo, hi)]
        assert all(flat.reshape(-1)[j] == e for j in js), msg
        assert js == sorted(js), msg
    return idx


@pytest.mark.parametrize("ep,num_experts,top_k,tmax", [(1, 8, 1, 5), (3, 10, 8, 7), (8, 67, 22, 16), (8, 3, 2, 4),
                                                      (72, 288, 8, 2)])
def test_index_properties_random(ep, num_experts, top_k, tmax):
    rng, seed = fresh_rng()
    ids = _random_ids(rng, (ep, tmax, top_k), num_experts)
    w = rng.standard_normal((ep, tmax, top_k)).astype(np.float32)
    for rank in range(ep):
        _check_properties(ids, w, num_experts, ep, rank, f"{seed} rank={rank}")


def test_index_is_deterministic():
    rng, seed = fresh_rng()
    ids = _random_ids(rng, (4, 33, 6), 16)
    w = rng.standard_normal(ids.shape).astype(np.float32)
    a, b = (mref.build_index(ids.copy(), w.copy(), 16, 4, 1) for _ in range(2))
    for f in ("counts", "offsets", "rows", "row_weight", "row_of"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f"{seed}: {f}"


def test_token_with_several_local_experts_by_hand():
    # 2 ranks, 8 experts: rank 1 owns 4..7. Slot 0 picks 5, 4, 5 (again) and rank 0's 1;
    # slot 1 picks -1, 4 and an out-of-range id; slot 2 picks only rank 0's experts.
    ids = np.array([[5, 4, 5, 1], [-1, 4, 9, 6], [0, 1, 2, 3]], np.int32)
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 8
    idx = mref.build_index(ids, w, 8, 2, 1)
    assert idx.counts.tolist() == [2, 2, 1, 0]          # experts 4, 5, 6, 7
    assert idx.offsets.tolist() == [0, 2, 4, 5, 5]
    # expert 4: (0,1), (1,1); expert 5: (0,0), (0,2); expert 6: (1,3)
    assert idx.rows.tolist() == [0, 1, 0, 0, 1]
    assert idx.row_weight.tolist() == [w[0, 1], w[1, 1], w[0, 0], w[0, 2], w[1, 3]]
    assert idx.row_of.tolist() == [[2, 0, 3, -1], [-1, 1, -1, 4], [-1, -1, -1, -1]]


@pytest.mark.parametrize("num_experts,rank", [(16, 2), (3, 5)])  # no token reaches it / it owns no expert
def test_empty_rank(num_experts, rank):
    rng, seed = fresh_rng()
    owner = ref.expert_owner(num_experts, 8)
    others = np.flatnonzero(owner != rank)
    ids = rng.choice(np.append(others, -1), (8, 9, 4)).astype(np.int32)
    idx = mref.build_index(ids, np.ones(ids.shape, np.float32), num_experts, 8, rank)
    assert idx.total == 0 and (idx.row_of == -1).all() and len(idx.rows) == 0, f"{seed}"
    assert len(idx.counts) == len(mref.local_experts(num_experts, 8, rank))
    out = mref.finalize(idx, np.zeros((0, 5), np.float32), "float32", "bfloat16")
    assert out.shape == (8 * 9, 5) and (out == 0).all()


def test_gather_reference():
    rng, _ = fresh_rng()
    ids = _random_ids(rng, (3, 5, 4), 12)
    idx = mref.build_index(ids, np.ones(ids.shape, np.float32), 12, 3, 0)
    src = rng.integers(0, 256, (15, 7), dtype=np.uint8)
    got = mref.gather_rows(idx, src)
    assert got.shape == (idx.total, 7)
    for p in range(idx.total):
        assert np.array_equal(got[p], src[idx.rows[p]])


def test_finalize_order_rounding_and_empty_slots():
    # slot 0: rows of k = 0, 1, 2 hold 1e8, 1, -1e8 (weights 1): ((0 + 1e8) + 1) - 1e8 = 0 in fp32,
    # which a different order would not give. slot 1: no local row -> 0. slot 2: one row,
    # weight 0.5 * 3.0 -> 1.5, then bf16.
    row_of = np.array([[0, 1, 2], [-1, -1, -1], [-1, 3, -1]], np.int32)
    idx = mref.Index(np.array([4], np.int32), np.array([0, 4], np.int32), np.array([0, 0, 0, 2], np.int32),
                     np.array([1, 1, 1, 0.5], np.float32), row_of)
    fc2 = np.array([[1e8], [1.0], [-1e8], [3.0]], np.float32)
    out = mref.finalize(idx, fc2, "float32", "float32")
    assert out[:, 0].tolist() == [0.0, 0.0, 1.5]
    # bf16 output rounds to nearest even: 1 + 2**-8 is a tie between 1 and 1 + 2**-7 -> 1
    idx.row_weight[:] = 1
    fc2 = np.array([[1.0], [0.0], [0.0], [1 + 2**-8]], np.float32)
    out = mref.finalize(idx, fc2, "float32", "bfloat16")
    assert out[2, 0] == 0x3F80 and out[0, 0] == 0x3F80
    # bf16 input as uint16 bits
    out = mref.finalize(idx, np.array([[0x3F80], [0], [0], [0x4040]], np.uint16), "bfloat16", "float16")
    assert out.dtype == np.float16 and out[:, 0].tolist() == [1.0, 0.0, 3.0]


def test_finalize_matches_a_plain_loop():
    rng, seed = fresh_rng()
    ids = _random_ids(rng, (4, 6, 5), 20)
    w = rng.standard_normal(ids.shape).astype(np.float32)
    idx = mref.build_index(ids, w, 20, 4, 3)
    fc2 = rng.standard_normal((idx.total, 9)).astype(np.float32)
    got = mref.finalize(idx, fc2, "float32", "float32")
    for s in range(idx.row_of.shape[0]):
        acc = np.zeros(9, np.float32)
        for k in range(5):
            p = idx.row_of[s, k]
            if p >= 0:
                acc = np.float32(acc + np.float32(idx.row_weight[p]) * fc2[p])
        assert np.array_equal(got[s].view(np.uint32), acc.view(np.uint32)), f"{seed} slot={s}"


def test_local_experts_agree_with_reference_split():
    for E, ep in [(256, 8), (10, 4), (3, 8), (288, 72), (7, 1)]:
        for r in range(ep):
            first, n = moe.local_experts(E, ep, r)
            assert list(range(first, first + n)) == mref.local_experts(E, ep, r).tolist()


@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 16384, 16385, 100_000, 720_896, 6_488_064])
@pytest.mark.parametrize("num_local", [0, 1, 4, 32, 256, 1024])
def test_index_plan_covers_every_entry_within_budgets(n, num_local):
    fused, warps, tile, tiles = moe.index_plan(n, num_local)
    assert tile % 32 == 0 and tile * tiles >= n and tiles % warps == 0
    assert num_local * warps * 4 <= 40 * 1024  # the shared table
    if fused:
        assert tiles == warps <= 32 and tile <= 32 * 16
    else:
        assert warps * 32 <= 256 and tile >= 512 and num_local * tiles <= 1 << 16


def test_fc2_finalizes_where_its_counters_reach_and_not_into_fp8():
    """The rule both layers and the JAX experts call follows: FC2's kernel finalizes a bf16
    combine input up to FINALIZE_TILES column tiles of EXPERT_TILE; an FP8 one never."""
    limit = moe.FINALIZE_TILES * mx.EXPERT_TILE
    assert mx.fc2_finalizes(limit, False) and mx.fc2_finalizes(mx.EXPERT_K, False)
    assert not mx.fc2_finalizes(limit + mx.EXPERT_K, False)
    assert not any(mx.fc2_finalizes(h, True) for h in (mx.EXPERT_K, 7168, limit))


def test_kernel_argument_struct_generated_from_layout():
    """MoeIndexArgs has one definition (layout.py): the kernels get it from the generated
    header, field for field with a size assert, and moe.py launches with that structure."""
    from ep_a2a import layout
    assert moe.MoeIndexArgs is layout.MoeIndexArgs
    hdr = layout.c_header()
    body = re.search(r"struct MoeIndexArgs \{(.*?)\};", hdr, re.S).group(1)
    assert re.findall(r"(\w+);", body) == [f for f, _ in layout.MoeIndexArgs._fields_]
    assert f"sizeof(MoeIndexArgs) == {ctypes.sizeof(layout.MoeIndexArgs)}" in hdr
    kernels = [os.path.join(ROOT, "kernels", f) for f in os.listdir(os.path.join(ROOT, "kernels")) if f.endswith((".cu", ".cuh"))]
    assert not [k for k in kernels if "struct MoeIndexArgs" in open(k).read()], "a hand-written copy in the kernels"


def test_cubins_have_moe_kernels():
    from ep_a2a.driver import module
    built = module.built_cubins().get("moe_compute")
    if not built:
        pytest.skip("cubins not built (run `make cubins`)")
    data = (module.CUBIN_DIR / f"moe_compute.sm_{built[0]}.cubin").read_bytes()
    for sym in (b"moe_index_fused", b"moe_index_count", b"moe_index_scan", b"moe_index_scatter", b"moe_gather_rows",
                b"moe_finalize_bf16_bf16", b"moe_finalize_f32_f16", b"moe_swiglu_bf16", b"moe_swiglu_f16"):
        assert sym in data


@pytest.mark.parametrize("kw,words", [
    (dict(num_experts=0), "num_experts"), (dict(ep_size=0), "ep_size"), (dict(ep_size=73), "ep_size"),
    (dict(rank=4), "rank"), (dict(rank=-1), "rank"), (dict(num_experts=4096, ep_size=2), "local experts"),
])
def test_bad_routing_arguments_rejected_before_any_device_use(kw, words):
    args = dict(num_experts=16, ep_size=4, rank=0)
    args.update(kw)
    with pytest.raises(ValueError, match=words):
        moe.build_index(np.zeros((4, 2, 2), np.int32), np.zeros((4, 2, 2), np.float32), **args)


def test_host_arrays_rejected():
    with pytest.raises(ValueError, match="expert_ids: must be on cuda"):
        moe.build_index(np.zeros((4, 2, 2), np.int32), np.zeros((4, 2, 2), np.float32), num_experts=16, ep_size=4, rank=0)


def test_phase_gate_makes_every_stream_wait_for_every_rank_of_its_gpu(monkeypatch):
    """Replay the gate's records and waits: afterwards each stream's next work depends on
    the work every rank of the same GPU had issued, and nothing ties different GPUs."""
    import types
    from ep_a2a.layers import base as moe_layer
    from ep_a2a.driver import stream as S
    deps = {}  # stream -> set of (stream, position) its next work waits for
    pos = {}   # stream -> number of items issued

    class FakeEvent:
        def __init__(self, device):
            self.snap = set()

        def record(self, s):
            self.snap = {(s, pos.get(s, 0))} | deps.get(s, set())
            pos[s] = pos.get(s, 0) + 1
            return self

        def wait_on(self, s):
            deps.setdefault(s, set()).update(self.snap)
            pos[s] = pos.get(s, 0) + 1

    monkeypatch.setattr(S, "Event", FakeEvent)

    def layer(gpu, s):
        dev = types.SimpleNamespace(ordinal=gpu)
        return types.SimpleNamespace(a2a_rank=types.SimpleNamespace(device=dev), s=s, _gate_event=None)

    layers = [layer(0, 10), layer(0, 11), layer(1, 20), layer(0, 12), layer(1, 21), layer(2, 30)]
    for L in layers:
        pos[L.s] = 5  # work each rank issued before the gate
    moe_layer.phase_gate(layers)
    for L in layers:
        waited = {s for s, p in deps.get(L.s, set()) if p >= 5}  # records made at the gate
        same = {M.s for M in layers if M.a2a_rank.device.ordinal == L.a2a_rank.device.ordinal} - {L.s}
        assert same <= waited, (L.s, same, waited)
        assert not ({M.s for M in layers} - same - {L.s}) & waited, "a gate across GPUs"


def test_activation_kernel_computes_silu_as_torch_does():
    """moe_swiglu_* is bitwise torch's eager F.silu(gate) * up (the GPU test checks the bits)
    only while it is built as torch's kernels are: no fast math (expf and the division
    accurate) and nvcc's default contraction. The build's flags say so, and the PTX holds the
    accurate division and the expf whose last step fuses with the + 1 into one FMA, what
    x / (1 + expf(-x)) compiles to under those defaults."""
    flags = " ".join(kernels_build().NVCCFLAGS)
    for bad in ("fast_math", "ftz=true", "prec-div=false", "prec-sqrt=false", "fmad=false"):
        assert bad not in flags, f"kernels/build.py NVCCFLAGS has {bad}: moe_swiglu would no longer match torch"
    body = re.search(r"\.entry moe_swiglu_bf16\((.*?)\n}", kernel_ptx("moe_compute.cu"), re.S)
    assert body, "no moe_swiglu_bf16 in the PTX"
    ptx = body.group(1)
    assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx, "the division is not IEEE"
    exp2 = set(re.findall(r"ex2\.approx\.ftz\.f32\s+(%f\d+),", ptx))
    fused = re.findall(r"fma\.rn\.f32\s+%f\d+, (%f\d+), (%f\d+), 0f3F800000;", ptx)
    assert exp2 and any(a in exp2 or b in exp2 for a, b in fused), \
        "expf's last step and the + 1 are not one FMA: not what nvcc's defaults make of torch's silu expression"


def test_cubins_have_the_expert_kernels():
    from ep_a2a.driver import module
    built = module.built_cubins().get("moe_experts")
    if not built:
        pytest.skip("cubins not built (run `make cubins`)")
    data = (module.CUBIN_DIR / f"moe_experts.sm_{built[0]}.cubin").read_bytes()
    for sym in moe.EXPERT_KERNELS:
        assert sym.encode() in data


def test_expert_kernels_take_bf16_multiples_of_their_k_step_only():
    assert mx.expert_gemms_unsupported(2048, 1024) is None
    assert mx.expert_gemms_unsupported(7168, 2048) is None
    assert "hidden=96" in mx.expert_gemms_unsupported(96, 64)
    assert "intermediate=80" in mx.expert_gemms_unsupported(128, 80)
    assert "bfloat16 only" in mx.expert_gemms_unsupported(128, 64, "float16")
    assert mx.EXPERT_TILE == 16 and mx.EXPERT_K == 64 and mx.EXPERT_WIDE_ROWS == 64
    assert (mx.WIDE_FC1_COLS, mx.WIDE_FC2_COLS) == (64, 128)  # (kernels/moe_experts.cu: WIDE_COLS, twice it)


def test_auto_takes_the_expert_kernels_up_to_512_rows_below_a_hidden_of_4096():
    assert mx.FUSED_MAX_ROWS == 512 and mx.FUSED_MAX_HIDDEN == 4096
    assert mx.auto_expert_rows(2048, 1024) == mx.FUSED_MAX_ROWS
    assert mx.auto_expert_rows(4096, 64) == mx.FUSED_MAX_ROWS
    assert mx.auto_expert_rows(7168, 2048) == mx.EXPERT_PASS_ROWS == 16  # (DeepSeek-V3-like: one pass)
    assert mx.auto_expert_rows(96, 64) == 0       # (shapes the kernels do not take)
    assert mx.auto_expert_rows(2048, 1024, "float16") == 0


def test_expert_calls_take_passes_of_16_64_or_128_rows_by_the_rows_an_expert_may_hold():
    """ep_size * T^ (index.slots) bounds the rows of an expert through a router: up to 16, the
    kernels of 16-row passes; up to WIDE_FROM_ROWS the _m64 pair; above it the wide kernel of an FC
    whose columns (FC1: I, FC2: hidden) fill its tiles, at hidden sizes up to FUSED_MAX_HIDDEN,
    else the _m64 one."""
    from types import SimpleNamespace
    cases = ((1, ""), (16, ""), (17, "_m64"), (128, "_m64"), (129, "_wide"), (1024, "_wide"))
    for slots, suffix in cases:
        for fc in ("fc1", "fc2"):
            name = mx._expert_kernel(fc, SimpleNamespace(slots=slots), 2048, 1024)
            assert name == f"moe_expert_{fc}{suffix}_bf16" and name in moe.EXPERT_KERNELS
    index = SimpleNamespace(slots=mx.WIDE_FROM_ROWS + 1)
    assert mx._expert_kernel("fc1", index, 192, 192) == "moe_expert_fc1_wide_bf16"  # (192 = 3 * 64)
    assert mx._expert_kernel("fc2", index, 192, 192) == "moe_expert_fc2_m64_bf16"   # (not a multiple of 128)
    for fc in ("fc1", "fc2"):  # (a hidden size past FUSED_MAX_HIDDEN: the _m64 kernels, as measured)
        assert mx._expert_kernel(fc, index, 7168, 2048) == f"moe_expert_{fc}_m64_bf16"


@pytest.mark.parametrize("num_local,n_dim,sms", [(8, 1024, 132), (8, 2048, 132), (32, 7168, 132), (1, 64, 8),
                                                 (256, 2048, 132)])
@pytest.mark.parametrize("ranks_on_device", [1, 3, 8])
def test_expert_grid_covers_every_expert_and_tile(num_local, n_dim, sms, ranks_on_device):
    """Block b covers tile b % tiles of experts b // tiles, + groups, ... (the kernel's walk):
    every (expert, tile) exactly once, about four blocks per SM of the rank's share of the GPU
    (not fewer, not many more), at most a group per expert."""
    from types import SimpleNamespace
    index = SimpleNamespace(num_local_experts=num_local, device=SimpleNamespace(sm_count=sms),
                            ranks_on_device=ranks_on_device, slots=64)
    blocks, groups, threads = mx._expert_grid(index, "moe_expert_fc2_m64_bf16", n_dim)
    tiles = n_dim // mx.EXPERT_TILE
    assert blocks == tiles * groups and 1 <= groups <= num_local and threads == 128
    seen = sorted((e, b % tiles) for b in range(blocks) for e in range(b // tiles, num_local, groups))
    assert seen == [(e, t) for e in range(num_local) for t in range(tiles)]
    share = 4 * sms / ranks_on_device
    assert groups == num_local or blocks >= share
    assert groups == 1 or blocks < share + tiles


@pytest.mark.parametrize("num_local,slots,sms", [(8, 512, 132), (8, 1024, 132), (1, 65, 8), (32, 128, 132)])
@pytest.mark.parametrize("fc,n_dim", [("fc1", 1024), ("fc2", 2048), ("fc1", 64)])
@pytest.mark.parametrize("ranks_on_device", [1, 8])
def test_wide_grid_covers_every_pass_and_tile(num_local, slots, sms, fc, n_dim, ranks_on_device):
    """The wide kernels walk units (128-row passes, up to slots / 128 per expert) the same way:
    every (unit, tile) exactly once, no more groups than units, 256 threads a block."""
    from types import SimpleNamespace
    index = SimpleNamespace(num_local_experts=num_local, device=SimpleNamespace(sm_count=sms),
                            ranks_on_device=ranks_on_device, slots=slots)
    blocks, groups, threads = mx._expert_grid(index, f"moe_expert_{fc}_wide_bf16", n_dim)
    tiles = n_dim // (mx.WIDE_FC1_COLS if fc == "fc1" else mx.WIDE_FC2_COLS)
    units = num_local * -(-slots // 128)
    assert blocks == tiles * groups and 1 <= groups <= units and threads == 256
    seen = sorted((u, b % tiles) for b in range(blocks) for u in range(b // tiles, units, groups))
    assert seen == [(u, t) for u in range(units) for t in range(tiles)]
    share = 4 * sms / ranks_on_device
    assert groups == units or blocks >= share
