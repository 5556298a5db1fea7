"""README.md's quickstart, run verbatim on the GPU: the first ```python block under its
'## Quickstart' heading, in a fresh interpreter from outside the tree (the package found
through PYTHONPATH, as on the GPU machine). The CPU checks of the block are in
test_readme_cpu.py, which takes quickstart_code from here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEADING = "## Quickstart"


def quickstart_code(text: str | None = None) -> str:
    """The code of the quickstart block; ValueError when the section or its block is missing."""
    text = README.read_text() if text is None else text
    if HEADING not in text:
        raise ValueError(f"README.md has no '{HEADING}' section")
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    if "```python\n" not in section:
        raise ValueError(f"README.md's '{HEADING}' section has no ```python block")
    body = section.split("```python\n", 1)[1]
    if "\n```" not in "\n" + body:
        raise ValueError(f"README.md's '{HEADING}' block is not closed")
    return ("\n" + body).split("\n```", 1)[0][1:]


def _torch_with_cuda():
    """The quickstart moves arrays with PyTorch: skip (with the reason) where it cannot."""
    torch = pytest.importorskip("torch", reason="the README quickstart uses PyTorch, which is not installed here")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} sees no CUDA device (a CPU-only build?)")


@pytest.mark.gpu
def test_readme_quickstart_runs_verbatim(tmp_path):
    _torch_with_cuda()
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    print(r.stdout + r.stderr)
    assert r.returncode == 0, f"the quickstart failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip().splitlines()[-1].startswith("OK: 8 ranks x 16 tokens"), r.stdout
