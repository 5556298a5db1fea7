"""How the processes of one all-to-all group find each other and swap small bytes and file descriptors.

Each rank's workspace is a VMM allocation exported as a POSIX fd; peers import it. An fd
only crosses a process boundary through SCM_RIGHTS on an AF_UNIX socket, so every
bootstrap ends in `UnixSocketBootstrap` for `allgather_fds`, and the whole group must
live on one node for `allgather_fds` (a workspace spanning hosts shares FABRIC handles, which
are bytes, through `allgather` instead: symmetric.py).

Nothing received from a peer is unpickled: the wire format is a fixed struct header plus
raw bytes, every message is size-bounded and every wait is bounded by the timeout.
"""
from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import re
import secrets
import select
import signal
import socket
import stat
import struct
import time

from . import bootstrap_wire as wire
from .bootstrap_admission import RootAdmission, interruption, peer_cred, remove_stale_socket
from .bootstrap_identity import launcher_job
from .bootstrap_wire import MAX_FDS, MAX_PAYLOAD
from .driver.lifetime import Owned
from .errors import BootstrapError, BootstrapTimeout

__all__ = ["Bootstrap", "BootstrapError", "BootstrapTimeout", "NoJobTokenError", "UnixSocketBootstrap", "new_job_token",
           "TorchDistributedBootstrap", "MpiBootstrap"]

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_PEER_GRACE = 1.0     # peers wait a little longer than rank 0 so that rank 0's diagnosis reaches them
_SUN_PATH_MAX = 107   # sockaddr_un.sun_path is 108 bytes including the NUL


def new_job_token() -> str:
    """A fresh secret naming one job: draw it once (in the launcher, like NCCL's unique id)
    and give it to every rank as UnixSocketBootstrap(..., job_token=...)."""
    return secrets.token_hex(16)


def _job_digest(job_token) -> bytes:
    """What a hello carries of the job token: its SHA-256 (32 zero bytes without a token)."""
    if job_token is None:
        return bytes(32)
    raw = job_token.encode() if isinstance(job_token, str) else bytes(job_token)
    if not raw:
        raise ValueError("job_token: must not be empty (omit it, or use new_job_token())")
    return hashlib.sha256(b"ep_a2a job " + raw).digest()


class NoJobTokenError(BootstrapError):
    """A rendezvous of several ranks without a job token, where the launcher names no job."""


def _job_of(rank: int, world_size: int, name: str, job_token) -> tuple[bytes, str]:
    """The digest every hello carries, and where the job's identity came from: the token
    passed, else $EP_A2A_JOB_TOKEN, else the launcher's job (bootstrap_identity), else a
    refusal (a name alone lets two jobs that chose it, or a leftover rank, cross-wire)."""
    if job_token is not None:
        return _job_digest(job_token), "job_token"
    if os.environ.get("EP_A2A_JOB_TOKEN"):
        return _job_digest(os.environ["EP_A2A_JOB_TOKEN"]), "$EP_A2A_JOB_TOKEN"
    if world_size == 1:
        return _job_digest(None), "a group of one"
    job, what = launcher_job(rank, world_size)
    if job is not None:
        return _job_digest("launcher " + job), what
    raise NoJobTokenError(
        f"bootstrap {name!r}: rank {rank} of {world_size} has no job token, and {what}. A name alone "
        "cannot tell two jobs that chose it (or a rank left over from an earlier job) apart, so the "
        "group is not formed. Draw a token once where the ranks are started and give the same one "
        "to every rank: UnixSocketBootstrap(..., job_token=token) with token = "
        "ep_a2a.bootstrap.new_job_token() in the launcher, or "
        "EP_A2A_JOB_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))') exported "
        "for this launch only")


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM's default action ends the process without unwinding, leaving rank 0's socket
    file and the peers waiting for their timeout: while a rendezvous or a collective is in
    flight (main thread, default disposition only) it raises SystemExit(128 + SIGTERM)
    instead, so the cleanup runs, the peers are told, and the process still ends."""
    def terminate(signum, _frame):
        raise SystemExit(128 + signum)
    mine = False
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, terminate)
            mine = True
    except ValueError:  # not the main thread: only the main thread may set handlers
        pass
    try:
        yield
    finally:
        if mine and signal.getsignal(signal.SIGTERM) is terminate:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Bootstrap(Owned, abc.ABC):
    """Rendezvous of `world_size` processes: collectives over small byte strings and fds.

    Every method is collective: all ranks call it in the same order. Not thread-safe.
    """

    rank: int
    world_size: int
    timeout: float = 60.0
    _fd_bootstrap: "UnixSocketBootstrap | None" = None  # lazily made by the default allgather_fds
    base_dir = None  # where that one's socket lives (socket_dir)

    @abc.abstractmethod
    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's `data` in rank order (sizes may differ per rank)."""

    def allgather_fds(self, fds: list[int]) -> list[list[int]]:
        """Every rank's fds in rank order, as NEW fds the caller owns and must close.

        All ranks pass the same number of fds; this rank's own entry holds dup()s.
        Default: through a private UnixSocketBootstrap whose name and job token rank 0
        draws and shares with `allgather` (so all ranks must be on one node).
        """
        if self._fd_bootstrap is None:
            proposal = f"fds-{os.getpid()}-{secrets.token_hex(8)} {new_job_token()}".encode() if self.rank == 0 else b""
            name, _, token = self.allgather(proposal)[0].decode().partition(" ")
            if not _NAME_RE.fullmatch(name) or not token:
                raise BootstrapError(f"rank 0 proposed an invalid socket name or job token {name!r}")
            self._fd_bootstrap = UnixSocketBootstrap(self.rank, self.world_size, name=name, timeout=self.timeout,
                                                     base_dir=self.base_dir, job_token=token)
        return self._fd_bootstrap.allgather_fds(fds)

    def barrier(self) -> None:
        """Return once every rank of the group has called barrier."""
        self.allgather(b"")

    _kind = "bootstraps"

    def _release(self) -> None:
        if self._fd_bootstrap is not None:
            self._fd_bootstrap.close()
            self._fd_bootstrap = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"



SOCKET_DIR_TRIES = 8  # ep_a2a-<uid>, then ep_a2a-<uid>.1 ... .7


def _private_dir(path: str) -> str | None:
    """`path` created 0700 or already there as such, owned by us and no symlink; else None."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(path)  # lstat: a symlink planted by someone else must not be followed
    ok = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
    return path if ok else None


def socket_dir(base_dir=None) -> str:
    """`<base_dir or $XDG_RUNTIME_DIR or /tmp>/ep_a2a-<uid>`, created 0700.

    Only this user can then create or connect to the sockets inside, which is the first
    line of defence; SO_PEERCRED on every connection is the second. Anyone may create that
    name first in a shared /tmp (and a sticky /tmp keeps us from removing it): then the next
    of `ep_a2a-<uid>.1` ... that is ours, the same sequence on every rank, so the ranks still
    meet without any other channel.
    """
    base = os.fspath(base_dir or os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
    names = [f"ep_a2a-{os.getuid()}"] + [f"ep_a2a-{os.getuid()}.{k}" for k in range(1, SOCKET_DIR_TRIES)]
    for n in names:
        path = _private_dir(os.path.join(base, n))
        if path:
            return path
    raise BootstrapError(f"no private socket directory in {base}: {', '.join(names)} all exist and are not "
                         f"directories of uid {os.getuid()} with mode 0700 (someone else made them); pass "
                         "base_dir= (e.g. $XDG_RUNTIME_DIR or a directory of your own)")


def _dup_all(fds) -> list:
    """dup() of every fd, or none: a ValueError naming the first that is not open."""
    out = []
    for i, fd in enumerate(fds):
        try:
            out.append(os.dup(fd))
        except OSError as e:
            wire.close_fds(out)
            raise ValueError(f"fds[{i}]: {fd} is not an open file descriptor ({e.strerror})") from None
    return out


class UnixSocketBootstrap(RootAdmission, Bootstrap):
    """Processes on one node meet at an AF_UNIX socket of rank 0 (star topology through rank 0).

    Rank 0 listens on `socket_dir(base_dir)/<name>.sock` and the other ranks connect,
    retrying until `timeout`. A connection is admitted only if its SO_PEERCRED uid is ours
    and the pid in its hello equals the credential pid (same pid namespace required).
    The socket file is unlinked as soon as all ranks have connected, and on failure.
    `name` must be unique per group on the node ([A-Za-z0-9_.-], at most 64 characters).

    Which job a rank belongs to decides whom rank 0 admits, so that two jobs that chose one
    name, or a rank left over from an earlier job, are refused instead of cross-wired. It is,
    in this order: `job_token` (a str or bytes secret, the same on every rank of one job,
    e.g. new_job_token() drawn once by the launcher); $EP_A2A_JOB_TOKEN; the job its launcher
    names, where that differs per job (torchrun with --standalone or --rdzv-id, srun, Open
    MPI's mpirun, Hydra's mpiexec; see bootstrap_identity) and started this process as this
    rank; otherwise construction raises NoJobTokenError (a BootstrapError) saying how to give
    a token. `job_source` says which one it was.

    Interrupted anywhere (SIGINT; SIGTERM, raised as SystemExit(143) while the rendezvous or
    a collective is in flight and the default action is set; an exception), a rank removes its
    socket file, closes its fds and tells the others, who raise a BootstrapError at once; a rank killed outright (SIGKILL) is found by the others
    as a lost connection or, before it connected, at their timeout, and the peers of a killed
    rank 0 remove the socket file it left.
    """

    def __init__(self, rank: int, world_size: int, *, name: str, timeout: float = 60.0, base_dir=None,
                 job_token=None):
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"bootstrap name {name!r} must be 1-64 characters of [A-Za-z0-9_.-]")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.rank, self.world_size, self.name, self.timeout = rank, world_size, name, float(timeout)
        self._job, self.job_source = _job_of(rank, world_size, name, job_token)
        self.path = os.path.join(socket_dir(base_dir), name + ".sock")
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
            raise BootstrapError(f"socket path {self.path!r} is longer than the {_SUN_PATH_MAX} bytes AF_UNIX "
                                 f"allows: use a shorter base_dir or name")
        self._peers: dict[int, socket.socket] = {}  # rank 0: rank -> connection
        self._sock: socket.socket | None = None      # ranks > 0: connection to rank 0
        self._listener: socket.socket | None = None
        self._seq = 0            # collectives begun: every message carries it, so none pairs with another's
        self._why_closed = ""    # what closed it, for the error of every later call
        self._opened()
        if world_size == 1:
            return
        try:
            with _sigterm_raises():
                self._setup_root() if rank == 0 else self._setup_peer()
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------------------------

    def _setup_peer(self) -> None:
        try:
            self._connect_and_hello()
        except BaseException:
            # A rank 0 killed outright leaves its socket file behind: whoever learns it first removes it
            remove_stale_socket(self.path)
            raise

    def _connect_and_hello(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(wire.remaining(deadline))
                s.connect(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError, BlockingIOError):  # rank 0 not up yet, a stale file, a full backlog
                s.close()
                if time.monotonic() >= deadline:
                    raise BootstrapTimeout(f"bootstrap {self.name!r}: rank {self.rank} found no rank 0 listening on "
                                           f"{self.path} within {self.timeout:g} s", [0]) from None
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                s.close()
                raise BootstrapTimeout(f"bootstrap {self.name!r}: rank {self.rank} found no rank 0 listening on "
                                       f"{self.path} within {self.timeout:g} s", [0]) from None
            except BaseException:
                s.close()
                raise
        self._sock = s
        pid, uid, _ = peer_cred(s)
        if uid != os.getuid():
            raise BootstrapError(f"{self.path} is served by pid {pid} of uid {uid}, not by us (uid {os.getuid()})")
        self._from_root(wire.WELCOME, deadline + _PEER_GRACE, send=(wire.HELLO, struct.pack("<I", os.getpid()) + self._job))

    # -- collectives ---------------------------------------------------------------------------

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order (collective)."""
        data = bytes(data)
        if len(data) > MAX_PAYLOAD:
            raise ValueError(f"allgather contribution of {len(data)} bytes exceeds the {MAX_PAYLOAD}-byte bound")
        got = self._collective(wire.ALLGATHER, data, [])
        return [p for p, _ in got]

    def allgather_fds(self, fds: list[int]) -> list[list[int]]:
        """Every rank's file descriptors, in rank order, received as new fds of this process
        (SCM_RIGHTS; the caller closes them)."""
        fds = [int(fd) for fd in fds]
        if len(fds) > MAX_FDS:
            raise ValueError(f"allgather_fds of {len(fds)} fds exceeds the {MAX_FDS}-fd bound")
        got = self._collective(wire.ALLGATHER_FDS, struct.pack("<I", len(fds)), fds)
        return [f for _, f in got]

    def barrier(self) -> None:
        """Return once every rank of the group has called barrier."""
        self._collective(wire.BARRIER, b"", [])

    def _collective(self, kind: int, payload: bytes, fds: list[int]) -> list[tuple[bytes, list[int]]]:
        """Star through rank 0: everyone sends its part to rank 0, which sends everyone the others' parts."""
        if self._closed:
            raise BootstrapError(f"bootstrap {self.name!r} is closed" + (f": {self._why_closed}" if self._why_closed else ""))
        own = (payload, _dup_all(fds))  # (before the collective begins: a bad fd changes nothing)
        self._seq += 1
        deadline = time.monotonic() + self.timeout
        if self.world_size == 1:
            return [own]
        try:
            with _sigterm_raises():
                if self.rank == 0:
                    return self._root_collective(kind, own, deadline)
                msgs = self._from_root(kind, deadline + _PEER_GRACE, send=(kind, payload), fds=fds,
                                       sources=[r for r in range(self.world_size) if r != self.rank])
                msgs.insert(self.rank, own)  # rank 0 has checked every rank's fd count against its own
                return msgs
        except BaseException as e:
            wire.close_fds(own[1])
            if not isinstance(e, (BootstrapError, OSError)):  # KeyboardInterrupt, SystemExit, ...
                self._interrupted(e, kind)
            elif self._closed and not self._why_closed:
                self._why_closed = f"{wire.KIND_NAMES[kind]} #{self._seq} failed: {e}"
            raise

    def _interrupted(self, e: BaseException, kind: int) -> None:
        """A collective left halfway cannot be resumed: the peers' parts of it would pair with
        this rank's next call. Close, and make the peers raise now instead of at their timeout."""
        self._why_closed = f"rank {self.rank} was interrupted by {interruption(e)} in {wire.KIND_NAMES[kind]} #{self._seq}"
        err = BootstrapError(f"bootstrap {self.name!r}: {self._why_closed}; the group cannot go on")
        if self.rank == 0:
            self._abort(err)
        else:
            self.close()  # rank 0 finds the connection closed and tells the others

    def _root_collective(self, kind: int, own, deadline: float):
        got = {0: own}
        try:
            pending = {conn: r for r, conn in self._peers.items()}
            while pending:
                try:
                    ready, _, _ = select.select(list(pending), [], [], wire.remaining(deadline))
                    for conn in ready:
                        r = pending.pop(conn)
                        k, src, _, sq, p, f = wire.recv(conn, deadline, f"bootstrap {self.name!r}: rank {r} in "
                                                    f"{wire.KIND_NAMES[kind]}", MAX_FDS if kind == wire.ALLGATHER_FDS else 0)
                        got[r] = (p, f)
                        if sq != self._seq:
                            raise BootstrapError(f"bootstrap {self.name!r}: rank {r} sent its part of collective "
                                                 f"#{sq} while rank 0 is at #{self._seq} ({wire.KIND_NAMES[kind]}): "
                                                 "a collective was interrupted or skipped on one side")
                        if k != kind or src != r:
                            raise BootstrapError(f"bootstrap {self.name!r}: rank {r} called {wire.KIND_NAMES.get(k, k)}"
                                                 f"{f' as rank {src}' if src != r else ''} while rank 0 called "
                                                 f"{wire.KIND_NAMES[kind]}")
                except TimeoutError:
                    missing = sorted(r for r in self._peers if r not in got)
                    raise BootstrapTimeout(f"bootstrap {self.name!r}: rank(s) {missing} did not reach "
                                           f"{wire.KIND_NAMES[kind]} within {self.timeout:g} s", missing) from None
            out = [got[r] for r in range(self.world_size)]
            if kind == wire.ALLGATHER_FDS:
                self._check_fd_counts(out)
            for dst, conn in self._peers.items():
                for src, (p, f) in enumerate(out):
                    if src != dst:
                        try:
                            wire.send(conn, deadline, kind, src, self.world_size, p, f, self._seq)
                        except TimeoutError:
                            raise BootstrapTimeout(f"bootstrap {self.name!r}: rank {dst} did not take the "
                                                   f"{wire.KIND_NAMES[kind]} result within {self.timeout:g} s",
                                                   [dst]) from None
            return out
        except BaseException as e:
            for r, (_, f) in got.items():
                if r != 0:
                    wire.close_fds(f)
            if not isinstance(e, (BootstrapError, OSError)):
                raise
            err = e if isinstance(e, BootstrapError) else BootstrapError(
                f"bootstrap {self.name!r}: {wire.KIND_NAMES[kind]} failed on rank 0: {e}")
            self._abort(err)  # tell the others, so they raise this cause instead of timing out
            if err is e:
                raise
            raise err from e

    def _check_fd_counts(self, parts) -> None:
        mine = len(parts[0][1])
        for r, (p, f) in enumerate(parts):
            (claimed,) = struct.unpack("<I", p) if len(p) == 4 else (-1,)
            if claimed != len(f) or len(f) != mine:
                raise BootstrapError(f"bootstrap {self.name!r}: rank {r} passed {claimed} fds ({len(f)} arrived), "
                                     f"rank 0 passed {mine}: all ranks must pass the same number")

    def _from_root(self, kind: int, deadline: float, *, send, fds=(), sources=(0,)):
        """Peer side: send our part to rank 0, then take one `kind` message per rank in `sources`."""
        what = wire.KIND_NAMES[kind]
        who = f"bootstrap {self.name!r}: rank 0 (seen from rank {self.rank} in {what})"
        msgs = []
        try:
            try:
                wire.send(self._sock, deadline, send[0], self.rank, self.world_size, send[1], fds, self._seq)
            except ConnectionError as e:
                # Rank 0 may have failed the collective already: its reason is still in our receive buffer.
                k, p = self._pending_abort()
                raise wire.abort_reason(k, p) if k else BootstrapError(f"{who}: connection lost ({e})") from None
            for expected in sources:
                k, src, ws, sq, p, f = wire.recv(self._sock, deadline, who, MAX_FDS if kind == wire.ALLGATHER_FDS else 0)
                msgs.append((p, f))
                if k in (wire.ERROR, wire.TIMEOUT):
                    raise wire.abort_reason(k, p)
                if sq != self._seq:
                    raise BootstrapError(f"{who}: answered collective #{sq}, this rank is at #{self._seq}")
                if k != kind or ws != self.world_size or src != expected:
                    raise BootstrapError(f"{who}: answered with {wire.KIND_NAMES.get(k, k)} of rank {src} "
                                         f"(world_size {ws}); expected {what} of rank {expected}")
            return msgs
        except BaseException as e:
            for _, f in msgs:
                wire.close_fds(f)
            self.close()
            if isinstance(e, TimeoutError):
                raise BootstrapTimeout(f"{who}: no answer within {self.timeout:g} s", [0]) from None
            raise

    def _pending_abort(self):
        try:
            k, _, _, _, p, _ = wire.recv(self._sock, time.monotonic() + 0.5, "rank 0")
            return (k, p) if k in (wire.ERROR, wire.TIMEOUT) else (None, b"")
        except (OSError, BootstrapError):
            return None, b""

    # -- teardown ------------------------------------------------------------------------------

    def _notify(self, conns, err: BootstrapError) -> None:
        """Best effort: tell peers why we fail, so they raise the real cause instead of timing out."""
        if isinstance(err, BootstrapTimeout):
            kind, payload = wire.TIMEOUT, wire.pack_timeout(str(err), err.missing)
        else:
            kind, payload = wire.ERROR, str(err).encode()
        payload = payload[:MAX_PAYLOAD]
        for conn in conns:
            try:
                wire.send(conn, time.monotonic() + 0.5, kind, 0, self.world_size, payload)
            except (OSError, TimeoutError):
                pass

    def _abort(self, err: BootstrapError) -> None:
        try:
            self._notify(list(self._peers.values()), err)
        finally:  # a second interrupt while telling the peers must not keep the sockets open
            self.close()

    def _unlink(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _release(self) -> None:
        """Close the connections and remove the socket file if rank 0 still has it."""
        super()._release()
        self._unlink()
        for conn in self._peers.values():
            conn.close()
        self._peers.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None



class TorchDistributedBootstrap(Bootstrap):
    """Adapter for an initialised torch.distributed process group.

    Bytes travel as uint8 tensors (CPU for gloo, the current CUDA device for nccl), lengths
    first; never through pickle. `allgather_fds` needs all ranks on ONE node: it runs over
    a UnixSocketBootstrap whose name rank 0 draws. `timeout` bounds that socket bootstrap;
    torch collectives obey the process group's own timeout.
    """

    def __init__(self, group=None, *, timeout: float = 60.0, base_dir=None):
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self._group, self.base_dir = torch, dist, group, base_dir
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.timeout = float(timeout)
        backend = str(dist.get_backend(group))
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._opened()

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order (collective)."""
        import numpy as np

        torch, dist = self._torch, self._dist
        n = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        sizes = [torch.empty_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self._group)
        sizes = [int(s.item()) for s in sizes]
        width = max(max(sizes), 1)  # zero-size tensors are not reliably supported by every backend
        buf = np.zeros(width, np.uint8)
        buf[:len(data)] = np.frombuffer(bytes(data), np.uint8)
        t = torch.from_numpy(buf).to(self._device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self._group)
        return [o.cpu().numpy()[:s].tobytes() for o, s in zip(out, sizes)]


class MpiBootstrap(Bootstrap):
    """Adapter for an mpi4py communicator: Allgather/Allgatherv on uint8 buffers, never pickle.

    `allgather_fds` needs all ranks on ONE node: it runs over a UnixSocketBootstrap whose
    name rank 0 draws. `timeout` bounds that socket bootstrap; MPI collectives have none.
    """

    def __init__(self, comm, *, timeout: float = 60.0, base_dir=None):
        from mpi4py import MPI

        self._MPI, self._comm, self.base_dir = MPI, comm, base_dir
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        self._opened()

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order (collective)."""
        import numpy as np

        MPI = self._MPI
        sizes = np.empty(self.world_size, np.int64)
        self._comm.Allgather([np.array([len(data)], np.int64), MPI.INT64_T], [sizes, MPI.INT64_T])
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        recv = np.empty(max(int(sizes.sum()), 1), np.uint8)
        send = np.frombuffer(bytes(data), np.uint8)
        self._comm.Allgatherv([send, len(data), MPI.BYTE],
                              [recv, (sizes.tolist(), displs.tolist()), MPI.BYTE])
        return [recv[d:d + s].tobytes() for d, s in zip(displs.tolist(), sizes.tolist())]
