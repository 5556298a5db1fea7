"""Measured defaults stored with the package.

SENTINEL_MAX_TOKENS: protocol="auto" uses SENTINEL while runtime_max_tokens_per_rank is at
most this, FENCE above: the crossover measured by `python -m ep_a2a.bench --protocol auto`
(which sweeps both protocols) on one H200 with 8 in-process ranks, deepseek-v3, bf16
(bench/results/). Override per all-to-all with crossover_tokens=, or for the process with
the environment variable EP_A2A_SENTINEL_MAX_TOKENS.
"""
import os

# Measured 2026-11-29 (bench/results/NVIDIA_H200-deepseek-v3-bf16-8ranks-fence-sentinel-*.json):
# with 8 ranks sharing one H200, SENTINEL's round trip was slower than FENCE's at every size
# (16.6 vs 11.1 µs at 1 token per rank, 75 vs 18.5 at 16): on one GPU a system-scope fence
# is cheap, while SENTINEL's landing copy, per-word checks and resets cost memory traffic
# that all ranks share. So "auto" means FENCE on this machine; re-measure on NVLink-connected
# GPUs, where the paper finds SENTINEL faster at small batches.

SENTINEL_MAX_TOKENS_H200 = 0


def sentinel_max_tokens() -> int:
    v = os.environ.get("EP_A2A_SENTINEL_MAX_TOKENS")
    return int(v) if v else SENTINEL_MAX_TOKENS_H200
