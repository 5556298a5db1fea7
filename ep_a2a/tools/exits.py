"""The exit statuses every command-line tool shares, and the one check that ends a tool with
MISSING where this machine cannot run it. (`python -m ep_a2a`, the demo, is the exception:
without a GPU it runs the NumPy reference model and exits 0.)"""
from __future__ import annotations

import sys

OK = 0
FAILED = 1    # the run itself failed: a mismatch, an error, a rank process that died
USAGE = 2     # a bad command line (argparse's own status)
MISSING = 3   # no usable CUDA GPU or driver here (or, for a framework benchmark, no framework)

EPILOG = """exit status:
  0  success
  1  the run failed (a mismatch or an error)
  2  a bad command line
  3  nothing to run on here: no usable CUDA GPU or driver, or the framework the tool drives is
     not installed (said in one line on stderr)"""


def gpu_missing() -> str | None:
    """Why this machine has no usable CUDA GPU (one short line), or None where it has one."""
    from ..driver import device
    from ..driver.errors import NoDriverError
    try:
        device.init()
        if device.device_count() > 0:
            return None
        return "the CUDA driver sees no GPU"
    except NoDriverError as e:
        return str(e).splitlines()[0].split(" (", 1)[0]  # the loader's own words stay in the exception


def missing(prog: str, what: str) -> int:
    """Say on stderr, in one line, what this machine lacks for `prog`; returns MISSING."""
    print(f"{prog}: {what}", file=sys.stderr, flush=True)
    return MISSING


def require_gpu(prog: str) -> int | None:
    """None where a CUDA GPU is usable; otherwise MISSING, after saying why in one line."""
    why = gpu_missing()
    return None if why is None else missing(prog, f"no usable CUDA GPU here ({why}): nothing to run")


def require_framework_and_gpu(prog: str, module: str, role: str) -> int | None:
    """None where `module` (the framework a tool drives) is installed and a CUDA GPU is
    usable; otherwise MISSING, after saying which one is lacking (`role`: why the tool needs
    the framework)."""
    import importlib.util
    if importlib.util.find_spec(module) is None:
        return missing(prog, f"{module} is not installed: {role}")
    return require_gpu(prog)
