"""What the examples check before they start. A missing requirement ends the example with
ONE line on stderr and an exit code instead of a traceback:

    3  no usable GPU here (no NVIDIA driver, cuInit failing, no device)
    2  anything else missing (ep_a2a, a framework or its CUDA build, the launcher's environment)

The examples import this file from their own folder (Python puts a script's folder first on
sys.path, under torchrun too); copy it along with an example."""
from __future__ import annotations

import importlib
import os
import sys
import time

NO_GPU = 3
MISSING = 2
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fail(code: int, message: str) -> None:
    """Print `<script>: <message>` as one line on stderr and exit with `code`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "example"
    if os.environ.get("LOCAL_RANK", "0") == "0":  # under a launcher, one process speaks for the node
        print(f"{name}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    else:  # torchrun stops every worker once one exits: the silent ones leave last
        time.sleep(5)
    sys.exit(code)


def require_ep_a2a():
    """ep_a2a, from the installed package or else from the checkout this folder lives in."""
    try:
        return importlib.import_module("ep_a2a")
    except ImportError:
        pass
    if os.path.isdir(os.path.join(_ROOT, "ep_a2a")):
        sys.path.insert(0, _ROOT)  # run from a checkout without `pip install .`
    try:
        return importlib.import_module("ep_a2a")
    except ImportError as e:
        fail(MISSING, f"ep_a2a is not importable ({e}): pip install . (or PYTHONPATH=<checkout>)")


def require_module(name: str, install: str):
    """Import `name` (a framework) or exit 2 saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        fail(MISSING, f"needs {name} ({type(e).__name__}: {e}): {install}")


def require_gpu() -> int:
    """The number of GPUs ep_a2a can use here, or exit 3 saying why there is none."""
    ep_a2a = require_ep_a2a()
    from ep_a2a import driver  # (the package's driver layer: cuInit once, its failure as NoDriverError)
    try:
        driver.init()
    except ep_a2a.NoDriverError as e:
        fail(NO_GPU, f"no usable GPU here: {e}")
    n = driver.device_count()
    if n == 0:
        fail(NO_GPU, "no usable GPU here: the CUDA driver reports no device")
    return n


def require_torch_cuda():
    """PyTorch with CUDA (exit 2 without PyTorch, 3 without a GPU, 2 for a CPU-only build)."""
    torch = require_module("torch", "pip install torch (a CUDA build)")
    require_gpu()
    if not torch.cuda.is_available():
        fail(MISSING, f"PyTorch {torch.__version__} sees no GPU (a CPU-only build?): install a CUDA build of torch")
    return torch


def require_jax_gpu():
    """JAX with a GPU backend (exit 2 without JAX or without its CUDA plugin, 3 without a GPU)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for ep_a2a's workspaces
    jax = require_module("jax", "pip install 'jax[cuda13]'")
    require_gpu()
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        fail(MISSING, f"JAX {jax.__version__} has no GPU backend ({e}): pip install 'jax[cuda13]'")
    return jax, gpus


def require_torchrun() -> tuple:
    """(rank, world size, local rank) from torchrun's environment, or exit 2 naming what is unset."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    unset = [n for n in names if not os.environ.get(n)]
    if unset:
        fail(MISSING, f"run me under torchrun (python -m torch.distributed.run --nproc-per-node 2 "
                      f"{sys.argv[0]}): {', '.join(unset)} not set")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
