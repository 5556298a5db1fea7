"""The package's structural rules, read from its source: only ep_a2a/driver/ talks to
cuda.bindings, no Python file (package, tests, examples, build) imports another module's
private names or outgrows 600 lines, the package's imports form no cycle, and the kernels
keep PTX in ptx.cuh."""
import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ep_a2a"
KERNELS = PKG.parent / "kernels"
MODULES = sorted(p for p in PKG.rglob("*.py"))
EVERY_PY = sorted(p for d in (PKG, PKG.parent / "tests", PKG.parent / "examples", PKG.parent / "kernels")
                  for p in d.rglob("*.py")) + [PKG.parent / "setup.py"]


def _name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path):
    """(module imported, names imported from it) for every import statement, relative ones resolved."""
    tree = ast.parse(path.read_text())
    here = _name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            yield mod, tuple(a.name for a in node.names)


def test_only_the_driver_layer_imports_cuda_bindings():
    bad = [f"{p.relative_to(PKG.parent)}: {m}" for p in MODULES if "driver" not in p.relative_to(PKG).parts[:1]
           for m, _ in _imports(p) if m == "cuda" or m.startswith("cuda.")]
    assert not bad, bad


def test_no_module_imports_a_private_name_of_another():
    bad = [f"{p.relative_to(PKG.parent)}: from {m} import {n}" for p in EVERY_PY for m, names in _imports(p)
           if m.startswith("ep_a2a") for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, bad


def test_the_package_imports_form_no_cycle():
    names = {_name(p): p for p in MODULES}
    graph = {}
    for mod, p in names.items():
        deps = set()
        for m, imported in _imports(p):
            if m in names:
                deps.add(m)
            for n in imported:  # `from . import schedule` names a module
                if f"{m}.{n}" in names:
                    deps.add(f"{m}.{n}")
        graph[mod] = deps - {mod}
    # a package's __init__ importing its own submodules is not a cycle of concepts
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
            if d == m.rsplit(".", 1)[0] or m == d.rsplit(".", 1)[0] or d == "ep_a2a":
                continue
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2
    for m in graph:
        if m not in state:
            visit(m)


def test_no_python_file_over_600_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in EVERY_PY if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_inline_ptx_and_volatile_access_live_in_ptx_cuh():
    bad = []
    for f in sorted(KERNELS.glob("*.cu*")):
        if f.name == "ptx.cuh":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if re.search(r"\basm\b|\bvolatile\b", code):
                bad.append(f"{f.name}:{i}: {line.strip()}")
    assert not bad, bad


def test_readme_tree_names_only_files_that_exist():
    """README's 'Where things are' block: every file or folder it names is in the tree, and
    every module of the package is named there (directly or through its folder)."""
    readme = (PKG.parent / "README.md").read_text()
    block = readme.split("## Where things are", 1)[1].split("```", 2)[1]
    top, names = None, set()
    for line in block.splitlines():
        first = line.split()[0] if line.strip() else ""
        if line and not line.startswith(" ") and first.endswith("/"):
            top = first.rstrip("/")
            continue
        for tok in re.findall(r"(?<![\w./$])([\w]+(?:\.py|\.cuh|\.cu|/))(?=[\s,]|$)", line):
            names.add(f"{top}/{tok}".rstrip("/") if top else tok.rstrip("/"))
    missing = sorted(n for n in names if not (PKG.parent / n).exists())
    assert names and not missing, missing
    named = {n.split("/", 1)[1] for n in names if n.startswith("ep_a2a/")}
    unnamed = sorted(str(p.relative_to(PKG)) for p in MODULES if p.name != "__init__.py"
                     and str(p.relative_to(PKG)) not in named and str(p.relative_to(PKG)).split("/")[0] not in named)
    assert not unnamed, unnamed
