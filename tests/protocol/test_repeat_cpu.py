"""The repeat fast path of dispatch/combine (fastpath.Repeat) against the full path, on the
CPU: the same varied call sequence (tensor objects reused or replaced, T^, T, streams, outs,
staged partials, protocol settings with auto switching, active-rank changes, dispatch-only
steps) must produce byte-identical kernel parameter blocks, grids, streams, functions,
staging copies and returned views, launch by launch. Launches and driver calls are recorded,
not made."""
import ctypes
import types

import numpy as np
import pytest

import ep_a2a.alltoall as A
import ep_a2a.rank_plan as P  # (build_plan and the driver calls it makes)
import ep_a2a.interop.tensor as tensor_module
from ep_a2a import fastpath, schedule, validate
from ep_a2a.config import Options
from ep_a2a.errors import StateError
from ep_a2a.testing import hooks
from ep_a2a.testing.formats import payload_formats
from ep_a2a.interop.tensor import Tensor, as_dtype
from ep_a2a.layout import WorkspaceLayout, landing_bytes, sentinel_kind

EP, TMAX, H = 8, 64, 7168


class _HostMapped:
    def __init__(self, n, dev):
        self.buf = ctypes.create_string_buffer(n)
        self.host_ptr, self.device_ptr = ctypes.addressof(self.buf), 1 << 45  # (fixed: runs compare bytes)


class _Module:
    def function(self, name):
        return name


@pytest.fixture
def recorder(monkeypatch):
    rec = []

    class FakeLaunch:
        def __init__(self, dev, fn, args, grid, block, pdl=False, cluster=1):
            self.grid, self.fn, self.p = grid, fn if cluster == 1 else f"{fn}@cluster{cluster}", args[0]

        def __call__(self, stream):
            rec.append(("launch", self.fn, bytes(self.p), self.grid, stream))

    monkeypatch.setattr(A, "HostMapped", _HostMapped)
    monkeypatch.setattr(P, "Launch", FakeLaunch)
    monkeypatch.setattr(P, "load", lambda name, dev: _Module())
    monkeypatch.setattr(P, "occupancy", lambda f, t: 4)
    monkeypatch.setattr(P, "prefer_max_shared", lambda f: f)
    monkeypatch.setattr(P, "cluster_launch", lambda dev, fn, args, cluster, block, pdl, at_once:
                        FakeLaunch(dev, fn, args, cluster, block, pdl, cluster))
    monkeypatch.setattr(A, "DeviceAllocation", lambda dev, n: types.SimpleNamespace(ptr=1 << 32))
    monkeypatch.setattr(A, "copy_dtod_async", lambda *args: rec.append(("copy", args)))
    # a Tensor last used on another stream is ordered before the call's (as_tensor): both
    # paths must make the same waits
    monkeypatch.setattr(tensor_module, "_wait", lambda consumer, producer, dev: rec.append(("wait", consumer, producer)))
    return rec


def _rank(combine_quant=None, local=True):
    specs = payload_formats(H, 8)["bf16"]
    kinds = (0,) + tuple(sentinel_kind(s.dtype) for s in specs)
    pbytes = (32,) + tuple(s.bytes_per_token for s in specs)
    L = WorkspaceLayout.build(EP, TMAX, 8, pbytes, H * 2, sentinel=True,
                              landing=tuple(landing_bytes(b, k) for b, k in zip(pbytes, kinds)),
                              q8_hidden=H if combine_quant else 0)
    options = Options(EP, TMAX, 8, 256, H, payloads=tuple(specs), combine_dtype=as_dtype("bfloat16"), protocol="auto",
                      timeout_s=10, first_timeout_s=60, validate_expert_ids=False, crossover_tokens=8,
                      combine_quant=combine_quant)  # (unchecked: FP8 under "auto" exercises both paths)
    a2a = types.SimpleNamespace(
        options=options, ep_size=EP, top_k=8, num_experts=256, max_tokens_per_rank=TMAX, payload_specs=tuple(specs),
        combine_hidden_size=H, combine_dtype=as_dtype("bfloat16"), protocol="auto", layout=L, kinds=kinds,
        workspace=types.SimpleNamespace(base=lambda i: 1 << 40, peers=lambda i: [1 << 40] * EP), on_timeout="trap",
        group=types.SimpleNamespace(is_local=local),
        active_ranks=tuple(range(EP)), combine_quant=combine_quant, threads=256, pdl=True, validate_expert_ids=False,
        first_timeout_s=60, timeout_s=10, crossover_tokens=0)
    dev = types.SimpleNamespace(ordinal=0, sm_count=132, make_current=lambda: None)
    rank = types.SimpleNamespace(rank=0, device=dev, stream=types.SimpleNamespace(handle=7), ranks_on_device=EP)
    return a2a, A.RankAlltoAll(a2a, 0, rank), specs


def _plan(seed, steps, fp8=False):
    rng = np.random.default_rng(seed)
    plan, cur = [], dict(ids=0, tmax=16, T=16, stream=None, part="cin", out=None, proto="auto", active=EP, pays=0)
    for i in range(steps):
        c, u = dict(cur), rng.random()
        if u < 0.06:
            c["tmax"] = int(rng.integers(1, TMAX + 1))
            c["T"], c["ids"] = int(rng.integers(0, c["tmax"] + 1)), i
        elif u < 0.10:
            c["ids"], c["T"] = i, int(rng.integers(0, c["tmax"] + 1))
        elif u < 0.13:
            c["pays"] = i
        elif u < 0.16:
            c["stream"] = [None, 9, 7][int(rng.integers(3))]
        elif u < 0.19:
            parts = ["cin", f"p{i}"] + (["fp8"] if fp8 else [])  # fp8: what a quantizing epilogue wrote
            c["part"] = parts[int(rng.integers(len(parts)))]
        elif u < 0.22:
            c["out"] = [None, f"o{i}", f"odd{i}"][int(rng.integers(3))]
        elif u < 0.24:
            c["proto"] = ["auto", "fence", "sentinel"][int(rng.integers(3))]
        elif u < 0.25:
            c["active"] = int(rng.integers(6, EP + 1))
        cur = c
        plan.append(dict(c, dispatch_only=rng.random() < 0.03))
    return plan


def _run(plan, fast, rec, monkeypatch, combine_quant=None, vouch=False):
    """The plan's calls; vouch: as a caller that vouches for its Tensors (the torch ops) does:
    dispatch_same / combine_same with the record its last call left whenever it passes that
    call's objects again (the pool's Tensors never change), else the full call."""
    monkeypatch.setattr(fastpath, "REPEAT_FAST_PATH", fast)
    rec.clear()
    a2a, r, specs = _rank(combine_quant)
    pool, hits = {}, {"dispatch": 0, "combine": 0}
    vouched = {"d": (None, None), "c": (None, None)}  # (record, the objects of the call that left it)
    full = {"dispatch": 0, "combine": 0}  # repeats = calls launched - calls that took the full path's checks
    checked, dispatched, combined = r._dispatch_checked, r._dispatched, r._combined

    def count(counts, name, f):
        def g(*args):
            counts[name] += 1
            return f(*args)
        return g
    r._dispatch_checked, r._dispatched = count(full, "dispatch", checked), count(hits, "dispatch", dispatched)
    r._combined = count(hits, "combine", combined)
    monkeypatch.setattr(A, "check_combine_runtime_max", count(full, "combine", A.check_combine_runtime_max))

    def obj(key, make):  # the same key gives the same object within a run (engines reuse buffers)
        if key not in pool:
            pool[key] = make(len(pool))
        return pool[key]
    for c in plan:
        a2a.protocol = c["proto"]
        if c["active"] != len(a2a.active_ranks):
            a2a.active_ranks = tuple(range(c["active"]))
            r._set_active(a2a.active_ranks)
        T, tmax = c["T"], c["tmax"]
        ids = obj(("ids", c["ids"], T), lambda n: Tensor((1 << 33) + 64 * n, (T, 8), "int32", device=(2, 0)))
        pays = [obj(("pay", c["pays"], T, k), lambda n, s=s: Tensor((1 << 34) + 4096 * n + 4 * (c["pays"] % 3),
                                                                     (T,) + tuple(s.shape), s.dtype, device=(2, 0)))
                for k, s in enumerate(specs)]
        views = None
        if vouch and vouched["d"][0] is not None and vouched["d"][1] == [ids, *pays]:
            views = r.dispatch_same(vouched["d"][0], tmax, c["stream"])
        if views is None:
            views = r.dispatch(ids, pays, tmax, stream=c["stream"])
            vouched["d"] = (r.last_repeats[0], [ids, *pays])
        rec.append(("views", views[0].ptr, views[0].shape, views[0].stream, views[1][0].stream))
        if c["dispatch_only"]:
            r.forget_dispatch()  # as the benchmark's dispatch-only graphs do
            continue
        part = r.combine_input(tmax) if c["part"] == "cin" else r.combine_input(tmax, fp8=True) \
            if c["part"] == "fp8" else obj(
            ("part", c["part"], tmax), lambda n: Tensor((1 << 36) + 65536 * n, (EP, tmax, H), "bfloat16", device=(2, 0)))
        out = None
        if c["out"] is not None:
            off = 2 if c["out"].startswith("odd") else 0
            out = obj(("out", c["out"], T), lambda n: Tensor((1 << 37) + 65536 * n + off, (T, H), "bfloat16",
                                                             device=(2, 0)))
        y = None
        if vouch and vouched["c"][0] is not None and vouched["c"][1] == [part, out]:
            y = r.combine_same(vouched["c"][0], tmax, c["stream"])
        if y is None:
            y = r.combine(part, tmax, stream=c["stream"], out=out)
            vouched["c"] = (r.last_repeats[1], [part, out])
        rec.append(("out", y.ptr, y.shape, y.stream))
    return list(rec), {k: hits[k] - full[k] for k in hits}


@pytest.mark.parametrize("seed,combine_quant", [(0, None), (1, None), (2, "fp8")])
def test_repeat_fast_path_launches_exactly_what_the_full_path_launches(seed, combine_quant, recorder, monkeypatch):
    """(FP8: combines of plain partials, which quantize, alternate with epilogue-quantized ones,
    which never repeat and change how the next dispatch predicts its combine.)"""
    plan = _plan(seed, 1500, fp8=combine_quant == "fp8")
    full, none = _run(plan, False, recorder, monkeypatch, combine_quant)
    fast, hits = _run(plan, True, recorder, monkeypatch, combine_quant)
    assert none == {"dispatch": 0, "combine": 0}
    assert hits["dispatch"] > len(plan) // 2 and hits["combine"] > len(plan) // 10, hits  # both paths exercised
    assert len(full) == len(fast)
    bad = [i for i, (x, y) in enumerate(zip(full, fast)) if x != y]
    assert not bad, f"{len(bad)} of {len(full)} records differ, first {full[bad[0]][:2]} at {bad[0]}"
    vouched, v_hits = _run(plan, True, recorder, monkeypatch, combine_quant, vouch=True)
    assert v_hits["dispatch"] >= hits["dispatch"] and v_hits["combine"] >= hits["combine"], (v_hits, hits)
    bad = [i for i, (x, y) in enumerate(zip(full, vouched)) if x != y]
    assert len(full) == len(vouched) and not bad, f"vouched: {len(bad)} records differ, first at {bad[:1]}"


def test_vouched_repeats_decline_where_a_dispatch_may_not_run(recorder, monkeypatch):
    """dispatch_same / combine_same launch nothing and return None (the caller's full call then
    says why) mid-step, on an inactive rank, without a dispatch before a combine, and with a
    record that is no longer the rank's last; with the rank's own record they repeat."""
    a2a, r, specs = _rank()
    a2a.protocol = "fence"
    ids = Tensor(1 << 33, (4, 8), "int32", device=(2, 0))
    pays = [Tensor((1 << 34) + (1 << 30) * q, (4,) + tuple(s.shape), s.dtype, device=(2, 0)) for q, s in enumerate(specs)]
    for _ in range(schedule.FIRST_STEPS + 1):
        r.dispatch(ids, pays, 16)
        r.combine(r.combine_input(16), 16)
    d, c = r.last_repeats
    assert d is not None and c is not None
    n = len(recorder)
    assert r.combine_same(c, 16, None) is None and len(recorder) == n, "a combine with no dispatch before it"
    assert r.dispatch_same(d, 16, None) is not None and len(recorder) > n
    n = len(recorder)
    assert r.dispatch_same(d, 16, None) is None and len(recorder) == n, "a second dispatch mid-step"
    with pytest.raises(StateError, match="twice"):
        r.dispatch(ids, pays, 16)
    assert r.combine_same(c, 16, None) is not None
    other = [Tensor(t.ptr + 64, t.shape, t.dtype, device=(2, 0)) for t in [ids, *pays]]
    out = Tensor(1 << 37, (4, H), "bfloat16", device=(2, 0))
    for _ in range(2):  # another caller's calls: the records are no longer the ones we hold
        r.dispatch(other[0], other[1:], 16)
        r.combine(r.combine_input(16), 16, out=out)
    n = len(recorder)
    assert r.dispatch_same(d, 16, None) is None and len(recorder) == n
    r.dispatch(ids, pays, 16)
    assert r.combine_same(c, 16, None) is None and len(recorder) == n + 1
    r.combine(r.combine_input(16), 16)
    a2a.active_ranks = tuple(range(1, EP))
    r._set_active(a2a.active_ranks)
    n = len(recorder)
    assert r.dispatch_same(r.last_repeats[0], 16, None) is None and len(recorder) == n, "an inactive rank"


def test_one_token_fence_dispatch_runs_as_one_cluster_and_its_repeat_too(recorder, monkeypatch):
    """At T^ = CLUSTER_TOKENS a split FENCE dispatch launches the clustered kernel (full path
    and repeats alike); at a larger T^ the plain one, with the same grid of 8 blocks."""
    from ep_a2a import schedule
    a2a, r, specs = _rank()
    a2a.protocol = "fence"

    def launched(T, tmax, steps=8):
        ids = Tensor(1 << 33, (T, 8), "int32", device=(2, 0))
        pays = [Tensor((1 << 34) + 4096 * k, (T,) + tuple(s.shape), s.dtype, device=(2, 0)) for k, s in enumerate(specs)]
        recorder.clear()
        for _ in range(steps):
            r.dispatch(ids, pays, tmax)
            r.combine(r.combine_input(tmax), tmax)
        return {(x[1], x[3]) for x in recorder if x[0] == "launch" and x[1].startswith("fence_dispatch")}
    assert schedule.CLUSTER_TOKENS == 1 and r.schedule.clusters
    assert launched(1, 1) == {("fence_dispatch@cluster8", 8)}
    assert launched(1, 2) == {("fence_dispatch", 8)}  # T^ decides, as on every rank
    assert hooks.last_grids(r)[0] == 8


def test_stream_objects_never_repeat(recorder, monkeypatch):
    """Only calls with None or int streams may repeat: a stream object goes the full path
    (framework tensors: test_repeat_framework_cpu.py)."""
    a2a, r, specs = _rank()
    ids = Tensor(1 << 33, (4, 8), "int32", device=(2, 0))
    pays = [Tensor((1 << 34) + 4096 * k, (4,) + tuple(s.shape), s.dtype, device=(2, 0)) for k, s in enumerate(specs)]
    for _ in range(8):
        r.dispatch(ids, pays, 16)
        r.combine(r.combine_input(16), 16)
    assert r._repeat_dispatch is not None and r._repeat_combine is not None
    r.dispatch(ids, pays, 16, stream=types.SimpleNamespace(handle=7, __cuda_stream__=lambda: (0, 7)))
    assert r._repeat_dispatch is None
    r.combine(r.combine_input(16), 16)
    r.dispatch(ids, pays, 16)
    r.combine(r.combine_input(16), 16)
    rep = r._repeat_dispatch
    assert rep is not None and rep.matches(ids, pays, 16, None)
    ids.ptr += 64  # a Tensor whose address changed is not the call it was
    assert not rep.matches(ids, pays, 16, None)
    assert not rep.matches(Tensor(ids.ptr - 64, (4, 8), "int32", device=(2, 0)), pays, 16, None)  # nor another object


def test_a_dead_reference_never_matches_a_none_argument():
    """The last call's tensor has been dropped (its weak reference reads None) and the next
    call passes None where a tensor belongs: no match, so the full path's TypeError names
    the argument (the GPU hostile-input test caught an AttributeError from here)."""
    import gc

    t = Tensor(1 << 40, (4, H), "bfloat16", device=(2, 0))
    r = fastpath.Repeat.of(None, 4, [t, None], 0, None, None)
    assert r is not None and r.matches(t, (None,), 4, None)
    del t
    gc.collect()
    assert not r.matches(None, (None,), 4, None)


def test_a_dead_checked_input_never_matches_a_none_argument():
    """The same hole one level down, in the cache of checked arguments: the tensor last
    checked as token_selected_experts is gone and the next dispatch passes None. The check
    must run and name the argument (the GPU hostile-input test, SENTINEL case, caught an
    AttributeError here)."""
    import gc
    import weakref
    t = Tensor(1 << 40, (4, 8), "int32", device=(2, 0))
    inputs = validate.CheckedInputs(0, 64)
    inputs.seen["token_selected_experts"] = (weakref.ref(t), ())
    del t
    gc.collect()
    with pytest.raises(TypeError, match="token_selected_experts: expected a tensor, got None"):
        inputs(None, "token_selected_experts", (8,), "int32", None, 0)


def test_fp8_input_made_once_per_t_hat_and_checked_by_geometry(recorder):
    """combine_input(T^, fp8=True) is one object per T^ (an engine asks every step); the check
    combine makes compares the views' geometry recorded when they were made, so neither a
    changed field of that very object nor another T^'s views pass."""
    _, r, _ = _rank("fp8")
    q = r.combine_input(16, fp8=True)
    assert r.combine_input(16, fp8=True) is q and r.combine_input(8, fp8=True) is not q
    assert (q.values.shape, q.scales.shape, q.dtype) == ((EP, 16, H), (EP, 16, H // 128), "bfloat16")
    validate.check_fp8_partial(q, 16, 'fp8', lambda: r._fp8_input(16))
    for bad, why in ((r.combine_input(8, fp8=True), "its values is not that view"),
                     (A.Fp8Partial(q.values, q.scales, "float16"), "dtype must be 'bfloat16'"),
                     (A.Fp8Partial(q.values, None, "bfloat16"), "its scales is not that view")):
        with pytest.raises(ValueError, match=why):
            validate.check_fp8_partial(bad, 16, 'fp8', lambda: r._fp8_input(16))
    q.values.ptr += 128  # a caller moved the cached view: no longer the workspace's
    with pytest.raises(ValueError, match="its values is not that view"):
        validate.check_fp8_partial(q, 16, 'fp8', lambda: r._fp8_input(16))


def test_combine_input_made_once_per_t_hat_so_a_step_asking_every_time_repeats(recorder, monkeypatch):
    """combine_input(T^) is one object per T^: an engine (or the README's snippet) that asks for
    it at every combine hands over the same Tensor, so the combine takes the repeat path."""
    _, r, specs = _rank()
    c = r.combine_input(16)
    assert r.combine_input(16) is c and r.combine_input(8) is not c
    assert (c.shape, c.dtype.name, c.ptr) == ((EP, 16, H), "bfloat16", r.base + r.a2a.layout.off_combine)
    ids = Tensor(1 << 33, (4, 8), "int32", device=(2, 0))
    pays = [Tensor((1 << 34) + 4096 * k, (4,) + tuple(s.shape), s.dtype, device=(2, 0)) for k, s in enumerate(specs)]
    again = []
    checks = A.check_combine_runtime_max
    monkeypatch.setattr(A, "check_combine_runtime_max", lambda *args: again.append(-1) or checks(*args))  # (full path only)
    combined = r._combined
    r._combined = lambda *args: again.append(1) or combined(*args)
    for _ in range(schedule.FIRST_STEPS + 3):
        r.dispatch(ids, pays, 16)
        r.combine(r.combine_input(16), 16)
    assert sum(again) >= 2, again


def test_abandon_dispatch_is_fence_only(recorder):
    """A dispatch-only repeat is safe for FENCE; after a SENTINEL dispatch abandon_dispatch
    refuses (a peer's next push could land in a landing slot before this dispatch's reset)."""
    _, r, specs = _rank()
    ids = Tensor(1 << 33, (4, 8), "int32", device=(2, 0))
    pays = [Tensor((1 << 34) + 4096 * k, (4,) + tuple(s.shape), s.dtype, device=(2, 0)) for k, s in enumerate(specs)]
    r.dispatch(ids, pays, 16)                      # FENCE (_rank's auto: SENTINEL up to 8)
    hooks.abandon_dispatch(r)
    r.dispatch(ids, pays, 16)
    r.combine(r.combine_input(16), 16)
    r.dispatch(ids, pays, 8)                       # SENTINEL
    with pytest.raises(StateError, match="abandon_dispatch after a SENTINEL dispatch"):
        hooks.abandon_dispatch(r)
    assert r.mid_step  # (refused: the step is still open and combine completes it)
    r.combine(r.combine_input(8), 8)


@pytest.mark.parametrize("change", ["dtype", "strides", "device"])
def test_a_tensor_changed_in_place_gets_the_full_paths_refusal(recorder, change):
    """The same Tensor object with the same address and shape but another dtype, layout or
    device (changed in place): the fast path must not accept what the full path refuses."""
    _, r, specs = _rank()
    T = 8
    ids = Tensor(1 << 33, (T, 8), "int32", device=(2, 0))
    pays = [Tensor((1 << 34) + (1 << 24) * k, (T,) + tuple(s.shape), s.dtype, device=(2, 0))
            for k, s in enumerate(specs)]
    cin = r.combine_input(T)
    for _ in range(8):  # past the first steps: the calls now repeat
        r.dispatch(ids, pays, T)
        r.combine(cin, T)
    if change == "dtype":
        ids.dtype, want = as_dtype("float32"), (TypeError, "token_selected_experts: dtype must be int32")
    elif change == "strides":
        ids.strides, want = (1, T), (ValueError, "token_selected_experts: must be contiguous")
    else:
        ids.device, want = (2, 1), (ValueError, "token_selected_experts: must be on cuda:0")
    with pytest.raises(want[0], match=want[1]):
        r.dispatch(ids, pays, T)


def test_close_keeps_the_error_record_and_frees_the_record_page_even_if_a_free_fails(recorder, monkeypatch):
    """After close, raise_recorded reads a copy of the record (its host-mapped page is freed),
    and the page is freed even when freeing the output buffer raises (a lost context)."""
    from ep_a2a.errors import PeerTimeoutError
    from ep_a2a.layout import ERR_TIMEOUT
    freed = []

    class Out:
        ptr = 1 << 32

        def close(self):
            raise RuntimeError("cuMemFree failed: CUDA_ERROR_LAUNCH_FAILED")
    monkeypatch.setattr(A, "DeviceAllocation", lambda dev, n: Out())
    monkeypatch.setattr(_HostMapped, "close", lambda self: freed.append(self.host_ptr), raising=False)
    _, r, _ = _rank()
    r.device.synchronize = lambda: None
    r.record.kind, r.record.rank, r.record.peer, r.record.epoch = ERR_TIMEOUT, 0, 3, 7
    page = r.record_page.host_ptr
    with pytest.raises(RuntimeError, match="cuMemFree failed"):
        r.close()
    assert freed == [page], "the record page must be freed too"
    assert ctypes.addressof(r.record) != page
    ctypes.memset(page, 0, ctypes.sizeof(r.record))  # the old page is gone: nothing may read it
    with pytest.raises(PeerTimeoutError, match="waiting for rank 3 at step 7"):
        r.raise_recorded()
    r.close()  # closed: a second close does nothing


def test_error_is_a_non_raising_poll_of_the_record(recorder):
    """a2a.error(): None while the record is clear, the recorded PeerError once a kernel wrote
    one, and never a raise (an engine polls it between graph replays)."""
    from ep_a2a.alltoall import MoeAlltoAll
    from ep_a2a.errors import PeerAbortedError
    from ep_a2a.layout import ERR_PEER_ABORTED
    _, r, _ = _rank()
    a = types.SimpleNamespace(ranks=[r])
    assert MoeAlltoAll.error(a) is None and r.recorded_error() is None
    r.record.kind, r.record.rank, r.record.peer, r.record.epoch = ERR_PEER_ABORTED, 0, 2, 9
    err = MoeAlltoAll.error(a)
    assert isinstance(err, PeerAbortedError) and (err.peer, err.epoch) == (2, 9)
