"""Every example on a GPU, as a user runs it (a subprocess from the checkout): it exits 0 and
prints its success line. torch_distributed.py runs under torchrun with two processes on one
GPU (ProcessGroup supports several processes per GPU: each maps the others' workspaces through
POSIX-fd handles; they time-slice the GPU, hence few steps)."""
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.gpu


def run(argv, timeout=540):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"exit {p.returncode}:\n{out[-4000:]}"
    return p.stdout


def need(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here: its example is not run")


def test_quickstart_local_matches_numpy():
    out = run([str(EXAMPLES / "quickstart_local.py")])
    assert "combine matches NumPy" in out, out


def test_engine_adapter_matches_the_reference():
    need("torch")
    out = run([str(EXAMPLES / "engine_adapter.py")])
    assert "every rank's output matches the reference" in out, out


def test_torch_moe_layer_is_within_its_bf16_bounds():
    need("torch")
    out = run([str(EXAMPLES / "torch_moe_layer.py"), "--steps", "6"])
    assert "torch_moe_layer:" in out and "max |error| / max |reference|" in out, out


def test_jax_moe_layer_jit_equals_eager_and_is_within_its_bounds():
    need("jax")
    out = run([str(EXAMPLES / "jax_moe_layer.py"), "--steps", "6"])
    assert "jax_moe_layer:" in out and "jit == eager bit for bit: True" in out, out


def test_torch_distributed_under_torchrun_two_processes_on_one_gpu():
    need("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               str(EXAMPLES / "torch_distributed.py"), "--steps", "2", "--tokens", "8"])
    assert "all ranks match the reference" in out, out
