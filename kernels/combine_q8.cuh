// FP8 combine (combine_quant, FENCE only): the quantization pass over the received slots
// and the dequantizing reduction; fence.cu's combine kernels call them, and the MoE
// epilogue (moe_compute.cu) quantizes with q8_quantize8 when it writes FP8 partials itself.
#pragma once
#include "moe_common.cuh"

// ---- FP8 combine (combine_quant): e4m3 partial results with one fp32 scale per 128 values.
// scale = amax / 448 (the largest finite e4m3) over the 128 values, q = e4m3(x * (448 / amax))
// rounded to nearest even and saturated (x * 448/amax may round just past 448); an all-zero
// block gets scale 1 and factor 1 (reference._q8_blocks states the edge cases too).
// Divisions, products and conversions are exactly rounded, so reference.py reproduces every
// byte. Dequantization is e4m3 -> fp32 (exact) times the scale. EP_Q8_BLOCK = 16 lanes x 8.
//
// The pass is bandwidth work on a grid capped at the rank's share of the GPU, so it is
// written for loads in flight: a half-warp owns one 128-value block, each lane 8 values
// (one 16-byte load for 2-byte types), and every lane issues the loads of Q8_UNROLL blocks
// before it converts any of them.
constexpr int Q8_LANES = EP_Q8_BLOCK / 8;  // lanes per 128-value block
constexpr int Q8_UNROLL = 4;
// quantize_partials pairs the two half-warps of a warp (half & 1): two blocks per warp
static_assert(Q8_LANES == 16, "a 128-value block is one half-warp of 8-value lanes");

template <typename T> struct Q8Load { static constexpr int N = sizeof(T) * 8 / 16; };  // 16-byte loads for 8 values

template <typename T>
EP_DEVICE void q8_load(const T* x, uint4 (&raw)[Q8Load<T>::N]) {
#pragma unroll
  for (int h = 0; h < Q8Load<T>::N; ++h) raw[h] = reinterpret_cast<const uint4*>(x)[h];
}

// 8 values of one lane, its half-warp's amax (all 32 lanes call it together), 8 e4m3 bytes out.
// Also the MoE epilogue's (moe_compute.cu: finalize into the FP8 combine input).
EP_DEVICE void q8_quantize8(const float (&v)[8], bool live, uint2* q, float* scale_out) {
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
#pragma unroll
  for (int o = Q8_LANES / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!live) return;
  // two divisions per block, one multiply per value (a division per value would make the
  // pass ALU-bound). amax == 0, or so small that amax / 448 underflows: scale and factor 1. amax
  // below ~1.3e-36: 448 / amax overflows, and x * inf would make NaN of the block's zeros,
  // so such a block divides by the scale instead (uniform over the half-warp).
  const float scale0 = __fdiv_rn(amax, 448.f);
  const bool zero = !(scale0 > 0.f);
  const float scale = zero ? 1.f : scale0;
  const float inv = zero ? 1.f : __fdiv_rn(448.f, amax);
  const bool divide = isinf(inv);
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int e = 0; e < 8; e += 2) {  // one cvt rounds two values (each to nearest even, saturated)
    const float2 y = divide ? make_float2(__fdiv_rn(v[e], scale), __fdiv_rn(v[e + 1], scale))
                            : make_float2(__fmul_rn(v[e], inv), __fmul_rn(v[e + 1], inv));
    w[e >> 2] |= unsigned(__nv_cvt_float2_to_fp8x2(y, __NV_SATFINITE, __NV_E4M3)) << (8 * (e & 3));
  }
  *q = make_uint2(w[0], w[1]);
  if ((threadIdx.x & (Q8_LANES - 1)) == 0) *scale_out = scale;
}

template <typename T>
EP_DEVICE void q8_quantize8(const uint4 (&raw)[Q8Load<T>::N], bool live, uint2* q, float* scale_out) {
  float v[8];
  const T* el = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = to_float<T>(el[e]);
  q8_quantize8(v, live, q, scale_out);
}

// The FP8 variant of reduce_vectors: thread unit v = Q8_UNIT values (one 8-byte load of
// e4m3 from each source, one scale: a unit never straddles a 128-block); same tree over
// groups of 8 sources, same fp32 order, absent members skipped (group_sum: the same bits).
// The 8 results leave in one 16-byte store (bf16, fp16) when `out` is 16-byte aligned
// (vec16: the host's combine_vec), element-wise otherwise.
// (8 values a unit, not 16: 16-byte loads from 8 sources need more than the 64 registers
// that keep 4 blocks of 256 threads on an SM.)
constexpr unsigned Q8_UNIT = 8;

// One group of M present members (q[0..M), their scales sc_ptr[0..M)) at unit v.
template <int M>
EP_DEVICE void add_group_q8(const char* const* q, const char* const* sc_ptr, unsigned v, float (&acc)[Q8_UNIT],
                            bool first) {
  uint2 raw[M > 0 ? M : 1];
  float sc[M > 0 ? M : 1];
#pragma unroll
  for (int k = 0; k < M; ++k) {  // all loads first
    raw[k] = __ldcg(reinterpret_cast<const uint2*>(q[k]) + v);
    sc[k] = __ldcg(reinterpret_cast<const float*>(sc_ptr[k]) + v * Q8_UNIT / EP_Q8_BLOCK);
  }
  // two values at a time: one cvt turns a source's 2 bytes into 2 halves (exact), so
  // 2 * M dequantized floats are live, not 8 * M
#pragma unroll
  for (int e = 0; e < Q8_UNIT; e += 2) {
    float lo[8], hi[8];
#pragma unroll
    for (int k = 0; k < M; ++k) {
      const unsigned w = e < 4 ? raw[k].x : raw[k].y;
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> (8 * (e & 3))), __NV_E4M3);
      lo[k] = __fmul_rn(__half2float(__ushort_as_half(h.x)), sc[k]);  // (bits, not a number)
      hi[k] = __fmul_rn(__half2float(__ushort_as_half(h.y)), sc[k]);
    }
    const auto pair = [&](const float* y, int j) { return 2 * j + 1 < M ? y[2 * j] + y[2 * j + 1] : y[2 * j]; };
    const float tl = group_sum<M>([&](int j) { return pair(lo, j); });
    const float th = group_sum<M>([&](int j) { return pair(hi, j); });
    acc[e] = first ? tl : acc[e] + tl;
    acc[e + 1] = first ? th : acc[e + 1] + th;
  }
}

template <typename T>
EP_DEVICE void reduce_q8(const char* const* q, const char* const* sc_ptr, int n, T* out, unsigned v0, unsigned v1,
                         bool vec16) {
  for (unsigned v = v0 + threadIdx.x; v < v1; v += blockDim.x) {
    float acc[Q8_UNIT];
    for (int c = 0; c < n || c == 0; c += 8)
      with_members(min(n - c, 8), [&](auto m) { add_group_q8<decltype(m)::value>(q + c, sc_ptr + c, v, acc, c == 0); });
    union { uint4 raw[Q8_UNIT * sizeof(T) / 16]; T el[Q8_UNIT]; } o;
#pragma unroll
    for (int e = 0; e < Q8_UNIT; ++e) o.el[e] = from_float<T>(acc[e]);
    if (vec16) {
#pragma unroll
      for (int h = 0; h < int(Q8_UNIT * sizeof(T) / 16); ++h) reinterpret_cast<uint4*>(out + Q8_UNIT * v)[h] = o.raw[h];
    } else {
#pragma unroll
      for (int e = 0; e < Q8_UNIT; ++e) out[Q8_UNIT * v + e] = o.el[e];
    }
  }
}

// combine_quant: quantize the partial results of every slot that holds a token into the
// combine_q section, where the sources pull them. Slots holding tokens are, for each active
// source r, the first C[s][r] of its region: the count our dispatch flag from r carries
// (dispatch acquired it in an earlier kernel of this stream; clamped to T^ like there). The
// blocks of those rows are spread over every half-warp of the grid, so no block idles on
// a short row list.
// Returns whether this block is the last to finish, which publishes (FinishedBlocks: its
// thread 0 acquired every other block's increment, and bar.sync orders that before the
// publishing lanes' fence, so a peer that acquires our flag sees every block's rows).
template <typename T>
EP_DEVICE bool quantize_partials(const A2AParams& p, char* ws, int tmax) {
  __shared__ unsigned s_rows[EP_MAX_RANKS + 1];  // prefix sums of the received slot counts
  if (threadIdx.x == 0) {
    const char* const flags = ws + p.off_dispatch_flags;
    unsigned acc = 0;
    for (int r = 0; r < p.ep_size; ++r) {
      s_rows[r] = acc;
      if (rank_active(p, r)) acc += min(dispatched_count(flags, r), static_cast<unsigned>(tmax));
    }
    s_rows[p.ep_size] = acc;
  }
  __syncthreads();
  const unsigned H = p.combine_bytes / sizeof(T), per_row = H / EP_Q8_BLOCK;
  const unsigned units = s_rows[p.ep_size] * per_row;  // 128-value blocks to quantize
  const T* const x = reinterpret_cast<const T*>(ws + p.off_combine);
  unsigned char* const q = reinterpret_cast<unsigned char*>(ws + p.off_combine_q);
  float* const scales = reinterpret_cast<float*>(ws + p.off_combine_scales);
  const unsigned lane = threadIdx.x & (Q8_LANES - 1);
  // half-warps of the grid; the loop is uniform over each full warp (the shuffles need it)
  const unsigned half = (blockIdx.x * blockDim.x + threadIdx.x) / Q8_LANES;
  const unsigned halves = gridDim.x * blockDim.x / Q8_LANES;
  const unsigned warp_base = half & ~1u;
  for (unsigned u0 = warp_base; u0 < units; u0 += Q8_UNROLL * halves) {
    uint4 raw[Q8_UNROLL][Q8Load<T>::N] = {};
    size_t at[Q8_UNROLL];  // value index of this lane's 8 values (slot * H + block * 128 + lane * 8)
#pragma unroll
    for (int k = 0; k < Q8_UNROLL; ++k) {
      const unsigned u = u0 + k * halves + (half & 1);
      at[k] = ~size_t(0);
      if (u < units) {
        const unsigned row = u / per_row;
        int r = 0;
        while (row >= s_rows[r + 1]) ++r;
        const size_t slot = static_cast<size_t>(r) * tmax + (row - s_rows[r]);
        at[k] = slot * H + (u - row * per_row) * EP_Q8_BLOCK + lane * 8;
        q8_load<T>(x + at[k], raw[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < Q8_UNROLL; ++k) {
      const bool live = at[k] != ~size_t(0);
      q8_quantize8<T>(raw[k], live, reinterpret_cast<uint2*>(q + (live ? at[k] : 0)),
                      scales + (live ? at[k] / EP_Q8_BLOCK : 0));
    }
  }
  const FinishedBlocks blocks(p);
  const bool last = blocks.elect_last();
  if (last && threadIdx.x == 0) blocks.acquire();
  return last;
}
