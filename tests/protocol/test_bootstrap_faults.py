"""Fault injection over real processes: one rank of three is stopped (SIGKILL, SIGINT, SIGTERM)
before each message of the rendezvous and the collectives in turn. Whatever the point, every
process ends, no socket file is left, neither the stopped rank (when it lives on) nor any
other leaks an fd, and every other rank either completed or raised a BootstrapError within
its timeout."""
import multiprocessing as mp
import os
import signal
import time
import uuid

import numpy as np
import pytest

WORLD, TIMEOUT = 3, 2.0
GRACE = 1.0 + 2.0  # the peers' grace over rank 0, plus a loaded machine's slack


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def count_messages(plan):
    """Count every message sent or received and every connection rank 0 takes or reads a hello
    from; with plan = (n, signal), raise that signal in this process just before event n."""
    from ep_a2a import bootstrap_admission as adm
    from ep_a2a import bootstrap_wire as wire

    events = [0]

    def counted(fn):
        def call(*a, **k):
            events[0] += 1
            if plan is not None and events[0] == plan[0] + 1:
                os.kill(os.getpid(), plan[1])
                time.sleep(0.05)  # (SIGINT and SIGTERM raise here, at the next bytecode)
            return fn(*a, **k)
        return call
    wire.send, wire.recv = counted(wire.send), counted(wire.recv)
    adm.RootAdmission._accept = counted(adm.RootAdmission._accept)
    adm.RootAdmission._read_hello = counted(adm.RootAdmission._read_hello)
    return events


def _member(rank, name, base_dir, token, plan, q):
    from ep_a2a.bootstrap import BootstrapError, UnixSocketBootstrap

    events = count_messages(plan)
    memfd = os.memfd_create("part")
    os.write(memfd, b"rank%d" % rank)
    before, t0, b = _open_fds(), time.monotonic(), None
    try:
        b = UnixSocketBootstrap(rank, WORLD, name=name, base_dir=base_dir, timeout=TIMEOUT, job_token=token)
        assert b.allgather(b"%d" % rank) == [b"%d" % r for r in range(WORLD)]
        got = b.allgather_fds([memfd])
        assert [os.pread(f, 8, 0) for [f] in got] == [b"rank%d" % r for r in range(WORLD)]
        for [f] in got:
            os.close(f)
        b.barrier()
        b.close()
        outcome, msg = "ok", ""
    except (BootstrapError, KeyboardInterrupt, SystemExit) as e:  # no close(): the bootstrap must have closed itself
        outcome, msg = type(e).__name__, str(e)
    elapsed = time.monotonic() - t0
    q.put((rank, outcome, msg, elapsed, _open_fds() - before, events[0]))


def _run(tmp_path, plans):
    """Three ranks, rank r stopped as plans[r] says; {rank: report}, after checking that every
    process ended and no socket file remains."""
    ctx = mp.get_context("forkserver")
    name, token, q = "f" + uuid.uuid4().hex[:12], uuid.uuid4().hex, ctx.Queue()
    ps = [ctx.Process(target=_member, args=(r, name, str(tmp_path), token, plans.get(r), q)) for r in range(WORLD)]
    for p in ps:
        p.start()
    return reap(ps, q, TIMEOUT + GRACE + 20, plans, tmp_path)


def reap(ps, q, wait_s, plans, tmp_path):
    """Join the rank processes `ps` (killing those alive after `wait_s`), then {rank: report}
    from `q`, after checking that every process ended by itself and no socket file remains."""
    deadline = time.monotonic() + wait_s
    for p in ps:
        p.join(max(0.1, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(ps) if p.is_alive()]
    for p in ps:
        if p.is_alive():
            p.kill()
            p.join()
    out = {}
    while not q.empty() or len(out) < sum(p.exitcode == 0 for p in ps):
        r, *rest = q.get(timeout=5)
        out[r] = rest
    assert not alive, f"ranks {alive} still running after {wait_s:g} s (plans {plans}, reports {out})"
    left = os.listdir(tmp_path / f"ep_a2a-{os.getuid()}")
    assert not left, f"socket files left behind: {left} (plans {plans}, reports {out})"
    return out


@pytest.fixture(scope="module")
def events_per_rank(tmp_path_factory):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["ep_a2a.bootstrap"])
    out = _run(tmp_path_factory.mktemp("calibrate"), {})
    assert all(o[0] == "ok" and o[3] == 0 for o in out.values()), out
    return {r: o[4] for r, o in out.items()}


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["KILL", "INT", "TERM"])
def test_a_rank_stopped_before_any_message(tmp_path, events_per_rank, victim, sig):
    n = events_per_rank[victim]
    # every boundary for rank 0 (the hub) under SIGKILL; for the rest a fresh random half of them
    rng = np.random.default_rng()
    points = range(n) if (victim, sig) == (0, signal.SIGKILL) else sorted(rng.choice(n, (n + 1) // 2, replace=False))
    for k in points:
        out = _run(tmp_path, {victim: (int(k), sig)})
        where = f"rank {victim} stopped by {signal.Signals(sig).name} before event {k} of {n}: {out}"
        if sig != signal.SIGKILL:
            outcome, msg, _, fd_delta, _ = out[victim]
            assert outcome == {signal.SIGINT: "KeyboardInterrupt", signal.SIGTERM: "SystemExit"}[sig], where
            assert fd_delta == 0, where
        for r, (outcome, msg, elapsed, fd_delta, _) in out.items():
            if r == victim:
                continue
            assert outcome in ("ok", "BootstrapError", "BootstrapTimeout"), where
            assert fd_delta == 0, where
            assert elapsed < TIMEOUT + GRACE, where
        assert any(o[0] != "ok" for r, o in out.items() if r != victim) or k >= n - 3, where
