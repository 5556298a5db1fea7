// The experts' GEMMs at decode sizes, on the expert-major rows of the index
// (kernels/moe_compute.cu): FC1 reads each row where dispatch delivered it (rows[p], the
// slot of permuted row p: no gather) and applies the gated SiLU before it stores, FC2 reads
// the activations in row order. ep_a2a/moe_experts.py (expert_fc1, expert_fc2) drives them.
//
// Why not a library GEMM: at a few rows per expert the GEMMs only stream weights, and a
// grouped GEMM that tiles 64-128 rows per block keeps most SMs idle while it does. Here a
// warp owns 8 output columns (one mma n8 tile) of up to 16 rows (64 in the _m64 kernels) over
// its share of k (KS warps split k and add their sums in shared memory, in k order), so the
// blocks of one expert cover its weights in 8-column slices and every SM streams. Experts
// without rows read nothing (the offsets are read on the device, so a captured graph adapts
// per step). Rows past a pass (16, or 64 in the _m64 kernels) run further passes that read
// the weights again (from L2 only where they meet there): the layer uses these kernels while
// few passes cover an expert; the wide kernels (below) take experts that may get more than 128
// rows (moe_experts.py: _expert_kernel, FUSED_MAX_ROWS).
//
// The k order inside a 64-wide step is permuted so that each lane loads 16 contiguous
// elements (two 16-byte loads) of its weight row and of its two A rows: for mma j (0..3) of
// the step, the fragment's k = 2t, 2t + 1 (resp. 2t + 8, 2t + 9) of lane t hold elements
// 16t + 4j + 0, 1 (resp. 2, 3). A and B use the same map, so the sum over k is unchanged.
#include "moe_common.cuh"

constexpr int EXP_WARPS = 4;  // warps per block: 4 / KS column groups of 8 (one mma n8 tile) each
constexpr int EXP_K = 64;     // k per step (moe.py: EXPERT_K divides K)
constexpr int EXP_U = 4;      // steps whose loads are in flight together (16-row kernels)

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

// A row r's first 16-byte vector (an index row of a gathering FC1 is read at its slot
// a_rows[r]), and this lane's (16 elements per step).
EP_DEVICE const uint4* row_start(const __nv_bfloat16* a, const int* a_rows, int r, int k_dim) {
  const long long row = a_rows ? a_rows[r] : r;
  return reinterpret_cast<const uint4*>(a + row * k_dim);
}
EP_DEVICE const uint4* a_row(const __nv_bfloat16* a, const int* a_rows, int r, int k_dim) {
  return row_start(a, a_rows, r, k_dim) + 2 * (threadIdx.x & 3);
}

// The warp's sums over steps [s_begin, s_end) for rows m0 + g (c[0], c[1]) and m0 + g + 8 (c[2],
// c[3]), columns 2t, 2t + 1 of its tile; rows past `end` are zeros. Every load of EXP_U steps
// is issued before their mma: weight bytes in flight are this kernel's speed (a step past the
// share loads zeros and adds nothing).
template <bool GATED>
EP_DEVICE void partial_sums(const __nv_bfloat16* a, const int* a_rows, const uint4* wg, const uint4* wu, int k_dim,
                            int m0, int end, int s_begin, int s_end, float (&cg)[4], float (&cu)[4]) {
  const int g = (threadIdx.x & 31) >> 2;
  const bool v0 = m0 + g < end, v1 = m0 + g + 8 < end;
  const uint4* x0 = a_row(a, a_rows, v0 ? m0 + g : m0, k_dim);
  const uint4* x1 = a_row(a, a_rows, v1 ? m0 + g + 8 : m0, k_dim);
#pragma unroll
  for (int c = 0; c < 4; ++c) cg[c] = cu[c] = 0.f;
  for (int s0 = s_begin; s0 < s_end; s0 += EXP_U) {
    uint4 bg[EXP_U][2], bu[EXP_U][2], p[EXP_U][2], q[EXP_U][2];
#pragma unroll
    for (int u = 0; u < EXP_U; ++u) {
      const int s = s0 + u;
      const bool in = s < s_end;
      load2(bg[u], wg + 8 * s, in);
      if (GATED) load2(bu[u], wu + 8 * s, in);
      load2(p[u], x0 + 8 * s, in && v0);
      load2(q[u], x1 + 8 * s, in && v1);
    }
#pragma unroll
    for (int u = 0; u < EXP_U; ++u) {
      mma_step(cg, p[u], q[u], bg[u]);
      if (GATED) mma_step(cu, p[u], q[u], bu[u]);
    }
  }
}

// The sums of MT m-tiles (rows m0 + 16 mt + g and + 8, as partial_sums' c[0..3] each) for the
// _m64 and wide kernels (blocks of THREADS), with the rows' steps staged through shared memory:
// a ring of STAGES steps holding every k share (48 KiB: 3 steps of both shares at 64 rows, or
// of 128 rows; fewer rows, more steps ahead), filled by the whole block with asynchronous copies
// and read by its warps there. Loaded by every warp
// from global memory, a pass's rows would outweigh its weights several times in L1 and L2
// traffic. A 16-byte chunk c of a staged row r sits at c ^ (r & 1), so that the 8 lanes of a
// 128-bit shared load (rows g and g + 1, chunks 2t or 2t + 1) meet no bank twice. The weights
// (wg and, GATED, wu: two weight rows whose tiles share every A fragment) stream into registers
// DB steps ahead. Ends with every copy landed and every warp past the ring.
constexpr int EXP_RING = 3 * 2 * 64 * 8;  // uint4s of the ring
template <bool GATED, int KS, int MT, int THREADS = EXP_WARPS * 32>
EP_DEVICE void staged_sums(const __nv_bfloat16* a, const int* a_rows, const uint4* wg, const uint4* wu, int k_dim,
                           int m0, int end, uint4* ring, float (&cg)[MT][4], float (&cu)[MT][4]) {
  constexpr int ROWS = 16 * MT, STAGE = KS * ROWS * 8, PER = STAGE / THREADS, J = PER / KS, WARPS = THREADS / 32;
  constexpr int STAGES = EXP_RING / STAGE < 8 ? EXP_RING / STAGE : 8, DB = KS * MT >= 8 ? 2 : 3;
  static_assert(STAGE % THREADS == 0 && PER % KS == 0 && STAGES >= 3, "a thread copies rows tid / 8 + THREADS / 8 j");
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int ks = KS == 1 ? 0 : (tid >> 5) / (WARPS / KS);  // (KS == 1: the wide kernels' registers)
  const int steps = k_dim / EXP_K, iters = (steps + KS - 1) / KS;
  const int s_begin = ks * steps / KS, s_end = (ks + 1) * steps / KS;
  // this thread's copies: chunk tid % 8 of rows tid / 8 + THREADS / 8 j (j < J) of each k share h
  const uint4* src[J];
  bool valid[J];
  int dst[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int r = tid / 8 + THREADS / 8 * j;
    valid[j] = m0 + r < end;
    src[j] = row_start(a, a_rows, valid[j] ? m0 + r : m0, k_dim) + (tid & 7);
    dst[j] = r * 8 + ((tid & 7) ^ (r & 1));
  }
  auto stage = [&](int i) {  // step i of both shares into slot i % STAGES
    if (i >= iters) return;
    uint4* slot = ring + (i % STAGES) * STAGE;
#pragma unroll
    for (int q = 0; q < PER; ++q) {
      const int h = q / J, j = q % J, s = h * steps / KS + i;
      cp_async_16(slot + h * ROWS * 8 + dst[j], src[j] + 8 * s, valid[j] && s < (h + 1) * steps / KS);
    }
  };
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) cg[mt][c] = cu[mt][c] = 0.f;
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    stage(i);
    cp_async_commit();
  }
  uint4 bg[DB][2], bu[DB][2];  // the weights of steps i .. i + DB - 1, at [i % DB]
#pragma unroll
  for (int d = 0; d < DB; ++d) {
    load2(bg[d], wg + 8 * (s_begin + d), s_begin + d < s_end);
    if (GATED) load2(bu[d], wu + 8 * (s_begin + d), s_begin + d < s_end);
  }
  for (int i0 = 0; i0 < iters; i0 += DB) {
#pragma unroll
    for (int d = 0; d < DB; ++d) {
      const int i = i0 + d, s = s_begin + i;
      if (i >= iters) break;              // (the block's: every warp leaves here)
      cp_async_wait<STAGES - 2>();        // this thread's copies of step i landed
      __syncthreads();                    // everyone's, and every warp is past step i - 1's slot
      stage(i + STAGES - 1);              // (into step i - 1's slot)
      cp_async_commit();
      if (s < s_end) {
        const uint4* rows = ring + (i % STAGES) * STAGE + ks * ROWS * 8;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (mt > 0 && m0 + 16 * mt >= end) break;  // (warp-uniform: an m-tile without rows adds nothing)
          const int r = 16 * mt + g, x = r & 1;  // (rows r and r + 8 share a parity)
          const uint4 p[2] = {rows[r * 8 + ((2 * t) ^ x)], rows[r * 8 + ((2 * t + 1) ^ x)]};
          const uint4 q[2] = {rows[(r + 8) * 8 + ((2 * t) ^ x)], rows[(r + 8) * 8 + ((2 * t + 1) ^ x)]};
          mma_step(cg[mt], p, q, bg[d]);
          if (GATED) mma_step(cu[mt], p, q, bu[d]);
        }
      }
      load2(bg[d], wg + 8 * (s + DB), s + DB < s_end);
      if (GATED) load2(bu[d], wu + 8 * (s + DB), s + DB < s_end);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
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
                           __nv_bfloat16* out, uint4* smem, int k_dim, int n_dim, int n0, int m0, int end,
                           int s_begin, int s_end) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp % GROUPS, ks = warp / GROUPS;
  const int t2 = 2 * (lane & 3), g = lane >> 2;
  float cg[MT][4], cu[MT][4];
  if constexpr (MAX_MT == 1)
    partial_sums<GATED>(a, a_rows, wg, wu, k_dim, m0, end, s_begin, s_end, cg[0], cu[0]);
  else
    staged_sums<GATED, KS, MT>(a, a_rows, wg, wu, k_dim, m0, end, smem, cg, cu);
  // (the table of the k shares' sums lies over the ring: staged_sums ends past it)
  auto& part = *reinterpret_cast<float(*)[KS][GROUPS][2][MAX_MT][4][32]>(smem);
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

// FC2 with finalize (moe_compute.cu's, into the combine input), run per column tile by the
// tile's last block to finish: no second launch, and no kernel waiting for FC2's slowest block
// before it can start. out[s, the tile's columns] = sum over k ascending, row = row_of[s, k] >=
// 0, of row_weight[row] * fc2[row] in fp32, each product and sum rounded apart: finalize_slots'
// sums, so its bits. The tile's blocks count themselves in done[tile] after their stores; the
// last to count reads every block's rows (through L2: this kernel wrote them), 16 columns of a
// slot per thread, the rows of FIN_K selections loaded together (load_selections). FinalizeArgs:
// generated/params.cuh (ep_a2a/layout.py); `last`: a word of the block's shared memory no warp
// reads any more.
template <int TILE>
EP_DEVICE void finalize_tile(const FinalizeArgs& f, const __nv_bfloat16* fc2, int n_dim, int tile, int groups,
                             int& last) {
  static_assert(TILE % 16 == 0, "a thread's piece of a slot row is 16 columns: two 16-byte vectors");
  constexpr int PIECES = TILE / 16;
  using Row = union { uint4 raw[2]; __nv_bfloat16 el[16]; };
  __syncthreads();  // every warp of the block stored its rows (and read its table of sums)
  if (threadIdx.x == 0) {
    __threadfence();  // (the block's stores, before its count)
    last = atomicAdd(f.done + tile, 1) == groups - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // (the others' counts, before their rows are read)
  for (int item = threadIdx.x; item < f.slots * PIECES; item += blockDim.x) {
    const int s = item / PIECES, c0 = tile * TILE + 16 * (item % PIECES);
    const int* sel = f.row_of + static_cast<long long>(s) * f.top_k;
    float acc[16];
#pragma unroll
    for (int c = 0; c < 16; ++c) acc[c] = 0.f;
    for (int k0 = 0; k0 < f.top_k; k0 += FIN_K) {
      int row[FIN_K];
      float w[FIN_K];
      Row x[FIN_K];
      load_selections(sel, k0, f.top_k, row);
#pragma unroll
      for (int j = 0; j < FIN_K; ++j) {
        if (row[j] < 0) continue;
        const uint4* at = reinterpret_cast<const uint4*>(fc2 + static_cast<long long>(row[j]) * n_dim + c0);
        w[j] = f.row_weight[row[j]];
        x[j].raw[0] = __ldcg(at);
        x[j].raw[1] = __ldcg(at + 1);
      }
#pragma unroll
      for (int j = 0; j < FIN_K; ++j) {
        if (row[j] < 0) continue;
#pragma unroll
        for (int c = 0; c < 16; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(w[j], __bfloat162float(x[j].el[c])));
      }
    }
    Row o;
#pragma unroll
    for (int c = 0; c < 16; ++c) o.el[c] = __float2bfloat16(acc[c]);
    uint4* y = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(f.out) + static_cast<long long>(s) * n_dim + c0);
    y[0] = o.raw[0];
    y[1] = o.raw[1];
  }
  if (threadIdx.x == 0) f.done[tile] = 0;
}

// f(e, m0, m_end) for each unit of block group `group`: an expert's rows cut into units of up to
// UNIT rows (a pass each), numbered over the experts in order, units group, + groups, + 2 groups,
// ... (u and e are the block's: every warp takes the same pass). An expert without rows has no
// unit: its weights are not read.
template <int UNIT, typename F>
EP_DEVICE void for_each_unit(const int* offsets, int num_local, int groups, int group, const F& f) {
  int first = 0;  // units of the experts before e
  for (int e = 0; e < num_local; ++e) {
    const int begin = offsets[e], end = offsets[e + 1], units = (end - begin + UNIT - 1) / UNIT;
    int u = first + ((group - first) % groups + groups) % groups;  // this block's first unit >= first
    first += units;
    for (; u < first; u += groups) {
      const int m0 = begin + (u - (first - units)) * UNIT;
      f(e, m0, min(end, m0 + UNIT));
    }
  }
}

// out[p, n] for every row: an expert's rows split into units of up to 16 MAX_MT rows (a pass
// each), numbered over the experts in order; block b covers column tile b % tiles of units
// b / tiles, + groups, + 2 groups, ... (the host sizes `groups` to a few blocks per SM: a block
// per unit and tile would mostly launch blocks without a unit). So an expert's passes run on
// several blocks at once, which share its weights' reads in L2 where they meet there. A unit
// of the _m64 kernels takes 16, 32 or 64 rows per pass by its row count. w: [num_local, (2
// if GATED) * N, K]. KS warps split each column group's k steps.
template <bool GATED, int KS, int MAX_MT>
EP_DEVICE void expert_gemm(const __nv_bfloat16* a, const int* a_rows, const __nv_bfloat16* w, __nv_bfloat16* out,
                           const int* offsets, int num_local, int groups, int k_dim, int n_dim,
                           const FinalizeArgs* fin = nullptr) {
  constexpr int GROUPS = EXP_WARPS / KS, TILE = 8 * GROUPS, UNIT = 16 * MAX_MT;
  constexpr int RING = MAX_MT > 1 ? EXP_RING : 0, PART = KS * GROUPS * 2 * MAX_MT * 4 * 32 / 4;
  __shared__ uint4 smem[RING > PART ? RING : PART];  // (uint4s: the ring of staged rows, or the table of sums)
  const int tiles = n_dim / TILE, tile = blockIdx.x % tiles, group = blockIdx.x / tiles;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp % GROUPS, ks = warp / GROUPS;
  const int n0 = tile * TILE + grp * 8, steps = k_dim / EXP_K, t2 = 2 * (lane & 3), g = lane >> 2;
  const int s_begin = ks * steps / KS, s_end = (ks + 1) * steps / KS;
  const long long per_expert = static_cast<long long>(GATED ? 2 : 1) * n_dim * k_dim;
  const __nv_bfloat16* w_tile = w + static_cast<long long>(n0 + g) * k_dim;
  for_each_unit<UNIT>(offsets, num_local, groups, group, [&](int e, int m0, int m_end) {
    const __nv_bfloat16* w_gate = w_tile + e * per_expert;
    const uint4* wg = reinterpret_cast<const uint4*>(w_gate) + t2;
    const uint4* wu = reinterpret_cast<const uint4*>(w_gate + static_cast<long long>(n_dim) * k_dim) + t2;
    if constexpr (MAX_MT >= 4) {
      if (m_end - m0 > 32)
        return expert_pass<GATED, KS, GROUPS, MAX_MT, 4>(a, a_rows, wg, wu, out, smem, k_dim, n_dim, n0, m0, m_end,
                                                         s_begin, s_end);
    }
    if constexpr (MAX_MT >= 2) {
      if (m_end - m0 > 16)
        return expert_pass<GATED, KS, GROUPS, MAX_MT, 2>(a, a_rows, wg, wu, out, smem, k_dim, n_dim, n0, m0, m_end,
                                                         s_begin, s_end);
    }
    expert_pass<GATED, KS, GROUPS, MAX_MT, 1>(a, a_rows, wg, wu, out, smem, k_dim, n_dim, n0, m0, m_end, s_begin,
                                              s_end);
  });
  if (fin != nullptr && fin->out != nullptr)
    finalize_tile<TILE>(*fin, out, n_dim, tile, groups, *reinterpret_cast<int*>(smem));
}

// moe_expert_fc1_bf16: grid groups * (I / EXP_TILE) blocks of EXP_WARPS warps; src [slots, K]
// (the dispatched hidden states), rows / offsets of the index, w_gate_up [num_local, 2 I, K],
// act [rows, I]. K a multiple of EXP_K, I of EXP_TILE, every pointer 16-byte aligned.
// moe_expert_fc2_bf16: act [rows, I] in row order, w_down [num_local, hidden, I], out [rows,
// hidden]; grid groups * (hidden / EXP_TILE); with fin.out, also the finalize into it (fin.done:
// hidden / EXP_TILE counts, zero). Two warps split k (EXP_KS): each warp's serial
// chain of loads halves, which is what a lone expert with a long k waits on (docs/layer.md
// has the A/B against one warp). These take 16 rows per pass, loading them as the weights
// from global memory; the _m64 kernels (same arguments, same bits) up to 64, staging them in
// 48 KiB of shared memory per block, for experts that may hold more than 16 rows.
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
      int num_local, int groups, int inter, int hidden, FinalizeArgs fin) {                                       \
    expert_gemm<false, EXP_KS, MAX_MT>(act, nullptr, w_down, out, offsets, num_local, groups, inter, hidden, &fin); \
  }
EP_EXPERT_KERNELS(_bf16, 1)
EP_EXPERT_KERNELS(_m64_bf16, 4)

// The wide kernels, for experts of a hundred rows and more (the layer's steps of 32-64 tokens
// per rank at 8 ranks; the JAX layer's up to 128): the 16-column blocks above read a pass's rows
// from L2 once per 16 output columns, which at these sizes outweighs the weights several times
// over, and re-read an expert's weights every 64 rows. Here a block of WIDE_WARPS warps covers
// WIDE_COLS (FC1: 64 activation columns, whose gate and up rows it reads) or 2 WIDE_COLS (FC2)
// columns over the whole k range (no k split: these sizes have rows enough to keep every SM
// busy), in passes of up to 128 rows staged by staged_sums. Each warp holds two n8 tiles that
// share every A fragment (FC1: the gate's and the up's of 8 columns; FC2: 16 columns), so
// shared-memory reads per mma halve too. The k order is the one warp's step order (other bits
// than the k-split kernels', the same for every pass size).
constexpr int WIDE_WARPS = 8;
constexpr int WIDE_THREADS = 32 * WIDE_WARPS;
constexpr int WIDE_COLS = 8 * WIDE_WARPS;  // FC1's activation columns per block (FC2: twice)

// One pass: FC1 (GATED) stores silu(gate) * up of the warp's 8 columns at n0, FC2 the sums of
// its 16 columns at n0 (the tiles' order: n0, n0 + 8).
template <bool GATED, int MT>
EP_DEVICE void wide_pass(const __nv_bfloat16* a, const int* a_rows, const uint4* b0, const uint4* b1,
                         __nv_bfloat16* out, uint4* ring, int k_dim, int n_dim, int n0, int m0, int end) {
  float c0[MT][4], c1[MT][4];
  staged_sums<true, 1, MT, WIDE_THREADS>(a, a_rows, b0, b1, k_dim, m0, end, ring, c0, c1);  // (two rows, as gated)
  const int lane = threadIdx.x & 31, t2 = 2 * (lane & 3), g = lane >> 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + 16 * mt + 8 * h + g;
      if (r >= end) continue;
      __nv_bfloat16* y = out + static_cast<long long>(r) * n_dim + n0 + t2;
      if (GATED) {
        const __nv_bfloat16 lo = epilogue<true>(c0[mt][2 * h], c1[mt][2 * h]);
        const __nv_bfloat16 hi = epilogue<true>(c0[mt][2 * h + 1], c1[mt][2 * h + 1]);
        *reinterpret_cast<__nv_bfloat162*>(y) = __halves2bfloat162(lo, hi);
      } else {
        *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(c0[mt][2 * h], c0[mt][2 * h + 1]);
        *reinterpret_cast<__nv_bfloat162*>(y + 8) = __floats2bfloat162_rn(c1[mt][2 * h], c1[mt][2 * h + 1]);
      }
    }
}

// out[p, n] for every row, as expert_gemm but with the wide blocks: block b covers column tile
// b % tiles (COLS columns) of units (up to 128 rows of one expert) b / tiles, + groups, ...
template <bool GATED>
EP_DEVICE void wide_gemm(const __nv_bfloat16* a, const int* a_rows, const __nv_bfloat16* w, __nv_bfloat16* out,
                         const int* offsets, int num_local, int groups, int k_dim, int n_dim,
                         const FinalizeArgs* fin = nullptr) {
  constexpr int COLS = GATED ? WIDE_COLS : 2 * WIDE_COLS, UNIT = 128;
  __shared__ uint4 ring[EXP_RING];
  const int tiles = n_dim / COLS, tile = blockIdx.x % tiles, group = blockIdx.x / tiles;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t2 = 2 * (lane & 3);
  const int n0 = tile * COLS + warp * (COLS / WIDE_WARPS);
  const long long per_expert = static_cast<long long>(GATED ? 2 : 1) * n_dim * k_dim;
  // the warp's two weight rows: FC1 gate row n0 + g and up row n_dim + n0 + g; FC2 n0 + g, n0 + 8 + g
  const long long r0 = n0 + g, r1 = GATED ? n_dim + n0 + g : n0 + 8 + g;
  for_each_unit<UNIT>(offsets, num_local, groups, group, [&](int e, int m0, int m_end) {
    const __nv_bfloat16* we = w + e * per_expert;
    const uint4* b0 = reinterpret_cast<const uint4*>(we + r0 * k_dim) + t2;
    const uint4* b1 = reinterpret_cast<const uint4*>(we + r1 * k_dim) + t2;
    const int n = m_end - m0;
    if (n > 64)
      wide_pass<GATED, 8>(a, a_rows, b0, b1, out, ring, k_dim, n_dim, n0, m0, m_end);
    else if (n > 32)
      wide_pass<GATED, 4>(a, a_rows, b0, b1, out, ring, k_dim, n_dim, n0, m0, m_end);
    else
      wide_pass<GATED, 2>(a, a_rows, b0, b1, out, ring, k_dim, n_dim, n0, m0, m_end);
  });
  if (fin != nullptr && fin->out != nullptr)
    finalize_tile<COLS>(*fin, out, n_dim, tile, groups, *reinterpret_cast<int*>(ring));
}

// moe_expert_fc1_wide_bf16 / moe_expert_fc2_wide_bf16: the arguments of the kernels above; grid
// groups * (I / WIDE_COLS), resp. groups * (hidden / (2 WIDE_COLS)), blocks of WIDE_THREADS, two
// per SM (128 registers: more per thread, at one block per SM, made the layer slower).
extern "C" __global__ void __launch_bounds__(WIDE_THREADS, 2) moe_expert_fc1_wide_bf16(
    const __nv_bfloat16* src, const int* rows, const int* offsets, const __nv_bfloat16* w_gate_up,
    __nv_bfloat16* act, int num_local, int groups, int k_dim, int inter) {
  wide_gemm<true>(src, rows, w_gate_up, act, offsets, num_local, groups, k_dim, inter);
}
extern "C" __global__ void __launch_bounds__(WIDE_THREADS, 2) moe_expert_fc2_wide_bf16(
    const __nv_bfloat16* act, const int* offsets, const __nv_bfloat16* w_down, __nv_bfloat16* out, int num_local,
    int groups, int inter, int hidden, FinalizeArgs fin) {
  wide_gemm<false>(act, nullptr, w_down, out, offsets, num_local, groups, inter, hidden, &fin);
}
