"""Cubins built ahead of time (kernels/build.py, run by `make cubins` and by every wheel
build), chosen by compute capability, and their kernels."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from cuda.bindings import driver as _drv

from .device import Device
from .errors import DriverTooOldError, UnsupportedDeviceError, call

CUBIN_DIR = Path(__file__).resolve().parent.parent / "cubins"
_NAME = re.compile(r"^(?P<stem>[A-Za-z0-9_]+)\.sm_(?P<arch>\d+)\.cubin$")
_REBUILD = "reinstall ep_a2a (pip compiles them with nvcc) or, in a clone, run `make cubins`"


def _cuda_version(v: int) -> str:
    return f"CUDA {v // 1000}.{v % 1000 // 10}"


def require_driver(installed: int, manifest: dict) -> None:
    """Raise DriverTooOldError unless a driver reporting `installed` (cuDriverGetVersion's
    1000 * major + 10 * minor) can load cubins described by `manifest` (cubins/manifest.json)."""
    need = int(manifest["required_driver_cuda"])
    if installed < need:
        raise DriverTooOldError(
            f"the installed NVIDIA driver supports {_cuda_version(installed)} (cuDriverGetVersion {installed}); "
            f"ep_a2a's kernels were built by nvcc {manifest['nvcc']} and need a driver for {_cuda_version(need)} "
            f"or newer (cuDriverGetVersion >= {need}; R580 or newer for CUDA 13): upgrade the driver, "
            f"or rebuild the kernels with an nvcc no newer than the driver supports")


@functools.lru_cache(maxsize=None)
def check_driver() -> None:
    """Once per process, before the first cubin is loaded: is the driver new enough?"""
    path = CUBIN_DIR / "manifest.json"
    if not path.is_file():
        raise UnsupportedDeviceError(f"no cubins in {CUBIN_DIR} (manifest.json missing): {_REBUILD}")
    require_driver(call(_drv.cuDriverGetVersion), json.loads(path.read_text()))


def built_cubins() -> dict:
    """{source stem: sorted list of sm numbers} of the cubins present in the package."""
    out: dict = {}
    if CUBIN_DIR.is_dir():
        for f in CUBIN_DIR.iterdir():
            m = _NAME.match(f.name)
            if m:
                out.setdefault(m["stem"], []).append(int(m["arch"]))
    return {k: sorted(v) for k, v in out.items()}


def cubin_path(stem: str, device: Device) -> Path:
    major, minor = device.compute_capability
    arch = major * 10 + minor
    path = CUBIN_DIR / f"{stem}.sm_{arch}.cubin"
    if not path.is_file():
        archs = built_cubins().get(stem)
        if not archs:
            raise UnsupportedDeviceError(f"no cubins for '{stem}' in {CUBIN_DIR}: {_REBUILD}")
        built = ", ".join(f"sm_{a}" for a in archs)
        raise UnsupportedDeviceError(
            f"{device.name} is sm_{arch}; ep_a2a's kernels were built for {built} only "
            f"(rebuild with `make cubins ARCHS=\"{arch}\"` if nvcc supports it)")
    return path


class Module:
    """One cubin loaded into one device's primary context."""

    def __init__(self, stem: str, device: Device):
        self.device, self.stem = device, stem
        check_driver()
        device.make_current()
        self.handle = call(_drv.cuModuleLoadData, cubin_path(stem, device).read_bytes())
        self._functions: dict = {}

    def function(self, name: str):
        f = self._functions.get(name)
        if f is None:
            f = self._functions[name] = call(_drv.cuModuleGetFunction, self.handle, name.encode())
        return f


@functools.lru_cache(maxsize=None)
def load(stem: str, device: Device) -> Module:
    """The process-wide module of `stem` on `device` (loaded once, kept for the process)."""
    return Module(stem, device)
