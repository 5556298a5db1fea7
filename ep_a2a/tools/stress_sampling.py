"""What the mixed soak samples once a minute, and the verdict on growth.

A sample is this process's footprint between two steps: device memory in use (NVML: this
process's own use where the driver reports it, else the whole device's), host RSS, open file
descriptors, lines of /proc/self/maps, and the live counts of the library's resources
(driver.lifetime: VMM allocations and mappings, graphs, streams, events, all-to-alls).
The verdict compares the sample one interval after the warm-up (minute 1: every step kind
has made its buffers, the caching allocators have seen the sizes) with the last one; each
quantity may grow by at most its stated tolerance. A leak of one buffer per step exceeds
these within a minute at the soak's step rate; noise of the allocators stays under them.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

MIB = 1 << 20

# growth allowed from minute 1 to the last sample, per quantity (bytes or counts)
TOLERANCE = {
    "device_bytes": 64 * MIB,   # a torch caching-allocator block or two for a size seen late
    "rss_bytes": 64 * MIB,      # pymalloc arenas and NumPy's freelists are not returned at once
    "fds": 0,
    "maps": 16,                 # shared libraries a late import maps (a leak of mappings: per step)
    "live": 0,                  # library resources (driver.lifetime): each kind, exactly
}


@dataclass
class Sample:
    t_s: float                  # seconds since the soak's clock started
    steps: int                  # steps run when it was taken
    device_bytes: int | None    # device memory in use (None: NVML cannot tell)
    device_scope: str           # "process" or "device" (what device_bytes counts)
    rss_bytes: int
    fds: int
    maps: int
    live: dict = field(default_factory=dict)   # driver.lifetime.live_counts()

    def line(self) -> str:
        dev = "n/a" if self.device_bytes is None else f"{self.device_bytes / MIB:.1f} MiB ({self.device_scope})"
        vmm = self.live.get("allocations", 0), self.live.get("mappings", 0)
        return (f"[{self.t_s / 60:5.2f} min] steps {self.steps}, device {dev}, rss {self.rss_bytes / MIB:.1f} MiB, "
                f"fds {self.fds}, maps {self.maps}, vmm allocations/mappings {vmm[0]}/{vmm[1]}, "
                f"graphs {self.live.get('graphs', 0)}, alltoalls {self.live.get('alltoalls', 0)}")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapped_regions() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def device_used(pci_bus_id: str | None) -> tuple:
    """(bytes in use, "process" | "device") on the GPU at `pci_bus_id`, or (None, "none")."""
    if pci_bus_id is None:
        return None, "none"
    try:
        import pynvml
        pynvml.nvmlInit()  # (reference counted by NVML: safe to repeat)
        domain, rest = pci_bus_id.split(":", 1) if pci_bus_id.count(":") == 2 else ("0", pci_bus_id)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(f"{int(domain, 16):08X}:{rest.upper()}")
        pid = os.getpid()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory), "process"
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), "device"
    except Exception:  # no nvidia-ml-py, no libnvidia-ml, or a driver that hides per-process figures
        return None, "none"


def take(t_s: float, steps: int, pci_bus_id: str | None = None) -> Sample:
    """One sample of this process now."""
    from ..driver.lifetime import live_counts
    dev, scope = device_used(pci_bus_id)
    return Sample(round(t_s, 3), steps, dev, scope, rss_bytes(), open_fds(), mapped_regions(), dict(live_counts()))


def growth(first: Sample, last: Sample) -> dict:
    """{quantity: last - first} (live: per kind); device_bytes None where either sample lacks it
    or they count different scopes."""
    dev = None
    if first.device_bytes is not None and last.device_bytes is not None and first.device_scope == last.device_scope:
        dev = last.device_bytes - first.device_bytes
    kinds = set(first.live) | set(last.live)
    return dict(device_bytes=dev, rss_bytes=last.rss_bytes - first.rss_bytes, fds=last.fds - first.fds,
                maps=last.maps - first.maps, live={k: last.live.get(k, 0) - first.live.get(k, 0) for k in sorted(kinds)})


def verdict(samples: list, tolerance: dict = None) -> tuple:
    """(ok, reasons, growth) over `samples` (taken in order; samples[0] right after the
    warm-up): growth from samples[1] (minute 1) to the last one within `tolerance` (TOLERANCE
    by default). With fewer than three samples there is no minute-1-to-last span to judge:
    not ok, saying so (a soak shorter than two intervals proves nothing about growth)."""
    tol = dict(TOLERANCE, **(tolerance or {}))
    if len(samples) < 3:
        return False, [f"only {len(samples)} samples: a growth verdict needs the warm-up, minute 1 and a later one"], {}
    grew = growth(samples[1], samples[-1])
    reasons = []
    for key in ("device_bytes", "rss_bytes", "fds", "maps"):
        if grew[key] is not None and grew[key] > tol[key]:
            unit = f"{grew[key] / MIB:.1f} MiB" if key.endswith("bytes") else str(grew[key])
            reasons.append(f"{key} grew by {unit} from minute 1 to the end (tolerance {tol[key]})")
    for kind, d in grew["live"].items():
        if d > tol["live"]:
            reasons.append(f"live {kind} grew by {d} from minute 1 to the end (tolerance {tol['live']})")
    return not reasons, reasons, grew


def as_json(samples: list) -> list:
    return [asdict(s) for s in samples]
