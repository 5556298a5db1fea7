"""Every command-line tool without a GPU: complete --help texts, argparse errors (status 2,
naming the option) for bad values, status 3 with one line where no GPU is usable (the demo
excepted: it runs the NumPy reference and exits 0), and where the JSON goes."""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ep_a2a.__main__ as demo
from ep_a2a.driver import device
from ep_a2a.tools import bench_cli, bench_layer, bench_layer_host, bench_report, bench_torch, exits, result_paths, stress

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"demo": (demo.parser, demo.parse_args), "bench": (bench_cli.parser, bench_cli.parse_args),
         "bench_layer": (bench_layer.parser, bench_layer.parse_args),
         "bench_torch": (bench_torch.parser, bench_torch.parse_args), "stress": (stress.parser, stress.parse_args),
         "bench_layer_host": (bench_layer_host.parser, bench_layer_host.parse_args)}
MAINS = {"bench": bench_cli.main, "bench_layer": bench_layer.main, "bench_torch": bench_torch.main, "stress": stress.main,
         "bench_layer_host": bench_layer_host.main}


@pytest.mark.parametrize("tool", TOOLS)
def test_every_option_has_help_and_the_epilog_an_example(tool):
    ap = TOOLS[tool][0]()
    assert ap.description and "example" in ap.epilog and "exit status" in ap.epilog
    for action in ap._actions:
        assert action.help and action.help.strip(), f"{tool}: {action.option_strings} has no help"
    assert "python -m ep_a2a" in ap.format_help()


def _bad_values(rng):
    """Fresh wrong values per run: zero, negatives, non-integers, empty list entries."""
    neg = -int(rng.integers(1, 10 ** 6))
    return [("--ranks", "0", "--ranks"), ("--ranks", str(neg), "--ranks"), ("--tokens", str(neg), "--tokens"),
            ("--tokens", "1,,8", "--tokens"), ("--tokens", f"{rng.integers(1, 99)}.5", "--tokens"),
            ("--top-k", "0", "--top-k"), ("--top-k", "two", "--top-k"), ("--experts", str(neg), "--experts"),
            ("--hidden", "0", "--hidden"), ("--iters", "0", "--iters"), ("--warmup", str(neg), "--warmup"),
            ("--steps", "0", "--steps"), ("--minutes", "-1", "--minutes"), ("--max-tokens", "0", "--max-tokens"),
            ("--device", str(neg), "--device"), ("--seed", str(neg), "--seed")]


@pytest.mark.parametrize("tool", TOOLS)
def test_bad_values_are_argparse_errors_naming_the_option(tool, capsys):
    ap = TOOLS[tool][0]()
    known = {s for a in ap._actions for s in a.option_strings}
    tried = 0
    for flag, value, name in _bad_values(np.random.default_rng()):
        if flag not in known:
            continue
        with pytest.raises(SystemExit) as e:
            TOOLS[tool][1]([flag, value])
        err = capsys.readouterr().err
        assert e.value.code == exits.USAGE and f"argument {name}" in err, (tool, flag, value, err)
        tried += 1
    assert tried >= 3


@pytest.mark.parametrize("tool", ["demo", "bench", "bench_layer", "bench_torch"])
def test_top_k_above_the_experts_is_refused(tool, capsys):
    with pytest.raises(SystemExit) as e:
        TOOLS[tool][1](["--top-k", "9", "--experts", "4"] + (["--profile", "custom", "--hidden", "64"] if tool == "bench" else []))
    assert e.value.code == 2 and "exceeds the 4 experts" in capsys.readouterr().err


def test_the_layer_benchmark_takes_fence_for_fp8_combine_and_refuses_another(capsys):
    assert bench_layer.parse_args([]).protocol == "auto"
    assert bench_layer.parse_args(["--combine-quant", "fp8"]).protocol == "fence"
    with pytest.raises(SystemExit) as e:
        bench_layer.parse_args(["--combine-quant", "fp8", "--protocol", "sentinel"])
    assert e.value.code == 2 and "needs --protocol fence" in capsys.readouterr().err


@pytest.mark.skipif(device.available(), reason="checks the no-GPU exit; this machine has a GPU")
@pytest.mark.parametrize("tool", MAINS)
def test_without_a_gpu_every_tool_exits_3_with_one_line(tool, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert MAINS[tool](["--out", str(out)]) == exits.MISSING
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("no usable CUDA GPU" in err[0] or "not installed" in err[0]), err
    assert not out.exists()


@pytest.mark.skipif(device.available(), reason="checks the NumPy fallback; this machine has a GPU")
def test_the_demo_falls_back_to_numpy_and_exits_0(capsys):
    assert demo.main(["--ranks", "3", "--tokens", "5", "--hidden", "16", "--experts", "12", "--top-k", "4"]) == 0
    assert "NumPy reference" in capsys.readouterr().out


def test_a_checkout_writes_into_its_bench_results_whatever_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert result_paths.checkout_root() == ROOT
    p = result_paths.output_path(None, "stress-h200-5min")
    assert p == ROOT / "bench" / "results" / "stress-h200-5min.json" and p.is_absolute()
    assert result_paths.output_path(str(tmp_path / "x.json"), "ignored") == tmp_path / "x.json"


def test_an_installed_package_requires_out(tmp_path):
    """A copy of the package outside any checkout (as in site-packages): --out or an argparse error."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "ep_a2a", site / "ep_a2a", ignore=shutil.ignore_patterns("__pycache__", "cubins"))
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import sys; from ep_a2a.tools import result_paths as r; assert r.checkout_root() is None, r.PACKAGE; "
            "from ep_a2a.tools import bench_cli; bench_cli.parse_args(sys.argv[1:]); print('parsed')")
    r = subprocess.run([sys.executable, "-c", code, "--tokens", "1"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 2 and "--out is required" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", code, "--out", str(tmp_path / "a.json")], capture_output=True, text=True,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0 and "parsed" in r.stdout, r.stderr


@pytest.mark.parametrize("name,gpus,want", [("NVIDIA H200", 1, "h200"), ("NVIDIA H200", 2, "2xh200"),
                                            ("NVIDIA H100 80GB HBM3", 1, "h100-80gb-hbm3"), ("NVIDIA B200", 8, "8xb200")])
def test_device_slugs(name, gpus, want):
    assert result_paths.device_slug(name, gpus) == want


def test_default_names_follow_the_convention():
    """<benchmark>-<device>-<ranks>-<profile>[-<variant>]: no date, no commit."""
    args = bench_cli.parse_args(["--protocol", "fence"])
    res = dict(mode="inproc", device="NVIDIA H200", ep_size=8, gpus=1)
    assert bench_report.result_file(res, args) == "alltoall-h200-8ranks-deepseek-v3-fence"
    args = bench_cli.parse_args(["--mode", "procs", "--format", "mxfp8", "--protocol", "fence", "--combine-quant", "fp8"])
    res = dict(mode="procs", device="NVIDIA H200", ep_size=2, gpus=2)
    assert bench_report.result_file(res, args) == "alltoall-2xh200-2procs-deepseek-v3-mxfp8-fence-fp8"
    args = bench_layer.parse_args(["--framework", "jax", "--ranks", "4"])
    assert bench_layer.result_file(dict(device="NVIDIA H200"), args) == "moe-layer-h200-4ranks-small-jax"
    args = bench_layer.parse_args(["--hidden", "1024", "--combine-quant", "fp8"])
    assert bench_layer.result_file(dict(device="NVIDIA H200"), args) == "moe-layer-h200-8ranks-small-hidden1024-torch-fp8"


def test_json_is_written_with_its_folders(tmp_path):
    doc = {"x": float(np.random.default_rng().random())}
    p = result_paths.write_json(tmp_path / "a" / "b.json", doc)
    assert json.loads(p.read_text()) == doc


def test_argtypes_accept_what_they_should():
    from ep_a2a.tools.argtypes import int_in, int_list, positive_float
    assert int_list(1)("1, 8,64") == [1, 8, 64] and int_in(0, 3)("3") == 3 and positive_float("0.5") == 0.5
    for bad in ("inf", "nan", "0", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_float(bad)


def test_a_missing_framework_is_named_before_the_gpu_is_asked(capsys, monkeypatch):
    from ep_a2a.tools import exits
    monkeypatch.setattr(exits, "require_gpu", lambda prog: pytest.fail("the GPU was asked first"))
    assert exits.require_framework_and_gpu("ep_a2a.x", "no_such_framework_ep_a2a", "x drives it") == exits.MISSING
    assert capsys.readouterr().err == "ep_a2a.x: no_such_framework_ep_a2a is not installed: x drives it\n"
    monkeypatch.setattr(exits, "require_gpu", lambda prog: None)
    assert exits.require_framework_and_gpu("ep_a2a.x", "numpy", "x drives it") is None
