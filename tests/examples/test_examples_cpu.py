"""The examples on a machine without a usable GPU: each one stops with ONE line that says what
is missing and a documented exit code (3: no usable GPU here; 2: anything else missing, such
as its framework or torchrun's environment), never a traceback. Each example runs for real in
a subprocess; a framework is hidden from it (sys.modules[name] = None: its import fails as if
it were not installed) to reach the "needs <framework>" path where the framework is present."""
import ast
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ep_a2a import driver

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NO_GPU, MISSING = 3, 2
# script -> the framework it needs (None: ep_a2a alone)
SCRIPTS = {"quickstart_local.py": None, "engine_adapter.py": "torch", "torch_moe_layer.py": "torch",
           "jax_moe_layer.py": "jax", "torch_distributed.py": "torch"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")

pytestmark = pytest.mark.skipif(driver.device_count() > 0, reason="a GPU is usable here: the examples run "
                                "(tests/examples/test_examples_gpu.py), their no-GPU path is not reached")


def installed(module):
    return module is None or importlib.util.find_spec(module) is not None


def run(argv, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def one_line(p, script: str) -> str:
    """The example's single line (stderr), after checking it said nothing else."""
    lines = [s for s in p.stderr.splitlines() if s.strip()]
    assert p.stdout == "" and len(lines) == 1, f"expected one line on stderr, got:\n{p.stdout}{p.stderr}"
    assert lines[0].startswith(f"{script}: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_without_a_gpu_an_example_says_so_in_one_line_and_exits_3(script):
    need = SCRIPTS[script]
    if not installed(need):
        pytest.skip(f"{need} is not installed here: the example stops at that first (exit {MISSING}, "
                    "test_without_its_framework_...)")
    argv = [str(EXAMPLES / script)]
    if script == "torch_distributed.py":  # one process as torchrun would start it; torchrun itself below
        argv = ["-c", "import os, runpy, sys; os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', "
                "MASTER_ADDR='127.0.0.1', MASTER_PORT='29500'); sys.argv = [sys.argv[1]]; "
                "sys.path.insert(0, os.path.dirname(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')",
                str(EXAMPLES / script)]
    p = run(argv)
    assert p.returncode == NO_GPU, f"exit {p.returncode}:\n{p.stdout}{p.stderr}"
    line = one_line(p, script)
    assert "no usable GPU here" in line and ("driver" in line or "device" in line), line


@pytest.mark.parametrize("script", sorted(s for s, need in SCRIPTS.items() if need))
def test_without_its_framework_an_example_names_it_in_one_line_and_exits_2(script):
    need = SCRIPTS[script]
    hide = f"sys.modules[{need!r}] = None; " if installed(need) else ""  # (absent: nothing to hide)
    p = run(["-c", f"import os, runpy, sys; {hide}sys.argv = [sys.argv[1]]; "
             "sys.path.insert(0, os.path.dirname(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')",
             str(EXAMPLES / script)])
    assert p.returncode == MISSING, f"exit {p.returncode}:\n{p.stdout}{p.stderr}"
    assert f"needs {need} " in one_line(p, script)


def test_torch_distributed_outside_torchrun_names_what_is_unset_and_exits_2():
    if not installed("torch"):
        pytest.skip("torch is not installed here: the example stops at that first (exit 2)")
    p = run([str(EXAMPLES / "torch_distributed.py")])
    assert p.returncode == MISSING, f"exit {p.returncode}:\n{p.stdout}{p.stderr}"
    line = one_line(p, "torch_distributed.py")
    assert "run me under torchrun" in line and "RANK" in line and "MASTER_ADDR" in line, line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_without_a_gpu_prints_the_line_once_and_fails_with_3():
    """Two workers under torchrun: one line from local rank 0 (the other exits silently, after
    it), exit code 3 in torchrun's report, no traceback of the example (torchrun prints its own
    ChildFailedError report, which is not ours to change)."""
    if not installed("torch"):
        pytest.skip("torch is not installed here: no torchrun")
    p = run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
             str(EXAMPLES / "torch_distributed.py")], timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    ours = [s for s in out.splitlines() if s.startswith("torch_distributed.py: ")]
    assert len(ours) == 1 and "no usable GPU here" in ours[0], out
    assert "exitcode  : 3" in out, out
    assert "ZeroDivisionError" not in out and 'examples/torch_distributed.py", line' not in out, out


def test_the_examples_build_and_run_their_steps_without_ep_a2a_testing():
    """ep_a2a.testing may only check a result (the layer oracle), never build inputs or run a step."""
    allowed = {"ep_a2a.testing.layer_oracle"}
    for script in SCRIPTS:
        tree = ast.parse((EXAMPLES / script).read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [m for m in mods if m.startswith("ep_a2a.testing") and m not in allowed]
            assert not bad, f"{script} imports {bad}"
