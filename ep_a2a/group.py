"""Ranks and groups: the same rank abstraction whether ranks share a process or not.

* `LocalGroup(devices)`: several ranks in this process, one per entry of `devices`
  (entries may repeat: several ranks on one GPU). This is how a single controller drives
  every GPU of a node, and how the test suite runs EP on one GPU.
* `ProcessGroup(bootstrap, device)`: this process is one rank of a group whose processes
  met through a Bootstrap (Unix socket, torch.distributed or MPI).
"""
from __future__ import annotations

import struct
import weakref

from . import topology
from .driver.device import Device, get_device
from .layout import MAX_RANKS
from .driver.lifetime import Owned
from .driver.memory import has_held, hold_frees, release_held
from .driver.stream import Stream, is_capturing
from .validate import check_bool, check_int, is_int


class Rank:
    """One EP rank as seen from this process: its index, GPU and default stream.

    Ranks of a LocalGroup must not share a stream: their kernels wait on each other, so
    they have to run concurrently; each rank gets a non-blocking stream of its own.
    """

    def __init__(self, rank: int, ep_size: int, device: Device):
        self.rank, self.ep_size, self.device = rank, ep_size, device
        self.stream = Stream(device)
        # ranks that share this GPU with us in this process (grids are capped by it)
        self.ranks_on_device = 1

    def __repr__(self) -> str:
        return f"Rank({self.rank}/{self.ep_size}, cuda:{self.device.ordinal})"


class Group(Owned):
    """What LocalGroup and ProcessGroup share: `ranks` (the ranks living in this process),
    `ep_size` (all ranks of the group) and `bootstrap` (None in a LocalGroup). A group is
    closed by close() or its context manager, after the all-to-alls built on it."""
    _kind = "groups"
    ranks: list        # the ranks that live in this process
    ep_size: int
    bootstrap = None   # None for LocalGroup

    @property
    def is_local(self) -> bool:
        """True for a LocalGroup: every rank of the group lives in this process."""
        return self.bootstrap is None

    def _release(self) -> None:
        for r in self.ranks:
            r.stream.close()


class LocalGroup(Group):
    """Every rank of the group in this process: rank i on GPU `devices[i]` (a list of CUDA
    ordinals; repeats put several ranks on one GPU, e.g. LocalGroup([0] * 8)), each with its
    own non-blocking stream. `check_topology`: distinct GPUs must reach each other over
    NVLink (checked through NVML; a TopologyError otherwise).

    In-process ranks spin on each other: issue every rank's dispatch before anything
    blocks on one of them (the same for combine)."""

    def __init__(self, devices, check_topology: bool = True):
        if not isinstance(devices, (list, tuple, range)) or not all(is_int(d) for d in devices):
            raise TypeError(f"devices: must be a list of CUDA device ordinals (ints), got {devices!r}")
        devices = [check_int(d, "devices", 0) for d in devices]
        if not 1 <= len(devices) <= MAX_RANKS:
            raise ValueError(f"devices: a LocalGroup needs 1..{MAX_RANKS} ranks (one device per rank), got {len(devices)}")
        check_topology = check_bool(check_topology, "check_topology")
        self.ep_size = len(devices)
        devs = [get_device(d) for d in devices]
        if check_topology:
            topology.check_nvlink([d.pci_bus_id for d in devs])
        self.ranks = [Rank(i, self.ep_size, d) for i, d in enumerate(devs)]
        for r in self.ranks:
            r.ranks_on_device = devices.count(r.device.ordinal)
        self._opened()

    @property
    def devices(self):
        """The distinct CUDA ordinals of the group, sorted."""
        return sorted({r.device.ordinal for r in self.ranks})


class ProcessGroup(Group):
    """This process is one rank (bootstrap.rank of bootstrap.world_size) of a group whose
    processes met through `bootstrap` (UnixSocketBootstrap, TorchDistributedBootstrap,
    MpiBootstrap), on the CUDA ordinal `device`. Construction is collective: every process
    builds its ProcessGroup. `check_topology`: every pair of distinct GPUs must reach each
    other over NVLink (NVML; a TopologyError otherwise)."""

    def __init__(self, bootstrap, device: int, check_topology: bool = True):
        for attr in ("rank", "world_size", "allgather", "barrier"):
            if not hasattr(bootstrap, attr):
                raise TypeError(f"bootstrap: must be a Bootstrap (UnixSocketBootstrap, TorchDistributedBootstrap, "
                                f"MpiBootstrap), got {type(bootstrap).__name__} without {attr!r}")
        device = check_int(device, "device", 0)
        check_topology = check_bool(check_topology, "check_topology")
        world = check_int(bootstrap.world_size, "bootstrap.world_size", 1, MAX_RANKS)
        check_int(bootstrap.rank, "bootstrap.rank", 0, world - 1)
        self.bootstrap = bootstrap
        self.ep_size = world
        dev = get_device(device)
        ids = [b.decode() for b in bootstrap.allgather(dev.pci_bus_id.encode())]
        if check_topology:
            topology.check_nvlink(ids)
        self.ranks = [Rank(bootstrap.rank, self.ep_size, dev)]
        self.ranks[0].ranks_on_device = ids.count(dev.pci_bus_id)
        self.pci_bus_ids = ids
        self._opened()

    def agree(self, values: tuple, what: str) -> None:
        """Raise unless every rank passed the same integers (construction arguments)."""
        mine = struct.pack(f"<{len(values)}q", *values)
        for r, other in enumerate(self.bootstrap.allgather(mine)):
            if other != mine:
                theirs = struct.unpack(f"<{len(other) // 8}q", other)
                raise ValueError(f"{what}: rank {r} has {theirs}, rank {self.ranks[0].rank} has {values}; "
                                 "every rank must construct with the same values")


# Several ranks driven by this process spin on each other (on one GPU or several), so no
# cuMemFree may run between their launches of a phase (driver/memory.py queues frees while
# any holder exists). The holders are the all-to-alls with several ranks in this process.
_HOLDING = weakref.WeakSet()


def hold_frees_for(a2a) -> weakref.finalize:
    """Queue this process's frees while `a2a` lives; the returned finalizer (called by
    close(), or by the garbage collector for an all-to-all dropped unclosed) ends it, once."""
    hold_frees(True)
    _HOLDING.add(a2a)
    return weakref.finalize(a2a, hold_frees, False)


def release_frees_if_safe(stream: int) -> None:
    """Free what is queued once every active rank of every holder has launched every kernel
    of the same step: a free synchronizes the device, so no kernel may then wait on the
    host, nor on a rank (or a half) the host has still to issue. Never while `stream` is
    being captured."""
    if has_held() and not is_capturing(stream) and all(settled(a) for a in list(_HOLDING)):
        release_held()


def settled(a2a) -> bool:
    """Every active rank of `a2a` is between steps, the same step (ranks only leave the
    active set, so theirs count alike), with no receive half due."""
    active = [r for r in a2a.ranks if r.is_active]
    return len({r.steps for r in active}) <= 1 and all(not r.mid_step and r.halves.due is None for r in active)
