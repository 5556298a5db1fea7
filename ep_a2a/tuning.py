"""Measured defaults stored with the package.

SENTINEL_MAX_TOKENS: protocol="auto" uses SENTINEL while runtime_max_tokens_per_rank is at
most this, FENCE above: the crossover measured by `python -m ep_a2a.bench --protocol auto`
(which sweeps both protocols) on one H200 with 8 in-process ranks, deepseek-v3, bf16
(bench/results/). Override per all-to-all with crossover_tokens=, or for the process with
the environment variable EP_A2A_SENTINEL_MAX_TOKENS.
"""
import os

SENTINEL_MAX_TOKENS_H200 = 16


def sentinel_max_tokens() -> int:
    v = os.environ.get("EP_A2A_SENTINEL_MAX_TOKENS")
    return int(v) if v else SENTINEL_MAX_TOKENS_H200
