import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the test folders (driver/, protocol/, moe/, layers/, tools/) import common.py from here, and
# protocol/'s GPU tests share test_fence_gpu's make/run, whatever pytest's import mode
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[1:1] = [_HERE, os.path.join(_HERE, "protocol")]

from ep_a2a.driver import device as _device  # noqa: E402

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
