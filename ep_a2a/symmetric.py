"""A symmetric workspace: one VMM region per rank, every region mapped in every rank."""
from __future__ import annotations

import ctypes
import os

from .bootstrap_wire import close_fds
from .driver.lifetime import Owned
from .driver.memory import DeviceAllocation, copy_htod
from .driver.vmm import Allocation, DeviceBuffer, Mapping, VmmOptions


class SymmetricWorkspace(Owned):
    """`nbytes` of device memory per rank of `group`, mapped into every rank.

    `peers(r)[q]` is the address at which local rank `r` reaches rank `q`'s region;
    `peer_table(r)` is the same list as a device array of u64 (for users' kernels).
    In a LocalGroup all ranks share one address space, so a region is mapped once, with
    access granted to every GPU of the group. In a ProcessGroup each rank exports its
    allocation as a POSIX fd, the fds travel through the bootstrap (SCM_RIGHTS) and every
    rank imports and maps the others'.
    """

    _kind = "workspaces"

    def __init__(self, group, nbytes: int):
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
        buf = DeviceBuffer(nbytes, rank.device)
        self._own = [buf]
        sizes = {int.from_bytes(b, "little") for b in group.bootstrap.allgather(buf.size.to_bytes(8, "little"))}
        if len(sizes) != 1:
            raise ValueError(f"workspace sizes differ between ranks: {sorted(sizes)}")
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
                alloc = Allocation.import_fd_and_close(fds.pop(0), buf.size, rank.device)
                try:
                    m = Mapping(alloc, access_devices=(rank.device,))
                except BaseException:
                    alloc.close()
                    raise
                self._imported.append((m, alloc))
                bases.append(m.ptr)
            except BaseException:
                # every fd not imported yet pins a whole peer workspace: close them all
                for rest in received[q:]:
                    close_fds(rest)
                raise
            finally:
                close_fds(fds)  # what is left of this rank's entry (our own dup, extras)
        self._peers = [bases]

    @staticmethod
    def _upload_table(device, bases):
        arr = (ctypes.c_uint64 * len(bases))(*bases)
        table = DeviceAllocation(device, ctypes.sizeof(arr))
        copy_htod(table.ptr, ctypes.addressof(arr), ctypes.sizeof(arr))
        return table

    def peers(self, local_index: int = 0) -> list:
        return self._peers[local_index]

    def base(self, local_index: int = 0) -> int:
        return self._own[local_index].ptr

    def peer_table(self, local_index: int = 0) -> int:
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
