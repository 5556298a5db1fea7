"""examples/two_batch_overlap.py without a usable GPU, as test_examples_cpu.py checks the other
examples: one line and exit 3 without a GPU, one line naming torch and exit 2 without it, and
no step built from ep_a2a.testing."""
import ast

import pytest
from test_examples_cpu import EXAMPLES, MISSING, NO_GPU, installed, one_line, run

from ep_a2a import driver

SCRIPT = "two_batch_overlap.py"
pytestmark = pytest.mark.skipif(driver.device_count() > 0, reason="a GPU is usable here: the example runs "
                                "(tests/examples/test_two_batch_overlap_gpu.py), its no-GPU path is not reached")


def test_without_a_gpu_it_says_so_in_one_line_and_exits_3():
    if not installed("torch"):
        pytest.skip("torch is not installed here: the example stops at that first (exit 2)")
    p = run([str(EXAMPLES / SCRIPT)])
    assert p.returncode == NO_GPU, f"exit {p.returncode}:\n{p.stdout}{p.stderr}"
    line = one_line(p, SCRIPT)
    assert "no usable GPU here" in line and ("driver" in line or "device" in line), line


def test_without_torch_it_names_it_in_one_line_and_exits_2():
    hide = "sys.modules['torch'] = None; " if installed("torch") else ""
    p = run(["-c", f"import os, runpy, sys; {hide}sys.argv = [sys.argv[1]]; "
             "sys.path.insert(0, os.path.dirname(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')",
             str(EXAMPLES / SCRIPT)])
    assert p.returncode == MISSING, f"exit {p.returncode}:\n{p.stdout}{p.stderr}"
    assert "needs torch " in one_line(p, SCRIPT)


def test_it_runs_its_step_without_ep_a2a_testing():
    for node in ast.walk(ast.parse((EXAMPLES / SCRIPT).read_text())):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not [m for m in mods if m.startswith("ep_a2a.testing")], mods
