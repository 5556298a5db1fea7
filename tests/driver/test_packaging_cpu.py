"""CPU suite: the build rules (kernels/build.py), the bare-interpreter header step, the
driver-version check and the one version number."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ep_a2a
from ep_a2a.driver import module
from common import kernels_build

ROOT = Path(__file__).resolve().parents[2]  # the repository
kbuild = kernels_build()


def test_header_generates_with_a_bare_interpreter(tmp_path):
    # -I -S: no site packages, no user site, no environment: the build's own Python steps
    # must not need cuda.bindings or NumPy.
    code = ("import importlib.util, sys; p = sys.argv[1]; "
            "s = importlib.util.spec_from_file_location('b', p); m = importlib.util.module_from_spec(s); "
            "s.loader.exec_module(m); sys.stdout.write(m._layout_module().c_header())")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(ROOT / "kernels" / "build.py")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from ep_a2a import layout
    assert r.stdout == layout.c_header()


def test_importing_the_layout_does_not_import_the_driver():
    r = subprocess.run([sys.executable, "-c", "import sys, ep_a2a.layout; "
                        "print(sorted(m for m in ('cuda', 'numpy') if m in sys.modules))"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


def test_built_cubins_are_every_source_for_every_arch():
    expected = set(kbuild.cubin_names())
    present = {p.name for p in module.CUBIN_DIR.iterdir()}
    assert expected <= present, sorted(expected - present)
    assert {s.stem for s in kbuild.sources()} == set(module.built_cubins())
    manifest = json.loads((module.CUBIN_DIR / kbuild.MANIFEST).read_text())
    assert manifest["archs"] == [int(a) for a in kbuild.ARCHS]
    assert manifest["required_driver_cuda"] == int(manifest["nvcc"].split(".")[0]) * 1000


def test_missing_nvcc_names_nvcc_and_how_to_point_at_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(kbuild, "DEFAULT_NVCC", str(tmp_path / "cuda" / "bin" / "nvcc"))
    with pytest.raises(kbuild.BuildError, match=r"nvcc was not found \(tried.*NVCC=/path/to/nvcc.*CUDA_HOME"):
        kbuild.find_nvcc()


def test_a_wrong_nvcc_pointer_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(kbuild.BuildError, match=r"nvcc was not found at .*no-such-nvcc \(given by NVCC\)"):
        kbuild.find_nvcc()
    with pytest.raises(kbuild.BuildError, match=r"given by --nvcc"):
        kbuild.find_nvcc(str(tmp_path / "other"))


def test_stale_cubin_is_rebuilt_and_fresh_one_is_not(tmp_path):
    out = tmp_path / "cubins"
    lines = []
    kbuild.build(out, archs=("90",), log=lines.append)
    assert sum("-cubin" in ln for ln in lines) == len(kbuild.sources())
    lines.clear()
    kbuild.build(out, archs=("90",), log=lines.append)
    assert not any("-cubin" in ln for ln in lines)
    stale = out / "util.sm_90.cubin"
    os.utime(stale, (0, 0))
    kbuild.build(out, archs=("90",), log=lines.append)
    assert [ln for ln in lines if "-cubin" in ln] and all("util.cu" in ln for ln in lines if "-cubin" in ln)


@pytest.mark.parametrize("installed", [12080, 12090, 11080])
def test_old_driver_gets_one_clear_error(installed):
    manifest = {"nvcc": "13.0", "required_driver_cuda": 13000}
    with pytest.raises(module.DriverTooOldError) as e:
        module.require_driver(installed, manifest)
    msg = str(e.value)
    assert f"CUDA {installed // 1000}.{installed % 1000 // 10}" in msg and str(installed) in msg
    assert "CUDA 13.0" in msg and "13000" in msg and "R580" in msg
    assert ep_a2a.DriverTooOldError is module.DriverTooOldError


@pytest.mark.parametrize("installed", [13000, 13010, 14000])
def test_new_enough_driver_passes(installed):
    module.require_driver(installed, {"nvcc": "13.0", "required_driver_cuda": 13000})


def test_one_version_number():
    toml = (ROOT / "pyproject.toml").read_text()
    assert not re.search(r'^version\s*=\s*"', toml, re.M) and 'version = {attr = "ep_a2a.__version__"}' in toml
    assert re.fullmatch(r"\d+\.\d+\.\d+", ep_a2a.__version__)


def test_lazy_package_exports_every_public_name():
    for name in ep_a2a.__all__:
        assert getattr(ep_a2a, name) is not None
    assert ep_a2a.bootstrap.UnixSocketBootstrap is ep_a2a.UnixSocketBootstrap
    with pytest.raises(AttributeError):
        ep_a2a.no_such_name


def test_every_package_folder_is_listed_for_the_wheel():
    """pyproject's explicit package list names every folder of ep_a2a that has an
    __init__.py (a folder missing there ships without its modules: the wheel check in
    .ci/run caught ep_a2a/ops)."""
    root = Path(__file__).resolve().parents[2]
    listed = set(re.search(r"^packages = \[(.*)\]$", (root / "pyproject.toml").read_text(), re.M).group(1)
                 .replace('"', "").replace(" ", "").split(","))
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "ep_a2a").rglob("__init__.py")}
    assert found == listed, (sorted(found - listed), sorted(listed - found))


def test_the_package_declares_its_licence_and_ships_its_annotations():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0" and meta["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["ep_a2a"]
    assert (ROOT / "ep_a2a" / "py.typed").is_file()
    # the SPDX string needs setuptools >= 77 (PEP 639); an older backend would refuse it
    req = next(r for r in meta["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.search(r">=\s*(\d+)", req).group(1)) >= 77
