"""python -m ep_a2a.stress: a short soak on the GPU, and its behaviour without one."""
import json

import numpy as np
import pytest

from ep_a2a.tools import stress


@pytest.mark.gpu
def test_stress_20_steps_every_byte_checked(tmp_path, capsys):
    seed = int(np.random.default_rng().integers(2 ** 31))
    out = tmp_path / "soak.json"
    rc = stress.main(["--steps", "20", "--ranks", "3", "--max-tokens", "24", "--seed", str(seed), "--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0, f"seed {seed}:\n{text.out}\n{text.err}"
    res = json.loads(out.read_text())
    assert res["steps"] == res["steps_checked"] == 20, res   # the first 50 steps are all checked
    assert res["mismatches"] == 0 and res["errors"] == 0
    assert sum(res["protocols"].values()) == 20 and set(res["protocols"]) <= {"fence", "sentinel"}
    assert res["bytes_moved"] == res["dispatch_bytes"] + res["combine_bytes"] > 0
    assert res["device"] and res["commit"] and res["args"]["seed"] == seed
    assert "steps run" in text.out and "mismatches     0" in text.out


@pytest.mark.gpu
def test_stress_check_every(tmp_path):
    out = tmp_path / "soak.json"
    assert stress.main(["--steps", "15", "--check-every", "7", "--ranks", "2", "--max-tokens", "8",
                        "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["steps"] == 15 and res["steps_checked"] == 3  # steps 0, 7, 14


def test_stress_without_gpu_exits_3(capsys, tmp_path):
    from ep_a2a.driver.device import available
    if available():
        pytest.skip("this machine has a GPU")
    assert stress.main(["--steps", "3", "--out", str(tmp_path / "s.json")]) == 3
    assert "no usable CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--minutes", "-1"], ["--check-every", "0"],
                                  ["--steps", "3", "--minutes", "1"], ["--ranks", "0"],
                                  ["--minutes", "nan"], ["--max-tokens", "0"], ["--seed", "-1"]])
def test_stress_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        stress.main(argv)
    assert e.value.code == 2


def test_logical_bytes_follow_the_paper():
    """bytes = tokens * min(ep, top_k) * activation bytes (hidden + scales; ids and weights left out)."""
    from ep_a2a.testing.formats import payload_formats
    d, c = stress.logical_bytes([3, 0, 5, 1], 4, 8, payload_formats(7168, 8)["mxfp8"], 7168, 2)
    assert d == 9 * 4 * (7168 + 224) and c == 9 * 4 * 7168 * 2
    d, c = stress.logical_bytes([2], 16, 6, payload_formats(100, 6)["nvfp4"], 100, 4)
    assert d == 2 * 6 * (50 + 7) and c == 2 * 6 * 100 * 4


def test_the_classic_tally_counts_checks_and_mismatches(capsys):
    """stress._tally: one step's figures into the tally, a combine that checked fewer rows
    than the step had is a mismatch, printed at once."""
    import types
    from ep_a2a import PayloadSpec
    a2a = types.SimpleNamespace(ep_size=2, top_k=2, payload_specs=[PayloadSpec("x", (16,), "bfloat16")],
                                combine_hidden_size=16, combine_dtype=np.dtype(np.float32))
    fig = dict(steps=0, steps_checked=0, dispatch_bytes=0, combine_bytes=0, bytes_checked=0, mismatches=0,
               protocols={}, formats={}, first_failures=[])
    d = dict(tokens=[3, 1], key=("bf16", "fence"))
    ok = types.SimpleNamespace(dispatch_bytes_checked=100, combine_rows_checked=4, mismatches=[])
    stress._tally(fig, a2a, d, ok, "fence", False, True, 0, 7)
    short = types.SimpleNamespace(dispatch_bytes_checked=50, combine_rows_checked=3, mismatches=[])
    stress._tally(fig, a2a, d, short, "sentinel", True, True, 1, 7)
    db, cb = stress.step_bytes(a2a, d["tokens"])
    assert db > 0 and cb > 0
    assert fig["steps"] == fig["steps_checked"] == 2 and fig["bytes_checked"] == 150
    assert (fig["dispatch_bytes"], fig["combine_bytes"]) == (2 * db, 2 * cb)
    assert fig["protocols"] == {"fence": 1, "sentinel": 1}
    assert fig["formats"] == {"bf16/fence": 1, "bf16/fence/epilogue-fp8": 1}
    assert fig["mismatches"] == 1 and "combine checked 3 rows of 4" in fig["first_failures"][0]
    assert "MISMATCH at step 1 (seed 7" in capsys.readouterr().err
