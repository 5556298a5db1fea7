"""Rank 0's side of the rendezvous: accept connections and admit the group's ranks.

A connection is admitted only if its SO_PEERCRED uid is ours, the pid in its hello equals the
credential pid (same pid namespace required) and its hello proves the job token. Hellos are
read from every waiting connection at once (non-blocking), so silent or slow connections
cost no one else their time; how many may wait, and how much of their story is kept for
the error, are bounded.
"""
from __future__ import annotations

import errno
import hmac
import os
import select
import signal
import socket
import stat
import struct
import time

from . import bootstrap_wire as wire
from .bootstrap_wire import MAX_PAYLOAD
from .errors import BootstrapError, BootstrapTimeout

_HELLO_TIMEOUT = 5.0  # a genuine peer sends its hello right after connect; a silent one must not stall setup
_MAX_PENDING = 64     # connections beyond the group's own that may wait for their hello at once


class _Rejections:
    """Why connections were turned away, for the timeout's message: the first few in full,
    the rest counted (a connect/close loop must not grow the message without bound)."""
    KEEP = 8

    def __init__(self):
        self.first, self.more = [], 0

    def add(self, why: str) -> None:
        if len(self.first) < self.KEEP:
            self.first.append(why[:300])
        else:
            self.more += 1

    def summary(self) -> str:
        if not self.first:
            return ""
        more = f" (and {self.more} more)" if self.more else ""
        return f"; rejected connections: {'; '.join(self.first)}{more}"


class _Rejected(BootstrapError):
    """A connection that is not a member of this group (rank 0 drops it and keeps waiting)."""


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def interruption(e: BaseException) -> str:
    """What interrupted a rank, as the others' errors name it (SIGTERM arrives as SystemExit(143))."""
    if isinstance(e, SystemExit) and e.code == 128 + signal.SIGTERM:
        return "SIGTERM"
    return type(e).__name__


def remove_stale_socket(path: str) -> bool:
    """Remove `path` if it is a socket file nobody listens on (its rank 0 died without
    unlinking it); True if it is gone. The file removed is the one probed (same inode), so
    a rank 0 that replaced it meanwhile keeps its own."""
    for _ in range(10):
        try:
            before = os.lstat(path)
        except FileNotFoundError:
            return True
        if not stat.S_ISSOCK(before.st_mode):
            return False
        verdict = _probe(path)
        if verdict == "listening":
            return False
        if verdict == "dying":
            time.sleep(0.02)
            continue
        if verdict == "refused":
            try:
                if os.lstat(path).st_ino == before.st_ino:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            return True
    return False


def _probe(path: str) -> str:
    """'refused', 'listening', or 'dying': a process being killed may release its connections
    before its listener, so a connect that its peers' EOF preceded can still succeed; a live
    rank 0 then keeps the probe open (waiting for a hello), a dying one resets it at once."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        probe.settimeout(0.1)
        return "dying" if not probe.recv(1) else "listening"
    except (FileNotFoundError, ConnectionRefusedError):
        return "refused"
    except ConnectionResetError:
        return "dying"
    except OSError:  # TimeoutError included: it holds the connection open, as a live rank 0 does
        return "listening"
    finally:
        probe.close()


class RootAdmission:
    """The rank-0 half of UnixSocketBootstrap (which provides path, name, world_size,
    timeout, the job digest, its peers and _notify / _abort / _unlink)."""

    def _setup_root(self) -> None:
        """Accept and admit until every rank is in. Hellos are read from all waiting
        connections at once (non-blocking), so silent or slow connections cost no one else
        their time; how many may wait, and how much of their story is kept, are bounded."""
        deadline = time.monotonic() + self.timeout
        self._listener = self._listen()
        rejected = _Rejections()
        pending: dict = {}  # connection -> [hello deadline, pid, bytes so far]

        def reject(conn, why: str) -> None:
            pending.pop(conn, None)
            rejected.add(why)
            try:
                conn.setblocking(True)
                self._notify([conn], BootstrapError(f"rejected by rank 0 of {self.name!r}: {why}"))
            finally:  # (an interrupt while telling it must not leave the connection open)
                conn.close()
        try:
            while len(self._peers) < self.world_size - 1:
                now = time.monotonic()
                if now >= deadline:
                    missing = sorted(set(range(1, self.world_size)) - set(self._peers))
                    raise BootstrapTimeout(f"bootstrap {self.name!r}: rank(s) {missing} did not connect within "
                                           f"{self.timeout:g} s{rejected.summary()}", missing)
                for conn, (dl, pid, _) in list(pending.items()):
                    if now >= dl:
                        reject(conn, f"pid {pid} sent no hello within {_HELLO_TIMEOUT:g} s")
                wake = min([deadline] + [dl for dl, _, _ in pending.values()])
                ready, _, _ = select.select([self._listener, *pending], [], [], max(0.0, wake - now))
                for conn in ready:
                    if conn is self._listener:
                        self._accept(pending, reject, min(deadline, now + _HELLO_TIMEOUT))
                    elif conn in pending:
                        self._read_hello(conn, pending, reject)
            for conn in list(pending):
                reject(conn, "the group was complete")
            self._unlink()
            for conn in self._peers.values():
                wire.send(conn, deadline, wire.WELCOME, 0, self.world_size)
        except BaseException as e:
            for conn in pending:
                conn.close()
            if isinstance(e, BootstrapError):
                self._abort(e)
                raise
            if not isinstance(e, OSError):  # KeyboardInterrupt, SIGTERM, ...: the admitted ranks learn it now
                self._abort(BootstrapError(f"bootstrap {self.name!r}: rank 0 was interrupted by {interruption(e)} "
                                           "while the group formed"))
                raise
            # TimeoutError included: a peer that stopped reading, or died, before its welcome
            err = (BootstrapTimeout if isinstance(e, TimeoutError) else BootstrapError)(
                f"bootstrap {self.name!r}: sending the welcome failed: {e or 'timed out'}")
            self._abort(err)
            raise err from None

    def _accept(self, pending: dict, reject, hello_deadline: float) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pending[conn] = [hello_deadline, -1, bytearray()]  # from here an interrupt's cleanup closes it
        pid, uid, _ = peer_cred(conn)
        pending[conn][1] = pid
        if uid != os.getuid():
            reject(conn, f"pid {pid} runs as uid {uid}, not {os.getuid()}")
        elif len(pending) > _MAX_PENDING + self.world_size:
            reject(conn, f"pid {pid} connected while {_MAX_PENDING + self.world_size} others waited for their hello")
        else:
            conn.setblocking(False)

    def _read_hello(self, conn, pending: dict, reject) -> None:
        """Take what has arrived of one connection's hello; admit it once whole."""
        _, pid, buf = pending[conn]
        want = wire.HEADER.size + 4 + len(self._job)
        try:
            data = conn.recv(want - len(buf))  # (no ancillary buffer: fds sent along are discarded)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return reject(conn, f"pid {pid}: connection lost ({e})")
        if not data:
            return reject(conn, f"pid {pid} closed the connection before its hello")
        buf += data
        if len(buf) < wire.HEADER.size:
            return
        magic, version, kind, rank, world_size, _, n = wire.HEADER.unpack_from(buf)
        if magic != wire.MAGIC or version != wire.VERSION:
            return reject(conn, f"pid {pid} sent no ep_a2a bootstrap message (magic {magic:#x}, version {version})")
        if n > MAX_PAYLOAD:
            return reject(conn, f"pid {pid} sent a {n}-byte {wire.KIND_NAMES.get(kind, kind)} message, over the "
                                f"{MAX_PAYLOAD}-byte bound")
        if kind != wire.HELLO:
            return reject(conn, f"pid {pid} sent a {wire.KIND_NAMES.get(kind, kind)} message instead of a hello")
        if wire.HEADER.size + n != want:
            return reject(conn, f"pid {pid} sent a {n}-byte hello; a hello has {want - wire.HEADER.size} bytes")
        if len(buf) < want:
            return
        conn.setblocking(True)
        try:
            self._admit(conn, pid, rank, world_size, bytes(buf[wire.HEADER.size:]))
        except _Rejected as e:
            return reject(conn, str(e))
        del pending[conn]  # (only now: until admitted, an interrupt's cleanup closes it as pending)

    def _listen(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                s.bind(self.path)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:  # anything but "a socket file is there already"
                    raise
                self._remove_stale()
                s.bind(self.path)
            s.listen(self.world_size + _MAX_PENDING)
            return s
        except BaseException:
            s.close()
            raise

    def _remove_stale(self) -> None:
        """A socket file nobody listens on is left over from a dead process: remove it."""
        if not remove_stale_socket(self.path):
            raise BootstrapError(f"bootstrap name {self.name!r} is in use: another process listens on {self.path}")

    def _admit(self, conn: socket.socket, pid: int, rank: int, world_size: int, payload: bytes) -> None:
        (hello_pid,) = struct.unpack_from("<I", payload)
        if hello_pid != pid:
            raise _Rejected(f"hello claims pid {hello_pid} but the connection belongs to pid {pid}")
        if not hmac.compare_digest(payload[4:], self._job):
            raise _Rejected(f"pid {pid} (rank {rank}) belongs to another job: its job token differs from rank 0's "
                            f"(two jobs chose the name {self.name!r}, or a rank of an earlier job is still running)")
        # From here the peer is a process of ours: a disagreement is a misconfigured group, not an intruder.
        err = None
        if world_size != self.world_size:
            err = f"rank {rank} (pid {pid}) has world_size {world_size}, rank 0 has {self.world_size}"
        elif not 1 <= rank < self.world_size:
            err = f"rank {rank} (pid {pid}) is out of range for world_size {self.world_size}"
        elif rank in self._peers:
            err = f"rank {rank} connected twice (the second time from pid {pid})"
        if err:
            e = BootstrapError(f"bootstrap {self.name!r}: {err}")
            try:
                self._notify([conn], e)
            finally:
                conn.close()
            raise e
        self._peers[rank] = conn
