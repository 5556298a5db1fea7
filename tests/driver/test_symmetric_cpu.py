"""The process-group import path of the symmetric workspace, on the CPU: the driver objects
are stand-ins, the file descriptors are real (memfds), so leaks show in /proc/self/fd."""
import os
import types

import pytest

from ep_a2a import symmetric


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_a_failed_peer_import_closes_every_fd_not_imported_yet(monkeypatch):
    world, me = 4, 0
    buf = types.SimpleNamespace(size=1 << 21, ptr=1 << 40, close=lambda: None,
                                allocation=types.SimpleNamespace(export_fd=lambda: os.memfd_create("own")))
    monkeypatch.setattr(symmetric, "DeviceBuffer", lambda n, dev: buf)
    imported = []

    def import_fd_and_close(fd, size, dev):  # the real one closes its fd whatever happens
        os.close(fd)
        if len(imported) == 1:
            raise RuntimeError("cuMemImportFromShareableHandle failed")
        imported.append(fd)
        return types.SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(symmetric.Allocation, "import_fd_and_close", staticmethod(import_fd_and_close))
    monkeypatch.setattr(symmetric, "Mapping", lambda alloc, access_devices: types.SimpleNamespace(ptr=1 << 41))

    class Bootstrap:
        def allgather(self, data):
            return [data] * world

        def allgather_fds(self, fds):  # every rank's entry as new fds, ours as dups
            return [[os.dup(fds[0])] if r == me else [os.memfd_create(f"peer{r}")] for r in range(world)]
    group = types.SimpleNamespace(ranks=[types.SimpleNamespace(rank=me, device=None)], bootstrap=Bootstrap())
    ws = object.__new__(symmetric.SymmetricWorkspace)
    ws._own, ws._imported = [], []
    before = _open_fds()
    with pytest.raises(RuntimeError, match="Import"):
        symmetric.SymmetricWorkspace._init_process(ws, group, 1 << 20)
    assert len(imported) == 1 and _open_fds() == before, "fds of the peers after the failed one stayed open"
