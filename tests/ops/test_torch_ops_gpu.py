"""The torch ops (ep_a2a/ops/torch.py) on the GPU, every result checked against the NumPy
reference: eager on in-process ranks (one torch stream each), an explicit stream= with the
inputs freed at once (the caching allocator's streams), the MoE ops bitwise against
moe_reference, torch.compile(fullgraph=True) with inductor against eager and the reference,
CUDA graphs captured with capture_error_mode="global", one per T^, replayed in shuffled
order, and torchrun (and mpirun, where mpi4py is importable) over two processes on one GPU.
Fresh random inputs every run (the seed is in every failure message); outputs poisoned."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from common import fresh_rng

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
from ep_a2a.ops import torch as ops  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch.device("cuda", 0)


def _make(ep, *, hidden=256, top_k=4, max_tokens=32, protocol="fence", experts=None, **kw):
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    group = ep_a2a.LocalGroup([0] * ep)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max_tokens, top_k=top_k, num_experts=experts or 4 * ep,
                             payloads=payload_formats(hidden, top_k)["bf16"], combine_hidden_size=hidden,
                             protocol=protocol, timeout_s=20.0, **kw)
    return group, a2a


def _close(group, a2a, binds=()):
    for b in binds:
        b.release()
    a2a.close()
    group.close()


def _copies_unchanged(before, what):
    from ep_a2a.ops import torch as ops
    assert ops.copies() == before, f"{what}: an op was handed a copy of its own view {ops.copies() - before} times"


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "dispatcher"])
@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
@pytest.mark.parametrize("ep", [1, 4])
def test_eager_steps_match_the_reference(ep, protocol, direct, monkeypatch):
    """Steps with changing T^ and token counts (one empty rank, one full), out= given or
    made by combine, partials in the workspace or staged from a tensor of their own; eager
    calls running the implementations directly (the default) or through the dispatcher."""
    from ep_a2a.testing.torch_step import run_torch_step
    _cuda()
    monkeypatch.setattr(ops, "EAGER_DIRECT", direct)
    rng, seed = fresh_rng()
    group, a2a = _make(ep, protocol=protocol, validate_expert_ids=True)
    binds = [ops.bind(r) for r in a2a.ranks]
    streams = {b.rank: torch.cuda.Stream() for b in binds}
    before = ops.copies()
    try:
        assert all(not r.validate_expert_ids for r in a2a.ranks), "bind() must turn the rank's host check off"
        for step in range(8):
            tmax = int(rng.integers(1, 33))
            tokens = [int(rng.integers(0, tmax + 1)) for _ in range(ep)]
            if step == 0:
                tokens[0], tokens[-1] = tmax, 0 if ep > 1 else tmax
            rep = run_torch_step(a2a, binds, rng, tokens, tmax, streams=streams, out_given=step % 2 == 0,
                                 staged=step % 3 == 2)
            assert not rep.mismatches, f"{seed} step {step} T^={tmax} tokens={tokens}: {rep.mismatches[:5]}"
            assert rep.combine_rows_checked == sum(tokens)
        _copies_unchanged(before, "eager")
    finally:
        _close(group, a2a, binds)


def test_a_dispatch_mode_and_tensor_subclasses_see_the_registered_ops():
    """Under a TorchDispatchMode the functions call the registered ops (the mode sees each
    dispatch and combine; eager calls skip the dispatcher only where nothing would see it),
    and the results still match the reference; nn.Parameter inputs (a subclass) too."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from ep_a2a.testing.torch_step import run_torch_step, to_torch

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith("ep_a2a."):
                self.names.append(str(func))
            return func(*args, **(kwargs or {}))
    dev = _cuda()
    rng, seed = fresh_rng()
    ep = 2
    group, a2a = _make(ep, validate_expert_ids=False)
    binds = [ops.bind(r) for r in a2a.ranks]
    streams = {b.rank: torch.cuda.Stream() for b in binds}
    try:
        for step in range(3):
            mode = Seen()
            with mode:
                rep = run_torch_step(a2a, binds, rng, [8, 5], 8, streams=streams, out_given=step != 1)
            assert not rep.mismatches, f"{seed} step {step}: {rep.mismatches[:5]}"
            assert sorted(mode.names) == ["ep_a2a.combine.default"] * ep + ["ep_a2a.dispatch.default"] * ep, mode.names
        ids, x, w = _draw(rng, a2a, 8)
        for b in binds:  # a subclass goes through the dispatcher too (here a plain kernel call)
            p = [torch.nn.Parameter(to_torch(v, dev, d), requires_grad=False) for v, d in ((x, "bfloat16"), (w, "float32"))]
            with torch.cuda.stream(streams[b.rank]):
                ops.dispatch(b, to_torch(ids, dev, "int32"), p, 8)
        for b in binds:
            with torch.cuda.stream(streams[b.rank]):
                ops.combine(b, ops.combine_input(b, 8), 8)
        torch.cuda.synchronize()
    finally:
        _close(group, a2a, binds)


def test_bad_arguments_are_named_before_any_launch():
    dev = _cuda()
    group, a2a = _make(1)
    tr = ops.bind(a2a.ranks[0])
    try:
        x = torch.zeros(3, 256, dtype=torch.bfloat16, device=dev)
        w = torch.zeros(3, 4, dtype=torch.float32, device=dev)
        with pytest.raises(TypeError, match="^token_selected_experts: dtype must be int32"):
            ops.dispatch(tr, torch.zeros(3, 4, dtype=torch.int64, device=dev), [x, w], 4)
        with pytest.raises(ValueError, match="^token_selected_experts: must be on cuda:0"):
            ops.dispatch(tr, torch.zeros(3, 4, dtype=torch.int32), [x, w], 4)
        with pytest.raises(ValueError, match="^runtime_max_tokens_per_rank: must be an int in 1..max_tokens_per_rank"):
            ops.dispatch(tr, torch.zeros(3, 4, dtype=torch.int32, device=dev), [x, w], 99)
        with pytest.raises(ValueError, match=r"^payloads\[0\] \(hidden\): has 2 rows"):
            ops.dispatch(tr, torch.zeros(3, 4, dtype=torch.int32, device=dev), [x[:2], w], 4)
        with pytest.raises(ValueError, match="^payloads: expected 2 tensors"):
            ops.dispatch(tr, torch.zeros(3, 4, dtype=torch.int32, device=dev), [x], 4)
        strided = torch.zeros(6, 256, dtype=torch.bfloat16, device=dev)[::2]
        with pytest.raises(ValueError, match=r"^payloads\[0\] \(hidden\): must be contiguous"):
            ops.dispatch(tr, torch.zeros(3, 4, dtype=torch.int32, device=dev), [strided, w], 4)
        tr.validate_expert_ids = True
        with pytest.raises(ValueError, match="^token_selected_experts: ids must be in 0..num_experts-1=3"):
            ops.dispatch(tr, torch.full((3, 4), 7, dtype=torch.int32, device=dev), [x, w], 4)
        ops.dispatch(tr, torch.zeros(3, 4, dtype=torch.int32, device=dev), [x, w], 4)  # still usable
        with pytest.raises(ValueError, match="^runtime_max_tokens_per_rank: combine got 5"):
            ops.combine(tr, ops.combine_input(tr, 5), 5)
        y = ops.combine(tr, ops.combine_input(tr, 4), 4)
        torch.cuda.synchronize()
        assert y.shape == (3, 256)
    finally:
        _close(group, a2a, [tr])


def _identity_want(ids_h, x_bits, a2a):
    """combine(dispatch(x)) when the 'MoE' copies each dispatched row into the combine input:
    each token's row summed once per distinct target rank, in the kernels' order."""
    from ep_a2a.testing import reference as ref
    owner = ref.expert_owner(a2a.num_experts, a2a.ep_size)
    H = x_bits.shape[1]
    want = np.zeros_like(x_bits)
    for i in range(x_bits.shape[0]):
        n = len(ref.targets_of(ids_h[i], owner))
        want[i] = ref.from_float32(ref.tree_sum([ref.to_float32(x_bits[i], "bfloat16")] * n, H), "bfloat16")
    return want


def _draw(rng, a2a, T):
    from ep_a2a.testing.formats import routing
    from ep_a2a.testing.reference import from_float32
    ids = routing("uniform", rng, T, a2a.top_k, a2a.num_experts, a2a.ep_size)
    x = from_float32(rng.integers(-64, 65, (T, a2a.combine_hidden_size)).astype(np.float32), "bfloat16")
    w = rng.uniform(0.1, 1.0, (T, a2a.top_k)).astype(np.float32)
    return ids, x, w


def test_explicit_stream_keeps_freed_inputs_until_the_kernels_ran():
    """stream= another stream than the current one, its kernels held back behind a spin;
    the caller frees the inputs at once and the current stream writes poison into new
    allocations of the same size: the ops must hold the inputs (no record_stream)."""
    from ep_a2a.testing.torch_step import host_bits, to_torch
    dev = _cuda()
    rng, seed = fresh_rng()
    ep, T = 2, 16
    group, a2a = _make(ep, validate_expert_ids=False)
    binds = [ops.bind(r) for r in a2a.ranks]
    side = [torch.cuda.Stream() for _ in binds]
    try:
        for step in range(3):
            drawn = [_draw(rng, a2a, T) for _ in binds]
            outs = [torch.full((T, 256), -1, dtype=torch.int16, device=dev).view(torch.bfloat16) for _ in binds]
            torch.cuda.synchronize()
            for s, (b, (ids, x, w)) in enumerate(zip(binds, drawn)):
                torch.cuda._sleep(20_000_000)   # ~10 ms on the current stream: the side stream waits for it
                ops.dispatch(b, to_torch(ids, dev, "int32"), [to_torch(x, dev, "bfloat16"), to_torch(w, dev, "float32")],
                             T, stream=side[s])
                junk = [torch.empty(T, 256, dtype=torch.bfloat16, device=dev) for _ in range(4)]
                for j in junk:
                    j.view(torch.int16).fill_(0x7FC0)  # NaN into whatever memory the freed inputs had
                del junk
            for s, b in enumerate(binds):
                with torch.cuda.stream(side[s]):
                    recv = b.dispatch_views(T)[1][0]   # the identity 'MoE'
                    cin = ops.combine_input(b, T)
                    cin.copy_(recv)
                ops.combine(b, cin, T, out=outs[s], stream=side[s])
            torch.cuda.synchronize()
            for s, (ids, x, w) in enumerate(drawn):
                got = host_bits(outs[s])
                assert np.array_equal(got, _identity_want(ids, x, a2a)), f"{seed} step {step} rank {s}"
    finally:
        _close(group, a2a, binds)


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_steady_state_repeats_vouched_by_the_slots_and_every_change_is_seen(protocol, monkeypatch):
    """An engine's steady state: the same torch tensors every step, their contents rewritten
    in place, so the ops repeat the all-to-all's last call without its geometry compare
    (RankAlltoAll.dispatch_same / combine_same, counted here: the test fails if they never
    run). Between such steps every way a call can differ: a payload at another address, a
    tensor changed in place (set_ onto other memory, same shape), another token count, a
    combine into another out, a staged partial, a call refused for a bad dtype, another T^;
    each step checked bitwise against the reference (the identity 'MoE'); and calls that fail
    in a slot after another slot took a new tensor, whose next call passes that tensor again."""
    from ep_a2a.testing.torch_step import host_bits, to_torch
    dev = _cuda()
    rng, seed = fresh_rng()
    ep, T = 4, 8
    group, a2a = _make(ep, protocol=protocol, max_tokens=16, validate_expert_ids=False)
    binds = [ops.bind(r) for r in a2a.ranks]
    streams = [torch.cuda.Stream() for _ in binds]
    hits = {"dispatch": 0, "combine": 0}
    for r in a2a.ranks:
        for phase in hits:
            def counted(*args, _f=getattr(r, f"{phase}_same"), _phase=phase):
                got = _f(*args)
                hits[_phase] += got is not None
                return got
            monkeypatch.setattr(r, f"{phase}_same", counted)

    def tensors(n):
        return [(torch.zeros(n, 4, dtype=torch.int32, device=dev), torch.zeros(n, 256, dtype=torch.bfloat16, device=dev),
                 torch.zeros(n, 4, dtype=torch.float32, device=dev), torch.empty(n, 256, dtype=torch.bfloat16, device=dev))
                for _ in binds]
    live, spare = tensors(T), tensors(T)

    def run(tmax, cur, staged=False, parts=None, before_combine=None):
        """One checked step; parts: a staged partial per rank kept by the caller (else the
        workspace's, or a new clone with staged); before_combine(b, part, out) runs first."""
        drawn = [_draw(rng, a2a, ids.shape[0]) for ids, _, _, _ in cur]
        for (ids, x, w), (ti, tx, tw, out) in zip(drawn, cur):  # in place: the addresses stay
            ti.copy_(to_torch(ids, dev, "int32"))
            tx.copy_(to_torch(x, dev, "bfloat16"))
            tw.copy_(to_torch(w, dev, "float32"))
            out.view(torch.int16).fill_(-1)  # poison
        torch.cuda.synchronize()
        for b, st, (ti, tx, tw, _) in zip(binds, streams, cur):
            with torch.cuda.stream(st):
                ops.dispatch(b, ti, [tx, tw], tmax)
        for b, st, (ti, _, _, out) in zip(binds, streams, cur):
            with torch.cuda.stream(st):
                recv = b.dispatch_views(tmax)[1][0]  # the identity 'MoE'
                if parts is not None:
                    part = parts[b.rank][:, :tmax]
                    part.copy_(recv)
                else:
                    part = recv.clone() if staged else ops.combine_input(b, tmax)
                    part.copy_(recv)
                if before_combine:
                    before_combine(b, part, out)
                ops.combine(b, part, tmax, out=out)
        torch.cuda.synchronize()
        return drawn

    def check(drawn, cur, what):
        for s, ((ids, x, w), (_, _, _, out)) in enumerate(zip(drawn, cur)):
            assert np.array_equal(host_bits(out), _identity_want(ids, x, a2a)), f"{seed} {protocol} {what}: rank {s}"
    try:
        for step in range(8):
            check(run(T, live), live, f"steady step {step}")
        assert hits["dispatch"] >= ep and hits["combine"] >= ep, f"the vouched repeat never ran: {hits}"
        changes = {  # what changes -> the phases whose call it changes
            "payload at another address": (lambda: [(i, spare[k][1], w, o) for k, (i, _, w, o) in enumerate(live)],
                                           ["dispatch"]),
            "out at another address": (lambda: [(i, x, w, spare[k][3]) for k, (i, x, w, _) in enumerate(live)],
                                       ["combine"]),
            "ids set_ onto other memory": (lambda: [(i.set_(spare[k][0].clone()), x, w, o)
                                                    for k, (i, x, w, o) in enumerate(live)], ["dispatch"]),
            "fewer tokens": (lambda: [(i[:5], x[:5], w[:5], o[:5]) for i, x, w, o in live], ["dispatch", "combine"]),
        }
        for what, (change, phases) in changes.items():
            live = change()
            before = dict(hits)
            check(run(T, live), live, what)
            assert all(hits[p] == before[p] for p in phases), f"{what}: a changed call was repeated {hits} vs {before}"
            check(run(T, live), live, f"after {what}")
            assert all(hits[p] > before[p] for p in phases), f"{what}: the unchanged next call did not repeat {hits}"
        check(run(T, live, staged=True), live, "staged partial")
        check(run(T, live, staged=True), live, "staged partial again")
        check(run(T, live), live, "workspace partial after staged")
        bad = [(i, x.to(torch.float16), w, o) for i, x, w, o in live]
        with pytest.raises(TypeError, match="payloads"):
            ops.dispatch(binds[0], bad[0][0], [bad[0][1], bad[0][2]], T)
        check(run(T, live), live, "after a refused call")
        # A call that fails in a slot after another slot took a new tensor; the next call passes
        # that tensor again (its slot reads "unchanged") and must not repeat the call before.
        kept = {b.rank: [torch.empty(ep, T, 256, dtype=torch.bfloat16, device=dev) for _ in range(2)] for b in binds}
        for _ in range(3):
            check(run(T, live, parts={r: p[0] for r, p in kept.items()}), live, "kept staged partials")

        def refused_out(b, part, out):
            kept[b.rank][0].view(torch.int16).fill_(0x7FC0)  # the partial before: NaN now
            with pytest.raises(TypeError, match="out"):
                ops.combine(b, part, T, out=torch.empty(out.shape, dtype=torch.complex64, device=dev))
        check(run(T, live, parts={r: p[1] for r, p in kept.items()}, before_combine=refused_out), live,
              "a staged partial whose first call failed at its out")
        moved = [(spare[k][0][:n], x, w, o) for k, ((i, x, w, o), n) in enumerate(zip(live, [t[0].shape[0] for t in live]))]
        for b, (i, x, w, _) in zip(binds, moved):
            with pytest.raises(RuntimeError):  # the ids slot takes the new ids, then a payload's data_ptr() raises
                ops.dispatch(b, i, [x.to_sparse(), w], T)
        live = moved
        check(run(T, live), live, "ids whose first call failed at a payload")
        check(run(16, live), live, "another T^")
        check(run(16, live), live, "another T^ again")
        check(run(T, live), live, "back to the first T^")
    finally:
        torch.cuda.synchronize()
        _close(group, a2a, binds)


def _moe_step(tr, ix, ids, x, w, T, fc2_rows):
    """dispatch -> index -> gather -> a stand-in expert (x * 3 in bf16) -> finalize -> combine."""
    ids_v, (x_v, w_v) = ops.dispatch(tr, ids, [x, w], T)
    ops.build_index(ix, ids_v, w_v)
    ops.gather_rows(ix, x_v, fc2_rows)
    fc2 = fc2_rows * 3
    ops.finalize(ix, fc2, ops.combine_input(tr, T))
    return ops.combine(tr, ops.combine_input(tr, T), T)


def _moe_reference(ids, x, w, a2a, T):
    from ep_a2a.testing import moe_reference as mref
    from ep_a2a.testing import reference as ref
    E, H, k = a2a.num_experts, a2a.combine_hidden_size, a2a.top_k
    ids_t = np.full((1, T, k), -1, np.int32)
    ids_t[0, :ids.shape[0]] = ids
    w_t = np.zeros((1, T, k), np.float32)
    w_t[0, :ids.shape[0]] = w
    x_t = np.zeros((1, T, H), np.uint16)
    x_t[0, :ids.shape[0]] = x
    ix = mref.build_index(ids_t, w_t, E, 1, 0)
    rows = mref.gather_rows(ix, x_t.reshape(T, H))
    fc2 = ref.from_float32(ref.to_float32(rows, "bfloat16") * 3, "bfloat16")
    part = mref.finalize(ix, fc2, "bfloat16", "bfloat16")  # [T, H]: every token is its own slot
    return part[:ids.shape[0]]


def test_moe_ops_eager_and_compiled_fullgraph_match_the_reference():
    """One rank (ep=1): the whole MoE step in one torch.compile(fullgraph=True) graph with
    inductor, against the same step eagerly and against moe_reference, bitwise; the compiled
    graph's ops get the workspace views themselves (no copies)."""
    from ep_a2a.testing.torch_step import host_bits, to_torch
    dev = _cuda()
    rng, seed = fresh_rng()
    group, a2a = _make(1, experts=8, max_tokens=32, validate_expert_ids=False)
    tr = ops.bind(a2a.ranks[0])
    ix = ops.expert_index(tr)
    fc2_rows = torch.empty(32 * 4, 256, dtype=torch.bfloat16, device=dev)
    torch._dynamo.reset()
    compiled = torch.compile(_moe_step, fullgraph=True)
    before = ops.copies()
    try:
        for step in range(4):
            T = [32, 7, 1, 20][step]
            tr.prepare([T])
            ids, x, w = _draw(rng, a2a, int(rng.integers(1, T + 1)))
            args = (to_torch(ids, dev, "int32"), to_torch(x, dev, "bfloat16"), to_torch(w, dev, "float32"), T, fc2_rows)
            want = _moe_reference(ids, x, w, a2a, T)
            eager = host_bits(_moe_step(tr, ix, *args))
            got = host_bits(compiled(tr, ix, *args))
            torch.cuda.synchronize()
            assert np.array_equal(eager, want), f"{seed} step {step}: eager differs from moe_reference"
            assert np.array_equal(got, want), f"{seed} step {step}: torch.compile differs from moe_reference"
        _copies_unchanged(before, "torch.compile with inductor")
    finally:
        ix.release()
        ix.index.close()
        _close(group, a2a, [tr])


def test_opcheck_of_the_moe_ops():
    """torch.library.opcheck on build_index, gather_rows and finalize (repeatable ops: the
    all-to-all's own alternate dispatch and combine and cannot run twice in a row)."""
    from ep_a2a.testing.torch_step import to_torch
    dev = _cuda()
    rng, seed = fresh_rng()
    group, a2a = _make(1, experts=8, max_tokens=16, validate_expert_ids=False)
    tr = ops.bind(a2a.ranks[0])
    ix = ops.expert_index(tr)
    try:
        ids, x, w = _draw(rng, a2a, 16)
        ids_v, (x_v, w_v) = ops.dispatch(tr, to_torch(ids, dev, "int32"), [to_torch(x, dev, "bfloat16"),
                                                                          to_torch(w, dev, "float32")], 16)
        ops.build_index(ix, ids_v, w_v)
        rows_out = torch.empty(64, 256, dtype=torch.bfloat16, device=dev)
        tests = ("test_schema", "test_faketensor")
        for op, args in ((ops.OPS["build_index"], (ix.handle, ids_v, w_v, ix.counts, ix.offsets, ix.rows, ix.row_weight,
                                                    ix.row_of)),
                         (ops.OPS["gather_rows"], (ix.handle, ix.rows, ix.offsets, x_v, rows_out)),
                         (ops.OPS["finalize"], (ix.handle, ix.row_of, ix.row_weight, rows_out, ops.combine_input(tr, 16)))):
            torch.library.opcheck(op, args, test_utils=tests)
        ops.combine(tr, ops.combine_input(tr, 16), 16)
        torch.cuda.synchronize()
    finally:
        ix.release()
        ix.index.close()
        _close(group, a2a, [tr])


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_cuda_graphs_per_batch_size_replayed_in_shuffled_order(protocol):
    """In-process ranks (one torch stream each), one graph per T^ captured with
    capture_error_mode='global' (an allocation, free or synchronization in any thread would
    fail the capture), replayed in a shuffled order with fresh inputs copied in before each
    replay; every replay checked against the reference."""
    from ep_a2a.testing.torch_step import host_bits, to_torch
    dev = _cuda()
    rng, seed = fresh_rng()
    ep, sizes = 4, [1, 5, 16]
    group, a2a = _make(ep, protocol=protocol, max_tokens=16, validate_expert_ids=False)
    binds = [ops.bind(r) for r in a2a.ranks]
    streams = [torch.cuda.Stream() for _ in binds]
    static = {}
    for T in sizes:  # static inputs and outputs per graph (T tokens on every rank)
        static[T] = [(torch.zeros(T, 4, dtype=torch.int32, device=dev), torch.zeros(T, 256, dtype=torch.bfloat16, device=dev),
                      torch.zeros(T, 4, dtype=torch.float32, device=dev), torch.empty(T, 256, dtype=torch.bfloat16, device=dev))
                     for _ in binds]

    def step(T):
        cap = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(cap)
        for b, s, (ids, x, w, _) in zip(binds, streams, static[T]):
            with torch.cuda.stream(s):
                ops.dispatch(b, ids, [x, w], T)
        for b, s, (_, _, _, out) in zip(binds, streams, static[T]):
            with torch.cuda.stream(s):
                cin = ops.combine_input(b, T)
                cin.copy_(b.dispatch_views(T)[1][0])   # the identity 'MoE'
                ops.combine(b, cin, T, out=out)
        for s in streams:
            cap.wait_stream(s)

    def fill(T):
        drawn = [_draw(rng, a2a, T) for _ in binds]
        for (ids, x, w), (ti, tx, tw, out) in zip(drawn, static[T]):
            ti.copy_(to_torch(ids, dev, "int32"))
            tx.copy_(to_torch(x, dev, "bfloat16"))
            tw.copy_(to_torch(w, dev, "float32"))
            out.view(torch.int16).fill_(-1)
        return drawn

    def check(T, drawn, what):
        torch.cuda.synchronize()
        for s, ((ids, x, w), (_, _, _, out)) in enumerate(zip(drawn, static[T])):
            assert np.array_equal(host_bits(out), _identity_want(ids, x, a2a)), f"{seed} {what} T^={T} rank {s}"
    graphs = {}
    try:
        for T in sizes:  # eager first: the views of each T^ exist before any capture
            for _ in range(2):
                drawn = fill(T)
                step(T)
                check(T, drawn, "eager")
        for T in sizes:
            torch.cuda.synchronize()
            graphs[T] = g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="global"):
                step(T)
            torch.cuda.synchronize()
        order = [T for _ in range(4) for T in sizes]
        rng.shuffle(order)
        for i, T in enumerate(order):
            drawn = fill(T)
            graphs[T].replay()
            check(T, drawn, f"replay {i} of {order}")
        drawn = fill(sizes[0])  # eager after the replays: the host state still pairs with the device's
        step(sizes[0])
        check(sizes[0], drawn, "eager after replays")
    finally:
        torch.cuda.synchronize()
        graphs.clear()
        _close(group, a2a, binds)


def _launcher_env(mpi: bool = False):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    if mpi:  # Open MPI refuses to start as root (the GPU machine runs tests as root) unless both are set
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def test_torchrun_two_processes_on_one_gpu():
    """examples/torch_distributed.py under torchrun: the group meets through
    TorchDistributedBootstrap (gloo), each process one rank on GPU 0 (time-sliced)."""
    _cuda()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port",
           str(29500 + os.getpid() % 1000), os.path.join(ROOT, "examples", "torch_distributed.py"), "--steps", "2",
           "--tokens", "8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=_launcher_env(), cwd=ROOT)
    tail = (p.stdout + p.stderr)[-4000:]
    assert p.returncode == 0, f"torchrun exited {p.returncode}:\n{tail}"
    assert "all ranks match the reference" in p.stdout, tail


def test_mpirun_two_processes_on_one_gpu():
    _cuda()
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not importable here: the MPI bootstrap is not run")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("mpi4py is importable but no mpirun/mpiexec is on PATH")
    cmd = [mpirun, "-n", "2", sys.executable, os.path.join(ROOT, "examples", "torch_distributed.py"), "--mpi",
           "--steps", "2", "--tokens", "8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=_launcher_env(mpi=True), cwd=ROOT)
    tail = (p.stdout + p.stderr)[-4000:]
    assert p.returncode == 0, f"mpirun exited {p.returncode}:\n{tail}"
    assert "all ranks match the reference" in p.stdout, tail


def test_torch_host_overhead_runs_and_reports():
    """The benchmark's torch host-time function on 8 in-process ranks (deepseek-v3 shapes):
    it runs, reports every field, and the ops made no copies. The figures go in its output."""
    import ep_a2a
    from ep_a2a.tools import bench, bench_cli
    from ep_a2a.tools.bench_torch import torch_host_overhead
    _cuda()
    assert ops.plain_eager(), "eager calls would take the dispatcher on this torch (a TLS check is missing)"
    args = bench_cli.parse_args(["--ranks", "8", "--tokens", "1,128", "--protocol", "fence"])
    with ep_a2a.LocalGroup([0] * 8) as group:
        b = bench.Bench(args, group, 1234)
        try:
            b.a2a.use_protocol("fence")
            rows = [torch_host_overhead(b, T, 50) for T in (1, 128)]
        finally:
            b.close()
    for row in rows:
        print("torch host overhead", row)
        for k in ("torch_ops_us", "torch_ops_out_us", "torch_ops_moved_us", "torch_dispatcher_us", "ep_a2a_tensors_us",
                  "two_bare_launches_us"):
            assert row[k] > 0, (k, row)
        assert row["torch_ops_copies"] == 0, row
