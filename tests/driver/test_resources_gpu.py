"""Create/destroy cycles leave nothing behind: device free memory (cuMemGetInfo), the VMM live
counters (ep_a2a/driver/vmm.py) and this process's open fds, with in-process ranks and with
one rank per process (real fd export/import through the bootstrap)."""
import gc
import os

import numpy as np
import pytest

from common import run_processes

pytestmark = pytest.mark.gpu

# After the warm-up (module loads, driver pools), a leak of even 2 KiB per cycle over the
# cycles below would exceed this; one VMM granularity absorbs the driver's own bookkeeping.
TOLERANCE = 2 << 20


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _state(dev):
    from ep_a2a.driver.vmm import live_counts
    gc.collect()
    return dev.free_memory(), live_counts(), _open_fds()


def _make(group, hidden, protocol):
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    return ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=32, top_k=4, num_experts=4 * group.ep_size + 1,
                              payloads=payload_formats(hidden, 4)["mxfp8"], combine_hidden_size=hidden,
                              protocol=protocol, crossover_tokens=8, timeout_s=20.0)


def _local_cycle(ranks, seed, i, step):
    import ep_a2a
    from ep_a2a.testing.harness import run_step
    rng = np.random.default_rng([seed, i])
    with ep_a2a.LocalGroup([0] * ranks) as group:
        a2a = _make(group, int(rng.choice([8, 200, 1024])), ("fence", "sentinel", "auto")[i % 3])
        try:
            if step:
                tmax = int(rng.integers(1, 33))
                rep = run_step(a2a, rng, [int(t) for t in rng.integers(0, tmax + 1, ranks)], tmax)
                assert not rep.mismatches, f"seed {seed}, cycle {i}: {rep.mismatches[:3]}"
        finally:
            a2a.close()


def test_local_group_1000_create_destroy_cycles():
    from ep_a2a.driver import get_device
    seed = int(np.random.default_rng().integers(2 ** 31))
    dev = get_device(0)
    for i in range(6):  # warm-up: every rank count, protocol and a step of each
        _local_cycle(2 + i % 3, seed, i, step=True)
    free0, counts0, fds0 = _state(dev)
    assert counts0 == {"allocations": 0, "mappings": 0}
    for i in range(1000):
        _local_cycle(2 + i % 3, seed, i, step=i % 100 == 0)
    free1, counts1, fds1 = _state(dev)
    assert counts1 == counts0, f"seed {seed}: VMM objects leaked: {counts1}"
    assert fds1 == fds0, f"seed {seed}: open fds {fds0} -> {fds1}"
    assert abs(free1 - free0) <= TOLERANCE, f"seed {seed}: device free memory {free0} -> {free1} after 1000 cycles"


def _process_cycles_child(rank, name, base_dir, seed, cycles, q):
    """One rank: warm up, measure, `cycles` all-to-alls built, used every 100th cycle and
    closed, measure again. Both ranks measure at the same point (barriers around it)."""
    try:
        import ep_a2a
        from ep_a2a.bootstrap import UnixSocketBootstrap
        from ep_a2a.testing.harness import run_step
        from ep_a2a.driver import get_device
        dev = get_device(0)
        bad = []

        def cycle(g, i, step):
            rng = np.random.default_rng([seed, i])  # the same draws in both processes
            a2a = _make(g, int(rng.choice([8, 200, 1024])), ("fence", "sentinel", "auto")[i % 3])
            try:
                if step:
                    tmax = int(rng.integers(1, 33))
                    bad.extend(run_step(a2a, rng, [int(t) for t in rng.integers(0, tmax + 1, 2)], tmax).mismatches)
            finally:
                a2a.close()

        with UnixSocketBootstrap(rank, 2, name=name, base_dir=base_dir, timeout=60) as bs:
            g = ep_a2a.ProcessGroup(bs, 0)
            for i in range(3):
                cycle(g, i, step=True)
            bs.barrier()
            before = _state(dev)
            bs.barrier()
            for i in range(cycles):
                cycle(g, i, step=i % 100 == 0)
            bs.barrier()
            after = _state(dev)
            bs.barrier()
            g.close()
        q.put((rank, before, after, bad, None))
    except BaseException:  # report, never hang the parent
        import traceback
        q.put((rank, None, None, [], traceback.format_exc()))


def test_process_group_create_destroy_cycles(tmp_path):
    os.chmod(tmp_path, 0o700)
    seed = int(np.random.default_rng().integers(2 ** 31))
    cycles = 1000
    name = f"res{os.getpid()}"
    got, procs = run_processes(_process_cycles_child, lambda r: (r, name, str(tmp_path), seed, cycles), 2, 240, join=10)
    results = sorted(got)
    for rank, before, after, bad, exc in results:
        assert exc is None, f"seed {seed}, rank {rank}:\n{exc}"
        assert not bad, f"seed {seed}, rank {rank}: {bad[:3]}"
        (free0, counts0, fds0), (free1, counts1, fds1) = before, after
        assert counts0 == counts1 == {"allocations": 0, "mappings": 0}, f"rank {rank}: {counts0} -> {counts1}"
        assert fds1 == fds0, f"seed {seed}, rank {rank}: open fds {fds0} -> {fds1} after {cycles} cycles"
        assert abs(free1 - free0) <= TOLERANCE, f"seed {seed}, rank {rank}: free memory {free0} -> {free1}"
    assert [p.exitcode for p in procs] == [0, 0]
    assert os.listdir(tmp_path / f"ep_a2a-{os.getuid()}") == [], "bootstrap left files behind"
