"""MoE compute on the rank-major dispatch workspace: what the experts of one rank need between
dispatch and combine (the router before dispatch is router.py; its names are re-exported here).

    route(logits, topk_ids, topk_weights)     # top-k of the router logits and their softmax weights
    ids, (x, w) = r.dispatch(topk_ids, [hidden, topk_weights], T_hat)    # [ep_size, T^, ...] views
    index = ExpertIndex.for_rank(r)                                       # once, up front
    build_index(ids, w, num_experts=E, ep_size=ep, rank=r.rank, out=index)  # local experts' rows
    gather_rows(index, x, x_rows)             # x_rows[p] = x[slot of row p]: expert-major input
    ...  FC1 (grouped GEMM over index.offsets) -> h [rows, 2 * I] ...
    activation(index, h, act)                 # act[p] = silu(h[p, :I]) * h[p, I:], rows < total
    ...  FC2 -> fc2_out[p] = expert(x_rows[p]) ...
    finalize(index, fc2_out, r.combine_input(T_hat))   # weighted sum per slot, into the workspace
    # or, up to a few hundred rows per expert, gather + FC1 + activation, and FC2 + finalize, as
    # ep_a2a's kernels (moe_experts.py): expert_fc1(index, x, w_gate_up, act); expert_fc2(...)
    y = r.combine(r.combine_input(T_hat), T_hat)

Slots: slot s = source rank * T^ + i is the i-th token source rank sent here. Every selection
(s, k) whose expert is a local expert of this rank gets one permuted row p; rows are grouped
by local expert (expert-major, as grouped GEMMs want them) and, inside an expert, ordered by
slot then k. The order is a stable counting sort (kernels/moe_compute.cu), so it is the same
on every run; moe_reference.py computes the same index, gather and finalize in NumPy.

Everything runs on the device without host synchronisation, with launch shapes fixed by T^,
so every piece captures into a CUDA graph: make the ExpertIndex first (`ExpertIndex(...)`,
`.for_rank(a2a.ranks[i])`) and pass it as `out=`, with several ranks in one process too (else
each call allocates one, and a cuMemFree between two ranks' launches of a phase blocks on a
kernel that waits for the next rank).
"""
from __future__ import annotations

import ctypes
import math

from .config import Fp8Partial, REDUCE_DTYPES
from .driver.device import Device, get_device
from .driver.launch import Launch
from .driver.lifetime import Owned
from .driver.memory import DeviceAllocation, memset_d8_async
from .driver.module import load
from .driver.stream import stream_handle, synchronize_stream
from .interop.tensor import CUDA, Tensor, float32, int32
from .layout import MAX_RANKS, MAX_TOP_K, Q8_BLOCK, FinalizeArgs, MoeIndexArgs
from .schedule import vector_bytes
from .validate import check_int, cuda_tensor, require
# the router before dispatch lives in router.py; moe.route and its names stay here too
from .router import ROUTE_DTYPES, ROUTE_KERNELS, ROUTE_MAX_EXPERTS, ROUTE_MAX_TOP_K, Router, route, \
    route_unsupported, router_for  # noqa: F401

MAX_LOCAL_EXPERTS = 1024
_TABLE_SHARED_INTS = 10240     # the [local expert][warp] table in shared memory: 40 KiB of the 48 KiB default
_TILE_ROUNDS = 16              # a warp tile is at most 16 rounds of 32 entries while the table is small
_MAX_TABLE = 1 << 16           # [local expert][tile] counts the one-block scan reads (multi-kernel path)
_THREADS = 256                 # gather / finalize blocks
ACTIVATION_DTYPES = {"bfloat16": "bf16", "float16": "f16"}  # the gated activation's kernels (moe_swiglu_*)
_KERNELS = ("moe_index_fused", "moe_index_count", "moe_index_scan", "moe_index_scatter", "moe_gather_rows") + tuple(
    f"moe_finalize{q}_{i}_{o}" for q in ("", "_q8") for i in REDUCE_DTYPES.values() for o in REDUCE_DTYPES.values()
) + tuple(f"moe_swiglu_{d}" for d in ACTIVATION_DTYPES.values())
# The experts' GEMMs (moe_experts.py, kernels/moe_experts.cu), fetched with the index's other
# kernels; expert_fc2(finalize_into=) counts its blocks per column tile in FINALIZE_TILES words.
EXPERT_KERNELS = tuple(f"moe_expert_fc{i}{pair}_bf16" for pair in ("", "_m64", "_wide") for i in (1, 2))
FINALIZE_TILES = 1024


def local_experts(num_experts: int, ep_size: int, rank: int) -> tuple:
    """(first local expert, number of local experts) of `rank`: the all-to-all's split, contiguous
    blocks with the first num_experts % ep_size ranks owning one more (kernels' rank_of_expert)."""
    per, rem = divmod(num_experts, ep_size)
    return rank * per + min(rank, rem), per + (1 if rank < rem else 0)


def index_plan(n_entries: int, num_local: int) -> tuple:
    """How the index of `n_entries` selections is cut: (fused, warps per block, tile entries, tiles).

    fused: one block, one tile per warp, the table in shared memory (one launch: decode sizes).
    Otherwise count / scan / scatter kernels over `tiles` warp tiles; tiles grow past 16 rounds
    only to keep the [local expert][tile] table within what one block scans quickly.
    """
    budget = _TABLE_SHARED_INTS // max(num_local, 1)
    fused_warps = min(32, budget)
    if n_entries <= fused_warps * 32 * _TILE_ROUNDS:
        warps = max(1, min(fused_warps, -(-n_entries // 32)))
        return True, warps, -(-n_entries // (warps * 32)) * 32, warps
    warps = min(8, budget)
    max_tiles = (_MAX_TABLE // max(num_local, 1)) // warps * warps
    tile = max(32 * _TILE_ROUNDS, -(-n_entries // (max_tiles * 32)) * 32)
    tiles = -(-(-(-n_entries // tile)) // warps) * warps
    return False, warps, tile, tiles


def _check_routing(num_experts, ep_size, rank) -> tuple:
    ep_size = check_int(ep_size, "ep_size", 1, MAX_RANKS)
    num_experts = check_int(num_experts, "num_experts", 1)
    rank = check_int(rank, "rank", 0, ep_size - 1)
    n_local = local_experts(num_experts, ep_size, rank)[1]
    require(n_local <= MAX_LOCAL_EXPERTS, "num_experts",
             f"rank {rank} would own {n_local} local experts; at most {MAX_LOCAL_EXPERTS} are supported")
    return num_experts, ep_size, rank


class ExpertIndex(Owned):
    """The local experts' rows of one rank for one dispatch, as device tensors (ep_a2a Tensors:
    DLPack / CUDA Array Interface, so PyTorch, JAX and CuPy take them without copies).

      counts      int32 [num_local_experts]       rows of each local expert
      offsets     int32 [num_local_experts + 1]   first row of each local expert; offsets[-1] = total
      rows        int32 [capacity]                slot (source rank * T^ + i) of permuted row p < total
      row_weight  fp32  [capacity]                router weight of permuted row p < total
      row_of      int32 [ep_size * T^, top_k]     permuted row of (slot, k); -1: not a local expert

    capacity = ep_size * T^ * top_k for the T^ of the last build; entries of rows and row_weight
    past the total are not written. Allocated once, for max_tokens_per_rank (build_index(out=)).
    """
    _kind = "indexes"

    def __init__(self, device, *, num_experts: int, ep_size: int, rank: int, max_tokens_per_rank: int, top_k: int,
                 ranks_on_device: int = 1):
        num_experts, ep_size, rank = _check_routing(num_experts, ep_size, rank)
        top_k = check_int(top_k, "top_k", 1, MAX_TOP_K)
        self.ranks_on_device = check_int(ranks_on_device, "ranks_on_device", 1, MAX_RANKS)
        max_tokens_per_rank = check_int(max_tokens_per_rank, "max_tokens_per_rank", 1)
        require(ep_size * max_tokens_per_rank * top_k < 2 ** 31, "max_tokens_per_rank",
                 "ep_size * max_tokens_per_rank * top_k must stay below 2**31 (int32 rows)")
        self.device = device if isinstance(device, Device) else get_device(int(device))
        self.num_experts, self.ep_size, self.rank, self.top_k = num_experts, ep_size, rank, top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.first_local_expert, self.num_local_experts = local_experts(num_experts, ep_size, rank)
        L, cap = self.num_local_experts, ep_size * max_tokens_per_rank * top_k
        # the [local expert][tile] table of the multi-kernel path (fused plans need none; fusion
        # is monotone in the entry count, so a fused capacity means every T^ is fused)
        table = 0 if index_plan(cap, L)[0] else _MAX_TABLE
        sizes = {"counts": L, "offsets": L + 1, "rows": cap, "row_weight": cap, "row_of": cap, "tile_counts": table,
                 "fin_done": FINALIZE_TILES}
        offsets, end = {}, 0
        for name, n in sizes.items():
            offsets[name], end = end, end + -(-4 * n // 256) * 256
        self._alloc = DeviceAllocation(self.device, end)  # contents are undefined until the first build
        self._base = {k: self._alloc.ptr + o for k, o in offsets.items()}
        memset_d8_async(self._base["fin_done"], 0, 4 * FINALIZE_TILES, 0)  # (FC2's counts start at zero)
        synchronize_stream(0)
        self.nbytes = end
        self.counts, self.offsets = self._tensor("counts", (L,), int32), self._tensor("offsets", (L + 1,), int32)
        # every kernel is fetched (hence loaded, under lazy loading) now, never during a graph capture
        self._module = load("moe_compute", self.device)
        for name in _KERNELS:
            self._module.function(name)
        self._experts = load("moe_experts", self.device)
        for name in EXPERT_KERNELS:
            self._experts.function(name)
        self._launches = {}
        self.last_issued = ()  # the Launches of the last call of any piece (ops/torch_views.Replays)
        self._views = {}
        self.runtime_max_tokens_per_rank, self.stream = None, None
        self.rows, self.row_weight, self.row_of = self._views_for(max_tokens_per_rank)
        a = self._args = MoeIndexArgs()
        for f in ("counts", "offsets", "rows", "row_weight", "row_of", "tile_counts"):
            setattr(a, f, self._base[f])
        a.top_k, a.first_expert, a.num_local = top_k, self.first_local_expert, L
        self._fin = {k: FinalizeArgs(0, self._base["row_of"], self._base["row_weight"], self._base["fin_done"], 0, top_k)
                     for k in EXPERT_KERNELS if "fc2" in k}  # (per kernel: a relaunch (Replays) keeps its last call's)
        self._opened()

    @classmethod
    def for_rank(cls, rank_a2a) -> "ExpertIndex":
        """An index sized for one rank of a MoeAlltoAll (a2a.ranks[i]), its GPU shared as the rank's."""
        a = rank_a2a.a2a
        return cls(rank_a2a.device, num_experts=a.num_experts, ep_size=a.ep_size, rank=rank_a2a.rank,
                   max_tokens_per_rank=a.max_tokens_per_rank, top_k=a.top_k, ranks_on_device=rank_a2a.ranks_on_device)

    # -- shapes of the last build ---------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Rows of the rank-major receive layout: ep_size * T^ (of the last build)."""
        return self.ep_size * (self.runtime_max_tokens_per_rank or self.max_tokens_per_rank)

    @property
    def capacity(self) -> int:
        """Expert-major rows the last build can place: slots * top_k."""
        return self.slots * self.top_k

    def _tensor(self, name, shape, dtype) -> Tensor:
        return Tensor(self._base[name], shape, dtype, device=(CUDA, self.device.ordinal), owner=self._alloc)

    def _views_for(self, runtime_max: int) -> tuple:
        v = self._views.get(runtime_max)
        if v is None:
            cap = self.ep_size * runtime_max * self.top_k
            v = self._views[runtime_max] = (self._tensor("rows", (cap,), int32), self._tensor("row_weight", (cap,), float32),
                                     self._tensor("row_of", (self.ep_size * runtime_max, self.top_k), int32))
        return v

    # -- what moe_experts.py launches through ----------------------------------------------------
    def address(self, name: str) -> int:
        """The device address of one of the index's arrays: "rows", "offsets", "row_of", ..."""
        return self._base[name]

    def finalize_args(self, kernel: str) -> FinalizeArgs:
        """The finalize arguments of FC2 kernel `kernel`, one set per kernel (a relaunch keeps its
        last call's)."""
        return self._fin[kernel]

    def expert_function(self, name: str):
        """Expert kernel `name` (kernels/moe_experts.cu), loaded with the index."""
        return self._experts.function(name)

    def launch_expert(self, name: str, args, grid: int, block: int, stream: int) -> None:
        """Launch expert kernel `name` as the index's own pieces launch (last_issued names it)."""
        self.last_issued = (self._launch(name, args, grid, block, 0, stream, self._experts),)

    def _launch(self, name: str, args, grid: int, block: int, shared: int, stream: int, module=None) -> None:
        """Launch kernel `name` (of moe_compute, or of `module`) and return its Launch, which
        keeps the first call's argument objects (the packed pointer array points at them); later
        calls copy their values in."""
        self.device.make_current()
        launch = self._launches.get(name)
        if launch is None:
            launch = self._launches[name] = Launch(self.device, (module or self._module).function(name), args, grid,
                                                   block)
        else:
            for mine, new in zip(launch.args, args):
                if mine is not new:
                    mine.value = new.value
        launch.grid = grid  # (through the setter: Launch caches the grid it last set)
        cfg = launch.config
        cfg.blockDimX, cfg.sharedMemBytes = block, shared
        launch.stamp += 1
        launch(stream)
        return launch

    def _build(self, ids: Tensor, weights: Tensor, runtime_max: int, stream: int) -> None:
        a, L = self._args, self.num_local_experts
        a.expert_ids, a.weights = ids.ptr, weights.ptr
        a.n_entries = n = self.ep_size * runtime_max * self.top_k
        fused, warps, tile, tiles = index_plan(n, L)
        a.tile_entries, a.num_tiles = tile, tiles
        shared = 4 * L * warps
        if fused:
            self.last_issued = (self._launch("moe_index_fused", [a], 1, 32 * warps, shared, stream),)
        else:
            self.last_issued = (self._launch("moe_index_count", [a], tiles // warps, 32 * warps, shared, stream),
                                self._launch("moe_index_scan", [a], 1, 1024, 0, stream),
                                self._launch("moe_index_scatter", [a], tiles // warps, 32 * warps, shared, stream))
        self.runtime_max_tokens_per_rank, self.stream = runtime_max, stream
        self.rows, self.row_weight, self.row_of = self._views_for(runtime_max)
        for t in (self.counts, self.offsets, self.rows, self.row_weight, self.row_of):
            t.stream = stream or 1  # DLPack consumers on other streams wait for this build (1: legacy stream)

    def _release(self) -> None:
        alloc, self._alloc = self._alloc, None
        alloc.close()


# -- checks ----------------------------------------------------------------------------------------
def slot_rows(t: Tensor, name: str, index: ExpertIndex) -> tuple:
    """The per-slot row shape of a [ep_size, T^, ...] (3+ dims) or [ep_size * T^, ...] tensor."""
    runtime_max = index.runtime_max_tokens_per_rank
    if t.ndim >= 3 and t.shape[:2] == (index.ep_size, runtime_max):
        return t.shape[2:]
    if not (t.ndim >= 2 and t.shape[0] == index.slots):
        raise ValueError(f"{name}: must be [ep_size={index.ep_size}, T^={runtime_max}, ...] or [{index.slots}, ...] "
                         f"(the index's slots), got {list(t.shape)}")
    return t.shape[1:]


def call_stream(stream, default) -> int:
    return default if stream is None else stream_handle(stream)


def _groups(vectors: int) -> tuple:
    """(threads per row: a power of two up to a block, rows per block) for rows of `vectors` vectors."""
    group = min(_THREADS, 1 << max(0, vectors - 1).bit_length())
    return group, _THREADS // group


# -- the pieces ---------------------------------------------------------------------------------
def build_index(expert_ids, weights, *, num_experts: int, ep_size: int, rank: int, stream=None,
                out: ExpertIndex = None) -> ExpertIndex:
    """Index the slots of one dispatch by the local experts of `rank`.

    expert_ids: int32 [ep_size, T^, top_k], the dispatched expert ids (dispatch's view, or any
      DLPack / CUDA Array Interface tensor); ids of other ranks' experts, -1 and out-of-range
      ids are skipped. weights: fp32 [ep_size, T^, top_k], the dispatched router weights.
    stream: where to run (default: the stream expert_ids was produced on when it is an ep_a2a
      view, such as dispatch's; else the legacy default stream).
    out: an ExpertIndex to reuse (same routing and top_k, max_tokens_per_rank >= T^); required
      under CUDA graph capture, where nothing may be allocated. Returns the index.
    """
    num_experts, ep_size, rank = _check_routing(num_experts, ep_size, rank)
    produced_on = expert_ids.stream if isinstance(expert_ids, Tensor) else None
    s = call_stream(stream, 0 if produced_on is None else produced_on)
    ids = cuda_tensor(expert_ids, "expert_ids", s)
    if ids.dtype != int32:  # (hot path: each message is formatted only when its rule is broken)
        raise ValueError(f"expert_ids: dtype must be int32, got {ids.dtype.name}")
    if not (ids.ndim == 3 and ids.shape[0] == ep_size and ids.shape[1] >= 1 and 1 <= ids.shape[2] <= MAX_TOP_K):
        raise ValueError(f"expert_ids: shape must be [ep_size={ep_size}, T^ >= 1, top_k in 1..{MAX_TOP_K}], "
                         f"got {list(ids.shape)}")
    w = cuda_tensor(weights, "weights", s, ids.device[1])
    if w.dtype != float32:
        raise ValueError(f"weights: dtype must be float32, got {w.dtype.name}")
    if w.shape != ids.shape:
        raise ValueError(f"weights: shape must equal expert_ids' {list(ids.shape)}, got {list(w.shape)}")
    runtime_max, top_k = ids.shape[1], ids.shape[2]
    if out is None:
        out = ExpertIndex(ids.device[1], num_experts=num_experts, ep_size=ep_size, rank=rank,
                          max_tokens_per_rank=runtime_max, top_k=top_k)
    else:
        require(isinstance(out, ExpertIndex) and not out.closed, "out", "must be an open ExpertIndex")
        if (out.num_experts, out.ep_size, out.rank, out.top_k) != (num_experts, ep_size, rank, top_k):
            raise ValueError(f"out: was made for num_experts={out.num_experts}, ep_size={out.ep_size}, "
                             f"rank={out.rank}, top_k={out.top_k}; this call has {num_experts}, {ep_size}, {rank}, {top_k}")
        if out.device.ordinal != ids.device[1]:
            raise ValueError(f"out: lives on cuda:{out.device.ordinal}, expert_ids on cuda:{ids.device[1]}")
        if runtime_max > out.max_tokens_per_rank:
            raise ValueError(f"expert_ids: T^={runtime_max} exceeds the index's max_tokens_per_rank={out.max_tokens_per_rank}")
    out._build(ids, w, runtime_max, s)
    return out


def check_built(index, what: str) -> None:
    require(isinstance(index, ExpertIndex) and not index.closed, "index", "must be an open ExpertIndex")
    if index.runtime_max_tokens_per_rank is None:
        raise ValueError(f"index: build it with build_index() before {what}")


def gather_rows(index: ExpertIndex, src, out, stream=None) -> None:
    """out[p, ...] = src[rows[p], ...] for every permuted row p < total (rows past it untouched).

    src: a dispatched payload [ep_size, T^, ...] (or [ep_size * T^, ...]) of any dtype; out:
    [rows >= index.capacity, ...] of src's dtype and row shape. Copies in 16-byte vectors when
    the row size and both addresses allow. stream: default, the stream of the index's build.
    """
    check_built(index, "gather_rows")
    s = call_stream(stream, index.stream)
    dev = index.device.ordinal
    x = cuda_tensor(src, "src", s, dev)
    inner = slot_rows(x, "src", index)
    y = cuda_tensor(out, "out", s, dev)
    if y.dtype != x.dtype:
        raise ValueError(f"out: dtype must be src's {x.dtype.name}, got {y.dtype.name}")
    if not (y.ndim == 1 + len(inner) and y.shape[1:] == inner and y.shape[0] >= index.capacity):
        raise ValueError(f"out: shape must be [rows >= capacity={index.capacity}, {', '.join(map(str, inner))}], "
                         f"got {list(y.shape)}")
    row_bytes = math.prod(inner) * x.itemsize
    if not 0 < row_bytes < 2 ** 31:
        raise ValueError(f"src: rows must hold 1..2**31-1 bytes, got {row_bytes}")
    vec = vector_bytes(row_bytes, x.ptr, y.ptr)
    group, per_block = _groups(row_bytes // vec)
    grid = max(1, min(-(-index.capacity // per_block), 8 * index.device.sm_count))
    args = [ctypes.c_uint64(x.ptr), ctypes.c_uint64(y.ptr), ctypes.c_uint64(index._base["rows"]),
            ctypes.c_uint64(index._base["offsets"]), ctypes.c_int32(index.num_local_experts),
            ctypes.c_uint32(row_bytes), ctypes.c_uint32(vec), ctypes.c_int32(group)]
    index.last_issued = (index._launch("moe_gather_rows", args, grid, _THREADS, 0, s),)


def activation(index: ExpertIndex, fc1_out, out, stream=None) -> None:
    """The gated SiLU between FC1 and FC2: out[p, :] = silu(fc1_out[p, :I]) * fc1_out[p, I:]
    for every permuted row p < total (rows past it untouched).

    fc1_out: bf16 / fp16 [rows >= index.capacity, 2 * I] (gate then up, as FC1 of the stacked
    w_gate_up writes them), contiguous; out: [rows >= index.capacity, I] of its dtype. The
    total is read on the device, so a captured graph computes only the rows a rank received,
    and each value is bitwise what torch's eager F.silu(gate) * up gives (silu in fp32 rounded
    to the dtype, then the product in fp32 rounded). stream: default, the index's build's.
    """
    check_built(index, "activation")
    s = call_stream(stream, index.stream)
    dev = index.device.ordinal
    x = cuda_tensor(fc1_out, "fc1_out", s, dev)
    y = cuda_tensor(out, "out", s, dev)
    code = ACTIVATION_DTYPES.get(x.dtype.name)
    if code is None:
        raise ValueError(f"fc1_out: dtype must be one of {tuple(ACTIVATION_DTYPES)}, got {x.dtype.name}")
    if y.dtype != x.dtype:
        raise ValueError(f"out: dtype must be fc1_out's {x.dtype.name}, got {y.dtype.name}")
    if not (x.ndim == 2 and x.shape[1] >= 2 and x.shape[1] % 2 == 0 and x.shape[0] >= index.capacity):
        raise ValueError(f"fc1_out: shape must be [rows >= capacity={index.capacity}, 2 * I], got {list(x.shape)}")
    inter = x.shape[1] // 2
    if not (y.ndim == 2 and y.shape[1] == inter and y.shape[0] >= index.capacity):
        raise ValueError(f"out: shape must be [rows >= capacity={index.capacity}, I={inter}], got {list(y.shape)}")
    size = x.itemsize
    elems = next(e for e in (8, 4, 2, 1) if inter % e == 0 and x.ptr % (e * size) == 0 and y.ptr % (e * size) == 0)
    group, per_block = _groups(inter // elems)
    grid = max(1, min(-(-index.capacity // per_block), 8 * index.device.sm_count))
    args = [ctypes.c_uint64(x.ptr), ctypes.c_uint64(y.ptr), ctypes.c_uint64(index._base["offsets"]),
            ctypes.c_int32(index.num_local_experts), ctypes.c_int32(inter), ctypes.c_int32(elems),
            ctypes.c_int32(group)]
    index.last_issued = (index._launch(f"moe_swiglu_{code}", args, grid, _THREADS, 0, s),)



def finalize(index: ExpertIndex, fc2_out, out, stream=None) -> None:
    """out[s, :] = sum over k ascending, row = row_of[s, k] >= 0, of row_weight[row] * fc2_out[row, :].

    Accumulated in fp32 (each product and sum rounded separately, as moe_reference.finalize),
    then rounded to out's dtype (round to nearest even); slots without a local row get 0.
    fc2_out: bf16 / fp16 / fp32 [rows >= index.capacity, hidden], the experts' outputs in the
    index's row order. out: bf16 / fp16 / fp32 [ep_size, T^, hidden] (or [ep_size * T^,
    hidden]), typically r.combine_input(T^): written in place, no staging copy. Or, with
    combine_quant="fp8", r.combine_input(T^, fp8=True) (an Fp8Partial): each sum is rounded
    to the combine dtype and quantized there as combine's own pass would (e4m3, one scale
    per 128 values), so combine skips that pass and delivers the same bits.
    stream: default, the stream of the index's build.
    """
    check_built(index, "finalize")
    s = call_stream(stream, index.stream)
    dev = index.device.ordinal
    if isinstance(out, Fp8Partial):
        return _finalize_fp8(index, fc2_out, out, s, dev)
    x = cuda_tensor(fc2_out, "fc2_out", s, dev)
    y = cuda_tensor(out, "out", s, dev)
    for t, name in ((x, "fc2_out"), (y, "out")):
        _check_finalize_dtype(t.dtype.name, name)
    inner = slot_rows(y, "out", index)
    if not (len(inner) == 1 and inner[0] >= 1):
        raise ValueError(f"out: must have one hidden dimension, got shape {list(y.shape)}")
    hidden = inner[0]
    _check_fc2_shape(x, hidden, index)
    widest = 16 // max(x.itemsize, y.itemsize)
    elems = next(e for e in (8, 4, 2, 1) if e <= widest and hidden % e == 0
                 and x.ptr % (e * x.itemsize) == 0 and y.ptr % (e * y.itemsize) == 0)
    group, per_block = _groups(hidden // elems)
    grid = max(1, min(-(-index.slots // per_block), 8 * index.device.sm_count))
    args = [ctypes.c_uint64(x.ptr), ctypes.c_uint64(y.ptr), ctypes.c_uint64(index._base["row_of"]),
            ctypes.c_uint64(index._base["row_weight"]), ctypes.c_int32(index.slots), ctypes.c_int32(index.top_k),
            ctypes.c_int32(hidden), ctypes.c_int32(elems), ctypes.c_int32(group)]
    name = f"moe_finalize_{REDUCE_DTYPES[x.dtype.name]}_{REDUCE_DTYPES[y.dtype.name]}"
    index.last_issued = (index._launch(name, args, grid, _THREADS, 0, s),)


def _check_finalize_dtype(dtype: str, name: str) -> None:
    if dtype not in REDUCE_DTYPES:
        raise ValueError(f"{name}: dtype must be one of {tuple(REDUCE_DTYPES)}, got {dtype}")


def _check_fc2_shape(x: Tensor, hidden: int, index: ExpertIndex) -> None:
    if not (x.ndim == 2 and x.shape[1] == hidden and x.shape[0] >= index.capacity):
        raise ValueError(f"fc2_out: shape must be [rows >= capacity={index.capacity}, hidden={hidden}], "
                         f"got {list(x.shape)}")


def _finalize_fp8(index: ExpertIndex, fc2_out, out: Fp8Partial, s: int, dev: int) -> None:
    """finalize into an FP8 combine input: a half-warp per 128-value block of a slot."""
    x = cuda_tensor(fc2_out, "fc2_out", s, dev)
    q, sc = (cuda_tensor(t, "out", s, dev) for t in (out.values, out.scales))
    _check_finalize_dtype(x.dtype.name, "fc2_out")
    _check_finalize_dtype(out.dtype, "out")
    if not (q.dtype.name == "float8_e4m3fn" and sc.dtype.name == "float32"):
        raise ValueError(f"out: an Fp8Partial holds float8_e4m3fn values and float32 scales, "
                         f"got {q.dtype.name} and {sc.dtype.name}")
    inner = slot_rows(q, "out", index)
    if not (len(inner) == 1 and inner[0] % Q8_BLOCK == 0 and inner[0] > 0):
        raise ValueError(f"out: values must have one hidden dimension, a multiple of {Q8_BLOCK}, "
                         f"got shape {list(q.shape)}")
    hidden = inner[0]
    if slot_rows(sc, "out", index) != (hidden // Q8_BLOCK,):
        raise ValueError(f"out: scales must be [..., hidden / {Q8_BLOCK} = {hidden // Q8_BLOCK}], got {list(sc.shape)}")
    _check_fc2_shape(x, hidden, index)
    if x.ptr % 16:
        raise ValueError(f"fc2_out: must be 16-byte aligned with an FP8 out (16-byte loads), got {x.ptr:#x}")
    require(q.ptr % 8 == 0 and sc.ptr % 4 == 0, "out", "values must be 8-byte aligned, scales 4-byte aligned")
    units = index.slots * (hidden // Q8_BLOCK)  # 128-value blocks: a half-warp each
    grid = max(1, min(-(-units // (_THREADS // 16)), 8 * index.device.sm_count))
    args = [ctypes.c_uint64(x.ptr), ctypes.c_uint64(q.ptr), ctypes.c_uint64(sc.ptr),
            ctypes.c_uint64(index._base["row_of"]), ctypes.c_uint64(index._base["row_weight"]),
            ctypes.c_int32(index.slots), ctypes.c_int32(index.top_k), ctypes.c_int32(hidden)]
    name = f"moe_finalize_q8_{REDUCE_DTYPES[x.dtype.name]}_{REDUCE_DTYPES[out.dtype]}"
    index.last_issued = (index._launch(name, args, grid, _THREADS, 0, s),)
