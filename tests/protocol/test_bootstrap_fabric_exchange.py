"""The FABRIC handle exchange of a workspace spanning hosts, over a real rendezvous of
processes (no GPU: the handles are the 64 opaque bytes the driver would export), and the
choice between it and fd passing."""
import os
import uuid

import numpy as np
import pytest

from common import run_processes

from ep_a2a import symmetric
from ep_a2a.errors import CudaError, TopologyError

WORLD = 3


def _handle(seed, rank):
    return np.random.default_rng([seed, rank]).integers(0, 256, symmetric.FABRIC_HANDLE_BYTES, np.uint8).tobytes()


def _member(rank, name, base_dir, token, seed, refusing, q):
    from ep_a2a.bootstrap import UnixSocketBootstrap

    try:
        with UnixSocketBootstrap(rank, WORLD, name=name, base_dir=base_dir, timeout=10, job_token=token) as b:
            hosts = b.allgather(symmetric.host_identity())
            if rank in refusing:
                got = symmetric.exchange_fabric_handles(b, None, f"CUDA_ERROR_NOT_PERMITTED on rank {rank}")
            else:
                got = symmetric.exchange_fabric_handles(b, _handle(seed, rank))
            q.put((rank, "ok", got, symmetric.ranks_on_other_hosts(hosts, rank)))
    except TopologyError as e:
        q.put((rank, "TopologyError", str(e), None))


def _run(tmp_path, refusing):
    seed = int(np.random.default_rng().integers(1 << 31))
    name, token = "x" + uuid.uuid4().hex[:10], uuid.uuid4().hex
    got, _ = run_processes(_member, lambda r: (r, name, str(tmp_path), token, seed, refusing), WORLD, timeout=60, join=10)
    return seed, {r: rest for r, *rest in got}


def test_every_rank_gets_every_handle_in_rank_order(tmp_path):
    seed, out = _run(tmp_path, refusing=())
    want = [_handle(seed, r) for r in range(WORLD)]
    for r in range(WORLD):
        kind, got, other_hosts = out[r]
        assert kind == "ok" and got == want, out
        assert other_hosts == [], "processes of one machine are one host: they pass fds, not FABRIC handles"


def test_a_rank_whose_driver_refuses_fabric_fails_every_rank_clearly(tmp_path):
    rng = np.random.default_rng()
    refusing = tuple(sorted(rng.choice(WORLD, int(rng.integers(1, WORLD)), replace=False).tolist()))
    _, out = _run(tmp_path, refusing)
    for r in range(WORLD):
        kind, msg, _ = out[r]
        assert kind == "TopologyError", out
        assert f"rank(s) {list(refusing)}" in msg and "IMEX" in msg, msg
        for q in refusing:
            assert f"CUDA_ERROR_NOT_PERMITTED on rank {q}" in msg, msg


def test_which_ranks_are_on_other_hosts():
    rng = np.random.default_rng()
    hosts = [bytes([int(h)]) for h in rng.integers(0, 3, 8)]
    for r in range(8):
        assert symmetric.ranks_on_other_hosts(hosts, r) == [q for q in range(8) if hosts[q] != hosts[r]]
    assert symmetric.host_identity() == symmetric.host_identity() and os.uname().nodename.encode() in symmetric.host_identity()


def test_a_handle_of_the_wrong_size_is_refused_before_the_exchange():
    with pytest.raises(ValueError, match="64 bytes, got 63"):
        symmetric.exchange_fabric_handles(None, bytes(63))


# -- on a GPU: the driver's own handles, or its refusal, through the same exchange -------------------


def _gpu_member(rank, name, base_dir, token, seed, q):
    import ctypes

    from ep_a2a.bootstrap import UnixSocketBootstrap
    from ep_a2a.driver.memory import copy_dtoh, copy_htod
    from ep_a2a.driver.vmm import Allocation, DeviceBuffer, Mapping, VmmOptions

    data = [np.random.default_rng([seed, r]).integers(0, 256, 4096, np.uint8) for r in range(2)]
    buf = DeviceBuffer(1 << 21, 0, VmmOptions(fabric=True))
    copy_htod(buf.ptr, data[rank].ctypes.data, data[rank].nbytes)
    try:
        handle, why = buf.allocation.export_fabric(), ""
    except (ValueError, CudaError) as e:
        handle, why = None, str(e)
    with UnixSocketBootstrap(rank, 2, name=name, base_dir=base_dir, timeout=30, job_token=token) as b:
        try:
            handles = symmetric.exchange_fabric_handles(b, handle, why)
        except TopologyError as e:
            q.put((rank, "refused", str(e)))
            buf.close()
            return
        peer = 1 - rank
        alloc = Allocation.import_fabric(handles[peer], buf.size, 0)
        m = Mapping(alloc)
        got = (ctypes.c_uint8 * 4096)()
        copy_dtoh(ctypes.addressof(got), m.ptr, 4096)
        same = bytes(got) == data[peer].tobytes()
        b.barrier()  # the peer reads our region: keep it until both have
        m.close()
        alloc.close()
    buf.close()
    q.put((rank, "imported", same))


@pytest.mark.gpu
def test_fabric_handles_of_the_driver_are_exchanged_or_refused_clearly(tmp_path):
    """Where the driver grants FABRIC (an IMEX channel), each rank maps the other's region from
    the 64 bytes it received and reads the bytes the owner wrote; where it refuses, both ranks
    raise the TopologyError that names the refusal."""
    seed = int(np.random.default_rng().integers(1 << 31))
    name, token = "fx" + uuid.uuid4().hex[:10], uuid.uuid4().hex
    got, _ = run_processes(_gpu_member, lambda r: (r, name, str(tmp_path), token, seed), 2, timeout=120, join=10)
    out = {r: rest for r, *rest in got}
    print("FABRIC on this machine:", {r: o[0] for r, o in out.items()})
    assert out[0][0] == out[1][0], out
    if out[0][0] == "refused":
        assert all("IMEX" in o[1] and "rank(s) [0, 1]" in o[1] for o in out.values()), out
    else:
        assert out[0][1] and out[1][1], "a rank read other bytes than its peer wrote through the imported handle"
