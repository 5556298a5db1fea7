"""Build the kernels: the generated header, then one cubin per source and architecture.

The one definition of the build rules, used by `make cubins` and by `pip install` / `pip
wheel` (setup.py) alike. Standard library only: it runs on a fresh machine's python3 before
any dependency is installed, and it imports ep_a2a/layout.py by path, not the package.

    python3 kernels/build.py [--out DIR] [--nvcc PATH] [--archs "90 100 103"] [--jobs N]
    python3 kernels/build.py --ffi-only     # only the JAX FFI library (native/ffi), for this python's jaxlib

nvcc is found as: --nvcc, else $NVCC, else $CUDA_HOME/bin/nvcc, else `nvcc` on PATH, else
/usr/local/cuda/bin/nvcc. A cubin is rebuilt when a kernel source, a header or layout.py is
newer than it. Beside the cubins, manifest.json records the toolkit that built them, which
the package checks against the installed driver before loading any of them.

The JAX FFI library (native/ffi/ep_a2a_ffi.cc -> libep_a2a_jax.so beside the cubins) is built
only where the running python has jaxlib installed: its headers come from the jaxlib wheel
(jaxlib/include, found without importing jax; $EP_A2A_JAX_INCLUDE overrides), cuda.h from
nvcc's toolkit, the compiler is $CXX or g++. manifest.json's "jax_ffi" names the jaxlib and
FFI API version it was built against. Without jaxlib it is skipped (JAX then runs the
Python fallback, ep_a2a/ops/jax_calls.py).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ARCHS = ("90", "100", "103")        # sm_90 (H100/H200), sm_100 (B200), sm_103 (B300)
NVCCFLAGS = ("-O3", "-std=c++17", "-lineinfo", "-Xptxas", "-warn-spills")
KERNELS = Path(__file__).resolve().parent
ROOT = KERNELS.parent
LAYOUT = ROOT / "ep_a2a" / "layout.py"
HEADER = KERNELS / "generated" / "params.cuh"
CUBIN_DIR = ROOT / "ep_a2a" / "cubins"
MANIFEST = "manifest.json"
DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"
FFI_SOURCE = ROOT / "native" / "ffi" / "ep_a2a_ffi.cc"
FFI_LIBRARY = "libep_a2a_jax.so"
FFI_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-static-libstdc++", "-static-libgcc")


class BuildError(Exception):
    """The kernels cannot be built; the message says what is missing and how to supply it."""


def sources() -> list:
    return sorted(KERNELS.glob("*.cu"))


def cubin_names(archs=ARCHS) -> list:
    """Every file a complete build puts in the cubin folder (what a wheel must hold)."""
    return [f"{s.stem}.sm_{a}.cubin" for s in sources() for a in archs] + [MANIFEST]


def find_nvcc(explicit: str | None = None) -> str:
    def usable(c):
        return shutil.which(c) or (c if Path(c).is_file() and os.access(c, os.X_OK) else None)

    how = ("ep_a2a's CUDA kernels are compiled when the package is built, by nvcc from CUDA 13.0 or newer. "
           "Install the CUDA toolkit and put nvcc on PATH, or point the build at it with NVCC=/path/to/nvcc "
           "(or CUDA_HOME=/path/to/cuda), e.g. `NVCC=/usr/local/cuda/bin/nvcc pip install .`. "
           "Only the build needs nvcc; running needs the driver.")
    chosen = explicit or os.environ.get("NVCC")
    if chosen:      # a pointer the user gave must work: never fall back behind it
        if usable(chosen):
            return usable(chosen)
        raise BuildError(f"nvcc was not found at {chosen} (given by {'--nvcc' if explicit else 'NVCC'}). {how}")
    candidates = [str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")] if os.environ.get("CUDA_HOME") else []
    candidates += ["nvcc", DEFAULT_NVCC]
    for c in candidates:
        if usable(c):
            return usable(c)
    raise BuildError(f"nvcc was not found (tried: {', '.join(candidates)} and PATH). {how}")


def nvcc_version(nvcc: str) -> tuple:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise BuildError(f"{nvcc} --version did not report a CUDA release:\n{out}")
    return int(m[1]), int(m[2])


def _layout_module():
    spec = importlib.util.spec_from_file_location("_ep_a2a_layout_for_build", LAYOUT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


def write_header() -> Path:
    text = _layout_module().c_header()
    if not HEADER.is_file() or HEADER.read_text() != text:
        HEADER.parent.mkdir(parents=True, exist_ok=True)
        tmp = HEADER.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(HEADER)
    return HEADER


def build(out: Path = CUBIN_DIR, nvcc: str | None = None, archs=ARCHS, jobs: int | None = None,
          log=print) -> list:
    """Build every missing or stale cubin into `out`; returns the paths of all of them."""
    nvcc = find_nvcc(nvcc)
    major, minor = nvcc_version(nvcc)
    if major < 13:
        raise BuildError(f"{nvcc} is CUDA {major}.{minor}; the kernels (sm_100, sm_103) need nvcc from CUDA 13.0 or "
                         f"newer: point the build at one with NVCC=/path/to/nvcc")
    write_header()
    out.mkdir(parents=True, exist_ok=True)
    deps = [LAYOUT, HEADER, *KERNELS.glob("*.cuh")]
    newest_dep = max(p.stat().st_mtime for p in deps)
    jobs_todo = []
    for src in sources():
        for a in archs:
            dst = out / f"{src.stem}.sm_{a}.cubin"
            if not dst.is_file() or dst.stat().st_mtime < max(newest_dep, src.stat().st_mtime):
                jobs_todo.append((src, a, dst))

    def compile_one(job):
        src, a, dst = job
        tmp = dst.with_suffix(".tmp")
        cmd = [nvcc, "-cubin", f"-arch=sm_{a}", *NVCCFLAGS, "-o", str(tmp), str(src)]
        log(" ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise BuildError(f"nvcc failed on {src.name} for sm_{a}:\n{r.stdout}{r.stderr}")
        if r.stderr.strip():
            log(r.stderr.rstrip())
        tmp.replace(dst)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, jobs_todo))
    # Minor-version compatibility: a driver of CUDA major release M loads cubins from any M.x toolkit.
    manifest = {"nvcc": f"{major}.{minor}", "required_driver_cuda": major * 1000,
                "archs": [int(a) for a in archs], "sources": [s.stem for s in sources()]}
    old = _read_manifest(out)
    if "jax_ffi" in old:
        manifest["jax_ffi"] = old["jax_ffi"]
    _write_manifest(out, manifest)
    built = [out / n for n in cubin_names(archs)]
    try:
        lib = build_ffi(out, nvcc, log=log, required=False)
    except BuildError as e:  # (optional: without it JAX takes the Python path, with a warning)
        log(f"kernels/build.py: the JAX FFI library was not built, JAX will use the Python path: {e}")
        lib = None
    return built + ([lib] if lib else [])


def _read_manifest(out: Path) -> dict:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(out / MANIFEST)


def find_jaxlib() -> tuple:
    """(jaxlib version, its FFI include folder), or (None, None) where this python has none.
    Found without importing jax (a build runs before the package's dependencies may load)."""
    import importlib.metadata
    given = os.environ.get("EP_A2A_JAX_INCLUDE")
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if given:
        return version or "unknown", Path(given)
    spec = importlib.util.find_spec("jaxlib")
    if version is None or spec is None or not spec.submodule_search_locations:
        return None, None
    include = Path(list(spec.submodule_search_locations)[0]) / "include"
    return (version, include) if (include / "xla" / "ffi" / "api" / "ffi.h").is_file() else (None, None)


def _ffi_api(include: Path) -> str:
    text = (include / "xla" / "ffi" / "api" / "c_api.h").read_text()
    major = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
    minor = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
    return f"{major[1]}.{minor[1]}" if major and minor else "unknown"


def build_ffi(out: Path = CUBIN_DIR, nvcc: str | None = None, log=print, required: bool = True):
    """Build the JAX FFI library for this python's jaxlib into `out` when stale (or built for
    another jaxlib); returns its path, or None where jaxlib is absent and not `required`."""
    version, include = find_jaxlib()
    if version is None:
        if required:
            raise BuildError("the JAX FFI library needs jaxlib's headers: install jax/jaxlib in this python "
                             "(or point EP_A2A_JAX_INCLUDE at a jaxlib/include folder)")
        log("kernels/build.py: no jaxlib in this python: the JAX FFI library is not built (JAX uses the Python path)")
        return None
    tried = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    try:
        tried.append(Path(find_nvcc(nvcc)).resolve().parent.parent / "include")
    except BuildError:
        pass
    tried.append(Path(DEFAULT_NVCC).parent.parent / "include")
    cuda_include = next((d for d in tried if (d / "cuda.h").is_file()), None)
    if cuda_include is None:
        raise BuildError(f"cuda.h not found (tried {', '.join(map(str, tried))}): the JAX FFI library needs the "
                         "CUDA toolkit's headers (set CUDA_HOME or NVCC)")
    out.mkdir(parents=True, exist_ok=True)
    lib = out / FFI_LIBRARY
    manifest = _read_manifest(out)
    info = {"library": FFI_LIBRARY, "jaxlib": version, "ffi_api": _ffi_api(include)}
    if lib.is_file() and lib.stat().st_mtime >= FFI_SOURCE.stat().st_mtime and manifest.get("jax_ffi") == info:
        return lib
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildError("no C++ compiler for the JAX FFI library: install g++ or set CXX")
    tmp = lib.with_suffix(".tmp")
    # (-isystem: warnings of XLA's headers are theirs; ours stay on)
    cmd = [cxx, *FFI_FLAGS, "-isystem", str(include), f"-I{cuda_include}", str(FFI_SOURCE), "-o", str(tmp), "-ldl"]
    log(" ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise BuildError(f"{cxx} failed on {FFI_SOURCE.name}:\n{r.stdout}{r.stderr}")
    tmp.replace(lib)
    manifest["jax_ffi"] = info
    _write_manifest(out, manifest)
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=CUBIN_DIR)
    ap.add_argument("--nvcc", default=None)
    ap.add_argument("--archs", default=" ".join(ARCHS), help="space-separated sm numbers")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--header-only", action="store_true", help="only (re)generate kernels/generated/params.cuh")
    ap.add_argument("--ffi-only", action="store_true", help="only (re)build the JAX FFI library for this python's jaxlib")
    ap.add_argument("--optional", action="store_true", help="with --ffi-only: skip quietly where this python has no jaxlib")
    args = ap.parse_args(argv)
    try:
        if args.header_only:
            write_header()
        elif args.ffi_only:
            lib = build_ffi(args.out, args.nvcc, required=not args.optional)
            if lib:
                print(lib)
        else:
            build(args.out, args.nvcc, tuple(args.archs.split()), args.jobs)
    except BuildError as e:
        print(f"kernels/build.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
