"""The layer benchmarks' shapes: the profiles, the command line's overrides of them, the seed."""
from __future__ import annotations

import os

PROFILES = {
    "small": dict(hidden=2048, intermediate=1024, experts=64, top_k=8),
    "deepseek-v3-like": dict(hidden=7168, intermediate=2048, experts=256, top_k=8),
}


def layer_shape(args, profiles: dict) -> tuple:
    """(hidden, intermediate, experts, top_k, ranks): the profile's, with the command line's
    overrides."""
    p = dict(profiles[args.profile])
    for k in ("hidden", "intermediate", "experts", "top_k"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    return p["hidden"], p["intermediate"], p["experts"], p["top_k"], args.ranks


def run_seed(args) -> int:
    """--seed, or a fresh one (printed by the caller, so a run reproduces)."""
    return args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
