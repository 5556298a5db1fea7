"""The experts' GEMMs at decode and small-batch sizes (kernels/moe_experts.cu), on the
expert-major rows of an ExpertIndex (moe.py): expert_fc1 reads each row where dispatch left it
(no gather) and applies the gated SiLU before it stores; expert_fc2 may finalize into the
combine input in the same kernel. They replace gather_rows + FC1 + activation and FC2 +
finalize of the grouped-GEMM path where an expert gets up to a few hundred rows.

    expert_fc1(index, x, w_gate_up, act)
    expert_fc2(index, act, w_down, fc2_out, finalize_into=r.combine_input(T_hat))

Three kernel pairs, chosen per call by the most rows an expert may get (index.slots, ep_size *
T^, fixed per T^ so that a captured graph keeps its kernel): 16-row passes, 64-row passes, and
the wide pair of 128-row passes with 64 / 128 output columns a block (_expert_kernel says where).
"""
from __future__ import annotations

import ctypes
import math

from .interop.tensor import Tensor
from .moe import FINALIZE_TILES, ExpertIndex, call_stream, check_built, slot_rows
from .validate import cuda_tensor, require

# The kernels (kernels/moe_experts.cu), bf16 only, k in steps of EXPERT_K. The first two pairs:
# a block of four warps covers EXPERT_TILE output columns of an expert, two warps splitting
# each 8 columns' k range; the first pair takes EXPERT_PASS_ROWS rows of an expert per pass, the
# _m64 pair (same bits) up to EXPERT_WIDE_ROWS. The _wide pair: a block of eight warps covers
# WIDE_FC1_COLS (FC1) or WIDE_FC2_COLS (FC2) columns over the whole k range in passes of up to
# 128 rows (other bits). A call takes the first pair while an expert may hold at most
# EXPERT_PASS_ROWS rows (index.slots, ep_size * T^, the most an expert gets through a router),
# the wide kernel of an FC past WIDE_FROM_ROWS where its columns divide into its tiles (and
# hidden is at most FUSED_MAX_HIDDEN), else _m64.
EXPERT_TILE = 16
EXPERT_K = 64
EXPERT_PASS_ROWS = 16
EXPERT_WIDE_ROWS = 64
_EXPERT_THREADS = 128
WIDE_FROM_ROWS = 128
WIDE_FC1_COLS, WIDE_FC2_COLS = 64, 128
_WIDE_THREADS = 256
_WIDE_ROWS = 128  # rows per pass of the wide kernels
# Where gemm="auto" takes them (auto_expert_rows), as the graphed layer benchmark found against
# torch's grouped GEMM (docs/layer.md): faster up to 512 rows an expert may get (64 tokens per
# rank of 8 ranks; at 128 its larger tiles win); with the long k and wide FC2 of a 7168 hidden
# size, faster in one 16-row pass only.
FUSED_MAX_ROWS = 512
FUSED_MAX_HIDDEN = 4096
FINALIZE_MAX_HIDDEN = FINALIZE_TILES * EXPERT_TILE


def fc2_finalizes(hidden: int, fp8: bool) -> bool:
    """Whether expert_fc2 finalizes into the combine input itself (finalize_into=): a bf16 one (no
    FP8 combine) of at most FINALIZE_MAX_HIDDEN columns; else a finalize launch follows FC2."""
    return not fp8 and hidden <= FINALIZE_MAX_HIDDEN


def expert_gemms_unsupported(hidden: int, inter: int, dtype: str = "bfloat16"):
    """Why expert_fc1 / expert_fc2 do not take these shapes (a string), or None."""
    if dtype != "bfloat16":
        return f"{dtype} (bfloat16 only)"
    if hidden % EXPERT_K:
        return f"hidden={hidden} (a multiple of {EXPERT_K} is needed)"
    if inter % EXPERT_K:
        return f"intermediate={inter} (a multiple of {EXPERT_K} is needed)"
    return None


def auto_expert_rows(hidden: int, inter: int, dtype: str = "bfloat16") -> int:
    """The most rows an expert may get (ep_size * T^) for which gemm="auto" takes the expert
    kernels with these shapes: FUSED_MAX_ROWS where they take the shapes and hidden is at most
    FUSED_MAX_HIDDEN, one 16-row pass (EXPERT_PASS_ROWS) above it, 0 (never) where they do not."""
    if expert_gemms_unsupported(hidden, inter, dtype) is not None:
        return 0
    return FUSED_MAX_ROWS if hidden <= FUSED_MAX_HIDDEN else EXPERT_PASS_ROWS


def _expert_weights(w, name: str, index: ExpertIndex, rows: int, k: int, s: int, dev: int) -> Tensor:
    t = cuda_tensor(w, name, s, dev, dtype="bfloat16")
    want = (index.num_local_experts, rows, k)
    if t.shape != want:
        raise ValueError(f"{name}: shape must be [num_local_experts, {rows}, {k}] = {list(want)}, got {list(t.shape)}")
    return t


def _expert_grid(index: ExpertIndex, name: str, n_dim: int) -> tuple:
    """(blocks, expert groups, threads) of kernel `name`: its column tiles times the expert groups
    (a block walks its group's units: passes of one expert) that make about four blocks per SM of
    this rank's share of the GPU (idle groups' blocks take slots co-resident ranks' kernels want),
    no more groups than an expert's units could fill (one per expert; the wide kernels: per pass)."""
    share = 4 * index.device.sm_count / index.ranks_on_device
    if name.endswith("_wide_bf16"):
        tiles = n_dim // (WIDE_FC1_COLS if "fc1" in name else WIDE_FC2_COLS)
        units = index.num_local_experts * -(-index.slots // _WIDE_ROWS)
        groups = max(1, min(units, math.ceil(share / tiles)))
        return tiles * groups, groups, _WIDE_THREADS
    tiles = n_dim // EXPERT_TILE
    groups = max(1, min(index.num_local_experts, math.ceil(share / tiles)))
    return tiles * groups, groups, _EXPERT_THREADS


def _expert_kernel(fc: str, index: ExpertIndex, hidden: int, inter: int) -> str:
    """The kernel of a call: 16 rows per pass while no expert can hold more (the others reserve 48
    KiB of shared memory and more registers per block, which those do not need); past
    WIDE_FROM_ROWS the wide kernel where the FC's output columns (FC1: inter, FC2: hidden) fill
    its tiles and hidden is at most FUSED_MAX_HIDDEN (where it was measured faster); else up to 64
    rows per pass."""
    if index.slots <= EXPERT_PASS_ROWS:
        return f"moe_expert_{fc}_bf16"
    n_dim, cols = (inter, WIDE_FC1_COLS) if fc == "fc1" else (hidden, WIDE_FC2_COLS)
    if index.slots > WIDE_FROM_ROWS and hidden <= FUSED_MAX_HIDDEN and n_dim % cols == 0:
        return f"moe_expert_{fc}_wide_bf16"
    return f"moe_expert_{fc}_m64_bf16"


def _aligned16(*named) -> None:
    for name, t in named:
        if t.ptr % 16:
            raise ValueError(f"{name}: data pointer 0x{t.ptr:x} must be 16-byte aligned (the expert kernels' loads)")


def expert_fc1(index: ExpertIndex, src, w_gate_up, out, stream=None) -> None:
    """FC1 of the local experts with the gated SiLU, reading each row where dispatch left it:
    out[p, n] = silu(h[p, n]) * h[p, I + n] for every permuted row p < total (rows past it
    untouched), h[p] = src[rows[p]] @ w_gate_up[e].T (e: p's local expert), fp32 accumulation
    rounded to bf16 as a bf16 FC1 output would be, then the activation's roundings
    (moe.activation's). So it replaces gather_rows, FC1 and activation; the sums' order is
    this kernel's own (not a library GEMM's bits).

    src: bf16 [ep_size, T^, hidden] (or [ep_size * T^, hidden]), the dispatched hidden states;
    w_gate_up: bf16 [num_local_experts, 2 * I, hidden] (gate rows, then up rows), contiguous;
    out: bf16 [rows >= index.capacity, I]. hidden and I multiples of 64 (expert_gemms_unsupported),
    pointers 16-byte aligned. Made for decode and small-batch sizes (the comment on this
    module's constants says which kernel takes which): an expert's rows past a pass of 16, 64
    or 128 rows read its weights again.
    stream: default, the stream of the index's build.
    """
    check_built(index, "expert_fc1")
    s = call_stream(stream, index.stream)
    dev = index.device.ordinal
    x = cuda_tensor(src, "src", s, dev, dtype="bfloat16")
    inner = slot_rows(x, "src", index)
    y = cuda_tensor(out, "out", s, dev, dtype="bfloat16")
    if not (len(inner) == 1 and y.ndim == 2 and y.shape[0] >= index.capacity):
        raise ValueError(f"src, out: must be [slots, hidden] and [rows >= capacity={index.capacity}, I], got "
                         f"{list(x.shape)} and {list(y.shape)}")
    hidden, inter = inner[0], y.shape[1]
    require((why := expert_gemms_unsupported(hidden, inter)) is None, "src, out", f"the expert kernels do not take {why}")
    w = _expert_weights(w_gate_up, "w_gate_up", index, 2 * inter, hidden, s, dev)
    _aligned16(("src", x), ("w_gate_up", w), ("out", y))
    name = _expert_kernel("fc1", index, hidden, inter)
    grid, groups, threads = _expert_grid(index, name, inter)
    args = [ctypes.c_uint64(x.ptr), ctypes.c_uint64(index.address("rows")), ctypes.c_uint64(index.address("offsets")),
            ctypes.c_uint64(w.ptr), ctypes.c_uint64(y.ptr), ctypes.c_int32(index.num_local_experts),
            ctypes.c_int32(groups), ctypes.c_int32(hidden), ctypes.c_int32(inter)]
    index.launch_expert(name, args, grid, threads, s)


def expert_fc2(index: ExpertIndex, act, w_down, out, stream=None, finalize_into=None) -> None:
    """FC2 of the local experts: out[p] = act[p] @ w_down[e].T for every permuted row p < total
    (rows past it untouched), fp32 accumulation rounded to bf16.

    act: bf16 [rows >= index.capacity, I] in the index's row order (expert_fc1's out);
    w_down: bf16 [num_local_experts, hidden, I], contiguous; out: bf16 [rows >= capacity,
    hidden] (finalize's fc2_out). Shapes and alignment as expert_fc1. stream: default, the
    stream of the index's build.
    finalize_into: bf16 [ep_size, T^, hidden] (or [ep_size * T^, hidden]), 16-byte aligned,
    hidden <= FINALIZE_MAX_HIDDEN: also finalize(index, out, finalize_into) in the same
    kernel, the same bits (each column tile's last block to finish sums it). Calls of one
    index with it run one at a time (they share the index's counts).
    """
    check_built(index, "expert_fc2")
    s = call_stream(stream, index.stream)
    dev = index.device.ordinal
    a = cuda_tensor(act, "act", s, dev, dtype="bfloat16")
    y = cuda_tensor(out, "out", s, dev, dtype="bfloat16")
    if not (a.ndim == 2 and y.ndim == 2 and a.shape[0] >= index.capacity and y.shape[0] >= index.capacity):
        raise ValueError(f"act, out: must be [rows >= capacity={index.capacity}, I] and [rows, hidden], got "
                         f"{list(a.shape)} and {list(y.shape)}")
    inter, hidden = a.shape[1], y.shape[1]
    require((why := expert_gemms_unsupported(hidden, inter)) is None, "act, out", f"the expert kernels do not take {why}")
    w = _expert_weights(w_down, "w_down", index, hidden, inter, s, dev)
    _aligned16(("act", a), ("w_down", w), ("out", y))
    target = 0 if finalize_into is None else _finalize_target(index, finalize_into, hidden, s, dev)
    fin = index.finalize_args(name := _expert_kernel("fc2", index, hidden, inter))
    fin.out, fin.slots = target, index.slots
    grid, groups, threads = _expert_grid(index, name, hidden)
    args = [ctypes.c_uint64(a.ptr), ctypes.c_uint64(index.address("offsets")), ctypes.c_uint64(w.ptr),
            ctypes.c_uint64(y.ptr), ctypes.c_int32(index.num_local_experts), ctypes.c_int32(groups),
            ctypes.c_int32(inter), ctypes.c_int32(hidden), fin]
    index.launch_expert(name, args, grid, threads, s)


def _finalize_target(index: ExpertIndex, t, hidden: int, s: int, dev: int) -> int:
    """The pointer of expert_fc2's finalize_into, checked."""
    c = cuda_tensor(t, "finalize_into", s, dev, dtype="bfloat16")
    require(slot_rows(c, "finalize_into", index) == (hidden,) and hidden <= FINALIZE_MAX_HIDDEN, "finalize_into",
            f"must be [ep_size, T^, hidden] or [slots, hidden], hidden={hidden} <= {FINALIZE_MAX_HIDDEN}; got {list(c.shape)}")
    _aligned16(("finalize_into", c))
    return c.ptr

