"""TorchDistributedBootstrap over a real gloo process group of two processes, no GPU: bytes of
different lengths (an empty part too), the barrier, and fds passed over its Unix-socket side
channel (each rank writes through the fd it received from its peer)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from ep_a2a.bootstrap import TorchDistributedBootstrap
    dist.init_process_group("gloo")
    bs = TorchDistributedBootstrap(timeout=60.0)
    rank, world = bs.rank, bs.world_size
    got = bs.allgather(b"" if rank == 1 else bytes(range(44)) * 3)
    assert got[1] == b"" and got[0] == bytes(range(0, 44)) * 3, [len(g) for g in got]
    bs.barrier()
    r, w = os.pipe()
    fds = bs.allgather_fds([w])
    peer = fds[1 - rank][0]
    os.write(peer, f"from {rank}".encode())
    for f in fds:
        for fd in f:
            os.close(fd)
    os.close(w)
    bs.barrier()
    msg = os.read(r, 64).decode()
    assert msg == f"from {1 - rank}", msg
    bs.close()
    dist.destroy_process_group()
    print("ok", rank)
""")


def test_torch_distributed_bootstrap_over_gloo_with_two_processes(tmp_path):
    port = 29000 + os.getpid() % 1000
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   LOCAL_RANK=str(rank), PYTHONPATH=ROOT, XDG_RUNTIME_DIR=str(tmp_path))
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two gloo ranks did not finish within 120 s")
        outs.append((p.returncode, out, err[-2000:]))
    for rank, (rc, out, err) in enumerate(outs):
        assert rc == 0 and f"ok {rank}" in out, f"rank {rank} exited {rc}: {out}\n{err}"
