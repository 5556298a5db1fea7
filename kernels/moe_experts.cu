// The experts' GEMMs at decode sizes, on the expert-major rows of the index
// (kernels/moe_compute.cu): FC1 reads each row where dispatch delivered it (rows[p], the
// slot of permuted row p: no gather) and applies the gated SiLU before it stores, FC2 reads
// the activations in row order. ep_a2a/moe.py (expert_fc1, expert_fc2) drives them.
//
// Why not a library GEMM: at a few rows per expert the GEMMs only stream weights, and a
// grouped GEMM that tiles 64-128 rows per block keeps most SMs idle while it does. Here a
// warp owns 8 output columns (one mma n8 tile) and up to 16 rows, so the blocks of one expert
// cover its weight matrix in 8-column slices and every SM streams. Experts without rows
// read nothing (the offsets are read on the device, so a captured graph adapts per step).
// Rows past 16 per expert run in further passes over the same weights (mostly from L2):
// the layer uses these kernels while rows per expert stay small (moe.FUSED_MAX_ROWS).
//
// The k order inside a 64-wide step is permuted so that each lane loads 16 contiguous
// elements (two 16-byte loads) of its weight row and of its two A rows: for mma j (0..3) of
// the step, the fragment's k = 2t, 2t + 1 (resp. 2t + 8, 2t + 9) of lane t hold elements
// 16t + 4j + 0, 1 (resp. 2, 3). A and B use the same map, so the sum over k is unchanged.
#include "moe_common.cuh"

constexpr int EXP_GROUPS = 2;                           // column groups of 8 (one mma n8 tile) per block
constexpr int EXP_KSPLIT = 4;                           // warps splitting a group's k range
constexpr int EXP_WARPS = EXP_GROUPS * EXP_KSPLIT;      // warps per block
constexpr int EXP_TILE = EXP_GROUPS * 8;                // output columns per block (moe.py: EXPERT_TILE)
constexpr int EXP_K = 64;                               // k per step (moe.py: EXPERT_K divides K)
constexpr int EXP_MAX_MT = 4;                           // m16 tiles per pass: up to 64 rows share a weight read

// The four mma of one step: p / q are rows g and g + 8 (16 elements each), b the weight row.
EP_DEVICE void mma_step(float (&d)[4], const uint4 (&p)[2], const uint4 (&q)[2], const uint4 (&b)[2]) {
  mma_bf16_16816(d, p[0].x, q[0].x, p[0].y, q[0].y, b[0].x, b[0].y);
  mma_bf16_16816(d, p[0].z, q[0].z, p[0].w, q[0].w, b[0].z, b[0].w);
  mma_bf16_16816(d, p[1].x, q[1].x, p[1].y, q[1].y, b[1].x, b[1].y);
  mma_bf16_16816(d, p[1].z, q[1].z, p[1].w, q[1].w, b[1].z, b[1].w);
}

EP_DEVICE void load2(uint4 (&v)[2], const uint4* at, bool valid) {
  v[0] = valid ? __ldg(at) : make_uint4(0, 0, 0, 0);
  v[1] = valid ? __ldg(at + 1) : make_uint4(0, 0, 0, 0);
}

// What a warp streams: the A rows (an index row p of a gathering FC1 is read at its slot
// a_rows[p]), its weight rows (gate; up at wu), and its share [s_begin, s_end) of the k steps.
struct ExpertWarp {
  const __nv_bfloat16* a;
  const int* a_rows;
  const uint4* wg;
  const uint4* wu;
  int k_dim, end, s_begin, s_end;
};

// This lane's first 16-byte vector of A row r.
EP_DEVICE const uint4* a_row(const ExpertWarp& w, int r) {
  const long long row = w.a_rows ? w.a_rows[r] : r;
  return reinterpret_cast<const uint4*>(w.a + row * w.k_dim) + 2 * (threadIdx.x & 3);
}

// The warp's partial sums over its k steps for rows m0 .. m0 + 16 MT - 1 (rows past `end` are
// zeros): tile i, c[0], c[1] row m0 + 16 i + g, c[2], c[3] row + 8 (columns 2t, 2t + 1).
// Every load of U steps is issued before their mma: weight bytes in flight are this kernel's
// speed (U shrinks as MT grows, to keep the registers).
template <bool GATED, int MT>
EP_DEVICE void partial_sums(const ExpertWarp& w, int m0, float (&cg)[MT][4], float (&cu)[MT][4]) {
  constexpr int U = 4 / MT;
  const int g = (threadIdx.x & 31) >> 2;
  const uint4* x[MT][2];
  bool v[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + 16 * i + 8 * h + g;
      v[i][h] = r < w.end;
      x[i][h] = a_row(w, v[i][h] ? r : m0);
    }
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) cg[i][c] = cu[i][c] = 0.f;
  for (int s0 = w.s_begin; s0 < w.s_end; s0 += U) {
    uint4 bg[U][2], bu[U][2], p[U][MT][2][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u;
      const bool in = s < w.s_end;  // (a step past the share loads zeros and adds nothing)
      load2(bg[u], w.wg + 8 * s, in);
      if (GATED) load2(bu[u], w.wu + 8 * s, in);
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) load2(p[u][i][h], x[i][h] + 8 * s, in && v[i][h]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        mma_step(cg[i], p[u][i][0], p[u][i][1], bg[u]);
        if (GATED) mma_step(cu[i], p[u][i][0], p[u][i][1], bu[u]);
      }
  }
}

// One pass over rows m0 .. m0 + 16 MT - 1 of the block's expert: the k-split warps' partial
// sums meet in shared memory and the first warp of each column group adds them in k order
// (the same order every run) and stores. GATED: out = silu(gate) * up with gate and up rounded
// to bf16 first, as the eager composition of a bf16 FC1 output, F.silu and the product rounds
// them (kernels/moe_compute.cu, swiglu_rows); else out = the sum rounded to bf16.
template <bool GATED, int MT>
EP_DEVICE void expert_pass(const ExpertWarp& w, int m0, int col, int ks, int grp, __nv_bfloat16* out, int n_dim,
                           float (*part)[EXP_GROUPS][2][EXP_MAX_MT * 4][32]) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
  float cg[MT][4], cu[MT][4];
  partial_sums<GATED, MT>(w, m0, cg, cu);
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      part[ks][grp][0][4 * i + c][lane] = cg[i][c];
      if (GATED) part[ks][grp][1][4 * i + c][lane] = cu[i][c];
    }
  __syncthreads();
  if (ks == 0) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m0 + 16 * i + 8 * h + g;
        if (r >= w.end) continue;
        __nv_bfloat16 o[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 4 * i + 2 * h + c;
          float sg = part[0][grp][0][e][lane], su = 0.f;
#pragma unroll
          for (int k = 1; k < EXP_KSPLIT; ++k) sg += part[k][grp][0][e][lane];
          if (GATED) {
            su = part[0][grp][1][e][lane];
#pragma unroll
            for (int k = 1; k < EXP_KSPLIT; ++k) su += part[k][grp][1][e][lane];
            const float x = __bfloat162float(__float2bfloat16(sg));
            const __nv_bfloat16 sl = __float2bfloat16(x / (1.0f + expf(-x)));
            o[c] = __float2bfloat16(__bfloat162float(sl) * __bfloat162float(__float2bfloat16(su)));
          } else {
            o[c] = __float2bfloat16(sg);
          }
        }
        *reinterpret_cast<__nv_bfloat162*>(out + static_cast<long long>(r) * n_dim + col) = __halves2bfloat162(o[0], o[1]);
      }
  }
  __syncthreads();  // the partial sums are read before the next pass writes them
}

// out[p, n] for every row of the block's experts: block b covers column tile b % tiles of
// experts b / tiles, + groups, + 2 groups, ... The host sizes `groups` to about two blocks per
// SM: a grid of a block per expert and tile would queue thousands of blocks that only find an
// empty expert, each waiting for a slot (one block of this size per SM). An expert's rows are
// spread over its `tiles` blocks. w: [num_local, (2 if GATED) * N, K].
template <bool GATED>
EP_DEVICE void expert_gemm(const __nv_bfloat16* a, const int* a_rows, const __nv_bfloat16* w, __nv_bfloat16* out,
                           const int* offsets, int num_local, int groups, int k_dim, int n_dim) {
  __shared__ float part[EXP_KSPLIT][EXP_GROUPS][2][EXP_MAX_MT * 4][32];
  const int tiles = n_dim / EXP_TILE, tile = blockIdx.x % tiles;
  const int warp = threadIdx.x >> 5, grp = warp % EXP_GROUPS, ks = warp / EXP_GROUPS;
  const int n0 = tile * EXP_TILE + grp * 8, steps = k_dim / EXP_K, t2 = 2 * (threadIdx.x & 3);
  const long long per_expert = static_cast<long long>(GATED ? 2 : 1) * n_dim * k_dim;
  const __nv_bfloat16* w_tile = w + static_cast<long long>(n0 + ((threadIdx.x & 31) >> 2)) * k_dim;
  for (int e = blockIdx.x / tiles; e < num_local; e += groups) {
    const int begin = offsets[e], end = offsets[e + 1];
    if (begin >= end) continue;  // an expert without rows reads no weight
    const __nv_bfloat16* w_gate = w_tile + e * per_expert;
    const ExpertWarp ew{a, a_rows, reinterpret_cast<const uint4*>(w_gate) + t2,
                        reinterpret_cast<const uint4*>(w_gate + static_cast<long long>(n_dim) * k_dim) + t2,
                        k_dim, end, ks * steps / EXP_KSPLIT, (ks + 1) * steps / EXP_KSPLIT};
    for (int m0 = begin; m0 < end;) {  // the block agrees on each pass's width (the same rows left)
      const int left = end - m0;
      if (left > 32) {
        expert_pass<GATED, 4>(ew, m0, n0 + t2, ks, grp, out, n_dim, part);
        m0 += 64;
      } else if (left > 16) {
        expert_pass<GATED, 2>(ew, m0, n0 + t2, ks, grp, out, n_dim, part);
        m0 += 32;
      } else {
        expert_pass<GATED, 1>(ew, m0, n0 + t2, ks, grp, out, n_dim, part);
        m0 += 16;
      }
    }
  }
}

// moe_expert_fc1_bf16: grid groups * (I / EXP_TILE) blocks of EXP_WARPS warps; src [slots, K]
// (the dispatched hidden states), rows / offsets of the index, w_gate_up [num_local, 2 I, K],
// act [rows, I]. K a multiple of EXP_K, I of EXP_TILE, every pointer 16-byte aligned.
extern "C" __global__ void __launch_bounds__(EXP_WARPS * 32) moe_expert_fc1_bf16(
    const __nv_bfloat16* src, const int* rows, const int* offsets, const __nv_bfloat16* w_gate_up,
    __nv_bfloat16* act, int num_local, int groups, int k_dim, int inter) {
  expert_gemm<true>(src, rows, w_gate_up, act, offsets, num_local, groups, k_dim, inter);
}

// moe_expert_fc2_bf16: act [rows, I] in row order, w_down [num_local, hidden, I], out [rows,
// hidden]; grid groups * (hidden / EXP_TILE).
extern "C" __global__ void __launch_bounds__(EXP_WARPS * 32) moe_expert_fc2_bf16(
    const __nv_bfloat16* act, const int* offsets, const __nv_bfloat16* w_down, __nv_bfloat16* out, int num_local,
    int groups, int inter, int hidden) {
  expert_gemm<false>(act, nullptr, w_down, out, offsets, num_local, groups, inter, hidden);
}
