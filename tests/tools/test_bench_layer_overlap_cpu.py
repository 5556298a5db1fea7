"""The overlapped layer benchmark's command line (`python -m ep_a2a.bench_layer --overlap`) and
the orders the two-micro-batch step accepts (layers/torch_overlap.check_order), without a GPU."""
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ep_a2a.layers.torch_overlap import PIECES, SEQUENTIAL, TBO, check_order
from ep_a2a.tools import bench_layer_overlap as blo

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_both_protocols_and_the_micro_batch_sizes():
    a = blo.parse_args(["--overlap", "--out", "/tmp/x.json"])
    assert a.protocols == ["fence", "sentinel"] and a.tokens == [1, 4, 16, 64, 128] and a.graph
    a = blo.parse_args(["--graph", "--overlap", "--protocol", "sentinel", "--tokens", "2,8", "--out", "/tmp/x.json"])
    assert a.protocols == ["sentinel"] and a.tokens == [2, 8]
    assert blo.result_file(dict(device="NVIDIA H200"), a) == "moe-layer-h200-8ranks-small-torch-graph-overlap"


@pytest.mark.parametrize("bad", [["--framework", "jax"], ["--combine-quant", "fp8"], ["--gemm", "loop"], []])
def test_what_the_overlapped_mode_does_not_run_is_a_usage_error(bad):
    argv = bad + ["--out", "/tmp/x.json"] + (["--overlap"] if bad else [])
    with pytest.raises(SystemExit) as e:
        blo.parse_args(argv)
    assert e.value.code == 2


def test_the_command_dispatches_overlap_and_says_no_gpu_in_one_line():
    from ep_a2a import driver
    if driver.device_count() > 0:
        pytest.skip("a GPU is usable here: the benchmark would run")
    p = subprocess.run([sys.executable, "-m", "ep_a2a.bench_layer", "--graph", "--overlap", "--out", "/tmp/x.json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = p.stderr.strip().splitlines()
    # (no GPU here; or, in an interpreter without torch, no torch: either is one line and exit 3)
    assert p.returncode == 3 and len(lines) == 1, p.stderr
    assert lines[0].startswith(("ep_a2a.bench_layer: no usable", "ep_a2a.bench_layer: torch is not installed")), p.stderr
    p = subprocess.run([sys.executable, "-m", "ep_a2a.bench_layer", "--overlap", "--help"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0 and "--overlap" in p.stdout, p.stdout


def test_orders_keep_each_micro_batch_in_turn():
    assert check_order("overlapped") == TBO and check_order("sequential") == SEQUENTIAL
    rnd = random.Random()
    a, b, merged = list(PIECES), list(PIECES), []
    while a or b:  # a random legal interleaving is accepted
        src = rnd.choice([x for x in (a, b) if x])
        merged.append(("A" if src is a else "B", src.pop(0)))
    assert check_order(merged) == tuple(merged)
    swapped = list(TBO)
    swapped[0], swapped[1] = swapped[1], swapped[0]  # A's receive before its send
    for bad in (swapped, TBO[:-1], TBO + (("C", "experts"),), "tbo"):
        with pytest.raises(ValueError):
            check_order(bad)
