"""The bootstrap's wire format: a fixed little-endian header, then raw bytes; SCM_RIGHTS fds
ride on the header. Nothing received is unpickled, every message is size-bounded and every
wait is bounded by a deadline."""
from __future__ import annotations

import array
import os
import socket
import struct
import time

from .errors import BootstrapError, BootstrapTimeout

MAX_PAYLOAD = 1 << 20  # bytes per message; a rank's allgather contribution is one message
MAX_FDS = 64           # fds per message; a rank's allgather_fds contribution is one message

# magic u32, version u16, kind u16, rank u32, world_size u32, collective number u32, payload length u32
HEADER = struct.Struct("<IHHIIII")
MAGIC = 0x32413245  # b"E2A2" little-endian
VERSION = 2
HELLO, WELCOME, ALLGATHER, ALLGATHER_FDS, BARRIER, ERROR, TIMEOUT = range(1, 8)
KIND_NAMES = {HELLO: "hello", WELCOME: "welcome", ALLGATHER: "allgather",
              ALLGATHER_FDS: "allgather_fds", BARRIER: "barrier", ERROR: "error", TIMEOUT: "timeout"}


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def send(sock: socket.socket, deadline: float, kind: int, rank: int, world_size: int,
          payload: bytes = b"", fds=(), seq: int = 0) -> None:
    msg = HEADER.pack(MAGIC, VERSION, kind, rank, world_size, seq, len(payload)) + payload
    sock.settimeout(remaining(deadline))
    sent = socket.send_fds(sock, [msg], list(fds)) if fds else 0
    if sent < len(msg):  # never sendall(b""): it fails with EPIPE once the peer has closed
        sock.sendall(msg[sent:])


def recv(sock: socket.socket, deadline: float, who: str, max_fds: int = 0):
    """One message from `who`: (kind, rank, world_size, seq, payload, fds), seq numbering the
    collective it belongs to (0: setup). Raises TimeoutError or BootstrapError."""
    buf, fds = bytearray(), []
    try:
        while len(buf) < HEADER.size:
            sock.settimeout(remaining(deadline))
            if max_fds:
                # SCM_RIGHTS fds ride on the first byte of the sender's sendmsg, i.e. the header.
                # recvmsg directly, not socket.recv_fds: that one drops `flags`, and received
                # fds must be close-on-exec like every fd Python creates. The bound is per
                # message: a header split over several sends gets what is left of it.
                data, anc, flags, _ = sock.recvmsg(HEADER.size - len(buf), socket.CMSG_SPACE((max_fds - len(fds)) * 4),
                                                   socket.MSG_CMSG_CLOEXEC)
                for level, typ, cdata in anc:
                    if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                        a = array.array("i")
                        a.frombytes(cdata[:len(cdata) - len(cdata) % a.itemsize])
                        fds.extend(a)
                if flags & socket.MSG_CTRUNC:
                    raise BootstrapError(f"{who} sent a message with more than {max_fds} fds")
            else:
                data = sock.recv(HEADER.size - len(buf))
            if not data:
                raise BootstrapError(f"{who} closed the connection (its process exited or closed the bootstrap)")
            buf += data
        magic, version, kind, rank, world_size, seq, n = HEADER.unpack(buf)
        if magic != MAGIC or version != VERSION:
            raise BootstrapError(f"{who} sent no ep_a2a bootstrap message (magic {magic:#x}, version {version}; "
                                 f"expected {MAGIC:#x}, {VERSION})")
        if n > MAX_PAYLOAD:
            raise BootstrapError(f"{who} sent a {n}-byte {KIND_NAMES.get(kind, kind)} message, over the "
                                 f"{MAX_PAYLOAD}-byte bound")
        payload = bytearray(n)
        view, got = memoryview(payload), 0
        while got < n:
            sock.settimeout(remaining(deadline))
            k = sock.recv_into(view[got:])
            if not k:
                raise BootstrapError(f"{who} closed the connection in the middle of a message")
            got += k
        return kind, rank, world_size, seq, bytes(payload), fds
    except BaseException as e:
        close_fds(fds)
        if isinstance(e, ConnectionError):
            raise BootstrapError(f"{who}: connection lost ({e})") from None
        raise


def close_fds(fds) -> None:
    """Close every fd; a list is emptied, so that closing it again closes nothing twice."""
    for fd in list(fds):
        try:
            os.close(fd)
        except OSError:
            pass
    if isinstance(fds, list):
        fds.clear()


def pack_timeout(message: str, missing) -> bytes:
    missing = list(missing)
    return struct.pack(f"<I{len(missing)}I", len(missing), *missing) + message.encode()


def abort_reason(kind: int, payload: bytes) -> BootstrapError:
    """The exception rank 0 reported in an ERROR or TIMEOUT message."""
    if kind == ERROR or len(payload) < 4:
        return BootstrapError(payload.decode(errors="replace"))
    n = min(struct.unpack_from("<I", payload)[0], (len(payload) - 4) // 4)
    return BootstrapTimeout(payload[4 + 4 * n:].decode(errors="replace"), struct.unpack_from(f"<{n}I", payload, 4))


