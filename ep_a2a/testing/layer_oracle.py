"""The NumPy oracle of the MoE layer (ep_a2a/layers/), framework-free: the router's routing,
distinct logits and random weights, a float64 dense reference of the whole layer and the bf16
tolerances the layer's output must meet against it."""
from __future__ import annotations

import numpy as np

from .reference import from_float32, to_float32


def route_reference(logits: np.ndarray, top_k: int, renormalize: bool = True):
    """(ids int32 [T, top_k] by descending logit, weights float32 [T, top_k]) as route() does."""
    logits = np.asarray(logits, np.float32)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    top = np.take_along_axis(logits, ids, axis=1).astype(np.float64)
    if renormalize:
        e = np.exp(top - top.max(axis=1, keepdims=True)) if len(top) else top
        w = e / e.sum(axis=1, keepdims=True) if len(top) else top
    else:
        full = logits.astype(np.float64)
        z = np.exp(full - full.max(axis=1, keepdims=True)) if len(full) else full
        w = np.take_along_axis(z / z.sum(axis=1, keepdims=True), ids, axis=1) if len(full) else top
    return ids, np.asarray(w, np.float32)


def distinct_logits(rng, tokens: int, num_experts: int) -> np.ndarray:
    """Random float32 router logits [tokens, num_experts] whose values in a row differ by at
    least 2/num_experts, so every top-k is unambiguous (no ties between implementations)."""
    ranks = np.argsort(rng.random((tokens, num_experts)), axis=1).astype(np.float32)
    return ((ranks + rng.uniform(0.0, 0.5, (tokens, num_experts)).astype(np.float32)) * np.float32(4.0 / num_experts)).astype(np.float32)


def random_weights(rng, num_experts: int, hidden: int, intermediate: int):
    """bf16 bits (uint16) of w_gate_up [E, 2*I, hidden] and w_down [E, hidden, I], scaled so that
    each projection keeps unit variance (std 1/sqrt(fan_in))."""
    w1 = rng.standard_normal((num_experts, 2 * intermediate, hidden), np.float32) / np.float32(np.sqrt(hidden))
    w2 = rng.standard_normal((num_experts, hidden, intermediate), np.float32) / np.float32(np.sqrt(intermediate))
    return from_float32(w1, "bfloat16"), from_float32(w2, "bfloat16")


def dense_reference(x_bits, ids, weights, w_gate_up_bits, w_down_bits) -> np.ndarray:
    """The layer in float64 over all tokens and all experts: float64 [N, hidden].

    x_bits: bf16 bits [N, hidden]; ids int [N, top_k] (ids outside 0..E-1 skipped); weights
    [N, top_k]; expert weights as bf16 bits, every expert [E, ...]. No intermediate rounding:
    the layer's error against it is its bf16 roundings (see check_layer_output)."""
    x = to_float32(np.asarray(x_bits), "bfloat16").astype(np.float64)
    w1 = to_float32(np.asarray(w_gate_up_bits), "bfloat16")
    w2 = to_float32(np.asarray(w_down_bits), "bfloat16")
    ids = np.asarray(ids)
    weights = np.asarray(weights, np.float64)
    inter = w2.shape[2]
    out = np.zeros((x.shape[0], x.shape[1]), np.float64)
    for e in range(w1.shape[0]):
        tok, k = np.nonzero(ids == e)
        if tok.size == 0:
            continue
        h = x[tok] @ w1[e].T.astype(np.float64)
        gate, up = h[:, :inter], h[:, inter:]
        y = (gate / (1.0 + np.exp(-gate)) * up) @ w2[e].T.astype(np.float64)
        np.add.at(out, tok, weights[tok, k][:, None] * y)
    return out


# Tolerances of the bf16 layer against dense_reference. On the path from the bf16 inputs and
# weights to the output there are six bf16 roundings (FC1 output, SiLU, gate * up, FC2 output,
# the finalized partial, the combined sum), each with relative error <= u = 2**-8; they are
# independent and of random sign, so they add in quadrature. A NumPy simulation of exactly
# these roundings (random data, hidden 256..2048, top_k 2..8) gives a relative L2 error of
# 0.0046 over all tokens, at most 0.0074 for one token, and element errors at most
# 5.6 * u * (|ref| + rms of the token's row). The bounds below leave 2-3x of margin; a lost,
# doubled, misweighted or misrouted selection is an O(1) relative error per token.
TOKEN_REL_L2 = 2.0 ** -6     # per token: ||out - ref|| <= 0.0156 ||ref||
ELEMENT_ULPS = 16            # per element: |out - ref| <= 16 u (|ref| + rms(ref row))
TOTAL_REL_L2 = 0.01          # over every token of a rank


def check_layer_output(got, want, what: str = "") -> None:
    """Raise AssertionError (with the worst token and element) unless `got` (any float
    [T, hidden], bf16 as values) is within the bf16 tolerances above of `want`."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    if got.size == 0:
        return
    assert np.isfinite(got).all(), f"{what}: non-finite output at {np.argwhere(~np.isfinite(got))[:4].tolist()}"
    err = got - want
    row_ref = np.linalg.norm(want, axis=1)
    row_err = np.linalg.norm(err, axis=1)
    total = np.linalg.norm(err) / max(np.linalg.norm(want), 1e-30)
    worst = int(np.argmax(row_err / np.maximum(row_ref, 1e-30)))
    assert total <= TOTAL_REL_L2, f"{what}: relative L2 error {total:.4g} > {TOTAL_REL_L2}"
    assert (row_err <= TOKEN_REL_L2 * row_ref + 1e-30).all(), \
        f"{what}: token {worst} relative error {row_err[worst] / max(row_ref[worst], 1e-30):.4g} > {TOKEN_REL_L2:.4g}"
    rms = np.sqrt(np.mean(want * want, axis=1, keepdims=True))
    bound = ELEMENT_ULPS * 2.0 ** -8 * (np.abs(want) + rms)
    bad = np.abs(err) > bound
    if bad.any():
        t, h = map(int, np.argwhere(bad)[0])
        raise AssertionError(f"{what}: element [{t}, {h}] = {got[t, h]:.6g}, reference {want[t, h]:.6g} "
                             f"(bound {bound[t, h]:.3g}); {int(bad.sum())} elements out of bounds")


def max_relative_error(got, want) -> float:
    """max |got - want| / max |want|: the one-number summary the examples print."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)) if want.size else 0.0
