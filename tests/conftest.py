import importlib.util
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the test folders (driver/, protocol/, moe/, layers/, tools/) import common.py from here, and
# protocol/'s GPU tests share test_fence_gpu's make/run, whatever pytest's import mode
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[1:1] = [_HERE, os.path.join(_HERE, "protocol")]

from ep_a2a.driver import device as _device  # noqa: E402

# rendezvous in tests without a launcher: one job token for this pytest run and its children
os.environ.setdefault("EP_A2A_JOB_TOKEN", __import__("secrets").token_hex(16))

HAVE_GPU = _device.available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with a reason where none is present)")


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (no libcuda.so.1 or no device): GPU test skipped")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_NOT_IMPORTED = re.compile(r"could not import '([\w.]+)'")


def pytest_terminal_summary(terminalreporter):
    """One line per package whose tests were skipped because it is missing (`make test` stays
    light: the frameworks are optional; CI installs .ci/requirements-frameworks.txt)."""
    files, tests = {}, {}
    for rep in terminalreporter.stats.get("skipped", []):
        m = _NOT_IMPORTED.search(str(rep.longrepr))
        if m and rep.when == "collect":   # importorskip at module level: the whole file
            files.setdefault(m.group(1), set()).add(rep.nodeid)
        elif m:
            tests.setdefault(m.group(1), set()).add(rep.nodeid)
    for name in sorted(set(files) | set(tests), key=lambda n: (n.split(".")[0], n)):
        top = name.split(".")[0]
        why = f"{top} not installed" if importlib.util.find_spec(top) is None else f"{name} not importable"
        f, t = files.get(name, set()), tests.get(name, set())
        parts = ([f"{len(f)} test file{'s' * (len(f) != 1)} ({', '.join(sorted(f))})"] if f else []) + \
                ([f"{len(t)} test{'s' * (len(t) != 1)}"] if t else [])
        terminalreporter.write_line(f"{why}: {' and '.join(parts)} skipped")
