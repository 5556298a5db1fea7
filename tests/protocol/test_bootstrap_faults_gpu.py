"""Fault injection into the construction of a two-process all-to-all on one GPU: one rank is
stopped (SIGKILL, SIGINT, SIGTERM) before a message of the rendezvous, the topology check,
the workspace's exchange or the constructor's barrier. Whatever the point, both processes
end, no socket file is left, and every rank that lives on (the stopped one too, after
SIGINT or SIGTERM) holds no VMM allocation or mapping, no workspace, no bootstrap and no fd
more than before, and the survivor raised an ep_a2a error within its timeout."""
import multiprocessing as mp
import os
import signal
import time
import uuid

import numpy as np
import pytest

from test_bootstrap_faults import count_messages, reap

TIMEOUT = 10.0
POINTS_PER_CASE = 8  # a fresh random draw of the message boundaries per (victim, signal)


def _member(rank, name, base_dir, token, plan, q):
    import ep_a2a
    from ep_a2a.bootstrap import UnixSocketBootstrap
    from ep_a2a.driver import lifetime
    from ep_a2a.driver.vmm import DeviceBuffer
    from ep_a2a.errors import EpA2AError
    from ep_a2a.testing.formats import payload_formats

    # the context and the driver's own device files first, so that only what construction holds is counted
    warm = DeviceBuffer(1 << 21, 0)
    os.close(warm.allocation.export_fd())
    warm.close()
    before_fds, before_live = len(os.listdir("/proc/self/fd")), lifetime.live_counts()
    events = count_messages(plan)
    t0, outcome, msg = time.monotonic(), "ok", ""
    try:
        with UnixSocketBootstrap(rank, 2, name=name, base_dir=base_dir, timeout=TIMEOUT, job_token=token) as bs:
            with ep_a2a.ProcessGroup(bs, 0) as g:
                a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=8, top_k=2, num_experts=4,
                                       payloads=payload_formats(64, 2)["bf16"], combine_hidden_size=64,
                                       protocol="fence", timeout_s=5.0, first_timeout_s=10.0)
                a.close()
    except (EpA2AError, KeyboardInterrupt, SystemExit) as e:
        outcome, msg = type(e).__name__, str(e)[:500]
    live = {k: v - before_live.get(k, 0) for k, v in lifetime.live_counts().items() if v != before_live.get(k, 0)}
    q.put((rank, outcome, msg, time.monotonic() - t0, len(os.listdir("/proc/self/fd")) - before_fds, live, events[0]))


def _run(tmp_path, plans):
    ctx = mp.get_context("forkserver")
    name, token, q = "g" + uuid.uuid4().hex[:12], uuid.uuid4().hex, ctx.Queue()
    ps = [ctx.Process(target=_member, args=(r, name, str(tmp_path), token, plans.get(r), q)) for r in range(2)]
    for p in ps:
        p.start()
    return reap(ps, q, TIMEOUT + 60, plans, tmp_path)


@pytest.fixture(scope="module")
def construction_events(tmp_path_factory):
    mp.get_context("forkserver").set_forkserver_preload(["ep_a2a"])  # (no CUDA call at import)
    out = _run(tmp_path_factory.mktemp("calibrate"), {})
    assert all(o[0] == "ok" and o[3] == 0 and not o[4] for o in out.values()), out
    return {r: o[5] for r, o in out.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["KILL", "INT", "TERM"])
def test_construction_stopped_at_a_message_leaks_no_mapping(tmp_path, construction_events, victim, sig):
    n = construction_events[victim]
    rng = np.random.default_rng()
    for k in sorted(rng.choice(n, min(n, POINTS_PER_CASE), replace=False)):
        out = _run(tmp_path, {victim: (int(k), sig)})
        where = f"rank {victim} stopped by {signal.Signals(sig).name} before event {k} of {n}: {out}"
        for r, (outcome, msg, elapsed, fd_delta, live, _) in out.items():
            assert not live, f"rank {r} still holds {live}; {where}"
            assert fd_delta == 0, f"rank {r} leaked {fd_delta} fds; {where}"
            if r == victim:
                assert outcome == {signal.SIGINT: "KeyboardInterrupt", signal.SIGTERM: "SystemExit"}[sig], where
            else:  # (stopped before its last message or two, the victim may have let the survivor finish)
                assert (outcome != "ok" or k >= n - 2) and elapsed < TIMEOUT + 5, where
        if sig == signal.SIGKILL:
            assert victim not in out, where
