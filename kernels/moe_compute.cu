// MoE compute: the router before dispatch, then the experts' side on the rank-major dispatch
// workspace of one rank.
//
// Dispatch leaves ep_size * T^ slots (slot s = source rank * T^ + i), each with top_k expert
// ids and router weights. The experts compute on expert-major rows, so this file has four
// pieces (ep_a2a/moe.py drives them, ep_a2a/moe_reference.py is the NumPy twin of the index,
// gather and finalize):
//   * the index: every (slot, k) that selects a local expert gets a permuted row; rows are
//     grouped by local expert, and inside an expert ordered by slot then k. The order is a
//     stable counting sort, so it is the same on every run (no atomics decide it);
//   * gather_rows: copies payload rows of slots into that expert-major order;
//   * the activation between the experts' FC1 and FC2 (SiLU(gate) * up) over the rows placed;
//   * finalize: sums each slot's weighted expert outputs in k order, in fp32, straight into
//     the combine input of the workspace.
// The router (moe_route_*, at the end) runs before dispatch: logits -> top-k ids and weights.
//
// The index is a counting sort over the flat entries j = s * top_k + k, cut into warp tiles
// (contiguous ranges of j). A warp counts its tile's entries per local expert, an exclusive
// scan of the table [local expert][tile] gives every (expert, tile) its first row (all rows
// of earlier experts, then the expert's rows in earlier tiles), and the warp walks its tile
// again, handing out rows in j order. Small inputs (decode) run all three steps in one block;
// large ones run them as count, scan and scatter kernels.
#include "combine_q8.cuh"

// MoeIndexArgs, the index kernels' argument block, is generated from ep_a2a/layout.py into
// generated/params.cuh (its fields are documented there, in layout.py).

// Local expert of flat entry j, or -1: past the tile, an invalid id (-1 or out of range) or
// another rank's expert. One unsigned compare covers all of them.
EP_DEVICE int local_expert(const MoeIndexArgs& a, int j, int end) {
  if (j >= end) return -1;
  const unsigned e = static_cast<unsigned>(a.expert_ids[j]) - static_cast<unsigned>(a.first_expert);
  return e < static_cast<unsigned>(a.num_local) ? static_cast<int>(e) : -1;
}

EP_DEVICE int tile_begin(const MoeIndexArgs& a, int tile) { return min(a.n_entries, tile * a.tile_entries); }
EP_DEVICE int tile_end(const MoeIndexArgs& a, int tile) { return min(a.n_entries, (tile + 1) * a.tile_entries); }

// One warp adds the entries of [begin, end) per local expert e to col[e * stride]. Lanes
// with the same expert elect their lowest lane to add for all of them; the __syncwarp
// orders that update before the next round's, whose leader may be another lane.
EP_DEVICE void count_tile(const MoeIndexArgs& a, int begin, int end, int* col, int stride) {
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += 32) {
    const int e = local_expert(a, base + lane, end);
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == __ffs(same) - 1) col[e * stride] += __popc(same);
    __syncwarp();
  }
}

// One warp hands out rows for [begin, end): col[e * stride] holds the next free row of local
// expert e in this tile. Inside a round of 32 entries, a lane's row is the cursor plus the
// number of lower lanes (earlier entries) with the same expert, so rows follow j order. The
// weight is loaded beside the id, not after the row is known: one memory latency less per
// round (decode sizes are a round or two).
EP_DEVICE void scatter_tile(const MoeIndexArgs& a, int begin, int end, int* col, int stride) {
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += 32) {
    const int j = base + lane;
    const float weight = j < end ? a.weights[j] : 0.f;
    const int e = local_expert(a, j, end);
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int before = __popc(same & ((1u << lane) - 1u));
    int row = -1;
    if (e >= 0) row = col[e * stride] + before;
    __syncwarp();  // every lane has read the cursor before its leader moves it
    if (e >= 0 && before == 0) col[e * stride] += __popc(same);
    __syncwarp();
    if (j < end) a.row_of[j] = row;
    if (row >= 0) {
      a.rows[row] = j / a.top_k;
      a.row_weight[row] = weight;
    }
  }
}

// In-place exclusive prefix sum of data[0, n) (shared or global memory) by the whole block;
// returns the total. Each thread scans a contiguous run, so the result is data order.
EP_DEVICE int block_exclusive_scan(int* data, int n) {
  __shared__ int warp_total[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int per = (n + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int lo = min(n, static_cast<int>(threadIdx.x) * per), hi = min(n, lo + per);
  int sum = 0;
  for (int i = lo; i < hi; ++i) sum += data[i];
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int v = lane < warps ? warp_total[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += y;
    }
    warp_total[lane] = v;  // inclusive over warps
  }
  __syncthreads();
  int run = incl - sum + (warp ? warp_total[warp - 1] : 0);
  const int total = warp_total[warps - 1];
  for (int i = lo; i < hi; ++i) {
    const int v = data[i];
    data[i] = run;
    run += v;
  }
  __syncthreads();  // the scanned table and warp_total are complete for every thread
  return total;
}

// counts and offsets from the scanned table: expert e's first row is its entry for tile 0.
EP_DEVICE void publish_offsets(const MoeIndexArgs& a, const int* table, int stride, int total) {
  for (int e = threadIdx.x; e <= a.num_local; e += blockDim.x) {
    const int first = e < a.num_local ? table[e * stride] : total;
    a.offsets[e] = first;
    if (e < a.num_local) a.counts[e] = (e + 1 < a.num_local ? table[(e + 1) * stride] : total) - first;
  }
}

// Decode path: one block; warp w owns tile w and column w of the shared table.
extern "C" __global__ void __launch_bounds__(1024) moe_index_fused(const __grid_constant__ MoeIndexArgs a) {
  extern __shared__ int table[];  // [num_local][warps]
  const int warps = blockDim.x >> 5, w = threadIdx.x >> 5;
  const int m = a.num_local * warps;
  for (int i = threadIdx.x; i < m; i += blockDim.x) table[i] = 0;
  __syncthreads();
  const int begin = tile_begin(a, w), end = tile_end(a, w);
  count_tile(a, begin, end, table + w, warps);
  __syncthreads();
  const int total = block_exclusive_scan(table, m);
  publish_offsets(a, table, warps, total);
  __syncthreads();  // publish_offsets read the table before the cursors move
  scatter_tile(a, begin, end, table + w, warps);
}

// Multi-kernel path, 1/3: every warp counts its tile into column `tile` of the global table.
extern "C" __global__ void __launch_bounds__(256) moe_index_count(const __grid_constant__ MoeIndexArgs a) {
  extern __shared__ int table[];  // [num_local][warps of this block]
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, w = threadIdx.x >> 5;
  const int tile = blockIdx.x * warps + w;
  for (int e = lane; e < a.num_local; e += 32) table[e * warps + w] = 0;
  __syncwarp();
  count_tile(a, tile_begin(a, tile), tile_end(a, tile), table + w, warps);
  for (int e = lane; e < a.num_local; e += 32) a.tile_counts[e * a.num_tiles + tile] = table[e * warps + w];
}

// 2/3: one block scans the whole table (expert-major, so the scan is the row layout).
extern "C" __global__ void __launch_bounds__(1024) moe_index_scan(const __grid_constant__ MoeIndexArgs a) {
  const int total = block_exclusive_scan(a.tile_counts, a.num_local * a.num_tiles);
  publish_offsets(a, a.tile_counts, a.num_tiles, total);
}

// 3/3: every warp hands out the rows of its tile from its column of the scanned table.
extern "C" __global__ void __launch_bounds__(256) moe_index_scatter(const __grid_constant__ MoeIndexArgs a) {
  extern __shared__ int table[];  // [num_local][warps of this block]: cursors
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, w = threadIdx.x >> 5;
  const int tile = blockIdx.x * warps + w;
  for (int e = lane; e < a.num_local; e += 32) table[e * warps + w] = a.tile_counts[e * a.num_tiles + tile];
  __syncwarp();
  scatter_tile(a, tile_begin(a, tile), tile_end(a, tile), table + w, warps);
}

// gather_rows: out[p] = src[rows[p]] for p < total. A group of `group` threads (a power of two
// dividing the block) copies one row in W-byte vectors; U vectors are loaded before they are
// stored so that each thread keeps several loads in flight.
template <int W>
EP_DEVICE void copy_rows(const char* src, char* out, const int* rows, int total, unsigned row_bytes, int group) {
  using V = typename VecT<W>::T;
  constexpr int U = 4;
  const unsigned n = row_bytes / W;
  const int per_block = blockDim.x / group, g = threadIdx.x / group, lane = threadIdx.x % group;
  for (int p = blockIdx.x * per_block + g; p < total; p += gridDim.x * per_block) {
    const V* s = reinterpret_cast<const V*>(src + static_cast<size_t>(rows[p]) * row_bytes);
    V* d = reinterpret_cast<V*>(out + static_cast<size_t>(p) * row_bytes);
    for (unsigned base = lane; base < n; base += group * U) {
      V x[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * group < n) x[u] = s[base + u * group];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * group < n) d[base + u * group] = x[u];
    }
  }
}

extern "C" __global__ void __launch_bounds__(256) moe_gather_rows(const char* src, char* out, const int* rows,
                                                                  const int* offsets, int num_local,
                                                                  unsigned row_bytes, unsigned vec, int group) {
  const int total = offsets[num_local];  // known only on the device: the grid covers the capacity
  switch (vec) {
    case 16: copy_rows<16>(src, out, rows, total, row_bytes, group); break;
    case 8: copy_rows<8>(src, out, rows, total, row_bytes, group); break;
    case 4: copy_rows<4>(src, out, rows, total, row_bytes, group); break;
    case 2: copy_rows<2>(src, out, rows, total, row_bytes, group); break;
    default: copy_rows<1>(src, out, rows, total, row_bytes, group); break;
  }
}

// activation (between FC1 and FC2): act[r, :] = silu(h[r, :I]) * h[r, I:] for r < total, the
// gated SiLU of FC1's stacked gate and up halves. The grid covers the capacity, but the rows
// stop at the total the index left on the device, so a graph captured for T^ computes only
// the rows a rank received. Each value is what torch's eager F.silu then torch.mul give:
// silu as x / (1 + expf(-x)) in fp32 (the same expression, built with the same default
// contraction and without fast math), rounded to T, then a product in fp32 rounded to T.
template <typename T, int E>
EP_DEVICE void swiglu_rows(const T* h, T* act, int total, int inter, int group) {
  using V = typename VecT<E * sizeof(T)>::T;
  const int n = inter / E;
  const int per_block = blockDim.x / group, g = threadIdx.x / group, lane = threadIdx.x % group;
  for (int r = blockIdx.x * per_block + g; r < total; r += gridDim.x * per_block) {
    const V* gate = reinterpret_cast<const V*>(h + static_cast<size_t>(r) * 2 * inter);
    const V* up = reinterpret_cast<const V*>(h + (static_cast<size_t>(r) * 2 + 1) * inter);
    V* out = reinterpret_cast<V*>(act + static_cast<size_t>(r) * inter);
    for (int v = lane; v < n; v += group) {
      union { V raw; T el[E]; } a, b, o;
      a.raw = gate[v];
      b.raw = up[v];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float x = to_float<T>(a.el[e]);
        const T s = from_float<T>(x / (1.0f + expf(-x)));
        o.el[e] = from_float<T>(to_float<T>(s) * to_float<T>(b.el[e]));
      }
      out[v] = o.raw;
    }
  }
}

// moe_swiglu_<dtype>: vec_elems (8, 4, 2 or 1) divides I; both tensors are aligned to it (the
// host picks it).
#define EP_SWIGLU(NAME, T)                                                                                      \
  extern "C" __global__ void __launch_bounds__(256) moe_swiglu_##NAME(const T* h, T* act, const int* offsets,  \
                                                                      int num_local, int inter, int vec_elems, \
                                                                      int group) {                             \
    const int total = offsets[num_local];                                                                      \
    switch (vec_elems) {                                                                                       \
      case 8: swiglu_rows<T, 8>(h, act, total, inter, group); break;                                           \
      case 4: swiglu_rows<T, 4>(h, act, total, inter, group); break;                                           \
      case 2: swiglu_rows<T, 2>(h, act, total, inter, group); break;                                           \
      default: swiglu_rows<T, 1>(h, act, total, inter, group); break;                                          \
    }                                                                                                          \
  }
EP_SWIGLU(bf16, __nv_bfloat16)
EP_SWIGLU(f16, __half)

// finalize: out[s] = sum over k (ascending) of row_weight[row] * fc2[row], row = row_of[s, k]
// >= 0, in fp32. __fmul_rn/__fadd_rn keep the multiply and the add separately rounded (no
// FMA contraction), which is what moe_reference.finalize computes in NumPy: bitwise equal.
// E elements per vector; a group of threads covers one slot's hidden vector.
//
// At decode sizes a slot's k selections were a chain of dependent loads (row_of[k], then
// the weight and the row, k after k). The rows of FIN_K selections are loaded together
// first; then each local selection costs one latency (its weight and row load in parallel),
// added in k order as before (the same bits). Only the rows are held, not the loaded values,
// and FIN_K (moe_common.cuh, load_selections) stays small: the kernel keeps its 32 registers,
// so the occupancy (bytes in flight) that the byte-bound large sizes need.

template <typename TIn, typename TOut, int E>
EP_DEVICE void finalize_slots(const TIn* fc2, TOut* out, const int* row_of, const float* row_weight, int slots,
                              int top_k, int hidden, int group) {
  using VIn = typename VecT<E * sizeof(TIn)>::T;
  using VOut = typename VecT<E * sizeof(TOut)>::T;
  const int n = hidden / E;
  const int per_block = blockDim.x / group, g = threadIdx.x / group, lane = threadIdx.x % group;
  for (int s = blockIdx.x * per_block + g; s < slots; s += gridDim.x * per_block) {
    const int* sel = row_of + static_cast<size_t>(s) * top_k;
    for (int v = lane; v < n; v += group) {
      float acc[E];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = 0.f;
      for (int k0 = 0; k0 < top_k; k0 += FIN_K) {
        int row[FIN_K];
        load_selections(sel, k0, top_k, row);
#pragma unroll
        for (int j = 0; j < FIN_K; ++j) {
          if (row[j] < 0) continue;
          const float w = row_weight[row[j]];
          union { VIn raw; TIn el[E]; } x;
          x.raw = reinterpret_cast<const VIn*>(fc2 + static_cast<size_t>(row[j]) * hidden)[v];
#pragma unroll
          for (int e = 0; e < E; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, to_float<TIn>(x.el[e])));
        }
      }
      union { VOut raw; TOut el[E]; } o;
#pragma unroll
      for (int e = 0; e < E; ++e) o.el[e] = from_float<TOut>(acc[e]);
      reinterpret_cast<VOut*>(out + static_cast<size_t>(s) * hidden)[v] = o.raw;
    }
  }
}

// The host picks E (elements per vector) so that loads and stores are at most 16 bytes and
// aligned; only those widths are instantiated.
template <typename TIn, typename TOut>
EP_DEVICE void finalize(const void* fc2, void* out, const int* row_of, const float* row_weight, int slots,
                        int top_k, int hidden, int vec_elems, int group) {
  constexpr int widest = 16 / (sizeof(TIn) > sizeof(TOut) ? sizeof(TIn) : sizeof(TOut));
  const TIn* x = static_cast<const TIn*>(fc2);
  TOut* y = static_cast<TOut*>(out);
  switch (vec_elems) {
    case 8:
      if constexpr (widest >= 8) finalize_slots<TIn, TOut, 8>(x, y, row_of, row_weight, slots, top_k, hidden, group);
      break;
    case 4: finalize_slots<TIn, TOut, 4>(x, y, row_of, row_weight, slots, top_k, hidden, group); break;
    case 2: finalize_slots<TIn, TOut, 2>(x, y, row_of, row_weight, slots, top_k, hidden, group); break;
    default: finalize_slots<TIn, TOut, 1>(x, y, row_of, row_weight, slots, top_k, hidden, group); break;
  }
}

// finalize into the FP8 combine input (combine_quant="fp8"): the same fp32 sum per value,
// rounded to the combine dtype TOut (what the bf16/fp16/fp32 finalize stores), then quantized
// as combine's own quantize pass would quantize that stored value: so the combine that
// follows (combine_prequantized) skips its pass and reads bit-identical e4m3 bytes and
// scales. A half-warp owns one 128-value block of a slot (lane l: values 8l..8l+7), the
// layout of the pass; the loop advances both halves of a warp together (the amax shuffles).
template <typename TIn, typename TOut>
EP_DEVICE void finalize_slots_q8(const TIn* fc2, unsigned char* q, float* scales, const int* row_of,
                                 const float* row_weight, int slots, int top_k, int hidden) {
  const unsigned per_row = hidden / EP_Q8_BLOCK, units = static_cast<unsigned>(slots) * per_row;
  const unsigned half = (blockIdx.x * blockDim.x + threadIdx.x) / Q8_LANES;
  const unsigned halves = gridDim.x * blockDim.x / Q8_LANES;
  const unsigned lane = threadIdx.x & (Q8_LANES - 1);
  for (unsigned u0 = half & ~1u; u0 < units; u0 += halves) {
    const unsigned u = u0 + (half & 1);
    const bool live = u < units;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.f;
    size_t at = 0;  // value index of this lane's 8 values: slot * hidden + col
    if (live) {
      const unsigned slot = u / per_row;
      const size_t col = (u - slot * per_row) * EP_Q8_BLOCK + lane * 8;  // block * 128 + lane * 8
      at = static_cast<size_t>(slot) * hidden + col;
      const int* sel = row_of + static_cast<size_t>(slot) * top_k;
      for (int k0 = 0; k0 < top_k; k0 += FIN_K) {  // (rows first, as finalize_slots: the same sums)
        int row[FIN_K];
        load_selections(sel, k0, top_k, row);
#pragma unroll
        for (int j = 0; j < FIN_K; ++j) {
          if (row[j] < 0) continue;
          const float w = row_weight[row[j]];
          uint4 raw[Q8Load<TIn>::N];  // (fc2 16-byte aligned: the host checks)
          q8_load<TIn>(fc2 + static_cast<size_t>(row[j]) * hidden + col, raw);
          const TIn* x = reinterpret_cast<const TIn*>(raw);
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(v[e], __fmul_rn(w, to_float<TIn>(x[e])));
        }
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = to_float<TOut>(from_float<TOut>(v[e]));
    }
    q8_quantize8(v, live, reinterpret_cast<uint2*>(q + at), scales + at / EP_Q8_BLOCK);
  }
}

// moe_finalize_<fc2 dtype>_<out dtype>
#define EP_FINALIZE(IN, TIN, OUT, TOUT)                                                                         \
  extern "C" __global__ void __launch_bounds__(256) moe_finalize_##IN##_##OUT(                                \
      const void* fc2, void* out, const int* row_of, const float* row_weight, int slots, int top_k, int hidden, \
      int vec_elems, int group) {                                                                              \
    finalize<TIN, TOUT>(fc2, out, row_of, row_weight, slots, top_k, hidden, vec_elems, group);                \
  }
// every (fc2 dtype, out dtype) pair, for the finalize kernels below
#define EP_FINALIZE_PAIRS(M)                                                                                     \
  M(bf16, __nv_bfloat16, bf16, __nv_bfloat16) M(bf16, __nv_bfloat16, f16, __half) M(bf16, __nv_bfloat16, f32, float) \
  M(f16, __half, bf16, __nv_bfloat16) M(f16, __half, f16, __half) M(f16, __half, f32, float)                        \
  M(f32, float, bf16, __nv_bfloat16) M(f32, float, f16, __half) M(f32, float, f32, float)
EP_FINALIZE_PAIRS(EP_FINALIZE)

// moe_finalize_q8_<fc2 dtype>_<combine dtype>: hidden a multiple of 128 (the host checks)
#define EP_FINALIZE_Q8(IN, TIN, OUT, TOUT)                                                                       \
  extern "C" __global__ void __launch_bounds__(256) moe_finalize_q8_##IN##_##OUT(                              \
      const void* fc2, unsigned char* q, float* scales, const int* row_of, const float* row_weight, int slots,  \
      int top_k, int hidden) {                                                                                  \
    finalize_slots_q8<TIN, TOUT>(static_cast<const TIN*>(fc2), q, scales, row_of, row_weight, slots, top_k,    \
                                 hidden);                                                                       \
  }
EP_FINALIZE_PAIRS(EP_FINALIZE_Q8)

// router: logits [tokens, num_experts] -> ids int32 [tokens, top_k] (descending logit; equal
// logits: the lower expert first) and weights fp32 [tokens, top_k]: softmax over the k selected
// logits (renormalize), or the full softmax's probabilities of the k. One warp per token, lane l
// holding experts l, l + 32, ... (N per lane, in registers); k rounds of a warp argmax.
//
// The weights follow torch's one-warp softmax (rows up to 1024) step by step, so that they
// match torch.softmax's bits where expf and the sums agree: x - max, expf, each lane's sum in
// its element order from 0, a butterfly over the lanes (lanes past the row hold exact zeros, so
// a 32-lane butterfly pairs the live lanes as a narrower one does), then a division.

// Unsigned order of a logit: compares as the floats do, -0 as +0, any NaN above everything
// (torch.topk ranks NaN largest). Every logit's key is above 0 (-inf's is 0x007fffff), so 0
// marks lanes' padding and experts already taken.
EP_DEVICE unsigned route_key(float x) {
  if (x != x) return 0xffffffffu;
  unsigned b = __float_as_uint(x);
  if (b == 0x80000000u) b = 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

EP_DEVICE float warp_sum(float s) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
  return s;
}

template <typename T, int N>
EP_DEVICE void route_tokens(const T* logits, int* ids, float* weights, int tokens, int num_experts, int top_k,
                            int renormalize) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < tokens; t += gridDim.x * warps) {
    const T* row = logits + static_cast<size_t>(t) * num_experts;
    float v[N];
    unsigned key[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = i * 32 + lane;
      v[i] = e < num_experts ? to_float<T>(row[e]) : -INFINITY;
      key[i] = e < num_experts ? route_key(v[i]) : 0u;
    }
    int my_id = 0;        // lane r < top_k: the r-th selection and its logit
    float my_logit = 0.f, top = 0.f;
    unsigned taken = 0;   // bit i: expert i * 32 + lane selected (a mask, not a write into key[],
                          // which a dynamic index would move to local memory)
    for (int r = 0; r < top_k; ++r) {
      unsigned best = 0;  // this lane's largest key not taken; its lowest expert on equal keys
      int best_i = 0;
      float best_v = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const unsigned k = (taken >> i) & 1u ? 0u : key[i];
        if (k > best) best = k, best_i = i, best_v = v[i];
      }
      const unsigned win = __reduce_max_sync(0xffffffffu, best);  // > 0: top_k <= num_experts
      const unsigned e = __reduce_min_sync(0xffffffffu, best == win ? static_cast<unsigned>(best_i * 32 + lane) : ~0u);
      const float x = __shfl_sync(0xffffffffu, best_v, e & 31);
      if (lane == static_cast<int>(e & 31)) taken |= 1u << (e >> 5);
      if (lane == r) my_id = static_cast<int>(e), my_logit = x;
      if (r == 0) top = x;
    }
    float w;
    if (renormalize) {
      const float p = lane < top_k ? expf(my_logit - top) : 0.f;
      w = p / warp_sum(p);
    } else {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) s += expf(v[i] - top);
      w = expf(my_logit - top) / warp_sum(s);
    }
    if (lane < top_k) {
      ids[static_cast<size_t>(t) * top_k + lane] = my_id;
      weights[static_cast<size_t>(t) * top_k + lane] = w;
    }
  }
}

// moe_route_<logits dtype>_<N>: num_experts <= 32 * N, 1 <= top_k <= min(32, num_experts) (the
// host picks N, the smallest power of two that holds the row, and checks the rest).
#define EP_ROUTE(NAME, T, N)                                                                                   \
  extern "C" __global__ void __launch_bounds__(256) moe_route_##NAME##_##N(                                    \
      const T* logits, int* ids, float* weights, int tokens, int num_experts, int top_k, int renormalize) {    \
    route_tokens<T, N>(logits, ids, weights, tokens, num_experts, top_k, renormalize);                         \
  }
#define EP_ROUTE_WIDTHS(NAME, T) \
  EP_ROUTE(NAME, T, 1) EP_ROUTE(NAME, T, 2) EP_ROUTE(NAME, T, 4) EP_ROUTE(NAME, T, 8) EP_ROUTE(NAME, T, 16) EP_ROUTE(NAME, T, 32)
EP_ROUTE_WIDTHS(f32, float)
EP_ROUTE_WIDTHS(bf16, __nv_bfloat16)
EP_ROUTE_WIDTHS(f16, __half)
