"""`python -m ep_a2a.bench --mode procs`: one rank per process, as a deployment runs.

The parent only places the ranks on GPUs, starts them and waits. Each rank process forms
a ProcessGroup over a UnixSocketBootstrap whose socket lives in a private temporary
directory, then runs the same measurements as the in-process mode (`tools.bench.sweep`); rank 0
writes the report. Ranks start with the "spawn" method: a forked child would inherit the
parent's CUDA driver state, which CUDA does not support.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import shutil
import sys
import tempfile

# Generous on purpose: ranks sharing a GPU time-slice it (milliseconds per cross-process
# wait), and a rank that dies makes the parent stop the others long before these expire.
BOOTSTRAP_TIMEOUT_S = 300.0
TIMEOUT_S = 60.0         # a kernel waiting on a peer, steady state
FIRST_TIMEOUT_S = 180.0  # the first steps (peers may still be loading their modules)


def placement(procs, gpu_count: int) -> list:
    """The GPU ordinal of each rank: one rank per GPU, or `procs` ranks round-robin over them."""
    from ..layout import MAX_RANKS
    if gpu_count < 1:
        raise ValueError("no visible GPU to place ranks on")
    n = gpu_count if procs is None else int(procs)
    if n < 2:
        raise ValueError(f"{n} rank process: an all-to-all needs at least 2. With one visible GPU, pass "
                         "--procs N (N >= 2) to share it (time-sliced: a correctness run, not performance)")
    if n > MAX_RANKS:
        raise ValueError(f"{n} rank processes: at most {MAX_RANKS}")
    return [r % gpu_count for r in range(n)]


def run(args) -> int:
    """Start one process per rank, wait for all; 0 when every rank succeeded."""
    from ..driver import device
    from . import exits
    try:
        devices = placement(args.procs, device.device_count())
    except ValueError as e:
        print(f"python -m ep_a2a.bench: error: --mode procs: {e}", file=sys.stderr)
        return exits.USAGE  # the GPUs present do not fit the command line
    args.procs = len(devices)
    seed = secrets.randbits(63)  # one routing seed for every rank
    base_dir = tempfile.mkdtemp(prefix="ep_a2a-bench-")  # 0700: only we reach the socket
    name = f"bench-{os.getpid()}-{secrets.token_hex(4)}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, devices, name, base_dir, args, seed),
                         name=f"bench rank {r} (cuda:{d})") for r, d in enumerate(devices)]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        for p in procs:
            p.start()
        return _wait(procs)
    finally:
        _stop(procs)
        shutil.rmtree(base_dir, ignore_errors=True)


def _wait(procs) -> int:
    """Until every rank has exited (0) or one has failed (1; the caller stops the rest)."""
    pending = list(procs)
    while pending:
        ready = mp.connection.wait([p.sentinel for p in pending])
        for p in [p for p in pending if p.sentinel in ready]:
            p.join()
            pending.remove(p)
            if p.exitcode != 0:
                print(f"{p.name} (pid {p.pid}) exited with code {p.exitcode}"
                      f"{'; stopping the other ranks' if pending else ''}", file=sys.stderr)
                return 1
    return 0


def _stop(procs) -> None:
    """Terminate, then kill, the rank processes we started that are still running."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.terminate()
    for p in started:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(rank: int, devices: list, name: str, base_dir: str, args, seed: int) -> None:
    """One rank process: meet the others, measure, and (rank 0) report.

    On an error it exits at once, without the orderly close: that would wait for kernels
    spinning on peers until they time out, while the parent can stop everyone now."""
    try:
        _rank(rank, devices, name, base_dir, args, seed)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def _rank(rank: int, devices: list, name: str, base_dir: str, args, seed: int) -> None:
    from .. import ProcessGroup, UnixSocketBootstrap
    from . import bench
    from .bench_report import report
    with UnixSocketBootstrap(rank, len(devices), name=name, base_dir=base_dir, timeout=BOOTSTRAP_TIMEOUT_S,
                             job_token=name) as bs:  # (the name holds a token drawn once by the launcher)
        with ProcessGroup(bs, devices[rank]) as group:
            b = bench.Bench(args, group, seed, timeout_s=TIMEOUT_S, first_timeout_s=FIRST_TIMEOUT_S)
            result = bench.sweep(b)
            if rank == 0:
                report(result, args)
            bs.barrier()  # every rank's work is done before anyone unmaps its workspace
            b.close()
