"""A peer process that dies (SIGKILL, or os._exit without closing) in the default trap mode:
the surviving rank's call fails within the timeout with PeerTimeoutError naming the missing
peer and the phase, and nothing is left in the rendezvous directory.

(test_fence_gpu covers the in-process timeout, test_reliability_gpu on_timeout="abort" and
test_bootstrap the rendezvous itself; here the peer is a real process that really dies.)
Two ranks on one GPU, one process each, plus the test process as the conductor: each rank
reports over a pipe and waits for the conductor's word, so the death lands exactly between
two chosen calls. After a trap the survivor's CUDA context is gone, so it only reports.
"""
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

TIMEOUT_S, WARM_STEPS = 2.0, 4  # WARM_STEPS >= 4: the failing step runs under timeout_s, not first_timeout_s
SLACK_S = 4.0                   # the trap, the record read and the pipe, on a time-sliced GPU


def _rank_main(rank, name, base_dir, protocol, scenario, seed, conn):
    """Scenarios: 'kill_between_steps' (the peer dies before the next dispatch), 'kill_mid_step'
    and 'exit_mid_step' (it dies after dispatch, before combine), 'exit_then_collective' (it
    exits between steps and the survivor calls a collective: the bootstrap must say so)."""
    try:
        import ep_a2a
        from ep_a2a.bootstrap import BootstrapError, UnixSocketBootstrap
        from ep_a2a.testing.formats import payload_formats, random_payload
        from ep_a2a.testing.harness import run_step
        from ep_a2a.interop.arrays import copy_from_numpy, from_numpy
        from ep_a2a.testing.reference import from_float32
        bs = UnixSocketBootstrap(rank, 2, name=name, base_dir=base_dir, timeout=30)
        g = ep_a2a.ProcessGroup(bs, 0)
        kw = dict(max_tokens_per_rank=8, top_k=2, num_experts=4, payloads=payload_formats(64, 2)["bf16"],
                  combine_hidden_size=64, protocol=protocol, timeout_s=TIMEOUT_S, first_timeout_s=10.0)
        a = ep_a2a.MoeAlltoAll(g, **kw)
        rng = np.random.default_rng(seed)  # the same draws in both processes
        bad = []
        for _ in range(WARM_STEPS):
            tmax = int(rng.integers(1, 9))
            bad += run_step(a, rng, [int(t) for t in rng.integers(0, tmax + 1, 2)], tmax, route="perfect").mismatches
        conn.send(("warm", bad))
        # the failing step: every token selects an expert of each rank (experts 0-1: rank 0, 2-3: rank 1)
        T = 5
        ids = from_numpy(np.tile(np.array([[1, 2]], np.int32), (T, 1)), a.ranks[0].device, "int32")
        pay = [from_numpy(random_payload(rng, sp, T), a.ranks[0].device, sp.dtype) for sp in a.payload_specs]
        if scenario in ("kill_between_steps", "exit_then_collective"):
            if rank == 1:
                if scenario == "exit_then_collective":
                    os._exit(0)      # no close of anything: sockets, workspace, context
                conn.send(("ready",))
                conn.recv()          # killed while waiting here
                return
            conn.send(("ready",))
            conn.recv()              # the conductor saw the peer die
            t0 = time.monotonic()
            if scenario == "exit_then_collective":
                try:
                    ep_a2a.MoeAlltoAll(g, **kw)  # agrees on the arguments through the bootstrap
                    conn.send(("result", "no error", time.monotonic() - t0))
                except BootstrapError as e:
                    conn.send(("result", (type(e).__name__, str(e)), time.monotonic() - t0))
                a.close()
                return
            a.dispatch(ids, pay, T)
        else:
            a.dispatch(ids, pay, T)
            a.synchronize()
            copy_from_numpy(a.combine_input(T), from_float32(rng.integers(-8, 9, (2, T, 64)).astype(np.float32),
                                                             "bfloat16"))
            if rank == 1:
                if scenario == "exit_mid_step":
                    os._exit(0)
                conn.send(("ready",))
                conn.recv()
                return
            conn.send(("ready",))
            conn.recv()
            t0 = time.monotonic()
            a.combine(a.combine_input(T), T)
        try:
            a.synchronize()
            conn.send(("result", "no error", time.monotonic() - t0))
        except ep_a2a.PeerTimeoutError as e:
            conn.send(("result", ("PeerTimeoutError", e.rank, e.phase, e.peer, e.epoch, str(e)),
                       time.monotonic() - t0))
    except BaseException:  # report, never hang the conductor
        import traceback
        conn.send(("exception", traceback.format_exc()))


def _conduct(tmp_path, protocol, scenario):
    os.chmod(tmp_path, 0o700)
    seed = int(np.random.default_rng().integers(2 ** 31))
    ctx = mp.get_context("spawn")
    name = f"pf{os.getpid()}{scenario[:4]}{protocol[0]}"
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank_main, args=(r, name, str(tmp_path), protocol, scenario, seed, pipes[r][1]))
             for r in range(2)]
    for p in procs:
        p.start()

    def get(r, timeout):
        assert pipes[r][0].poll(timeout), f"seed {seed}: rank {r} sent nothing within {timeout} s"
        msg = pipes[r][0].recv()
        assert msg[0] != "exception", f"seed {seed}: rank {r}:\n{msg[1]}"
        return msg

    try:
        for r in range(2):
            _, bad = get(r, 120)
            assert not bad, f"seed {seed}: rank {r}: {bad[:3]}"
        assert get(0, 60)[0] == "ready"
        if scenario.startswith("kill"):
            assert get(1, 60)[0] == "ready"
            os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(30)
        assert not procs[1].is_alive()
        # the dead rank's side of the rendezvous left nothing (the socket went at setup's end)
        assert os.listdir(tmp_path / f"ep_a2a-{os.getuid()}") == []
        pipes[0][0].send("go")
        _, result, waited = get(0, TIMEOUT_S + SLACK_S + 30)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert os.listdir(tmp_path / f"ep_a2a-{os.getuid()}") == []
    expected_exit = -signal.SIGKILL if scenario.startswith("kill") else 0
    assert procs[1].exitcode == expected_exit, f"seed {seed}: rank 1 exit code {procs[1].exitcode}"
    return seed, result, waited


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
@pytest.mark.parametrize("scenario", ["kill_between_steps", "kill_mid_step"])
def test_killed_peer_process_fails_the_survivor_within_the_timeout(tmp_path, protocol, scenario):
    seed, result, waited = _conduct(tmp_path, protocol, scenario)
    phase = {("fence", "kill_between_steps"): "dispatch", ("sentinel", "kill_between_steps"): "sentinel-dispatch",
             ("fence", "kill_mid_step"): "combine", ("sentinel", "kill_mid_step"): "sentinel-combine"}[
        protocol, scenario]
    assert result != "no error", f"seed {seed}: the survivor's step completed without its peer"
    kind, rank, got_phase, peer, epoch, msg = result
    assert (kind, rank, got_phase, peer) == ("PeerTimeoutError", 0, phase, 1), f"seed {seed}: {msg}"
    assert epoch == WARM_STEPS + 1, f"seed {seed}: {msg}"
    assert "rank 1" in msg and phase in msg
    assert waited < TIMEOUT_S + SLACK_S, f"seed {seed}: the survivor gave up after {waited:.1f} s (timeout {TIMEOUT_S} s)"


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_peer_exiting_without_close_does_not_hang_its_peer(tmp_path, protocol):
    seed, result, waited = _conduct(tmp_path, protocol, "exit_mid_step")
    phase = "combine" if protocol == "fence" else "sentinel-combine"
    assert result != "no error", f"seed {seed}: the survivor's step completed without its peer"
    kind, rank, got_phase, peer, epoch, msg = result
    assert (kind, rank, got_phase, peer, epoch) == ("PeerTimeoutError", 0, phase, 1, WARM_STEPS + 1), msg
    assert waited < TIMEOUT_S + SLACK_S, f"seed {seed}: the survivor gave up after {waited:.1f} s"


@pytest.mark.gpu
def test_collective_after_a_peer_exited_fails_at_once(tmp_path):
    seed, result, waited = _conduct(tmp_path, "fence", "exit_then_collective")
    assert result != "no error", f"seed {seed}: a collective completed without its peer"
    kind, msg = result
    assert kind == "BootstrapError" and "closed the connection" in msg, msg
    assert waited < 5.0, f"seed {seed}: took {waited:.1f} s to notice (bootstrap timeout 30 s)"


# -- without a GPU: the rendezvous itself when a member is SIGKILLed ---------------------------------

def _bootstrap_member(rank, world, name, base_dir, conn):
    try:
        from ep_a2a.bootstrap import BootstrapError, UnixSocketBootstrap
        b = UnixSocketBootstrap(rank, world, name=name, base_dir=base_dir, timeout=20)
        b.allgather(b"hello %d" % rank)
        conn.send(("formed",))
        conn.recv()  # the victim is killed while waiting here
        t0 = time.monotonic()
        try:
            b.allgather(b"again")
            conn.send(("result", "no error", time.monotonic() - t0))
        except BootstrapError as e:
            conn.send(("result", (type(e).__name__, str(e)), time.monotonic() - t0))
    except BaseException:
        import traceback
        conn.send(("exception", traceback.format_exc()))


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_killed_member_fails_the_next_collective_at_once(tmp_path, victim):
    """A SIGKILLed member (rank 0, the hub, or a leaf): the others' next allgather raises a
    BootstrapError well before the 20 s timeout, and the socket directory stays empty."""
    os.chmod(tmp_path, 0o700)
    ctx = mp.get_context("spawn")
    name = f"kb{os.getpid()}v{victim}"
    pipes = [ctx.Pipe() for _ in range(3)]
    procs = [ctx.Process(target=_bootstrap_member, args=(r, 3, name, str(tmp_path), pipes[r][1])) for r in range(3)]
    for p in procs:
        p.start()
    try:
        for r in range(3):
            assert pipes[r][0].poll(60), f"rank {r} never formed the group"
            msg = pipes[r][0].recv()
            assert msg[0] == "formed", msg
        assert os.listdir(tmp_path / f"ep_a2a-{os.getuid()}") == []
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(10)
        survivors = [r for r in range(3) if r != victim]
        for r in survivors:
            pipes[r][0].send("go")
        for r in survivors:
            assert pipes[r][0].poll(30), f"rank {r} did not return from allgather"
            msg = pipes[r][0].recv()
            assert msg[0] == "result", msg
            _, result, waited = msg
            assert result != "no error" and result[0] in ("BootstrapError", "BootstrapTimeout"), result
            assert waited < 10.0, f"rank {r} took {waited:.1f} s"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert os.listdir(tmp_path / f"ep_a2a-{os.getuid()}") == []
