"""Peer failure without losing the CUDA context (on_timeout="abort"), and going on without a
failed rank (set_active_ranks), with in-process ranks and with real processes on one GPU."""
import os
import signal
import time

import numpy as np
import pytest

from common import run_processes

from test_fence_gpu import run

pytestmark = pytest.mark.gpu

TIMEOUT_S = 0.5


def _make(group, protocol, **kw):
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    kw.setdefault("on_timeout", "abort")
    return ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=16, top_k=4, num_experts=4 * group.ep_size,
                              payloads=payload_formats(96, 4)["mxfp8"], combine_hidden_size=96, protocol=protocol,
                              timeout_s=TIMEOUT_S, first_timeout_s=TIMEOUT_S, **kw)


def _inputs(a2a, rank, T, rng, experts=None):
    from ep_a2a.testing.formats import random_payload
    from ep_a2a.interop.arrays import from_numpy
    dev = next(r.device for r in a2a.ranks if r.rank == rank)
    ids = experts if experts is not None else rng.integers(0, a2a.num_experts, (T, a2a.top_k)).astype(np.int32)
    pays = [from_numpy(random_payload(rng, sp, T), dev, sp.dtype) for sp in a2a.payload_specs]
    return from_numpy(ids, dev, "int32"), pays


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_abort_mode_stops_every_rank_and_the_context_survives(protocol):
    import ep_a2a
    rng = np.random.default_rng()
    with ep_a2a.LocalGroup([0, 0, 0]) as g:
        a = _make(g, protocol)
        run(a, rng, [3, 5, 2], 8)                      # a healthy step first
        ins = [_inputs(a, s, 4, rng) for s in range(3)]
        t0 = time.monotonic()
        a.ranks[0].dispatch(*ins[0], 4)
        a.ranks[1].dispatch(*ins[1], 4)                # rank 2 never arrives
        errs = []
        for r in a.ranks[:2]:
            with pytest.raises(ep_a2a.PeerError) as ei:
                r.synchronize()
            errs.append(ei.value)
        elapsed = time.monotonic() - t0
        assert elapsed < 10 * TIMEOUT_S + 2, f"the waits took {elapsed:.1f} s to give up"
        timeouts = [e for e in errs if isinstance(e, ep_a2a.PeerTimeoutError)]
        assert timeouts, [str(e) for e in errs]
        want_phase = "dispatch" if protocol == "fence" else "sentinel-dispatch"
        for e in timeouts:
            assert (e.peer, e.phase, e.epoch) == (2, want_phase, 2), str(e)
        for e in errs:
            if not isinstance(e, ep_a2a.PeerTimeoutError):
                assert isinstance(e, ep_a2a.PeerAbortedError) and e.peer in (0, 1), str(e)
        # the object refuses every later call with the same error; closing is allowed
        with pytest.raises(ep_a2a.PeerError):
            a.ranks[0].combine(a.ranks[0].combine_input(4), 4)
        a.close()
        # the CUDA context is intact: a new all-to-all on the same group works
        with _make(g, protocol) as b:
            for T in (1, 7, 16):
                run(b, rng, [T, 16 - T, T // 2], 16)


def _killed_peer_child(rank, name, base_dir, protocol, q):
    """Rank 1 dispatches step 2 and is killed before its combine; rank 0 must fail within the
    timeout, close without hanging, and then run a fresh all-to-all in the same process."""
    try:
        import ep_a2a
        from ep_a2a.bootstrap import UnixSocketBootstrap
        from ep_a2a.testing.formats import payload_formats
        from ep_a2a.testing.harness import run_step
        rng = np.random.default_rng(7)  # same draws in both processes
        bs = UnixSocketBootstrap(rank, 2, name=name, base_dir=base_dir, timeout=60)
        g = ep_a2a.ProcessGroup(bs, 0)
        a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=16, top_k=4, num_experts=8,
                               payloads=payload_formats(96, 4)["bf16"], combine_hidden_size=96,
                               protocol=protocol, timeout_s=3.0, first_timeout_s=30.0, on_timeout="abort")
        bad = []
        for _ in range(4):  # past the steps that get first_timeout_s
            bad += run_step(a, rng, [4, 6], 8).mismatches
        # step 5: every token selects experts of both ranks
        ids = np.tile(np.array([[0, 4, 1, 5]], np.int32), (3, 1))
        x = _inputs(a, rank, 3, rng, ids)
        a.dispatch(*x, 8)
        if rank == 1:
            a.synchronize()
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        a.combine(a.combine_input(8), 8)
        try:
            a.synchronize()
            q.put((rank, "no error", bad, 0.0, None))
            return
        except ep_a2a.PeerError as e:
            err = (type(e).__name__, e.peer, e.phase)
        waited = time.monotonic() - t0
        a.close()
        try:
            bs.close()
        except Exception:
            pass
        # same process, same context: a one-rank all-to-all still runs and checks out
        with ep_a2a.LocalGroup([0]) as lg, _make(lg, protocol) as b:
            bad += run_step(b, rng, [9], 16).mismatches
        q.put((rank, err, bad, waited, None))
    except BaseException as e:  # report, never hang the parent
        q.put((rank, "exception", [], 0.0, repr(e)))


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_abort_mode_with_a_killed_peer_process(protocol, tmp_path):
    os.chmod(tmp_path, 0o700)
    name = f"k{os.getpid()}{protocol[0]}"
    got, procs = run_processes(_killed_peer_child, lambda r: (r, name, str(tmp_path), protocol), 2, 150, join=20,
                               messages=1)
    (rank, err, bad, waited, exc), = got
    assert exc is None, exc
    assert rank == 0 and procs[1].exitcode == -signal.SIGKILL
    phase = "combine" if protocol == "fence" else "sentinel-combine"
    assert err == ("PeerTimeoutError", 1, phase), err
    assert waited < 3.0 + 3.0, f"gave up after {waited:.1f} s (timeout 3 s)"
    assert not bad, bad[:3]
    assert procs[0].exitcode == 0


@pytest.mark.parametrize("protocol", ["fence", "sentinel", "auto"])
def test_active_ranks_go_on_without_a_failed_rank(protocol):
    import ep_a2a
    from ep_a2a.testing.reference import dropped_selections
    rng = np.random.default_rng()
    with ep_a2a.LocalGroup([0] * 4) as g, _make(g, protocol, on_timeout="trap", crossover_tokens=8) as a:
        run(a, rng, [5, 0, 9, 16], 16)
        a.set_active_ranks([0, 1, 3])                  # rank 2 failed: nobody waits on it again
        for step in range(6):
            T = int(rng.integers(1, 17))
            tokens = [int(rng.integers(0, T + 1)), T, 0, int(rng.integers(0, T + 1))]
            rep = run(a, rng, tokens, T, route="uniform" if step % 2 else "zipf", invalid_fraction=0.05)
            want = {s: dropped_selections([rep.expert_ids[s]], a.num_experts, 4, (0, 1, 3)) for s in (0, 1, 3)}
            if step == 0:
                total = {s: 0 for s in want}
            for s in want:
                total[s] += want[s]
            got = {r.rank: r.dropped_selections() for r in a.ranks if r.rank != 2}
            assert got == total, (got, total)
        assert sum(total.values()) > 0                  # the test did drop selections
        with pytest.raises(ep_a2a.StateError, match="not an active rank"):
            a.ranks[2].dispatch(*_inputs(a, 2, 1, rng), 1)
        with pytest.raises(ValueError, match="can only remove"):
            a.set_active_ranks([0, 1, 2, 3])
        with pytest.raises(ValueError, match="ranks"):
            a.set_active_ranks([])


def test_ranks_that_disagree_on_the_active_set_are_told():
    import ep_a2a
    rng = np.random.default_rng()
    with ep_a2a.LocalGroup([0] * 3) as g, _make(g, "fence") as a:
        run(a, rng, [2, 2, 2], 4)
        a.set_active_ranks([0, 1])
        a.ranks[1]._set_active((0, 1, 2))  # as if rank 1's process had not called set_active_ranks
        for s in (0, 1):
            a.ranks[s].dispatch(*_inputs(a, s, 2, rng), 4)
        errs = []
        for r in a.ranks[:2]:
            try:
                r.synchronize()
            except ep_a2a.PeerError as e:
                errs.append(e)
        assert any(isinstance(e, ep_a2a.ActiveRanksMismatchError) for e in errs), [str(e) for e in errs]
