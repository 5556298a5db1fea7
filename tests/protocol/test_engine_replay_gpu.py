"""What an engine does for weeks, on one GPU with in-process ranks: graphs captured in one
order and replayed in another (the cross-step decisions live on the device), the 32-bit step
counter wrapping, error records read while kernels still write them, and hostile expert ids
with the host check off."""
import ctypes
import time

import numpy as np
import pytest

from common import run_processes

pytestmark = pytest.mark.gpu

H, K = 256, 2


def _make(ep, **kw):
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("first_timeout_s", 5.0)
    kw.setdefault("on_timeout", "abort")
    group = ep_a2a.LocalGroup([0] * ep)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=16, top_k=K, num_experts=2 * ep,
                             payloads=payload_formats(H, K)["bf16"], combine_hidden_size=H,
                             validate_expert_ids=False, **kw)
    return group, a2a


class Step:
    """One rank's inputs and output buffer for an identity 'MoE' step (the received hidden
    states copied into the combine input): every token has one target rank, so its combined
    output equals its hidden state bitwise."""

    def __init__(self, a2a, s, targets, rng, tmax):
        from ep_a2a.interop.arrays import copy_from_numpy, empty, from_numpy
        from ep_a2a.testing.formats import random_payload
        r = a2a.ranks[s]
        self.rank, self.tmax = r, tmax
        T = len(targets)
        ids = np.full((T, K), -1, np.int32)
        ids[:, 0] = [2 * t + int(rng.integers(2)) for t in targets]  # rank t owns experts 2t, 2t+1
        self.x = [random_payload(rng, sp, T) for sp in a2a.payload_specs]
        self.ids = from_numpy(ids, r.device, "int32")
        self.pays = [from_numpy(x, r.device, sp.dtype) for x, sp in zip(self.x, a2a.payload_specs)]
        self.out = empty((T, H), "bfloat16", r.device)
        copy_from_numpy(self.out, np.full(self.out.nbytes, 0xFF, np.uint8))  # poison (NaN)

    def dispatch(self):
        self.views = self.rank.dispatch(self.ids, self.pays, self.tmax)

    def moe(self):
        from cuda.bindings import driver as d
        hidden = self.views[1][0]
        d.cuMemcpyDtoDAsync(self.rank.combine_input(self.tmax).ptr, hidden.ptr, hidden.nbytes, self.rank.default_stream)

    def combine(self):
        self.rank.combine(self.rank.combine_input(self.tmax), self.tmax, out=self.out)

    def check(self, what):
        from ep_a2a.interop.arrays import to_numpy
        got = to_numpy(self.out).view(np.uint16)
        bad = np.flatnonzero((got != self.x[0].view(np.uint16)).any(axis=1))
        assert not len(bad), f"{what}: rank {self.rank.rank}, {len(bad)} of {len(got)} rows wrong (first {bad[:5]})"


def _capture(step):
    """A graph of one rank's whole step on its own stream (as each process of an engine does)."""
    from ep_a2a.driver.stream import Graph
    s = step.rank.default_stream
    Graph.begin(s)
    step.dispatch(); step.moe(); step.combine()
    return Graph.end(s)


def test_fence_graph_replayed_after_a_sentinel_step_waits_for_its_readers():
    """A FENCE step captured after a FENCE step, replayed right after a SENTINEL step in
    which rank 1 is still reading its dispatch workspace (its stream held by the host): the
    replayed FENCE dispatch of rank 0 must not overwrite what rank 1 is still to copy. The
    host decided that wait at capture, from the previous call, and skipped it here; the
    device decides it now. Rank 0's 16 FENCE tokens (T^=16) cover the bytes that hold rank 2's
    SENTINEL tokens (T^=4, region 2) on rank 1."""
    from cuda.bindings import driver as d
    from ep_a2a.driver.vmm import HostMapped
    rng = np.random.default_rng()
    group, a2a = _make(3, protocol="auto", crossover_tokens=4)
    with group, a2a:
        warm = [Step(a2a, s, [1] * 16 if s == 0 else [2, 0, 1], rng, 16) for s in range(3)]
        for f in (Step.dispatch, Step.moe, Step.combine):
            for st in warm:
                f(st)
        a2a.synchronize()
        graphs = [_capture(st) for st in warm]  # after a FENCE step: the host saw no reason to wait
        sent = [Step(a2a, 0, [0] * 4, rng, 4), Step(a2a, 1, [1] * 4, rng, 4), Step(a2a, 2, [1] * 4, rng, 4)]
        hold = HostMapped(4, group.ranks[1].device)
        try:
            for st in sent:
                st.dispatch()
            h1 = group.ranks[1].stream.handle
            (err,) = d.cuStreamWaitValue32(h1, hold.device_ptr, 1, d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
            assert err == d.CUresult.CUDA_SUCCESS, err
            for f in (Step.moe, Step.combine):
                for st in sent:
                    f(st)
            for st, g in zip(warm, graphs):
                g.launch(st.rank.default_stream)
            time.sleep(0.3)  # rank 0's SENTINEL step is done: its FENCE dispatch would push now
            ctypes.c_uint32.from_address(hold.host_ptr).value = 1  # let rank 1 go on
            a2a.synchronize()
        finally:
            hold.close()
        for st in sent:
            st.check("SENTINEL step before the replayed FENCE graph")
        for st in warm:
            st.check("replayed FENCE graph")
        for g in graphs:
            g.close()


def test_graphs_of_both_protocols_replayed_in_shuffled_orders():
    """One graph per T^ (SENTINEL at 2 and 4, FENCE at 8 and 16), captured in one order and
    replayed in random orders, every output checked after each replay."""
    from ep_a2a.interop.arrays import copy_from_numpy
    rng = np.random.default_rng()
    ep = 4
    group, a2a = _make(ep, protocol="auto", crossover_tokens=4)
    with group, a2a:
        plans = {}
        for tmax in (2, 4, 8, 16):
            plans[tmax] = [Step(a2a, s, list(rng.integers(0, ep, int(rng.integers(0, tmax + 1)))), rng, tmax)
                           for s in range(ep)]
        for tmax in (16, 2, 8, 4, 16):  # eager steps of both kinds first
            for f in (Step.dispatch, Step.moe, Step.combine):
                for st in plans[tmax]:
                    f(st)
        a2a.synchronize()
        graphs = {tmax: [_capture(st) for st in steps] for tmax, steps in plans.items()}
        order = [t for t in (2, 4, 8, 16) for _ in range(6)]
        rng.shuffle(order)
        for tmax in order:
            for st in plans[tmax]:
                copy_from_numpy(st.out, np.full(st.out.nbytes, 0xFF, np.uint8))
            for st, g in zip(plans[tmax], graphs[tmax]):
                g.launch(st.rank.default_stream)
            a2a.synchronize()
            for st in plans[tmax]:
                st.check(f"graph T^={tmax} in order {order}")
        for gs in graphs.values():
            for g in gs:
                g.close()


def _set_epochs(a2a, e):
    """Put every rank's step counter, and the flags its peers left it, at step e (what a job
    that has run e steps holds), so that the next steps cross the 32-bit wrap."""
    from ep_a2a.interop.arrays import copy_from_numpy
    from ep_a2a.interop.tensor import Tensor
    L, ep = a2a.layout, a2a.ep_size
    a2a.synchronize()
    for r in a2a.ranks:
        def put(off, arr):
            copy_from_numpy(Tensor(r.base + off, arr.shape, str(arr.dtype), device=(2, r.device.ordinal)), arr)
        put(L.off_epoch, np.array([e], np.uint32))
        put(L.off_dispatch_flags, np.full(2 * ep, e << 32, np.uint64))  # both words of every flag at step e
        put(L.off_combine_flags, np.full(ep, e, np.uint32))
    a2a.synchronize()


@pytest.mark.parametrize("protocol", ["fence", "sentinel", "auto"])
def test_steps_across_the_32_bit_step_wrap(protocol):
    from ep_a2a.testing.harness import run_step
    rng = np.random.default_rng()
    group, a2a = _make(4, protocol=protocol, crossover_tokens=4)
    with group, a2a:
        _set_epochs(a2a, 2 ** 32 - 5)
        for step in range(10):  # steps 2^32-4 .. 5
            tmax = (3, 16, 4, 9)[step % 4]
            rep = run_step(a2a, rng, list(rng.integers(0, tmax + 1, 4)), tmax)
            assert not rep.mismatches, (step, rep.mismatches[:3])
        a2a.check_errors()
        from ep_a2a.interop.arrays import to_numpy
        from ep_a2a.interop.tensor import Tensor
        r = a2a.ranks[0]
        epoch = to_numpy(Tensor(r.base + a2a.layout.off_epoch, (1,), "uint32", device=(2, r.device.ordinal)))
        assert int(epoch[0]) == 5, f"the step counter went from 2^32-5 through 10 steps to {int(epoch[0])}"


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_an_id_equal_to_the_slot_sentinel_is_an_invalid_id(protocol):
    """With the host check off, an input id equal to SENTINEL's id-slot sentinel (0x88888888,
    negative as int32) is dropped like any invalid id, on both protocols, and the step ends
    (it used to read as 'not arrived' and stall the receiver until the timeout)."""
    from ep_a2a.layout import SENTINEL_IDS
    from ep_a2a.testing.harness import run_step
    bad = np.int32(np.uint32(SENTINEL_IDS).view(np.int32))

    def hostile(ids):
        ids = ids.copy()
        ids[::2, -1] = bad
        return ids
    group, a2a = _make(4, protocol=protocol, timeout_s=2.0, first_timeout_s=2.0)
    with group, a2a:
        for _ in range(3):
            rep = run_step(a2a, np.random.default_rng(), [5, 8, 0, 3], 8, id_fn=hostile)
            assert not rep.mismatches, rep.mismatches[:3]
        assert a2a.error() is None


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_an_error_record_read_while_kernels_run_is_complete(protocol):
    """The host polls the error record while the kernels that fail are running: whenever it
    reads a kind, the fields that go with it are there (the kind is published last). Ranks
    pass different T^: every rank records RuntimeMaxMismatchError, never one with zero fields."""
    import ep_a2a
    from ep_a2a.interop.arrays import from_numpy
    for _ in range(5):
        group, a2a = _make(2, protocol=protocol)
        with group, a2a:
            ids = [from_numpy(np.array([[0, 3]], np.int32), r.device) for r in group.ranks]
            x = [[from_numpy(np.ones((1, H), np.uint16), r.device, "bfloat16"),
                  from_numpy(np.ones((1, K), np.float32), r.device)] for r in group.ranks]
            seen = []
            a2a.ranks[0].dispatch(ids[0], x[0], 4)
            a2a.ranks[1].dispatch(ids[1], x[1], 8)
            end = time.monotonic() + 10
            while len(seen) < 2 and time.monotonic() < end:
                for r in a2a.ranks:
                    e = r.recorded_error()
                    if e is not None and r.rank not in [s for s, _ in seen]:
                        seen.append((r.rank, e))
            assert len(seen) == 2, f"only {seen} recorded an error"
            for rank, e in seen:
                # (a rank may stop on its peer's abort before it reads the tag: PeerAbortedError)
                assert isinstance(e, (ep_a2a.RuntimeMaxMismatchError, ep_a2a.PeerAbortedError)) \
                    and e.rank == rank and e.peer == 1 - rank, f"rank {rank}: torn record read as {e!r}: {e}"
            with pytest.raises(ep_a2a.PeerError):
                a2a.synchronize()


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_an_aborted_step_under_graph_replay_poisons_its_outputs(protocol):
    """An engine replays per-rank graphs and makes no Python call that could raise. One
    replay runs without rank 2 (a stalled process): ranks 0 and 1 give up after their
    timeout, and their outputs say so instead of holding stale data: every combined byte
    0xFF (NaN), and -1 for every id of the missing rank's region (other regions hold tokens
    that did arrive in this step, or -1); error() reports it without raising. Every later replay,
    rank 2's too, ends at once and only poisons."""
    import ep_a2a
    from ep_a2a.interop.arrays import copy_from_numpy, to_numpy
    rng = np.random.default_rng()
    group, a2a = _make(3, protocol=protocol, timeout_s=0.5, first_timeout_s=0.5)
    with group, a2a:
        steps = [Step(a2a, s, list(rng.integers(0, 3, 6)), rng, 8) for s in range(3)]
        graphs = [_capture(st) for st in steps]
        sync = [r.stream.synchronize for r in group.ranks]

        def replay(ranks):
            for st in steps:
                copy_from_numpy(st.out, np.full(st.out.nbytes, 0x11, np.uint8))
            for s in ranks:
                graphs[s].launch(steps[s].rank.default_stream)
            t0 = time.monotonic()
            for s in ranks:
                sync[s]()
            return time.monotonic() - t0

        for _ in range(3):
            replay([0, 1, 2])
            for st in steps:
                st.check("healthy replay")
        assert a2a.error() is None
        replay([0, 1])
        err = a2a.error()
        assert isinstance(err, ep_a2a.PeerError), f"error() after the aborted replay: {err!r}"
        for st in steps[:2]:
            got = to_numpy(st.out).view(np.uint8)
            assert (got == 0xFF).all(), f"rank {st.rank.rank}: the aborted step's output is not all poison"
            ids = to_numpy(st.rank.dispatch_views(8)[0])[2]
            assert (ids == -1).all(), f"rank {st.rank.rank}: the missing rank's region kept expert ids " \
                f"{ids.tolist()} (records: {[r.recorded_error() for r in a2a.ranks]})"
        for _ in range(2):
            took = replay([0, 1, 2])
            assert took < 0.4, f"a replay after the abort took {took:.2f} s (it must not wait out a timeout)"
            for st in steps:
                assert (to_numpy(st.out).view(np.uint8) == 0xFF).all(), f"rank {st.rank.rank}: not poisoned"
        with pytest.raises(ep_a2a.PeerError):
            a2a.check_errors()
        for g in graphs:
            g.close()


def _replay_child(rank, name, base_dir, seed, q):
    """One rank of a two-process job: graphs per T^ of both protocols, captured in one order
    and replayed in a shuffled one (the same in both processes: T^ is every rank's)."""
    try:
        import ep_a2a
        from ep_a2a.bootstrap import UnixSocketBootstrap
        from ep_a2a.testing.formats import payload_formats
        bs = UnixSocketBootstrap(rank, 2, name=name, base_dir=base_dir, timeout=60)
        g = ep_a2a.ProcessGroup(bs, 0)
        a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=16, top_k=K, num_experts=4, payloads=payload_formats(H, K)["bf16"],
                               combine_hidden_size=H, validate_expert_ids=False, protocol="auto", crossover_tokens=4,
                               timeout_s=30.0, first_timeout_s=60.0)
        rng = np.random.default_rng([seed, rank])  # this rank's own inputs
        plans = {t: Step(a, 0, list(rng.integers(0, 2, int(rng.integers(1, t + 1)))), rng, t) for t in (2, 4, 8, 16)}
        for t in (16, 2, 8, 4):  # eager steps of both protocols first
            plans[t].dispatch(); plans[t].moe(); plans[t].combine()
        a.synchronize()
        graphs = {t: _capture(st) for t, st in plans.items()}
        order = [t for t in (2, 4, 8, 16) for _ in range(4)]
        np.random.default_rng(seed).shuffle(order)
        bad = []
        from ep_a2a.interop.arrays import copy_from_numpy
        for t in order:
            st = plans[t]
            copy_from_numpy(st.out, np.full(st.out.nbytes, 0xFF, np.uint8))
            graphs[t].launch(st.rank.default_stream)
            a.synchronize()
            try:
                st.check(f"process rank {rank}, graph T^={t} in order {order}")
            except AssertionError as e:
                bad.append(str(e))
        for gr in graphs.values():
            gr.close()
        a.close()
        g.close()
        q.put((rank, bad, None))
    except BaseException as e:  # report, never hang the parent
        q.put((rank, None, repr(e)))


def test_graphs_replayed_in_shuffled_orders_by_two_processes(tmp_path):
    """The same as the in-process shuffled replay, with each rank a process of its own on
    the one GPU (time-sliced), capturing its own graphs as an engine's processes do."""
    import os
    os.chmod(tmp_path, 0o700)
    seed = int(np.random.default_rng().integers(2 ** 31))
    got, _ = run_processes(_replay_child, lambda r: (r, f"g{os.getpid()}", str(tmp_path), seed), 2, 240)
    for rank, bad, exc in sorted(got):
        assert exc is None, f"rank {rank} (seed {seed}): {exc}"
        assert not bad, f"rank {rank} (seed {seed}): {bad[:3]}"


def _rejecting_child(rank, name, base_dir, protocol, q):
    """Rank 1 of two processes gets expert ids out of range at step 3 and rejects them after
    rank 0 has launched that step: rank 1 raises at once; rank 0 finishes the step well inside
    its timeout without a trap, its tokens routed to rank 1 combine to NaN, the others are
    exact, and it raises PeerRejectedError at its next call; rank 1 refuses every later call.
    Rank 0 queues one more step before it synchronizes (an engine's host runs ahead): that
    step must end at once too, not wait out the timeout for a rank that never launches."""
    try:
        import ep_a2a
        from ep_a2a.bootstrap import UnixSocketBootstrap
        from ep_a2a.interop.arrays import from_numpy, to_numpy
        from ep_a2a.testing.formats import payload_formats
        bs = UnixSocketBootstrap(rank, 2, name=name, base_dir=base_dir, timeout=60)
        g = ep_a2a.ProcessGroup(bs, 0)
        a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=16, top_k=K, num_experts=4, payloads=payload_formats(H, K)["bf16"],
                               combine_hidden_size=H, protocol=protocol, timeout_s=30.0, first_timeout_s=30.0)
        rng = np.random.default_rng([rank, 5])
        report = {}
        for _ in range(2):  # healthy steps
            st = Step(a, 0, list(rng.integers(0, 2, 8)), rng, 8)
            st.dispatch(); st.moe(); st.combine()
            a.synchronize()
            st.check("healthy step")
        targets = [0, 1] * 4
        st = Step(a, 0, targets, rng, 8)
        extra = Step(a, 0, targets, rng, 8)  # (made before the launches: its uploads synchronize)
        t0 = time.monotonic()
        if rank == 1:
            st.ids = from_numpy(np.full((8, K), 99, np.int32), st.rank.device, "int32")  # out of range
            try:
                st.dispatch()
                report["raised"] = None
            except ValueError as e:
                report["raised"] = str(e)
            try:
                st.dispatch()
            except ep_a2a.StateError as e:
                report["later"] = str(e)
        else:
            st.dispatch(); st.moe(); st.combine()
            try:  # the record may not be written yet: then this step launches and must end at once
                extra.dispatch(); extra.moe(); extra.combine()
                report["queued"] = "launched"
            except ep_a2a.PeerRejectedError:
                report["queued"] = "refused"
            try:
                a.synchronize()
                report["peer_error"] = None
            except ep_a2a.PeerRejectedError as e:
                report["peer_error"] = (e.peer, str(e))
            report["waited"] = time.monotonic() - t0
            y = to_numpy(st.out).view(np.uint16)
            x = st.x[0].view(np.uint16)
            to1 = np.array(targets) == 1
            as_float = y.astype(np.uint32) << 16
            report["nan_rows"] = bool(np.isnan(as_float.view(np.float32)[to1]).all())
            nan = np.isnan(as_float.view(np.float32)).all(axis=1)
            # the others: exact, or NaN when a wait gave up on the rejecting rank (never garbage)
            report["exact_rows"] = bool(all(np.array_equal(y[i], x[i]) or nan[i] for i in np.flatnonzero(~to1)))
            try:
                st.dispatch()
                report["next"] = None
            except ep_a2a.PeerRejectedError as e:
                report["next"] = type(e).__name__
        bs.barrier()
        a.close()
        g.close()
        q.put((rank, report, None))
    except BaseException:  # report, never hang the parent
        import traceback
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_a_rank_that_rejects_its_input_tells_its_peers(protocol, tmp_path):
    import os
    os.chmod(tmp_path, 0o700)
    msgs, procs = run_processes(_rejecting_child, lambda r: (r, f"j{os.getpid()}{protocol[0]}", str(tmp_path), protocol),
                            2, 200)
    got = dict((rank, (rep, exc)) for rank, rep, exc in msgs)
    for rank, (rep, exc) in got.items():
        assert exc is None, f"rank {rank}: {exc}"
    r0, r1 = got[0][0], got[1][0]
    assert r1["raised"] and "token_selected_experts" in r1["raised"], r1
    assert "rejected its input" in r1["later"], r1
    assert r0["peer_error"] and r0["peer_error"][0] == 1, r0
    assert r0["waited"] < 10.0, f"rank 0 took {r0['waited']:.1f} s to finish the rejected step (timeout 30 s)"
    assert r0["nan_rows"] and r0["exact_rows"], r0
    assert r0["next"] == "PeerRejectedError", r0
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
