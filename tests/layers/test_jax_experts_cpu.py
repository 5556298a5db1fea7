"""The JAX layer's expert functions on the CPU backend: padded_ffn (each local expert's rows
padded to a bound, one batched GEMM) against a float64 oracle and against ragged_ffn
(jax.lax.ragged_dot), on random counts with empty experts, the tight bound and unused rows,
and the bound the layer picks (expert_rows_bound)."""
import types

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (pip install jax)")
jnp = jax.numpy

from common import fresh_rng  # noqa: E402
from ep_a2a.layers.jax import (FUSED_MAX_ROWS_XLA, RAGGED_BELOW, auto_fused_rows, expert_gemm,  # noqa: E402
                               expert_rows_bound, traced_functions)


def _oracle(x, counts, w1t, w2t):
    x, w1t, w2t = (np.asarray(a, np.float64) for a in (x, w1t, w2t))
    inter, out, start = w2t.shape[1], np.zeros((x.shape[0], w2t.shape[2])), 0
    for e, c in enumerate(counts):
        h = x[start:start + c] @ w1t[e]
        g = h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]
        out[start:start + c] = g @ w2t[e]
        start += c
    return out


@pytest.mark.parametrize("tight", [True, False])
def test_padded_ffn_equals_the_oracle_and_ragged_dot(tight):
    rng, _ = fresh_rng()
    L, H, inter = int(rng.integers(2, 6)), 32, 16
    counts = rng.integers(0, 7, L)
    empty = int(rng.integers(L))
    counts[empty] = 0                                               # an expert with no row
    counts[(empty + 1) % L] = rng.integers(1, 7)                    # and one with rows (a max needs one)
    rows = int(counts.sum()) + int(rng.integers(1, 9))              # unused rows past the total
    x = rng.standard_normal((rows, H)).astype(np.float32)
    x[counts.sum():] = 1e4                                          # poison: must not reach the output
    w1t = (rng.standard_normal((L, H, 2 * inter)) / H ** 0.5).astype(np.float32)
    w2t = (rng.standard_normal((L, inter, H)) / inter ** 0.5).astype(np.float32)
    bound = int(counts.max()) if tight else rows
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)                     # noqa: E731
    fns = traced_functions()
    got = np.asarray(jax.jit(fns["padded_ffn"], static_argnums=4)(bf(x), jnp.asarray(counts, jnp.int32), bf(w1t), bf(w2t),
                                                                  bound), np.float32)
    want = _oracle(np.asarray(bf(x), np.float32), counts, np.asarray(bf(w1t), np.float32), np.asarray(bf(w2t), np.float32))
    used = int(counts.sum())
    assert np.all(got[used:] == 0)
    scale = np.max(np.abs(want)) + 1e-30
    assert np.max(np.abs(got[:used] - want[:used])) / scale < 0.02
    if hasattr(jax.lax, "ragged_dot"):
        ragged = np.asarray(jax.jit(fns["ragged_ffn"])(bf(x), jnp.asarray(counts, jnp.int32), bf(w1t), bf(w2t)), np.float32)
        assert np.max(np.abs(got[:used] - ragged[:used])) / scale < 0.02


def test_the_bound_is_one_row_per_token_only_for_our_router():
    layer = types.SimpleNamespace(ep_size=8)
    assert expert_rows_bound(layer, 16, True, 8 * 16 * 4) == 8 * 16
    assert expert_rows_bound(layer, 0, True, 64) == 8                # T^ 0 still leaves a row per rank
    assert expert_rows_bound(layer, 16, False, 8 * 16 * 4) == 8 * 16 * 4   # caller ids may repeat an expert
    assert expert_rows_bound(layer, 16, True, 100) == 100           # never past the workspace


def test_auto_takes_ragged_dot_below_the_threshold_and_padded_from_it():
    small = "ragged" if hasattr(jax.lax, "ragged_dot") else "padded"
    assert [expert_gemm("auto", t) for t in (1, RAGGED_BELOW - 1, RAGGED_BELOW, 1024)] == [small, small, "padded", "padded"]
    assert [expert_gemm(g, 1) for g in ("padded", "ragged", "loop")] == ["padded", "ragged", "loop"]


def test_auto_takes_the_expert_kernels_while_an_expert_gets_few_rows():
    small = "ragged" if hasattr(jax.lax, "ragged_dot") else "padded"
    # (8 ranks: 256 rows while T^ <= 32; one 16-row pass while T^ <= 2; T^ 0 counts as 1)
    assert [expert_gemm("auto", t, 256, 8) for t in (0, 1, 32, 33)] == ["fused", "fused", "fused", "padded"]
    assert [expert_gemm("auto", t, 16, 8) for t in (2, 3)] == ["fused", small]
    assert [expert_gemm(g, 1, 256, 8) for g in ("padded", "ragged", "loop")] == ["padded", "ragged", "loop"]


def test_auto_takes_the_kernels_to_more_rows_than_torch_at_every_hidden_size():
    from ep_a2a.moe_experts import FUSED_MAX_HIDDEN, auto_expert_rows
    assert auto_fused_rows(2048, 1024) == FUSED_MAX_ROWS_XLA
    assert auto_fused_rows(7168, 2048) == FUSED_MAX_ROWS_XLA > auto_expert_rows(7168, 2048)  # (DeepSeek-V3-like)
    assert auto_fused_rows(FUSED_MAX_HIDDEN + 64, 2048) == FUSED_MAX_ROWS_XLA
    assert auto_fused_rows(2048, 1000) == 0                                     # (the kernels do not take I=1000)
    assert auto_fused_rows(7168, 1000) == 0

