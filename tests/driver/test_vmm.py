"""VMM allocations, mappings, exports/imports and host-mapped memory.

CPU tests run anywhere; `gpu` tests need a CUDA device (the process-export test spawns a child)."""
import ctypes
import dataclasses
import gc
import multiprocessing
import os
import socket
import struct
import tempfile
import traceback

import numpy as np
import pytest
from cuda.bindings import driver as _drv

from ep_a2a.driver import CudaError, NoDriverError, available, call, get_device
from ep_a2a.driver import vmm
from ep_a2a.driver.vmm import (FABRIC, POSIX_FD, Allocation, DeviceBuffer, HostMapped, Mapping,
                               VmmOptions, granularity, live_counts, round_up)


# ---------------------------------------------------------------- CPU

def test_round_up():
    g = 2 << 20
    assert [round_up(n, g) for n in (1, g - 1, g, g + 1, 3 * g)] == [g, g, g, 2 * g, 3 * g]
    assert round_up(0, g) == 0
    assert round_up(7, 3) == 9  # any positive granularity, not only powers of two
    with pytest.raises(ValueError):
        round_up(1, 0)


def test_live_counts_start_at_zero():
    assert live_counts() == {"allocations": 0, "mappings": 0}


def test_options_are_frozen():
    o = VmmOptions()
    assert (o.fabric, o.access_devices) == (False, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.fabric = True


def test_alloc_prop_carries_a_handle_type_bitmask():
    # the binding's setter rejects POSIX_FD | FABRIC; the struct must hold it anyway
    prop = vmm._alloc_prop(3, POSIX_FD | FABRIC)
    assert ctypes.c_uint32.from_address(prop.getPtr() + 4).value == 9
    assert prop.location.id == 3
    assert prop.type == _drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert vmm._alloc_prop(0, POSIX_FD).requestedHandleTypes == _drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def test_sizes_are_checked_before_the_driver():
    with pytest.raises(ValueError):
        Allocation(0, 0)
    with pytest.raises(ValueError):
        HostMapped(0, 0)


def test_resource_close_is_idempotent_and_del_warns():
    released = []

    class Fake(vmm._Resource):
        _kind = "allocations"

        def __init__(self):
            self._opened()

        def _release(self):
            released.append(1)

    f = Fake()
    assert live_counts()["allocations"] == 1
    f.close()
    f.close()
    assert released == [1] and live_counts()["allocations"] == 0
    with Fake():
        assert live_counts()["allocations"] == 1
    assert released == [1, 1] and live_counts()["allocations"] == 0
    f = Fake()
    with pytest.warns(ResourceWarning):
        del f
        gc.collect()
    assert released == [1, 1, 1] and live_counts()["allocations"] == 0


@pytest.mark.skipif(available(), reason="this machine has a CUDA driver and GPU")
def test_no_driver_raises_clear_error():
    for make in (lambda: Allocation(1 << 20, 0), lambda: DeviceBuffer(1 << 20, 0),
                 lambda: HostMapped(4096, 0), lambda: granularity(0)):
        with pytest.raises(NoDriverError):
            make()
    assert live_counts() == {"allocations": 0, "mappings": 0}


# ---------------------------------------------------------------- GPU helpers

def _htod(ptr, a):
    call(_drv.cuMemcpyHtoD, ptr, a.ctypes.data, a.nbytes)


def _dtoh(ptr, nbytes):
    out = np.empty(nbytes, np.uint8)
    call(_drv.cuMemcpyDtoH, out.ctypes.data, ptr, nbytes)
    return out


def _random_bytes(n, seed=None):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def dev():
    d = get_device(0)
    d.make_current()
    before = live_counts()
    yield d
    assert live_counts() == before, "a test leaked VMM objects"


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_allocate_map_write_read(dev):
    g = granularity(dev)
    assert g > 0 and g & (g - 1) == 0
    with DeviceBuffer(g + 12345, dev) as buf:
        assert buf.size == 2 * g and buf.ptr % g == 0
        assert live_counts() == {"allocations": 1, "mappings": 1}
        data = _random_bytes(buf.size)
        _htod(buf.ptr, data)
        np.testing.assert_array_equal(_dtoh(buf.ptr, buf.size), data)
    assert buf.closed and live_counts() == {"allocations": 0, "mappings": 0}
    buf.close()  # idempotent


@pytest.mark.gpu
def test_create_close_cycles_leak_nothing(dev):
    g = granularity(dev)

    def cycle():
        buf = DeviceBuffer(g + 1, dev)
        imported = Allocation.import_fd_and_close(buf.allocation.export_fd(), buf.size, dev)
        Mapping(imported).close()
        imported.release()
        buf.close()

    cycle()  # first use may grow driver-internal state once
    counts, free, fds = live_counts(), dev.free_memory(), _open_fds()
    for _ in range(200):
        cycle()
    assert live_counts() == counts == {"allocations": 0, "mappings": 0}
    assert abs(dev.free_memory() - free) <= g
    assert _open_fds() == fds


@pytest.mark.gpu
def test_export_import_same_process_two_mappings(dev):
    with DeviceBuffer(3 << 20, dev) as buf:
        assert buf.allocation.handle_types & POSIX_FD
        fd = buf.allocation.export_fd()
        assert isinstance(fd, int) and fd >= 0
        with Allocation.import_fd_and_close(fd, buf.size, dev) as imp, Mapping(imp) as m2:
            assert m2.ptr != buf.ptr and m2.size == buf.size
            data = _random_bytes(buf.size)
            _htod(buf.ptr, data)
            np.testing.assert_array_equal(_dtoh(m2.ptr, m2.size), data)
            data = _random_bytes(buf.size)
            _htod(m2.ptr, data)
            np.testing.assert_array_equal(_dtoh(buf.ptr, buf.size), data)
        with pytest.raises(OSError):
            os.fstat(fd)  # closed by import_fd_and_close


def _child_import_and_write(path, ordinal, seed):
    """Spawned child: receive the fd over SCM_RIGHTS, import, map, write a seeded pattern."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(120)
    sock.connect(path)
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
        (size,) = struct.unpack("Q", msg[:8])
        d = get_device(ordinal)
        with Allocation.import_fd_and_close(fds[0], size, d) as alloc, Mapping(alloc) as m:
            _htod(m.ptr, _random_bytes(size, seed))
            call(_drv.cuCtxSynchronize)
        assert live_counts() == {"allocations": 0, "mappings": 0}
        sock.sendall(b"done")
    except BaseException:
        sock.sendall(traceback.format_exc().encode())
        raise
    finally:
        sock.close()


@pytest.mark.gpu
def test_export_to_child_process(dev):
    seed = int.from_bytes(os.urandom(4), "little")
    with tempfile.TemporaryDirectory() as tmp, DeviceBuffer(5 << 20, dev) as buf:
        _htod(buf.ptr, np.full(buf.size, 0xA5, np.uint8))  # poison: the child must overwrite all
        path = os.path.join(tmp, "sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        srv.settimeout(120)
        child = multiprocessing.get_context("spawn").Process(
            target=_child_import_and_write, args=(path, dev.ordinal, seed))
        child.start()
        try:
            conn, _ = srv.accept()
            conn.settimeout(120)
            fd = buf.allocation.export_fd()
            try:
                socket.send_fds(conn, [struct.pack("Q", buf.size)], [fd])
            finally:
                os.close(fd)  # the child holds its own duplicate now
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
            conn.close()
        finally:
            child.join(120)
            srv.close()
        assert reply == b"done", reply.decode(errors="replace")
        assert child.exitcode == 0
        np.testing.assert_array_equal(_dtoh(buf.ptr, buf.size), _random_bytes(buf.size, seed))


@pytest.mark.gpu
def test_set_access_failure_rolls_back(dev):
    g = granularity(dev)
    bad = call(_drv.cuDeviceGetCount) + 7
    free = dev.free_memory()
    with pytest.raises(CudaError) as e:
        DeviceBuffer(g, dev, VmmOptions(access_devices=(bad,)))
    assert e.value.call == "cuMemSetAccess"
    assert live_counts() == {"allocations": 0, "mappings": 0}
    with Allocation(g, dev) as alloc:
        with pytest.raises(CudaError) as e:
            Mapping(alloc, [bad])
        assert e.value.call == "cuMemSetAccess"
        assert live_counts() == {"allocations": 1, "mappings": 0}
        with Mapping(alloc, [dev]) as m:  # the allocation is intact and mappable after the rollback
            data = _random_bytes(g)
            _htod(m.ptr, data)
            np.testing.assert_array_equal(_dtoh(m.ptr, g), data)
    assert abs(dev.free_memory() - free) <= g


@pytest.mark.gpu
def test_fabric_request_falls_back_or_round_trips(dev):
    with DeviceBuffer(1 << 20, dev, VmmOptions(fabric=True)) as buf:
        types = buf.allocation.handle_types
        assert types & POSIX_FD  # one node always works through POSIX fds
        os.close(buf.allocation.export_fd())
        if not types & FABRIC:
            with pytest.raises(ValueError):
                buf.allocation.export_fabric()
            pytest.skip("FABRIC handles not permitted here (no IMEX channel?): fell back to POSIX fd")
        data = buf.allocation.export_fabric()
        assert isinstance(data, bytes) and len(data) == 64
        with Allocation.import_fabric(data, buf.size, dev) as imp, Mapping(imp) as m2:
            payload = _random_bytes(buf.size)
            _htod(buf.ptr, payload)
            np.testing.assert_array_equal(_dtoh(m2.ptr, buf.size), payload)


@pytest.mark.gpu
def test_forgotten_buffer_is_freed_with_a_warning(dev):
    buf = DeviceBuffer(1 << 20, dev)
    assert live_counts() == {"allocations": 1, "mappings": 1}
    with pytest.warns(ResourceWarning):
        del buf
        gc.collect()
    assert live_counts() == {"allocations": 0, "mappings": 0}


@pytest.mark.gpu
def test_host_mapped_round_trip(dev):
    rng = np.random.default_rng()
    with HostMapped(4096, dev) as hm:
        assert hm.device_ptr != 0 and hm.host_ptr != 0
        v = hm.array(np.uint32, (1024,))
        assert not v.any()  # zeroed, so stale error records are never read
        v[:] = rng.integers(0, 2**32, 1024, dtype=np.uint32)
        np.testing.assert_array_equal(_dtoh(hm.device_ptr, 4096).view(np.uint32), v)
        src = rng.integers(0, 2**32, 1024, dtype=np.uint32)
        _htod(hm.device_ptr, src)
        np.testing.assert_array_equal(v, src)
        # a device-side write into the mapped pages, as a kernel's error record would land
        with DeviceBuffer(4096, dev) as buf:
            src = rng.integers(0, 2**32, 1024, dtype=np.uint32)
            _htod(buf.ptr, src)
            call(_drv.cuMemcpyDtoD, hm.device_ptr, buf.ptr, 4096)
            call(_drv.cuCtxSynchronize)
        np.testing.assert_array_equal(hm.array(np.uint32, (32, 32)), src.reshape(32, 32))
        np.testing.assert_array_equal(hm.array(np.uint8, 16, offset=4080), src.view(np.uint8)[4080:])
        with pytest.raises(ValueError):
            hm.array(np.uint8, 4097)
    with pytest.raises(ValueError):
        hm.array(np.uint8, 1)
