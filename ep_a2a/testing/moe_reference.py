"""NumPy reference of the MoE compute pieces (ep_a2a/moe.py): the local experts' index of the
dispatched slots, the expert-major gather and the finalize. The oracle of the tests; written
for clarity, not speed. bfloat16 arrays are uint16 bits, as in reference.py."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .reference import expert_owner, from_float32, to_float32


@dataclass
class Index:
    counts: np.ndarray      # int32 [num_local]
    offsets: np.ndarray     # int32 [num_local + 1]
    rows: np.ndarray        # int32 [total]: slot of permuted row p
    row_weight: np.ndarray  # float32 [total]
    row_of: np.ndarray      # int32 [slots, top_k]: permuted row of (slot, k), -1 if not local

    @property
    def total(self) -> int:
        return int(self.offsets[-1])


def local_experts(num_experts: int, ep_size: int, rank: int) -> np.ndarray:
    """The experts `rank` owns, ascending (the all-to-all's contiguous split)."""
    return np.flatnonzero(expert_owner(num_experts, ep_size) == rank)


def build_index(expert_ids, weights, num_experts: int, ep_size: int, rank: int) -> Index:
    """expert_ids int32 / weights float32, [ep_size, T^, top_k] or [slots, top_k].

    Entry j = slot * top_k + k. Local expert by local expert, the entries selecting it in
    ascending j (ascending slot, then k) become consecutive permuted rows."""
    top_k = np.shape(expert_ids)[-1]
    flat = np.asarray(expert_ids, np.int64).reshape(-1)
    w = np.asarray(weights, np.float32).reshape(-1)
    per_expert = [np.flatnonzero(flat == e) for e in local_experts(num_experts, ep_size, rank)]
    order = np.concatenate(per_expert) if per_expert else np.zeros(0, np.int64)
    counts = np.array([len(j) for j in per_expert], np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    row_of = np.full(flat.size, -1, np.int32)
    row_of[order] = np.arange(order.size, dtype=np.int32)
    return Index(counts, offsets, (order // top_k).astype(np.int32), w[order], row_of.reshape(-1, top_k))


def gather_rows(index: Index, src: np.ndarray) -> np.ndarray:
    """[total, ...]: row p is slot rows[p] of src [slots, ...] (flatten [ep_size, T^] first)."""
    return np.asarray(src)[index.rows]


def finalize(index: Index, fc2_out: np.ndarray, fc2_dtype, out_dtype) -> np.ndarray:
    """[slots, hidden] in out_dtype: per slot, over k ascending with a local row, acc = acc +
    row_weight * fc2_out[row] in float32 (each product and sum rounded to fp32, as the kernel's
    __fmul_rn/__fadd_rn), from acc = 0; then rounded to nearest even into out_dtype."""
    x = to_float32(fc2_out, fc2_dtype)
    slots, top_k = index.row_of.shape
    acc = np.zeros((slots, x.shape[1]), np.float32)
    for k in range(top_k):
        rows = index.row_of[:, k]
        has = rows >= 0
        product = index.row_weight[rows[has]][:, None] * x[rows[has]]  # float32 * float32: one rounding
        acc[has] = acc[has] + product                                   # one rounding
    return from_float32(acc, out_dtype)
