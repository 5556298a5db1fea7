"""FENCE dispatch at small batches: slots from the table (token order, no atomics) and a
token's pushes shared by several blocks (schedule.dispatch_splits). The payloads are large
enough (hidden 7168) that the host really splits; every step is checked against the
reference, bitwise."""
import numpy as np
import pytest

from test_fence_gpu import make, run

pytestmark = pytest.mark.gpu


def splits_of(a2a, T):
    return a2a.ranks[0].schedule.dispatch_splits(T)


@pytest.mark.parametrize("route", ["perfect", "uniform", "zipf"])
def test_split_dispatch_at_every_small_size(route):
    rng = np.random.default_rng()
    group, a2a = make(8, hidden=7168, top_k=8, num_experts=256, max_tokens=256)
    with group, a2a:
        assert splits_of(a2a, 1) > 1 and splits_of(a2a, 129) == 1  # (the path under test is taken)
        for T in (1, 2, 3, 5, 8, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 200):
            run(a2a, rng, [T] * 8, T, route=route, invalid_fraction=0.1 if T % 2 else 0.0)
        run(a2a, rng, [1, 0, 3, 128, 2, 0, 33, 1], 128, route=route)  # unequal, table on some ranks only
        run(a2a, rng, [0, 130, 1, 5, 129, 0, 2, 64], 130, route=route)


def test_split_dispatch_with_a_large_runtime_max():
    # the sanitize pass sizes the grid (T^ >> T): the kernel then splits a token over all of it
    rng = np.random.default_rng()
    group, a2a = make(8, hidden=7168, top_k=8, num_experts=256, max_tokens=1024)
    with group, a2a:
        for T, tmax in ((1, 1024), (3, 700), (17, 1024), (0, 1024)):
            run(a2a, rng, [T] * 8, tmax)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4", "opaque"])
def test_split_dispatch_payload_formats(fmt):
    # odd byte counts (7 x 1031 B) and narrow vectors, split into parts of whole vectors
    rng = np.random.default_rng()
    for hidden in (7168, 7 * 1031):
        group, a2a = make(8, fmt=fmt, hidden=hidden, top_k=8, num_experts=64, max_tokens=32)
        with group, a2a:
            for T in (1, 4, 16, 32):
                run(a2a, rng, [T] * 8, T, route="zipf")


def test_split_dispatch_many_duplicate_selections():
    # top_k 22 over 8 ranks: most selections repeat a rank the token already reaches
    rng = np.random.default_rng()
    group, a2a = make(8, hidden=7168, top_k=22, num_experts=64, max_tokens=64)
    with group, a2a:
        for T in (1, 2, 7, 16, 64):
            run(a2a, rng, [T] * 8, T, route="uniform", invalid_fraction=0.1)


def test_split_dispatch_fp8_combine():
    rng = np.random.default_rng()
    group, a2a = make(8, hidden=7168, top_k=8, num_experts=256, max_tokens=64, combine_quant="fp8")
    with group, a2a:
        for T in (1, 4, 16, 64):
            run(a2a, rng, [T] * 8, T, exact=False, route="perfect")
            run(a2a, rng, [T] * 8, T, exact=False, prequantize=True)


def test_split_dispatch_counts_dropped_selections_once():
    # the blocks sharing a token select it alike; only the first counts what it drops
    from ep_a2a.testing.reference import dropped_selections
    rng = np.random.default_rng()
    group, a2a = make(4, hidden=7168, top_k=8, num_experts=64, max_tokens=32, on_timeout="trap")
    with group, a2a:
        a2a.set_active_ranks([0, 1, 3])
        total = {s: 0 for s in (0, 1, 3)}
        for T in (1, 2, 5, 16, 32):
            rep = run(a2a, rng, [T, T, 0, T], T, route="uniform", invalid_fraction=0.05)
            for s in total:
                total[s] += dropped_selections([rep.expert_ids[s]], a2a.num_experts, 4, (0, 1, 3))
            got = {r.rank: r.dropped_selections() for r in a2a.ranks if r.rank != 2}
            assert got == total, (T, got, total)
        assert sum(total.values()) > 0
