"""RankAlltoAll.dispatch called with CuPy arrays directly: the same arrays step after step,
their values rewritten in place on a CuPy stream of the caller's, take the repeat fast path
(interop/cupy_array.py reads their geometry; each repeat orders CuPy's current stream before
the rank's, as CuPy's DLPack export does) and deliver bitwise what the reference delivers;
new arrays take the full path."""
import weakref

import numpy as np
import pytest
from common import fresh_rng

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


def test_repeated_cupy_arrays_deliver_what_the_reference_delivers(monkeypatch):
    import ep_a2a
    from ep_a2a import fastpath
    from ep_a2a.testing.formats import payload_formats, random_payload, routing
    from ep_a2a.testing.harness import StepReport, check_dispatch, read_records
    try:
        weakref.ref(cupy.zeros(1))
    except TypeError:
        pytest.skip("this cupy.ndarray takes no weak references: its calls take the full path")
    rng, seed = fresh_rng()
    ep, T, tmax, H, top_k = 4, 8, 16, 256, 4
    group = ep_a2a.LocalGroup([0] * ep)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=top_k, num_experts=4 * ep,
                             payloads=payload_formats(H, top_k)["opaque"], combine_hidden_size=H, protocol="fence",
                             timeout_s=20.0, validate_expert_ids=False)
    ranks, specs = a2a.ranks, a2a.payload_specs
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in ranks]
    full, repeats = [0], [0]
    for r in ranks:
        def counted(*args, _f=r._dispatch_checked):
            full[0] += 1
            return _f(*args)
        monkeypatch.setattr(r, "_dispatch_checked", counted)
    order = fastpath.Repeat.order_producers

    def counted_order(self):
        repeats[0] += self.readers is not None
        return order(self)
    monkeypatch.setattr(fastpath.Repeat, "order_producers", counted_order)

    def arrays():
        return [(cupy.zeros((T, top_k), cupy.int32), [cupy.zeros((T,) + tuple(s.shape), s.dtype) for s in specs])
                for _ in ranks]

    def step(live, what):
        ids_h = [routing("uniform", rng, T, top_k, a2a.num_experts, ep, s) for s in range(ep)]
        pay_h = [[random_payload(rng, s, T) for s in specs] for _ in range(ep)]
        staged = [(cupy.asarray(i), [cupy.asarray(p) for p in ps]) for i, ps in zip(ids_h, pay_h)]
        cupy.cuda.Device().synchronize()  # (every allocation before the first launch)
        views = {}
        for s, (r, st, (ids, pays), (si, sp)) in enumerate(zip(ranks, streams, live, staged)):
            with st:  # CuPy's current stream: the in-place writes, then the call
                ids[...] = si
                for p, q in zip(pays, sp):
                    p[...] = q
                views[s] = r.dispatch(ids, pays, tmax)
        for r in ranks:
            r.combine(r.combine_input(tmax), tmax)
        a2a.synchronize()
        rep = StepReport([T] * ep, tmax)
        check_dispatch(a2a, rep, ids_h, pay_h, {s: read_records(r, T) for s, r in enumerate(ranks)}, views, False)
        assert not rep.mismatches, f"{seed} {what}: {rep.mismatches[:3]}"

    try:
        live = arrays()
        for k in range(8):
            step(live, f"steady step {k}")
        before = (full[0], repeats[0])
        for k in range(4):
            step(live, f"repeated step {k}")
        assert full[0] == before[0] and repeats[0] - before[1] == 4 * ep, (full, repeats, before)
        live = arrays()
        before = full[0]
        step(live, "new arrays")
        assert full[0] == before + ep, "new arrays did not take the full path"
        step(live, "new arrays again")
        assert full[0] == before + ep, "the unchanged next call did not repeat"
    finally:
        cupy.cuda.Device().synchronize()
        a2a.close()
        group.close()
