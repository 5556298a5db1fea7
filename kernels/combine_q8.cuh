// FP8 combine (combine_quant, FENCE only): the quantization pass over the received slots
// and the dequantizing reduction. Included by fence.cu after its workspace() helper.
#pragma once
#include "moe_common.cuh"

// ---- FP8 combine (combine_quant): e4m3 partial results with one fp32 scale per 128 values.
// A warp quantizes one 128-value block: 4 values a lane, scale = amax / 448 (the largest
// finite e4m3), q = e4m3(x / scale) rounded to nearest even and saturated; an all-zero block
// gets scale 1. Division and conversion are exactly rounded, so reference.py reproduces
// every byte. Dequantization is e4m3 -> fp32 (exact) times the scale. EP_Q8_BLOCK: layout.py.
template <typename T>
EP_DEVICE void quantize_row_q8(const T* x, unsigned n, unsigned char* q, float* scales) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (unsigned b = warp; b < n / EP_Q8_BLOCK; b += warps) {
    float v[4];
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[e] = to_float<T>(x[b * EP_Q8_BLOCK + 4 * lane + e]);
      amax = fmaxf(amax, fabsf(v[e]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
    unsigned packed = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      packed |= unsigned(__nv_cvt_float_to_fp8(__fdiv_rn(v[e], scale), __NV_SATFINITE, __NV_E4M3)) << (8 * e);
    reinterpret_cast<unsigned*>(q + b * EP_Q8_BLOCK)[lane] = packed;
    if (lane == 0) scales[b] = scale;
  }
}

EP_DEVICE float q8_to_float(unsigned char b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
}

// The FP8 variant of reduce_vectors: thread unit v = 8 values (8 bytes of e4m3 from each
// source, one scale); same tree over groups of 8 sources, same fp32 order.
template <typename T>
EP_DEVICE void reduce_q8(const char* const* q, const char* const* sc_ptr, int n, T* out, unsigned v0, unsigned v1) {
  for (unsigned v = v0 + threadIdx.x; v < v1; v += blockDim.x) {
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int c = 0; c < n || c == 0; c += 8) {
      uint2 raw[8];
      float sc[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        raw[k] = make_uint2(0, 0);
        sc[k] = 0.f;
        if (c + k < n) {
          raw[k] = __ldcg(reinterpret_cast<const uint2*>(q[c + k]) + v);
          sc[k] = __ldcg(reinterpret_cast<const float*>(sc_ptr[c + k]) + v * 8 / EP_Q8_BLOCK);
        }
      }
      // one value at a time keeps 8 dequantized floats live, not 64
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float x[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const unsigned w = e < 4 ? raw[k].x : raw[k].y;
          x[k] = c + k < n ? __fmul_rn(q8_to_float(static_cast<unsigned char>(w >> (8 * (e & 3)))), sc[k]) : 0.f;
        }
        const float t = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
        acc[e] = (c == 0) ? t : acc[e] + t;
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) out[8 * v + e] = from_float<T>(acc[e]);
  }
}

// combine_quant: quantize the partial results of every slot that holds a token (FP8 e4m3 +
// per-128 scales, moe_common.cuh) into the combine_q section, where the sources pull them.
// The last block to finish publishes: its thread 0's acq_rel increment of `done` follows every
// other block's release increment; bar.sync then orders it before the publishing lanes'
// fence.acq_rel.sys, so a peer that acquires our flag sees every block's quantized rows.
template <typename T>
EP_DEVICE void quantize_partials(const A2AParams& p, char* ws, int tmax, bool& last) {
  __shared__ int s_last;
  const int* const ids = reinterpret_cast<const int*>(ws + p.payloads[0].recv_offset);
  const unsigned H = p.combine_bytes / sizeof(T);
  for (int w = blockIdx.x; w < p.ep_size * tmax; w += gridDim.x) {
    const int has = threadIdx.x < p.top_k && ids[static_cast<size_t>(w) * p.top_k + threadIdx.x] != -1;
    if (!__syncthreads_or(has)) continue;
    quantize_row_q8<T>(reinterpret_cast<const T*>(ws + p.off_combine) + static_cast<size_t>(w) * H, H,
                       reinterpret_cast<unsigned char*>(ws + p.off_combine_q) + static_cast<size_t>(w) * H,
                       reinterpret_cast<float*>(ws + p.off_combine_scales) + static_cast<size_t>(w) * (H / EP_Q8_BLOCK));
  }
  __syncthreads();
  unsigned* const done = reinterpret_cast<unsigned*>(ws + p.off_done);
  if (threadIdx.x == 0) s_last = atomic_add_acq_rel_gpu(done, 1u) == gridDim.x - 1;
  __syncthreads();
  last = s_last;
  if (last && threadIdx.x == 0) ld_acquire_gpu(done);
}

