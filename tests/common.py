"""Helpers several test modules share (tests/ is on sys.path under pytest)."""
import os

import numpy as np


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
