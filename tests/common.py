"""Helpers several test modules share (tests/ is on sys.path under pytest)."""
import multiprocessing as mp
import os

import numpy as np


POISON = -21846  # 0xAAAA in every 16-bit output element before a call: a row written past the total shows


def torch_cuda(torch):
    """torch's cuda:0, or the test skips (torch built without a CUDA device)."""
    import pytest
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch.device("cuda", 0)


def fresh_rng():
    """A generator on a fresh random seed, and the 'seed=N' label every failure message carries."""
    seed = int.from_bytes(os.urandom(8), "little")
    return np.random.default_rng(seed), f"seed={seed}"


def layer_token_counts(rng, ep, tmax, step):
    """Tokens per rank of one MoE layer step: step 0 has a full rank and (ep > 1) an empty one,
    step 1 at most half of T^ each, later steps one random count for every rank."""
    if step == 0:
        t = [int(rng.integers(0, tmax + 1)) for _ in range(ep)]
        t[0] = tmax
        if ep > 1:
            t[-1] = 0
        return t
    if step == 1:
        return [int(rng.integers(0, tmax // 2 + 1)) for _ in range(ep)]
    return [int(rng.integers(1, tmax + 1))] * ep


def run_processes(target, args_of_rank, n, timeout, join=30, messages=None):
    """Runs target(*args_of_rank(r), q) in n spawned processes, one per rank, and returns
    (the first `messages` items they put on the queue q, default n, in arrival order; the
    processes). Every child is joined, and killed if still alive `join` s later, so a test
    never hangs on one: a child reports its exceptions through q instead of raising."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of_rank(r), q)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=timeout) for _ in range(n if messages is None else messages)]
    finally:
        for p in procs:
            p.join(join)
            if p.is_alive():
                p.kill()
    return got, procs


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def kernels_build():
    """kernels/build.py as a module (its nvcc flags, generated header and nvcc lookup)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("kernels_build", os.path.join(ROOT, "kernels", "build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def kernel_ptx(source: str, arch: str = "sm_90") -> str:
    """kernels/<source> compiled to PTX with the build's flags; skips the test where nvcc or
    the generated header is missing."""
    import subprocess
    import pytest
    build = kernels_build()
    try:
        nvcc = build.find_nvcc()
    except build.BuildError:
        pytest.skip("nvcc not found")
    if not os.path.isfile(build.HEADER):
        pytest.skip("kernels/generated not made here (run `make cubins`)")
    r = subprocess.run([nvcc, "-ptx", f"-arch={arch}", *build.NVCCFLAGS, "-o", "-", os.path.join(ROOT, "kernels", source)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout
