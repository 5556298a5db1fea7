"""Random inputs of the harness, the tests and the tools: the payload formats, payload data
of any dtype (raw bits where NumPy has no such dtype) and the routings (uniform, zipf,
perfect)."""
from __future__ import annotations

import numpy as np

from .. import PayloadSpec
from ..interop.tensor import as_dtype
from . import reference as ref


# payload formats (besides the int32 expert ids, always sent): name -> specs for a hidden size
def payload_formats(hidden: int, top_k: int) -> dict:
    w = PayloadSpec("weights", (top_k,), "float32")
    return {
        "bf16": [PayloadSpec("hidden", (hidden,), "bfloat16"), w],
        "mxfp8": [PayloadSpec("hidden", (hidden,), "float8_e4m3fn"), PayloadSpec("scales", (-(-hidden // 32),), "uint8"), w],
        "nvfp4": [PayloadSpec("hidden", (-(-hidden // 2),), "uint8"), PayloadSpec("scales", (-(-hidden // 16),), "float8_e4m3fn"), w],
        "opaque": [PayloadSpec("blob", (hidden,), "uint8"), PayloadSpec("odd", (3,), "uint8"), w],
    }


# NumPy unsigned integer type of each item size: the raw bits of dtypes NumPy lacks
NP_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def random_payload(rng, spec: PayloadSpec, T: int) -> np.ndarray:
    """Random data of spec's dtype, as raw bits where numpy has no such dtype. Never zeros."""
    shape = (T,) + tuple(spec.shape)
    if spec.dtype == "bfloat16":
        x = rng.standard_normal(shape).astype(np.float32)
        return ref.from_float32(x, "bfloat16")
    if spec.dtype in ("float32", "float16"):
        return rng.standard_normal(shape).astype(spec.dtype)
    if spec.dtype == "int32":
        return rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int64).astype(np.int32)
    size = as_dtype(spec.dtype).itemsize
    return rng.integers(0, 256, shape + (size,), dtype=np.uint8).view(NP_BITS[size]).reshape(shape)


def routing(kind: str, rng, T: int, top_k: int, num_experts: int, ep_size: int, source: int = 0,
            alpha: float = 1.2, invalid_fraction: float = 0.0) -> np.ndarray:
    """int32 [T, top_k] expert ids: 'uniform', 'zipf' (popularity ~ 1/rank^alpha, distinct
    experts per token) or 'perfect' (the paper's: the k selections of a token go to
    consecutive ranks, spread evenly over their experts)."""
    if T == 0:
        return np.zeros((0, top_k), np.int32)
    if kind == "perfect":
        owner = ref.expert_owner(num_experts, ep_size)
        first = np.searchsorted(owner, np.arange(ep_size))
        per = np.bincount(owner, minlength=ep_size)
        i = np.arange(T)[:, None]
        k = np.arange(top_k)[None, :]
        r = (i + source + k) % ep_size
        nper = np.maximum(per[r], 1)
        e = first[r] + ((i // ep_size + k // ep_size) % nper)
        ids = e.astype(np.int32)
    else:
        k = min(top_k, num_experts)
        if kind == "uniform":
            logits = np.zeros(num_experts)
        elif kind == "zipf":
            logits = -alpha * np.log1p(rng.permutation(num_experts))
        else:
            raise ValueError(f"routing: unknown kind {kind!r}")
        g = logits[None, :] - np.log(-np.log(rng.random((T, num_experts))))  # Gumbel top-k
        ids = np.argsort(-g, axis=1)[:, :k].astype(np.int32)
        if k < top_k:
            ids = np.concatenate([ids, np.full((T, top_k - k), -1, np.int32)], axis=1)
    if invalid_fraction:
        ids = np.where(rng.random(ids.shape) < invalid_fraction, -1, ids).astype(np.int32)
    return ids
