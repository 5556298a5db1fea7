"""The driver layer and the symmetric workspace on a real GPU."""
import ctypes
import os

import numpy as np
import pytest

from common import run_processes

pytestmark = pytest.mark.gpu


def _fill(dev, t, value, stream):
    from ep_a2a.driver.launch import launch_once
    from ep_a2a.driver.module import load
    fn = load("util", dev).function("ep_fill_u32")
    launch_once(dev, fn, [ctypes.c_uint64(t.ptr), ctypes.c_uint64(t.numel), ctypes.c_uint32(value)], 8, 128, stream)


def test_cubin_launch_and_graph_replay():
    from ep_a2a.driver import get_device
    from ep_a2a.interop.arrays import empty, to_numpy
    from ep_a2a.driver.stream import Graph, Stream
    dev = get_device(0)
    s = Stream(dev)
    t = empty((4097,), "uint32", dev)
    v = int(np.random.default_rng().integers(1, 2**32 - 1))
    _fill(dev, t, v, s.handle)
    s.synchronize()
    assert (to_numpy(t) == v).all()
    Graph.begin(s.handle)
    _fill(dev, t, v ^ 0x5A5A5A5A, s.handle)
    g = Graph.end(s.handle)
    _fill(dev, t, 7, s.handle)
    s.synchronize()
    assert (to_numpy(t) == 7).all()  # capture ran nothing
    g.launch(s.handle)
    s.synchronize()
    assert (to_numpy(t) == (v ^ 0x5A5A5A5A)).all()
    g.close()
    s.close()


def test_copy_bytes_kernel_matches_numpy():
    """util.cu's ep_copy_bytes as the JAX plan launches it (jax_plan.copy_launch: its grid and
    argument bytes): random sizes and byte offsets of both ends (the 16-byte path and the byte
    path), the bytes around the target left as poisoned."""
    from ep_a2a.driver import get_device
    from ep_a2a.driver.launch import launch_once
    from ep_a2a.driver.module import load
    from ep_a2a.driver.stream import Stream
    from ep_a2a.interop.arrays import from_numpy, to_numpy
    from ep_a2a.ops.jax_plan import CopyOp, copy_launch
    dev = get_device(0)
    s = Stream(dev)
    fn = load("util", dev).function("ep_copy_bytes")
    rng = np.random.default_rng()
    for _ in range(40):
        n = int(rng.choice([0, 1, 15, 16, 17, 4096, 12345, (1 << 20) + 48]))
        so, do = (0, 0) if rng.random() < 0.5 else (int(rng.integers(0, 32)), int(rng.integers(0, 32)))
        src_h = rng.integers(0, 256, n + 64, dtype=np.uint8)
        src, dst = from_numpy(src_h, dev), from_numpy(np.full(n + 64, 0xA5, np.uint8), dev)
        op = copy_launch(CopyOp(0, dst.ptr + do, src.ptr + so, n), fn, dev.sm_count)
        launch_once(dev, op.function, [ctypes.c_uint64.from_buffer_copy(a) for a in op.args], op.grid, op.block,
                    s.handle)
        s.synchronize()
        out = to_numpy(dst)
        assert (out[do:do + n] == src_h[so:so + n]).all(), (n, so, do)
        assert (out[:do] == 0xA5).all() and (out[do + n:] == 0xA5).all(), (n, so, do)
    s.close()


def test_unsupported_arch_error_lists_built(monkeypatch):
    from ep_a2a.driver import get_device
    from ep_a2a.driver.module import UnsupportedDeviceError, cubin_path
    dev = get_device(0)
    monkeypatch.setattr(dev, "compute_capability", (8, 6))
    with pytest.raises(UnsupportedDeviceError, match="sm_90"):
        cubin_path("fence", dev)


def test_local_group_peers_pingpong():
    """Two in-process ranks on one GPU: each reaches the other's region through the table."""
    import ep_a2a
    from ep_a2a.driver.launch import launch_once
    from ep_a2a.interop.arrays import to_numpy
    from ep_a2a.driver.module import load
    from ep_a2a.interop.tensor import Tensor
    from ep_a2a.symmetric import SymmetricWorkspace
    with ep_a2a.LocalGroup([0, 0]) as g, SymmetricWorkspace(g, 1 << 20) as ws:
        dev = g.ranks[0].device
        for i in range(2):
            table = Tensor(ws.peer_table(i), (2,), "uint64", device=(2, 0))
            assert list(to_numpy(table)) == ws.peers(i)
        fn = load("util", dev).function("ep_pingpong")
        a, b = ws.base(0), ws.base(1)
        from cuda.bindings import driver as d
        for r in range(2):
            d.cuMemsetD8(ws.base(r), 0, 4096)
        rounds = 50
        # rank 0 writes to rank 1's flag word and waits on its own; rank 1 the reverse
        launch_once(dev, fn, [ctypes.c_uint64(a), ctypes.c_uint64(b), ctypes.c_int(rounds), ctypes.c_int(1)], 1, 32,
                    g.ranks[0].stream.handle)
        launch_once(dev, fn, [ctypes.c_uint64(b), ctypes.c_uint64(a), ctypes.c_int(rounds), ctypes.c_int(0)], 1, 32,
                    g.ranks[1].stream.handle)
        dev.synchronize()
        assert int(to_numpy(Tensor(a, (1,), "uint32", device=(2, 0)))[0]) == rounds
        assert int(to_numpy(Tensor(b, (1,), "uint32", device=(2, 0)))[0]) == rounds


def _rendezvous_child(rank, world, name, base_dir, q):
    try:
        import ep_a2a
        from ep_a2a.bootstrap import UnixSocketBootstrap
        from ep_a2a.interop.arrays import copy_from_numpy, to_numpy
        from ep_a2a.interop.tensor import Tensor
        from ep_a2a.symmetric import SymmetricWorkspace
        with UnixSocketBootstrap(rank, world, name=name, base_dir=base_dir, timeout=60) as bs:
            g = ep_a2a.ProcessGroup(bs, 0)
            ws = SymmetricWorkspace(g, 1 << 20)
            peers = ws.peers(0)
            rng = np.random.default_rng(1234)
            pats = rng.integers(0, 256, (world, 4096), dtype=np.uint8)
            nxt = (rank + 1) % world
            # write my pattern into the next rank's region, at my slot
            copy_from_numpy(Tensor(peers[nxt] + rank * 4096, (4096,), "uint8", device=(2, 0)), pats[rank])
            g.ranks[0].device.synchronize()
            bs.barrier()
            prv = (rank - 1) % world
            got = to_numpy(Tensor(ws.base(0) + prv * 4096, (4096,), "uint8", device=(2, 0)))
            ok = np.array_equal(got, pats[prv])
            # a few FENCE steps with real peers in other processes
            from ep_a2a.testing.formats import payload_formats
            from ep_a2a.testing.harness import run_step
            a2a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=16, top_k=4, num_experts=4 * world,
                                     payloads=payload_formats(96, 4)["mxfp8"], combine_hidden_size=96, timeout_s=60)
            step_rng = np.random.default_rng(99)  # same draws in every process
            bad = []
            for _ in range(2):
                bad += run_step(a2a, step_rng, list(step_rng.integers(0, 17, world)), 16).mismatches
            a2a.close()
            ws.close()
            bs.barrier()
            q.put((rank, ok, bad))
    except BaseException as e:  # report, never hang the parent
        q.put((rank, False, [repr(e)]))


@pytest.mark.parametrize("world", [2, 3])
def test_multiprocess_rendezvous_and_fence(world, tmp_path):
    os.chmod(tmp_path, 0o700)
    name = f"t{os.getpid()}_{world}"
    results, _ = run_processes(_rendezvous_child, lambda r: (r, world, name, str(tmp_path)), world, 100, join=5)
    for rank, ok, bad in sorted(results):
        assert ok, f"rank {rank}: peer write not seen ({bad})"
        assert not bad, f"rank {rank}: {bad[:3]}"
