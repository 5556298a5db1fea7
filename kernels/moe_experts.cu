// The experts' GEMMs at decode sizes, on the expert-major rows of the index
// (kernels/moe_compute.cu): FC1 reads each row where dispatch delivered it (rows[p], the
// slot of permuted row p: no gather) and applies the gated SiLU before it stores, FC2 reads
// the activations in row order. ep_a2a/moe.py (expert_fc1, expert_fc2) drives them.
//
// Why not a library GEMM: at a few rows per expert the GEMMs only stream weights, and a
// grouped GEMM that tiles 64-128 rows per block keeps most SMs idle while it does. Here a
// warp owns 8 output columns (one mma n8 tile) of up to 16 rows over its share of k (KS warps
// split k and add their sums in shared memory, in k order), so the blocks of one expert cover
// its weights in 8-column slices and every SM streams. Experts without rows read nothing (the
// offsets are read on the device, so a captured graph adapts per step). Rows past 16 per
// expert run further passes that read its weights again (from L2 only where they fit there):
// the layer uses these kernels while one pass covers an expert (moe.FUSED_MAX_ROWS).
//
// The k order inside a 64-wide step is permuted so that each lane loads 16 contiguous
// elements (two 16-byte loads) of its weight row and of its two A rows: for mma j (0..3) of
// the step, the fragment's k = 2t, 2t + 1 (resp. 2t + 8, 2t + 9) of lane t hold elements
// 16t + 4j + 0, 1 (resp. 2, 3). A and B use the same map, so the sum over k is unchanged.
#include "moe_common.cuh"

constexpr int EXP_WARPS = 4;  // warps per block: 4 / KS column groups of 8 (one mma n8 tile) each
constexpr int EXP_K = 64;     // k per step (moe.py: EXPERT_K divides K)
constexpr int EXP_U = 4;      // steps whose loads are in flight together in a pass of 16 rows

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

// This lane's first 16-byte vector of A row r (an index row of a gathering FC1 is read at its
// slot a_rows[r]).
EP_DEVICE const uint4* a_row(const __nv_bfloat16* a, const int* a_rows, int r, int k_dim) {
  const long long row = a_rows ? a_rows[r] : r;
  return reinterpret_cast<const uint4*>(a + row * k_dim) + 2 * (threadIdx.x & 3);
}

// The warp's sums over steps [s_begin, s_end) for MT m-tiles of 16 rows from m0: rows m0 +
// 16 mt + g (c[mt][0], c[mt][1]) and + 8 (c[mt][2], c[mt][3]), columns 2t, 2t + 1 of its tile;
// rows past `end` are zeros. Every load of U steps is issued before their mma: weight bytes in
// flight are this kernel's speed (a step past the share loads zeros and adds nothing). The
// A rows of a pass are read by every warp of the expert's tiles, mostly from L1 and L2.
template <bool GATED, int MT, int U>
EP_DEVICE void partial_sums(const __nv_bfloat16* a, const int* a_rows, const uint4* wg, const uint4* wu, int k_dim,
                            int m0, int end, int s_begin, int s_end, float (&cg)[MT][4], float (&cu)[MT][4]) {
  const int g = (threadIdx.x & 31) >> 2;
  bool v[MT][2];
  const uint4* x[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + 16 * mt + 8 * h + g;
      v[mt][h] = r < end;
      x[mt][h] = a_row(a, a_rows, v[mt][h] ? r : m0, k_dim);
    }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) cg[mt][c] = cu[mt][c] = 0.f;
  for (int s0 = s_begin; s0 < s_end; s0 += U) {
    uint4 bg[U][2], bu[U][2], p[U][MT][2], q[U][MT][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u;
      const bool in = s < s_end;
      load2(bg[u], wg + 8 * s, in);
      if (GATED) load2(bu[u], wu + 8 * s, in);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        load2(p[u][mt], x[mt][0] + 8 * s, in && v[mt][0]);
        load2(q[u][mt], x[mt][1] + 8 * s, in && v[mt][1]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt > 0 && m0 + 16 * mt >= end) break;  // (warp-uniform: an m-tile without rows adds nothing)
        mma_step(cg[mt], p[u][mt], q[u][mt], bg[u]);
        if (GATED) mma_step(cu[mt], p[u][mt], q[u][mt], bu[u]);
      }
  }
}

// GATED: silu(gate) * up with gate and up rounded to bf16 first, as the eager composition of a
// bf16 FC1 output, F.silu and the product rounds them (kernels/moe_compute.cu, swiglu_rows);
// else the sum rounded to bf16.
template <bool GATED>
EP_DEVICE __nv_bfloat16 epilogue(float sg, float su) {
  if (!GATED) return __float2bfloat16(sg);
  const float x = __bfloat162float(__float2bfloat16(sg));
  const __nv_bfloat16 sl = __float2bfloat16(x / (1.0f + expf(-x)));
  return __float2bfloat16(__bfloat162float(sl) * __bfloat162float(__float2bfloat16(su)));
}

// One pass over rows [m0, min(m0 + 16 MT, end)) of the warp's 8 columns: the KS warps of a
// column group meet in shared memory, where its first warp adds their sums in k order (the
// same order every run, and for every MT: a row's bits do not depend on the pass that held it)
// and stores.
template <bool GATED, int KS, int GROUPS, int MAX_MT, int MT>
EP_DEVICE void expert_pass(const __nv_bfloat16* a, const int* a_rows, const uint4* wg, const uint4* wu,
                           __nv_bfloat16* out, float (&part)[KS][GROUPS][2][MAX_MT][4][32], int k_dim, int n_dim,
                           int n0, int m0, int end, int s_begin, int s_end) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp % GROUPS, ks = warp / GROUPS;
  const int t2 = 2 * (lane & 3), g = lane >> 2;
  float cg[MT][4], cu[MT][4];
  partial_sums<GATED, MT, EXP_U / MT>(a, a_rows, wg, wu, k_dim, m0, end, s_begin, s_end, cg, cu);
  if (KS > 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        part[ks][grp][0][mt][c][lane] = cg[mt][c];
        if (GATED) part[ks][grp][1][mt][c][lane] = cu[mt][c];
      }
    __syncthreads();
    if (ks == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int k = 1; k < KS; ++k) {
            cg[mt][c] += part[k][grp][0][mt][c][lane];
            if (GATED) cu[mt][c] += part[k][grp][1][mt][c][lane];
          }
    }
    __syncthreads();  // every sum is read before the next pass writes the table
  }
  if (ks != 0) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + 16 * mt + 8 * h + g;
      if (r < end)
        *reinterpret_cast<__nv_bfloat162*>(out + static_cast<long long>(r) * n_dim + n0 + t2) = __halves2bfloat162(
            epilogue<GATED>(cg[mt][2 * h], cu[mt][2 * h]), epilogue<GATED>(cg[mt][2 * h + 1], cu[mt][2 * h + 1]));
    }
}

// out[p, n] for every row: an expert's rows split into units of up to 16 MAX_MT rows (a pass
// each), numbered over the experts in order; block b covers column tile b % tiles of units
// b / tiles, + groups, + 2 groups, ... (the host sizes `groups` to a few blocks per SM: a block
// per unit and tile would mostly launch blocks without a unit). So an expert's passes run on
// several blocks at once, which share its weights' reads in L2 where they meet there. A unit
// takes 16, 32 or 64 rows per pass by its row count; each m-tile of 16 rows holds 4 / MT
// steps fewer of loads in flight (the registers a pass holds stay alike). w: [num_local, (2
// if GATED) * N, K]. KS warps split each column group's k steps.
template <bool GATED, int KS, int MAX_MT>
EP_DEVICE void expert_gemm(const __nv_bfloat16* a, const int* a_rows, const __nv_bfloat16* w, __nv_bfloat16* out,
                           const int* offsets, int num_local, int groups, int k_dim, int n_dim) {
  constexpr int GROUPS = EXP_WARPS / KS, TILE = 8 * GROUPS, UNIT = 16 * MAX_MT;
  __shared__ float part[KS][GROUPS][2][MAX_MT][4][32];
  const int tiles = n_dim / TILE, tile = blockIdx.x % tiles, group = blockIdx.x / tiles;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp % GROUPS, ks = warp / GROUPS;
  const int n0 = tile * TILE + grp * 8, steps = k_dim / EXP_K, t2 = 2 * (lane & 3), g = lane >> 2;
  const int s_begin = ks * steps / KS, s_end = (ks + 1) * steps / KS;
  const long long per_expert = static_cast<long long>(GATED ? 2 : 1) * n_dim * k_dim;
  const __nv_bfloat16* w_tile = w + static_cast<long long>(n0 + g) * k_dim;
  int first = 0;  // units of the experts before e
  for (int e = 0; e < num_local; ++e) {
    const int begin = offsets[e], end = offsets[e + 1], units = (end - begin + UNIT - 1) / UNIT;
    int u = first + ((group - first) % groups + groups) % groups;  // this block's first unit >= first
    first += units;
    if (u >= first) continue;  // (an expert without rows has no unit: its weights are not read)
    const __nv_bfloat16* w_gate = w_tile + e * per_expert;
    const uint4* wg = reinterpret_cast<const uint4*>(w_gate) + t2;
    const uint4* wu = reinterpret_cast<const uint4*>(w_gate + static_cast<long long>(n_dim) * k_dim) + t2;
    for (; u < first; u += groups) {  // (u and e are the block's: every warp takes the same pass)
      const int m0 = begin + (u - (first - units)) * UNIT, m_end = min(end, m0 + UNIT);
      if constexpr (MAX_MT >= 4) {
        if (m_end - m0 > 32) {
          expert_pass<GATED, KS, GROUPS, MAX_MT, 4>(a, a_rows, wg, wu, out, part, k_dim, n_dim, n0, m0, m_end,
                                                    s_begin, s_end);
          continue;
        }
      }
      if constexpr (MAX_MT >= 2) {
        if (m_end - m0 > 16) {
          expert_pass<GATED, KS, GROUPS, MAX_MT, 2>(a, a_rows, wg, wu, out, part, k_dim, n_dim, n0, m0, m_end,
                                                    s_begin, s_end);
          continue;
        }
      }
      expert_pass<GATED, KS, GROUPS, MAX_MT, 1>(a, a_rows, wg, wu, out, part, k_dim, n_dim, n0, m0, m_end,
                                                s_begin, s_end);
    }
  }
}

// moe_expert_fc1_bf16: grid groups * (I / EXP_TILE) blocks of EXP_WARPS warps; src [slots, K]
// (the dispatched hidden states), rows / offsets of the index, w_gate_up [num_local, 2 I, K],
// act [rows, I]. K a multiple of EXP_K, I of EXP_TILE, every pointer 16-byte aligned.
// moe_expert_fc2_bf16: act [rows, I] in row order, w_down [num_local, hidden, I], out [rows,
// hidden]; grid groups * (hidden / EXP_TILE). Two warps split k (EXP_KS): each warp's serial
// chain of loads halves, which is what a lone expert with a long k waits on (docs/layer.md
// has the A/B against one warp). These take 16 rows per pass; the _m64 kernels (same
// arguments, same bits) up to 64, for experts that may hold more than 16 rows: the passes of
// more rows hold more registers, which the 16-row kernels need not reserve.
constexpr int EXP_KS = 2;
constexpr int EXP_TILE = 8 * EXP_WARPS / EXP_KS;  // output columns per block (moe.py: EXPERT_TILE)
#define EP_EXPERT_KERNELS(SUFFIX, MAX_MT)                                                                            \
  extern "C" __global__ void __launch_bounds__(EXP_WARPS * 32) moe_expert_fc1##SUFFIX(                             \
      const __nv_bfloat16* src, const int* rows, const int* offsets, const __nv_bfloat16* w_gate_up,             \
      __nv_bfloat16* act, int num_local, int groups, int k_dim, int inter) {                                      \
    expert_gemm<true, EXP_KS, MAX_MT>(src, rows, w_gate_up, act, offsets, num_local, groups, k_dim, inter);     \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(EXP_WARPS * 32) moe_expert_fc2##SUFFIX(                             \
      const __nv_bfloat16* act, const int* offsets, const __nv_bfloat16* w_down, __nv_bfloat16* out,             \
      int num_local, int groups, int inter, int hidden) {                                                          \
    expert_gemm<false, EXP_KS, MAX_MT>(act, nullptr, w_down, out, offsets, num_local, groups, inter, hidden);   \
  }
EP_EXPERT_KERNELS(_bf16, 1)
EP_EXPERT_KERNELS(_m64_bf16, 4)
