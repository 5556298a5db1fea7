"""Can the GPUs of a group reach each other over NVLink? (NVML, through nvidia-ml-py.)

One-sided pushes into peer memory need NVLink P2P between every pair of distinct GPUs;
ranks that share a GPU (the one-GPU test modes) need nothing.
"""
from __future__ import annotations

import itertools
import re
import threading

from .errors import TopologyError

__all__ = ["TopologyError", "check_nvlink", "describe"]

_BUS_ID = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")
_lock = threading.Lock()
_nvml = None


def _bus_key(bus_id: str) -> str:
    """Canonical NVML form: CUDA says '0000:19:00.0', NVML '00000000:19:00.0'; both name one GPU."""
    m = _BUS_ID.fullmatch(bus_id.strip())
    if not m:
        raise ValueError(f"{bus_id!r} is not a PCI bus id ([domain:]bus:device.function)")
    dom, bus, dev, fn = (int(g or "0", 16) for g in m.groups())
    return f"{dom:08X}:{bus:02X}:{dev:02X}.{fn}"


def _nvml_module():
    """pynvml, initialised once per process (nvmlInit is refcounted; we keep our reference)."""
    global _nvml
    with _lock:
        if _nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
            except Exception as e:  # no nvidia-ml-py, no libnvidia-ml.so, no driver
                raise TopologyError(f"NVML is not available ({type(e).__name__}: {e}): cannot check that "
                                    f"distinct GPUs reach each other over NVLink") from None
            _nvml = pynvml
    return _nvml


def _handles(nv, keys):
    out = {}
    for k in keys:
        try:
            out[k] = nv.nvmlDeviceGetHandleByPciBusId(k)
        except nv.NVMLError as e:
            raise TopologyError(f"NVML finds no GPU at PCI bus id {k}: {e}") from None
    return out


def _status_name(nv, status: int) -> str:
    for n in dir(nv):
        if n.startswith("NVML_P2P_STATUS_") and getattr(nv, n) == status and "SUPPORED" not in n:
            return n[len("NVML_P2P_STATUS_"):]
    return f"status {status}"


def _p2p(nv, h1, h2) -> int:
    try:
        return nv.nvmlDeviceGetP2PStatus(h1, h2, nv.NVML_P2P_CAPS_INDEX_NVLINK)
    except nv.NVMLError as e:
        raise TopologyError(f"nvmlDeviceGetP2PStatus failed: {e}") from None


def check_nvlink(pci_bus_ids: list[str]) -> None:
    """Raise TopologyError naming every ordered pair of distinct GPUs without NVLink P2P.

    A bus id repeated (ranks sharing one GPU) is always fine and needs no NVML.
    """
    keys = list(dict.fromkeys(_bus_key(b) for b in pci_bus_ids))
    if len(keys) <= 1:
        return
    nv = _nvml_module()
    h = _handles(nv, keys)
    bad = [f"{a} -> {b}: {_status_name(nv, st)}" for a, b in itertools.permutations(keys, 2)
           if (st := _p2p(nv, h[a], h[b])) != nv.NVML_P2P_STATUS_OK]
    if bad:
        raise TopologyError("these GPUs cannot reach each other over NVLink P2P (one-sided all-to-all needs "
                            "every pair): " + "; ".join(bad))


def _active_links(nv, handle) -> int:
    n = 0
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            n += nv.nvmlDeviceGetNvLinkState(handle, link) == nv.NVML_FEATURE_ENABLED
        except nv.NVMLError:  # past the last link of this GPU, or no NVLink at all
            break
    return n


def describe(pci_bus_ids: list[str]) -> dict:
    """Topology facts for the benchmark JSON: GPU names, active NVLink counts, NVLink P2P matrix.

    `nvlink_p2p[i][j]` is "OK", an NVML P2P status name, or "same_device".
    """
    keys = [_bus_key(b) for b in pci_bus_ids]
    nv = _nvml_module()
    h = _handles(nv, dict.fromkeys(keys))
    gpus = []
    for k in keys:
        try:
            name = nv.nvmlDeviceGetName(h[k])
        except nv.NVMLError as e:
            name = f"unknown ({e})"
        gpus.append({"pci_bus_id": k, "name": name if isinstance(name, str) else name.decode(),
                     "nvlink_active_links": _active_links(nv, h[k])})
    matrix = [["same_device" if a == b else _status_name(nv, _p2p(nv, h[a], h[b])) for b in keys] for a in keys]
    return {"gpus": gpus, "nvlink_p2p": matrix}
