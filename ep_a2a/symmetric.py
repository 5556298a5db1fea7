"""A symmetric workspace: one VMM region per rank, every region mapped in every rank."""
from __future__ import annotations

import ctypes
import os
import socket

from .bootstrap_wire import close_fds
from .driver.lifetime import Owned
from .driver.memory import DeviceAllocation, copy_htod
from .driver.vmm import Allocation, DeviceBuffer, Mapping, VmmOptions
from .errors import CudaError, TopologyError
from .validate import check_workspace_fits

FABRIC_HANDLE_BYTES = 64


def host_identity() -> bytes:
    """This process's host as the workspace sees it: the kernel instance (boot id) and the
    hostname. Ranks that share it can pass POSIX fds (SCM_RIGHTS); the others cannot."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b"?"
    return boot + b" " + socket.gethostname().encode()


def ranks_on_other_hosts(hosts: list, rank: int) -> list:
    """The ranks whose host_identity() differs from `rank`'s (they need FABRIC handles)."""
    return [q for q, h in enumerate(hosts) if h != hosts[rank]]


def exchange_fabric_handles(bootstrap, handle, why_not: str = "") -> list:
    """Every rank's 64-byte FABRIC handle in rank order, through `bootstrap.allgather` (the
    torch.distributed group, MPI, or the socket rendezvous). `handle` is None where the driver
    refused FABRIC (`why_not` says why): then every rank raises the same TopologyError, instead
    of the others waiting for a handle that will never come."""
    if handle is not None and len(handle) != FABRIC_HANDLE_BYTES:
        raise ValueError(f"a FABRIC handle is {FABRIC_HANDLE_BYTES} bytes, got {len(handle)}")
    mine = b"F" + bytes(handle) if handle is not None else b"E" + why_not.encode()[:1000]
    parts = bootstrap.allgather(mine)
    refused = {q: p[1:].decode(errors="replace") for q, p in enumerate(parts)
               if p[:1] != b"F" or len(p) != 1 + FABRIC_HANDLE_BYTES}
    if refused:
        said = "; ".join(f"rank {q}: {why or 'no handle'}" for q, why in sorted(refused.items()))
        raise TopologyError(
            f"the workspace spans hosts, so it is shared through FABRIC handles, and the driver refused "
            f"FABRIC on rank(s) {sorted(refused)} ({said}). FABRIC needs a multi-node NVLink system "
            "(NVL72-class) with IMEX channels granted to this process (/dev/nvidia-caps-imex-channels); "
            "a group on one host shares POSIX fds instead")
    return [p[1:] for p in parts]


def check_memory(group, nbytes: int, free=None) -> None:
    """Before any allocation: the workspaces of this process's ranks on each GPU (several
    ranks of a LocalGroup may share one) must fit that GPU's free memory (a ValueError naming
    the sizes, instead of an out-of-memory CudaError from cuMemCreate halfway through)."""
    free, on = free or (lambda device: device.free_memory()), {}
    for r in group.ranks:
        on.setdefault(r.device.ordinal, []).append(r.device)
    for ordinal, devices in on.items():
        available = free(devices[0])
        if available is not None:
            check_workspace_fits(nbytes, len(devices), available, f"cuda:{ordinal}")


class SymmetricWorkspace(Owned):
    """`nbytes` of device memory per rank of `group`, mapped into every rank.

    `peers(r)[q]` is the address at which local rank `r` reaches rank `q`'s region;
    `peer_table(r)` is the same list as a device array of u64 (for users' kernels).
    In a LocalGroup all ranks share one address space, so a region is mapped once, with
    access granted to every GPU of the group. In a ProcessGroup on one host each rank exports
    its allocation as a POSIX fd, the fds travel through the bootstrap (SCM_RIGHTS) and every
    rank imports and maps the others'. A ProcessGroup whose ranks are on several hosts (one
    multi-node NVLink domain) allocates with FABRIC handles, 64 bytes each, which travel
    through `bootstrap.allgather`; where the driver refuses FABRIC, every rank raises a
    TopologyError saying so.
    """

    _kind = "workspaces"

    def __init__(self, group, nbytes: int):
        check_memory(group, nbytes)  # (before _opened: nothing is held yet)
        self._opened()  # (first: a constructor that fails halfway closes what it made)
        self.group, self._own, self._imported, self._tables = group, [], [], []
        self._peers: list = []
        try:
            if group.is_local:
                access = tuple(sorted({r.device.ordinal for r in group.ranks}))
                self._own = [DeviceBuffer(nbytes, r.device, VmmOptions(access_devices=access)) for r in group.ranks]
                bases = [b.ptr for b in self._own]
                self._peers = [bases for _ in group.ranks]
            else:
                self._init_process(group, nbytes)
            self.size = self._own[0].size
            for i, r in enumerate(group.ranks):
                self._tables.append(self._upload_table(r.device, self._peers[i]))
        except BaseException:
            self.close()
            raise

    def _init_process(self, group, nbytes: int) -> None:
        rank = group.ranks[0]
        hosts = group.bootstrap.allgather(host_identity())
        fabric = bool(ranks_on_other_hosts(hosts, rank.rank))  # (the same answer on every rank)
        buf = DeviceBuffer(nbytes, rank.device, VmmOptions(fabric=True)) if fabric else DeviceBuffer(nbytes, rank.device)
        self._own = [buf]
        sizes = {int.from_bytes(b, "little") for b in group.bootstrap.allgather(buf.size.to_bytes(8, "little"))}
        if len(sizes) != 1:
            raise ValueError(f"workspace sizes differ between ranks: {sorted(sizes)}")
        if fabric:
            self._peers = [self._import_fabric(group, buf)]
            return
        fd = buf.allocation.export_fd()
        try:
            received = group.bootstrap.allgather_fds([fd])
        finally:
            os.close(fd)
        bases = []
        for q, fds in enumerate(received):
            try:
                if q == rank.rank:
                    bases.append(buf.ptr)
                    continue
                bases.append(self._map(Allocation.import_fd_and_close(fds.pop(0), buf.size, rank.device), rank))
            except BaseException:
                # every fd not imported yet pins a whole peer workspace: close them all
                for rest in received[q:]:
                    close_fds(rest)
                raise
            finally:
                close_fds(fds)  # what is left of this rank's entry (our own dup, extras)
        self._peers = [bases]

    def _import_fabric(self, group, buf) -> list:
        """Peers on other hosts: FABRIC handles (bytes) through the bootstrap, each imported and mapped."""
        rank = group.ranks[0]
        try:
            handle, why = buf.allocation.export_fabric(), ""
        except (ValueError, CudaError) as e:  # the allocation fell back to POSIX fds only: the driver refused FABRIC
            handle, why = None, str(e)
        bases = []
        for q, h in enumerate(exchange_fabric_handles(group.bootstrap, handle, why)):
            if q == rank.rank:
                bases.append(buf.ptr)
                continue
            bases.append(self._map(Allocation.import_fabric(h, buf.size, rank.device), rank))
        return bases

    def _map(self, alloc, rank) -> int:
        """Map an imported peer allocation for this rank's device; the address of the mapping."""
        try:
            m = Mapping(alloc, access_devices=(rank.device,))
        except BaseException:
            alloc.close()
            raise
        self._imported.append((m, alloc))
        return m.ptr

    @staticmethod
    def _upload_table(device, bases):
        arr = (ctypes.c_uint64 * len(bases))(*bases)
        table = DeviceAllocation(device, ctypes.sizeof(arr))
        copy_htod(table.ptr, ctypes.addressof(arr), ctypes.sizeof(arr))
        return table

    def peers(self, local_index: int = 0) -> list:
        """Every rank's workspace address as local rank `local_index` reaches it."""
        return self._peers[local_index]

    def base(self, local_index: int = 0) -> int:
        """The address of local rank `local_index`'s own workspace."""
        return self._own[local_index].ptr

    def peer_table(self, local_index: int = 0) -> int:
        """Device address of peers(local_index) as an array of u64 (for users' kernels)."""
        return self._tables[local_index].ptr

    def _release(self) -> None:
        for t in self._tables:
            t.close()
        self._tables = []
        for m, a in self._imported:
            m.close()
            a.close()
        self._imported = []
        for b in self._own:
            b.close()
        self._own = []
