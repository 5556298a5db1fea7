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
