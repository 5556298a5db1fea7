"""RankAlltoAll.dispatch / combine called with torch tensors directly (no binding): the same
tensors step after step take the repeat fast path (fastpath.Repeat reads their geometry
through torch), and must give bitwise what a fresh call gives, after their contents were
rewritten in place; a tensor moved to other memory or resized in place must take the full
path. The caller's current stream is the rank's own, or another stream whose writes are
held back behind a spin: then each repeat must order that stream before the rank's, as the
DLPack exchange of the full path does, or the kernels read the values of the step before."""
import numpy as np
import pytest
from common import fresh_rng

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
from test_torch_ops_gpu import _cuda, _draw, _identity_want, _make  # noqa: E402

SPIN_CYCLES = 4_000_000  # (~2 ms: long enough that an unordered kernel reads the old values)


@pytest.mark.parametrize("validate", [False, True], ids=["unvalidated", "validated"])
@pytest.mark.parametrize("current", ["rank_stream", "other_stream"])
def test_repeated_torch_tensors_match_fresh_calls_and_changes_take_the_full_path(current, validate, monkeypatch):
    from ep_a2a import fastpath
    from ep_a2a.interop.arrays import to_numpy
    from ep_a2a.interop.torch_tensor import torch_view
    from ep_a2a.testing.torch_step import to_torch
    dev = _cuda()
    rng, seed = fresh_rng()
    ep, T, tmax, H = 4, 8, 16, 256
    group, a2a = _make(ep, hidden=H, max_tokens=tmax, validate_expert_ids=validate)
    ranks = a2a.ranks
    own = [torch.cuda.ExternalStream(r.default_stream, device=dev) for r in ranks]
    producers = own if current == "rank_stream" else [torch.cuda.Stream(device=dev) for _ in ranks]
    parts = [torch_view(r.combine_input(tmax)) for r in ranks]  # the identity 'MoE' writes here
    full, repeats = {"dispatch": 0, "combine": 0}, [0]
    for r in ranks:
        for phase, name in (("dispatch", "_dispatch_checked"), ("combine", "combine_call")):
            def counted(*args, _f=getattr(r, name), _phase=phase):
                full[_phase] += 1
                return _f(*args)
            monkeypatch.setattr(r, name, counted)
    order = fastpath.Repeat.order_producers

    def counted_order(self):
        repeats[0] += self.readers is not None
        return order(self)
    monkeypatch.setattr(fastpath.Repeat, "order_producers", counted_order)

    def tensors(n):
        return [(torch.zeros(n, 4, dtype=torch.int32, device=dev), torch.zeros(n, H, dtype=torch.bfloat16, device=dev),
                 torch.zeros(n, 4, dtype=torch.float32, device=dev)) for _ in ranks]

    def step(live, what):
        """Fresh values written in place (on the current stream, behind a spin), one eager
        step of every rank, each output checked bitwise against the reference."""
        drawn = [_draw(rng, a2a, ids.shape[0]) for ids, _, _ in live]
        # every allocation before the first launch: in-process ranks spin on each other
        staged = [(to_torch(i, dev, "int32"), to_torch(x, dev, "bfloat16"), to_torch(w, dev, "float32"))
                  for i, x, w in drawn]
        torch.cuda.synchronize()
        for r, p, (ti, tx, tw), (si, sx, sw) in zip(ranks, producers, live, staged):
            with torch.cuda.stream(p):
                torch.cuda._sleep(SPIN_CYCLES)
                ti.copy_(si)
                tx.copy_(sx)
                tw.copy_(sw)
                r.dispatch(ti, [tx, tw], tmax)
        ys = []
        for r, p, o, part in zip(ranks, producers, own, parts):
            with torch.cuda.stream(o):
                part.copy_(torch_view(r.dispatch_views(tmax)[1][0]))  # (on the rank's stream, after its dispatch)
            with torch.cuda.stream(p):
                ys.append(r.combine(part, tmax))
        torch.cuda.synchronize()
        a2a.synchronize()
        got = [to_numpy(y, np.uint16) for y in ys]
        for s, ((ids, x, _), y) in enumerate(zip(drawn, got)):
            assert np.array_equal(y, _identity_want(ids, x, a2a)), f"{seed} {current} {what}: rank {s}"
        return got

    try:
        live = tensors(T)
        for k in range(8):  # (past the first steps' longer timeouts, the repeats)
            step(live, f"steady step {k}")
        before = (dict(full), repeats[0])
        for k in range(4):
            step(live, f"repeated step {k}")
        assert full == before[0], f"a steady step took the full path: {full} vs {before[0]}"
        assert repeats[0] - before[1] == 4 * 2 * ep, f"not every call repeated: {repeats[0] - before[1]}"
        # a fresh call (new tensors: the full path) gives what the repeat gave, from the same values
        rng_state = rng.bit_generator.state
        repeated = step(live, "repeated")
        rng.bit_generator.state = rng_state
        before = dict(full)
        fresh = step(tensors(T), "fresh")
        assert full["dispatch"] == before["dispatch"] + ep, "new tensors did not take the full path"
        assert all(np.array_equal(a, b) for a, b in zip(repeated, fresh))
        changes = {
            "ids set_ onto other memory": lambda: [(i.set_(torch.zeros_like(i)), x, w) for i, x, w in live],
            "payload set_ onto other memory": lambda: [(i, x, w.set_(torch.zeros_like(w))) for i, x, w in live],
            "resized in place": lambda: [(i.resize_(T - 3, 4), x.resize_(T - 3, H), w.resize_(T - 3, 4))
                                         for i, x, w in live],
        }
        for what, change in changes.items():
            before = (dict(full), repeats[0])
            step(live, f"before {what}")
            step(live, f"before {what}, again")
            assert full["dispatch"] <= before[0]["dispatch"] + ep and repeats[0] > before[1], f"{what}: no repeat before"
            live = change()
            torch.cuda.synchronize()
            before = dict(full)
            step(live, what)
            assert full["dispatch"] == before["dispatch"] + ep, f"{what}: the changed call repeated"
            before = (dict(full), repeats[0])
            step(live, f"after {what}")
            assert full == before[0] and repeats[0] == before[1] + 2 * ep, f"{what}: the unchanged next call did not repeat"
    finally:
        torch.cuda.synchronize()
        a2a.close()
        group.close()
