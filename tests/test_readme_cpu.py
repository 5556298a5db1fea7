"""README.md and docs/ as a newcomer meets them, without a GPU: the quickstart block exists
and is valid Python, the README stays short, and every relative link of README.md and of
the docs pages points at a file of the tree (bench/results files are renamed over time)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from test_readme_quickstart_gpu import README, ROOT, quickstart_code

MAX_README_LINES = 260
# [text](target) links; absolute URLs and pure anchors are not files of the tree
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; at most {MAX_README_LINES} (details go to docs/)"


def test_quickstart_block_is_python_that_uses_the_public_api():
    code = quickstart_code()
    tree = ast.parse(code, "README.md quickstart")
    compile(tree, "README.md quickstart", "exec")
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    # eight in-process ranks on one GPU, every rank dispatched and combined, checked on the host
    assert {"LocalGroup", "MoeAlltoAll", "PayloadSpec", "dispatch", "combine_input", "combine",
            "synchronize", "allclose"} <= names, sorted(names)
    assert "LocalGroup([0] * EP)" in code and "EP, T, H, K, E = 8," in code


def test_quickstart_extraction_reports_what_is_missing():
    with pytest.raises(ValueError, match="no '## Quickstart' section"):
        quickstart_code("# title\n")
    with pytest.raises(ValueError, match="no ```python block"):
        quickstart_code("## Quickstart\ntext\n## Next\n```python\nx = 1\n```\n")
    assert quickstart_code("## Quickstart\n```python\nx = 1\ny = 2\n```\n## Next\n") == "x = 1\ny = 2"


def _links(page: Path):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


def test_relative_links_point_at_files_of_the_tree():
    pages = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = [f"{p.relative_to(ROOT)} -> {t}" for p in pages if p.exists() for t in _links(p)
               if not (p.parent / t).exists()]
    assert not missing, missing
