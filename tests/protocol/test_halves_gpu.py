"""The send and receive halves on one GPU with in-process ranks (ep_a2a/halves.py): two
micro-batches (two all-to-alls) with random sizes in random legal interleavings of their
halves (one order on every rank, the ranks issued in random order), eagerly and as shuffled graph replays, checked bitwise
against the NumPy reference; compute kernels that fill the GPU between the halves; a peer
that never sends while the others wait in a receive half."""
import random

import numpy as np
import pytest

from common import fresh_rng
from ep_a2a.testing.halves_step import BOTH_SENDS_FIRST, OPS, TBO, interleaving as _interleaving
from ep_a2a.testing.halves_step import Micro as _Micro

pytestmark = pytest.mark.gpu

EP, H, K, E, TMAX = 8, 256, 4, 32, 16


def _make(protocol, combine_quant=None, group=None, **kw):
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    kw.setdefault("timeout_s", 10.0)
    kw.setdefault("first_timeout_s", 10.0)
    group = group or ep_a2a.LocalGroup([0] * EP)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=TMAX, top_k=K, num_experts=E,
                             payloads=payload_formats(H, K)["bf16"], combine_hidden_size=H, protocol=protocol,
                             combine_quant=combine_quant, validate_expert_ids=False, **kw)
    return group, a2a


class Micro(_Micro):
    def check(self, what):
        bad = self.mismatches()
        assert not bad, f"{what}: {bad[:4]}"


def _busy(group, iters, blocks_per_sm=4):
    """Per rank: issue a compute kernel that fills the GPU (every SM, 4 blocks of 256) on its stream."""
    from ep_a2a.driver.memory import DeviceAllocation
    from ep_a2a.driver.module import load
    from ep_a2a.driver.launch import launch_once
    import ctypes
    dev = group.ranks[0].device
    sink = DeviceAllocation(dev, 4)
    fn = load("util", dev).function("ep_busy")

    def issue(s):
        r = group.ranks[s]
        launch_once(r.device, fn, [ctypes.c_uint64(sink.ptr), ctypes.c_uint32(iters)],
                    blocks_per_sm * r.device.sm_count, 256, r.stream.handle)
    return sink, issue


@pytest.mark.parametrize("protocol,quant", [("fence", None), ("sentinel", None), ("fence", "fp8"), ("auto", None)])
def test_two_micro_batches_in_random_interleavings_match_the_reference(protocol, quant):
    rng, seed = fresh_rng()
    rnd = random.Random(int(rng.integers(1 << 30)))
    kw = {"crossover_tokens": 4} if protocol == "auto" else {}
    group, a = _make(protocol, quant, **kw)
    _, b = _make(protocol, quant, group=group, **kw)
    sink, busy = _busy(group, 2000)
    with group, a, b:
        for it in range(12):
            m = {"A": Micro(a, rng, int(rng.choice([1, 4, 8, TMAX]))), "B": Micro(b, rng, int(rng.choice([1, 4, 16])))}
            fixed = {0: BOTH_SENDS_FIRST, 1: TBO}.get(it)
            order = fixed or _interleaving(rnd)  # one order on every rank (different ones can deadlock: docs/overlap.md)
            compute = it % 3 != 0  # compute that fills the GPU after every half
            for s in rnd.sample(range(EP), EP):  # ranks issued in a random order
                for name, op in order:
                    m[name].half(op, s)
                    if compute:
                        busy(s)
            a.synchronize()
            for name in "AB":
                m[name].check(f"{seed} iteration {it} ({protocol}, fp8={bool(quant)}) micro-batch {name}, "
                              f"order {order}")
        sink.close()


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_graphs_of_each_half_replay_in_shuffled_legal_orders(protocol):
    from ep_a2a.driver.stream import Graph
    from ep_a2a.interop.arrays import copy_from_numpy
    rng, seed = fresh_rng()
    rnd = random.Random(int(rng.integers(1 << 30)))
    group, a = _make(protocol)
    _, b = _make(protocol, group=group)
    with group, a, b:
        plans = {(name, tmax): Micro(x, rng, tmax) for name, x in (("A", a), ("B", b)) for tmax in (2, 16)}
        for m in plans.values():  # one eager step each first (views, plans)
            for op in OPS:
                for s in range(EP):
                    m.half(op, s)
        a.synchronize()
        graphs = {}
        for key, m in plans.items():
            for op in OPS:
                for s in range(EP):
                    st = group.ranks[s].stream.handle
                    Graph.begin(st)
                    m.half(op, s)
                    graphs[key, op, s] = Graph.end(st)
        for rep in range(6):
            ka, kb = ("A", int(rnd.choice([2, 16]))), ("B", int(rnd.choice([2, 16])))
            for k in (ka, kb):
                for o in plans[k].outs:
                    copy_from_numpy(o, np.full(o.nbytes, 0xFF, np.uint8))
            order = _interleaving(rnd)
            for s in rnd.sample(range(EP), EP):
                for name, op in order:
                    graphs[ka if name == "A" else kb, op, s].launch(group.ranks[s].stream.handle)
            a.synchronize()
            plans[ka].check(f"{seed} replay {rep} {ka}")
            plans[kb].check(f"{seed} replay {rep} {kb}")
        for g in graphs.values():
            g.close()


def _arrived_or_empty(micro, views, silent, sentinel):
    """What docs/reliability.md promises after an abort, per receiving rank: the silent
    sender's region reads -1 in every slot (never an earlier step's ids); a slot of another
    region holds -1 or the ids of a token that did arrive in this step (its reference slot)."""
    from ep_a2a.interop.arrays import to_numpy
    from ep_a2a.testing import reference as ref
    a2a = micro.a2a
    want_ids = [ref.sentinel_ids(x) for x in micro.ids_h] if sentinel else micro.ids_h
    received, _ = ref.dispatch(want_ids, micro.pay_h, a2a.ep_size, a2a.num_experts, micro.tmax)
    bad = []
    for t, (ids_v, _) in views.items():
        got = to_numpy(ids_v)
        for s in range(a2a.ep_size):
            if s == silent:
                if (got[s] != -1).any():
                    bad.append(f"rank {t}: the silent rank's region holds expert ids")
                continue
            n, tok = int(received[t]["counts"][s]), np.asarray(received[t]["tokens"][s], np.int64)
            slots = tok if sentinel else np.arange(n)
            want = {tuple(row) for row in received[t]["expert_ids"][s, :n]}
            for j in range(micro.tmax):
                row = tuple(got[s, j])
                if all(x == -1 for x in row):
                    continue
                if sentinel:  # slot j holds token j
                    ok = j in slots and row == tuple(received[t]["expert_ids"][s, list(slots).index(j)])
                else:
                    ok = row in want
                if not ok:
                    bad.append(f"rank {t} region {s} slot {j}: ids {row} are not this step's")
    return bad


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_a_peer_that_never_sends_ends_the_receive_halves_with_a_timeout(protocol):
    """After a whole step, rank 3 never issues its next send half: every other rank's receive
    half gives up after the timeout (abort mode), error() names it, no rank reads rank 3's
    region of the earlier step, and the all-to-all is refused from then on."""
    import ep_a2a
    rng, seed = fresh_rng()
    group, a = _make(protocol, timeout_s=0.5, first_timeout_s=0.5, on_timeout="abort")
    with group, a:
        first = Micro(a, rng, 4, tokens=[4] * EP)  # every region filled: stale ids a failure must not expose
        for op in OPS:
            for s in range(EP):
                first.half(op, s)
        a.synchronize()
        first.check(f"{seed}: the step before the failure")
        m = Micro(a, rng, 4)
        for s in range(EP):
            if s != 3:
                m.half("dispatch_send", s)
                m.half("dispatch_recv", s)
        group.ranks[0].device.synchronize()
        err = a.error()
        assert isinstance(err, (ep_a2a.PeerTimeoutError, ep_a2a.PeerAbortedError)), (seed, err)
        bad = _arrived_or_empty(m, m.views, 3, a.protocol_for(4) == "sentinel")
        assert not bad, (seed, bad[:4])
        with pytest.raises((ep_a2a.PeerError, ep_a2a.StateError)):
            a.ranks[0].combine_send(m.staged[0], 4)  # (the all-to-all is refused after an abort)


def test_misuse_raises_before_any_launch_on_the_gpu_too():
    from ep_a2a.errors import HalvesOrderError
    rng, _ = fresh_rng()
    group, a = _make("fence")
    with group, a:
        m = Micro(a, rng, 4)
        r = a.ranks[0]
        with pytest.raises(HalvesOrderError):
            r.dispatch_recv()
        with pytest.raises(HalvesOrderError):
            r.combine_send(m.staged[0], 4)
        for op in OPS:
            for s in range(EP):
                m.half(op, s)
        with pytest.raises(HalvesOrderError):
            r.combine_recv()
        a.synchronize()
        m.check("after refused calls")
        # refused while capturing too, before anything enters the graph
        from ep_a2a.driver.stream import Graph
        st = group.ranks[0].stream.handle
        Graph.begin(st)
        try:
            with pytest.raises(HalvesOrderError):
                r.dispatch_recv()
        finally:
            Graph.end(st).close()


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_a_runtime_max_mismatch_is_detected_by_the_receive_halves(protocol):
    """Rank 0 sends with T^ = 4 while its peers send with 8: the receive halves record the
    mismatch (abort mode: they go on, outputs poisoned) and error() says so."""
    import ep_a2a
    rng, seed = fresh_rng()
    group, a = _make(protocol, timeout_s=2.0, first_timeout_s=2.0, on_timeout="abort")
    with group, a:
        small, large = Micro(a, rng, 4), Micro(a, rng, 8)
        for op in ("dispatch_send", "dispatch_recv"):
            for s in range(EP):
                (small if s == 0 else large).half(op, s)
        group.ranks[0].device.synchronize()  # (a.synchronize() would raise the record)
        errors = [r.recorded_error() for r in a.ranks]
        assert any(isinstance(e, ep_a2a.RuntimeMaxMismatchError) for e in errors), (seed, errors)
