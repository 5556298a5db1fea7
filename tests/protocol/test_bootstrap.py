"""Bootstrap over real processes and sockets (no GPU), plus the GPU-free part of topology."""
import multiprocessing as mp
import os
import socket
import stat
import struct
import threading
import time
import uuid

import numpy as np
import pytest

from ep_a2a import bootstrap as bs_mod
from ep_a2a import bootstrap_wire as wire
from ep_a2a import topology
from ep_a2a.bootstrap import BootstrapError, BootstrapTimeout, UnixSocketBootstrap


def _name():
    return "t" + uuid.uuid4().hex[:16]


@pytest.fixture(autouse=True)
def _one_job_per_test(monkeypatch):
    """Every test is one job: its ranks (threads, and processes spawned with its environment)
    share a fresh token, as a launcher's would."""
    monkeypatch.setenv("EP_A2A_JOB_TOKEN", bs_mod.new_job_token())


def _job():
    return bs_mod._job_digest(os.environ["EP_A2A_JOB_TOKEN"])


def _payload(seed, rank, i=0):
    rng = np.random.default_rng([seed, rank, i])
    size = [0, 1, 200_000, 4097, 33][(rank + i) % 5]  # differing sizes, one empty, one large
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _worker(rank, world_size, name, base_dir, seed, timeout, q):
    """One rank: allgather, allgather_fds of memfds, barrier; report 'ok' or the failure."""
    t0 = time.monotonic()
    try:
        b = UnixSocketBootstrap(rank, world_size, name=name, timeout=timeout, base_dir=base_dir)
    except BootstrapError as e:
        q.put((rank, type(e).__name__, str(e), getattr(e, "missing", None), time.monotonic() - t0))
        return
    try:
        with b:
            if rank == 0:
                assert not os.path.exists(b.path), "socket file still there after every rank connected"
            for i in range(2):
                got = b.allgather(_payload(seed, rank, i))
                assert got == [_payload(seed, r, i) for r in range(world_size)]
            before = _open_fds()
            mine = []
            for i in range(3):
                fd = os.memfd_create(f"r{rank}f{i}")
                os.write(fd, _payload(seed, rank, 10 + i) + b"!")  # "!": never an empty file
                mine.append(fd)
            gathered = b.allgather_fds(mine)
            assert [len(f) for f in gathered] == [3] * world_size
            assert not set(gathered[rank]) & set(mine), "own entry must be dup()s, not the caller's fds"
            for fd in mine:
                os.close(fd)  # the dup()s must stay valid on their own
            for r, fds in enumerate(gathered):
                for i, fd in enumerate(fds):
                    want = _payload(seed, r, 10 + i) + b"!"
                    assert os.pread(fd, len(want) + 1, 0) == want, (r, i)
                    assert not os.get_inheritable(fd)
                    os.close(fd)
            assert _open_fds() == before, "allgather_fds leaked or lost fds"
            b.barrier()
            assert b.allgather(b"%d" % rank) == [b"%d" % r for r in range(world_size)]
        b.close()  # idempotent
        q.put((rank, "ok", "", None, time.monotonic() - t0))
    except Exception as e:
        q.put((rank, type(e).__name__, repr(e), getattr(e, "missing", None), time.monotonic() - t0))


def _spawn(ranks, world_size, name, base_dir, timeout, seed=1234):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, world_size, name, str(base_dir), seed, timeout, q)) for r in ranks]
    for p in ps:
        p.start()
    try:
        out = {}
        for _ in ranks:
            r, *rest = q.get(timeout=timeout + 15)
            out[r] = tuple(rest)
    finally:
        for p in ps:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return out


def _path(base_dir, name):
    return os.path.join(str(base_dir), f"ep_a2a-{os.getuid()}", name + ".sock")


@pytest.mark.parametrize("world_size", [2, 4])
def test_processes_allgather_fds_barrier(tmp_path, world_size):
    name = _name()
    out = _spawn(range(world_size), world_size, name, tmp_path, timeout=20)
    assert {r: o[0] for r, o in out.items()} == {r: "ok" for r in range(world_size)}, out
    assert not os.path.exists(_path(tmp_path, name))


def test_timeout_names_missing_rank(tmp_path):
    name, timeout = _name(), 2.0
    out = _spawn([0, 1], 3, name, tmp_path, timeout=timeout)
    for r in (0, 1):
        kind, msg, missing, elapsed = out[r]
        assert kind == "BootstrapTimeout", out
        assert missing == [2] and "[2]" in msg, out
        assert elapsed < timeout + bs_mod._PEER_GRACE + 1.0, out
    assert not os.path.exists(_path(tmp_path, name)), "socket file left after a failed setup"


def _interrupted_root(name, base_dir, q):
    """Rank 0 is interrupted (KeyboardInterrupt from a signal) inside its first allgather,
    then calls the next one, as a program catching the interrupt would."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt
    b = UnixSocketBootstrap(0, 2, name=name, timeout=20, base_dir=base_dir)
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        b.allgather(b"rank 0, first")
        q.put((0, "first returned"))
    except KeyboardInterrupt:
        pass
    try:
        q.put((0, "second returned", b.allgather(b"rank 0, second")))
    except BootstrapError as e:
        q.put((0, "BootstrapError", str(e)))


def _late_peer(name, base_dir, q):
    b = UnixSocketBootstrap(1, 2, name=name, timeout=20, base_dir=base_dir)
    time.sleep(1.0)  # rank 0 is interrupted while it waits for this part
    t0 = time.monotonic()
    try:
        q.put((1, "returned", b.allgather(b"rank 1, first")))
    except BootstrapError as e:
        q.put((1, "BootstrapError", str(e), time.monotonic() - t0))


def test_interrupted_collective_closes_the_group_and_tells_the_peers(tmp_path):
    """An interrupt inside a collective must not leave rank 0 open to pair its next call with
    the peers' earlier one (that returned a peer's data of the previous allgather): rank 0's
    next call raises, and the peer learns it at once instead of at its timeout."""
    name, q = _name(), mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=f, args=(name, str(tmp_path), q))
             for f in (_interrupted_root, _late_peer)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        r, *rest = q.get(timeout=30)
        out[r] = rest
    for p in procs:
        p.join(10)
    assert out[0][0] == "BootstrapError" and "interrupted by KeyboardInterrupt in allgather #1" in out[0][1], out
    assert out[1][0] == "BootstrapError" and "interrupted" in out[1][1] and out[1][2] < 5.0, out


def test_every_message_carries_its_collective_number(tmp_path):
    """A part of another collective (here: a peer one collective ahead) is refused by number,
    even where kind and rank match."""
    root, raw = _root_with_raw_rank1(tmp_path)
    g = _Thread(lambda: root.allgather(b"x"))
    raw.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.ALLGATHER, 1, 2, 2, 1) + b"y")  # collective #2
    with pytest.raises(BootstrapError, match=r"collective #2 while rank 0 is at #1"):
        g.get()
    raw.close()


# -- in-process checks (threads are enough: every rank still talks over the real socket) ---------


class _Thread(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:
            self.error = e

    def get(self, timeout=15):
        self.join(timeout)
        assert not self.is_alive(), "thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def _root_with_raw_rank1(base_dir):
    """Rank 0 of a group of two, and a raw socket that joined it as rank 1 (hello, welcome)."""
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=base_dir, timeout=5))
    raw = _raw_connect(_path(base_dir, name))
    raw.sendall(_header(wire.HELLO, 1, 2, 36) + struct.pack("<I", os.getpid()) + _job())
    assert _raw_recv(raw)[0] == wire.WELCOME
    return root.get(), raw


def _raw_connect(path, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            s.settimeout(timeout)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.01)


def _header(kind, rank, world_size, n):
    return wire.HEADER.pack(wire.MAGIC, wire.VERSION, kind, rank, world_size, 0, n)


def _raw_recv(s):
    kind, rank, ws, _, payload, _ = wire.recv(s, time.monotonic() + 5, "rank 0")
    return kind, payload


def test_single_rank(tmp_path):
    with UnixSocketBootstrap(0, 1, name=_name(), base_dir=tmp_path) as b:
        assert b.allgather(b"abc") == [b"abc"]
        fd = os.memfd_create("x")
        [[dup]] = b.allgather_fds([fd])
        assert dup != fd
        os.close(dup), os.close(fd)
        b.barrier()
    b.close()


@pytest.mark.parametrize("name", ["", "a/b", "../x", "x" * 65, "sp ace", "é"])
def test_bad_name_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="name"):
        UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path)


def test_two_jobs_on_one_name_are_kept_apart_by_their_tokens(tmp_path):
    """Start order A0, B1, A1 with one name: B's rank 1 reaches A's rank 0 first and is refused
    (another job's token), A forms from its own ranks, its allgather carries only A's data."""
    name, ta, tb = _name(), bs_mod.new_job_token(), bs_mod.new_job_token()
    a0 = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=8, job_token=ta))
    _raw_connect(_path(tmp_path, name)).close()  # A's rank 0 listens
    with pytest.raises(BootstrapError, match="belongs to another job"):
        UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=8, job_token=tb)
    with UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=8, job_token=ta) as a1, a0.get() as root:
        t = _Thread(lambda: root.allgather(b"A0"))
        assert a1.allgather(b"A1") == [b"A0", b"A1"]
        assert t.get() == [b"A0", b"A1"]


def test_a_rank_without_the_token_is_refused(tmp_path, monkeypatch):
    name = _name()
    monkeypatch.setenv("EP_A2A_JOB_TOKEN", "job-42")  # rank 0 takes the token from the environment
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=3))
    _raw_connect(_path(tmp_path, name)).close()
    with pytest.raises(BootstrapError, match="belongs to another job"):
        UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=3, job_token="job-41")
    with UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=3) as peer, root.get() as b0:
        t = _Thread(lambda: b0.barrier())
        peer.barrier()
        t.get()
    with pytest.raises(ValueError, match="job_token: must not be empty"):
        UnixSocketBootstrap(0, 1, name=name, base_dir=tmp_path, job_token="")


def test_a_bad_fd_is_refused_before_the_collective_and_leaks_nothing(tmp_path):
    with UnixSocketBootstrap(0, 1, name=_name(), base_dir=tmp_path) as b:
        good = [os.memfd_create("a"), os.memfd_create("b")]
        bad = max(int(f) for f in os.listdir("/proc/self/fd")) + 100
        before = _open_fds()
        with pytest.raises(ValueError, match=rf"fds\[2\]: {bad} is not an open file descriptor"):
            b.allgather_fds(good + [bad])
        assert _open_fds() == before, "the dups made before the bad fd leaked"
        (mine,) = b.allgather_fds(good)  # the bootstrap is still usable
        assert len(mine) == 2
        wire.close_fds(mine + good)


def test_fds_are_bounded_per_message_not_per_receive(tmp_path):
    """A header sent in two parts, each carrying 40 fds: 80 fds for one message are refused as
    over the 64-fd bound (they used to be installed, and only the count check refused them)."""
    b0, raw = _root_with_raw_rank1(tmp_path)
    g = _Thread(lambda: b0.allgather_fds([]))
    msg = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.ALLGATHER_FDS, 1, 2, 1, 4) + struct.pack("<I", 80)
    fds = [os.memfd_create(f"f{i}") for i in range(80)]
    socket.send_fds(raw, [msg[:10]], fds[:40])
    socket.send_fds(raw, [msg[10:]], fds[40:])
    wire.close_fds(fds)
    with pytest.raises(BootstrapError, match="more than 64 fds"):
        g.get()
    raw.close()
    b0.close()


def test_silent_connections_do_not_stall_the_group(tmp_path):
    """Three connections that never send a hello (each may wait 5 s) and a real rank behind
    them: the group forms in well under the 6 s timeout."""
    name = _name()
    t0 = time.monotonic()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=6))
    silent = [_raw_connect(_path(tmp_path, name)) for _ in range(3)]
    with UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=6) as peer, root.get() as b0:
        assert time.monotonic() - t0 < 3.0
        t = _Thread(lambda: b0.barrier())
        peer.barrier()
        t.get()
    for s in silent:
        s.close()


def test_a_connect_close_loop_cannot_grow_the_error_without_bound(tmp_path):
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=2))
    _raw_connect(_path(tmp_path, name)).close()
    deadline = time.monotonic() + 1.5
    n = 0
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(_path(tmp_path, name))
            except OSError:
                break
        n += 1
    with pytest.raises(BootstrapTimeout) as e:
        root.get()
    assert n > 50 and len(str(e.value)) < 4000 and "more)" in str(e.value), (n, len(str(e.value)))


def _meet(base_dir):
    """A group of two forms under base_dir: (the socket directory rank 0 used, both ranks' barrier done)."""
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=base_dir, timeout=5))
    with UnixSocketBootstrap(1, 2, name=name, base_dir=base_dir, timeout=5) as peer, root.get() as b0:
        t = _Thread(lambda: b0.barrier())
        peer.barrier()
        t.get()
        return os.path.dirname(b0.path)


@pytest.mark.parametrize("block", ["loose", "symlink", "file"])
def test_a_socket_directory_taken_by_someone_else_is_skipped(tmp_path, block):
    """Someone else made ep_a2a-<uid> first (a loose directory, a symlink, a file): it is left
    untouched, and every rank moves to the same next private name."""
    d = tmp_path / f"ep_a2a-{os.getuid()}"
    if block == "loose":
        d.mkdir()
        d.chmod(0o755)
    elif block == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        os.symlink(tmp_path / "real", d)
    else:
        d.write_bytes(b"")
    assert _meet(tmp_path) == str(d) + ".1"
    if block == "loose":
        assert os.listdir(d) == []                      # left as it was
    elif block == "symlink":
        assert os.listdir(tmp_path / "real") == []      # never followed
    st = os.lstat(str(d) + ".1")
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_every_socket_directory_taken_is_a_clear_error(tmp_path):
    for k in range(bs_mod.SOCKET_DIR_TRIES):
        d = tmp_path / (f"ep_a2a-{os.getuid()}" + (f".{k}" if k else ""))
        d.mkdir()
        d.chmod(0o777)
    with pytest.raises(BootstrapError, match="no private socket directory.*pass base_dir="):
        UnixSocketBootstrap(0, 2, name=_name(), base_dir=tmp_path, timeout=1)


def test_stale_socket_file_replaced(tmp_path):
    name = _name()
    path = _path(tmp_path, name)
    bs_mod.socket_dir(tmp_path)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # bound, never listening, then closed: what a killed rank 0 leaves
    dead.close()
    assert os.path.exists(path)
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=5))
    peer = UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=5)
    with root.get() as b0, peer:
        assert not os.path.exists(path)
        t = _Thread(lambda: b0.allgather(b"zero"))
        assert peer.allgather(b"one") == [b"zero", b"one"] == t.get()


def test_live_socket_name_in_use(tmp_path):
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=2))
    _raw_connect(_path(tmp_path, name)).close()  # wait until it listens
    with pytest.raises(BootstrapError, match="in use"):
        UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=1)
    with pytest.raises(BootstrapTimeout):
        root.get()


def test_oversized_hello_rejected_then_group_forms(tmp_path):
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=5))
    raw = _raw_connect(_path(tmp_path, name))
    raw.sendall(_header(wire.HELLO, 1, 2, wire.MAX_PAYLOAD + 1))
    kind, payload = _raw_recv(raw)
    assert kind == wire.ERROR and b"over the 1048576-byte bound" in payload
    raw.close()
    with UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=5) as peer, root.get() as b0:
        t = _Thread(lambda: b0.barrier())
        peer.barrier()
        t.get()


def test_forged_pid_rejected(tmp_path):
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=1.5))
    raw = _raw_connect(_path(tmp_path, name))
    raw.sendall(_header(wire.HELLO, 1, 2, 36) + struct.pack("<I", os.getpid() + 1) + bytes(32))
    kind, payload = _raw_recv(raw)
    assert kind == wire.ERROR and b"claims pid" in payload
    raw.close()
    with pytest.raises(BootstrapTimeout, match="rejected connections.*claims pid") as ei:
        root.get()
    assert ei.value.missing == [1]
    assert not os.path.exists(_path(tmp_path, name)), "socket file left after a failed setup"


def test_oversized_collective_message_rejected(tmp_path):
    b0, raw = _root_with_raw_rank1(tmp_path)
    t = _Thread(lambda: b0.allgather(b"x"))
    raw.sendall(_header(wire.ALLGATHER, 1, 2, 64 << 20))
    with pytest.raises(BootstrapError, match="rank 1 in allgather sent a 67108864-byte allgather message, over"):
        t.get()
    kind, payload = _raw_recv(raw)
    assert kind == wire.ERROR and b"over the 1048576-byte bound" in payload
    with pytest.raises(BootstrapError, match="closed"):
        b0.barrier()
    raw.close()


def test_world_size_mismatch(tmp_path):
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 3, name=name, base_dir=tmp_path, timeout=5))
    with pytest.raises(BootstrapError, match="world_size 2, rank 0 has 3"):
        UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=5)
    with pytest.raises(BootstrapError, match="world_size 2, rank 0 has 3"):
        root.get()
    assert not os.path.exists(_path(tmp_path, name))


def test_duplicate_rank(tmp_path):
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 3, name=name, base_dir=tmp_path, timeout=5))
    first = _Thread(lambda: UnixSocketBootstrap(1, 3, name=name, base_dir=tmp_path, timeout=5))
    time.sleep(0.3)  # let the first rank 1 be admitted before the second
    with pytest.raises(BootstrapError, match="rank 1 connected twice"):
        UnixSocketBootstrap(1, 3, name=name, base_dir=tmp_path, timeout=5)
    for t in (root, first):
        with pytest.raises(BootstrapError, match="rank 1 connected twice"):
            t.get()


def test_mismatched_collectives_and_fd_counts(tmp_path):
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=5))
    with UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=5) as peer, root.get() as b0:
        fd = os.memfd_create("x")
        t = _Thread(lambda: b0.allgather_fds([fd, fd]))
        with pytest.raises(BootstrapError, match="same number"):
            peer.allgather_fds([fd])
        with pytest.raises(BootstrapError, match="same number"):
            t.get()
        os.close(fd)
    name = _name()
    root = _Thread(lambda: UnixSocketBootstrap(0, 2, name=name, base_dir=tmp_path, timeout=5))
    with UnixSocketBootstrap(1, 2, name=name, base_dir=tmp_path, timeout=5) as peer, root.get() as b0:
        t = _Thread(lambda: b0.barrier())
        with pytest.raises(BootstrapError, match="called allgather"):
            peer.allgather(b"x")
        with pytest.raises(BootstrapError, match="rank 1 called allgather"):
            t.get()


def test_peer_without_root_times_out(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(BootstrapTimeout, match="no rank 0") as ei:
        UnixSocketBootstrap(1, 2, name=_name(), base_dir=tmp_path, timeout=0.5)
    assert ei.value.missing == [0] and time.monotonic() - t0 < 1.5


class _BytesOnly(bs_mod.Bootstrap):
    """An adapter that can only allgather bytes, like the torch and MPI ones."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size, self.timeout = inner, inner.rank, inner.world_size, 5.0

    def allgather(self, data):
        return self.inner.allgather(data)

    def close(self):
        super().close()
        self.inner.close()


def test_default_allgather_fds_through_negotiated_socket(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # where the negotiated socket goes
    name, n = _name(), 3
    ranks = [_Thread(lambda r=r: UnixSocketBootstrap(r, n, name=name, timeout=5)) for r in range(n)]

    def rank_main(inner):
        with _BytesOnly(inner) as b:
            fd = os.memfd_create("x")
            os.write(fd, b"rank%d" % b.rank)
            got = b.allgather_fds([fd])
            os.close(fd)
            out = [os.pread(f, 16, 0) for [f] in got]
            wire.close_fds(f for [f] in got)
            b.barrier()
            return out

    outs = [_Thread(lambda t=t: rank_main(t.get())) for t in ranks]
    for t in outs:
        assert t.get() == [b"rank%d" % r for r in range(n)]
    assert os.listdir(tmp_path / f"ep_a2a-{os.getuid()}") == []


# -- topology -------------------------------------------------------------------------------------


def test_nvlink_same_device_needs_no_nvml(monkeypatch):
    def boom():
        raise AssertionError("NVML touched for a single device")

    monkeypatch.setattr(topology, "_nvml_module", boom)
    topology.check_nvlink(["0000:19:00.0", "00000000:19:00.0", "19:00.0"])
    topology.check_nvlink([])
    with pytest.raises(ValueError):
        topology.check_nvlink(["not-a-bus-id"])


def test_nvlink_distinct_unknown_devices_raise():
    with pytest.raises(topology.TopologyError):
        topology.check_nvlink(["0000:fe:1f.6", "0000:fe:1f.7"])


@pytest.mark.gpu
def test_describe_device0():
    from ep_a2a.driver.device import get_device

    bus = get_device(0).pci_bus_id
    topology.check_nvlink([bus, bus])
    d = topology.describe([bus, bus])
    assert d["gpus"][0]["name"] and d["gpus"][0]["name"] == d["gpus"][1]["name"]
    assert isinstance(d["gpus"][0]["nvlink_active_links"], int)
    assert d["nvlink_p2p"] == [["same_device"] * 2] * 2
