"""Build the kernels: the generated header, then one cubin per source and architecture.

The one definition of the build rules, used by `make cubins` and by `pip install` / `pip
wheel` (setup.py) alike. Standard library only: it runs on a fresh machine's python3 before
any dependency is installed, and it imports ep_a2a/layout.py by path, not the package.

    python3 kernels/build.py [--out DIR] [--nvcc PATH] [--archs "90 100 103"] [--jobs N]

nvcc is found as: --nvcc, else $NVCC, else $CUDA_HOME/bin/nvcc, else `nvcc` on PATH, else
/usr/local/cuda/bin/nvcc. A cubin is rebuilt when a kernel source, a header or layout.py is
newer than it. Beside the cubins, manifest.json records the toolkit that built them, which
the package checks against the installed driver before loading any of them.
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
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return [out / n for n in cubin_names(archs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=CUBIN_DIR)
    ap.add_argument("--nvcc", default=None)
    ap.add_argument("--archs", default=" ".join(ARCHS), help="space-separated sm numbers")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--header-only", action="store_true", help="only (re)generate kernels/generated/params.cuh")
    args = ap.parse_args(argv)
    try:
        if args.header_only:
            write_header()
        else:
            build(args.out, args.nvcc, tuple(args.archs.split()), args.jobs)
    except BuildError as e:
        print(f"kernels/build.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
