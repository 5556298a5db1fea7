// The benchmark's byte floors and phase timestamps (ep_a2a/tools/bench_floors.py).
//
// The floors move exactly the bytes a protocol phase moves, with no synchronization at all,
// so a phase's time beside its floor says what its protocol work costs over the memory
// traffic it cannot avoid:
//   ep_floor_scatter: dispatch's bytes. Each token's row is read once and written to each
//     of its k destinations (k = the distinct target ranks of its selection).
//   ep_floor_gather: combine's bytes. For each token, k partial rows are read and one row
//     is written (their XOR: the floor counts bytes, not the sum's arithmetic).
// Rows sit `stride` bytes apart (a multiple of 16); the destinations (scatter) or partials
// (gather) of token t are rows offsets[t] .. offsets[t+1] of their buffer. A row is moved
// as 16-byte vectors plus a byte tail, so the bytes moved are exactly row_bytes per row.
//
// ep_timestamp: one thread writes %globaltimer once the kernel before it in the stream has
// completed (griddep_wait under PDL; stream order without), so stamps launched between a
// captured graph's phases bracket each phase on its rank's stream.
#include "ptx.cuh"

namespace {

constexpr int SCATTER_UNROLL = 4;  // vectors each thread loads before its stores: loads in flight
constexpr int GATHER_CHUNK = 8;    // partial rows loaded before their XOR: loads in flight

EP_DEVICE uint4 xor4(uint4 a, uint4 b) { return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w); }

}  // namespace

// Every index fits 32 bits: the host refuses more than 2^31 items (tokens * vectors per row).
extern "C" __global__ void ep_floor_scatter(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                            const int* __restrict__ offsets, int tokens, int row_bytes,
                                            int src_stride, int dst_stride) {
  griddep_wait();
  griddep_launch_dependents();
  const unsigned nv = row_bytes / 16, tail = row_bytes % 16;
  const unsigned step = gridDim.x * blockDim.x, first = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned n = unsigned(tokens) * nv;
  for (unsigned base = first; base < n; base += step * SCATTER_UNROLL) {
    uint4 v[SCATTER_UNROLL];
#pragma unroll
    for (int u = 0; u < SCATTER_UNROLL; ++u) {
      const unsigned i = base + u * step;
      if (i < n) v[u] = *reinterpret_cast<const uint4*>(src + size_t(i / nv) * src_stride + (i % nv) * 16);
    }
#pragma unroll
    for (int u = 0; u < SCATTER_UNROLL; ++u) {
      const unsigned i = base + u * step;
      if (i >= n) break;
      const unsigned t = i / nv, j = i % nv;
      for (int r = offsets[t], end = offsets[t + 1]; r < end; ++r)
        *reinterpret_cast<uint4*>(dst + size_t(r) * dst_stride + j * 16) = v[u];
    }
  }
  for (unsigned i = first; i < unsigned(tokens) * tail; i += step) {
    const unsigned t = i / tail, b = nv * 16 + i % tail;
    const unsigned char c = src[size_t(t) * src_stride + b];
    for (int r = offsets[t], end = offsets[t + 1]; r < end; ++r) dst[size_t(r) * dst_stride + b] = c;
  }
}

// in_bytes of each partial row are read, out_bytes of the output row written (FP8 combine:
// fewer read than written); vector j of the output is the XOR of vector j of the partials
// (none past in_bytes: then the vector's index is written).
extern "C" __global__ void ep_floor_gather(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                           const int* __restrict__ offsets, int tokens, int in_bytes, int out_bytes,
                                           int src_stride, int dst_stride) {
  griddep_wait();
  griddep_launch_dependents();
  const unsigned in_nv = in_bytes / 16, out_nv = out_bytes / 16;
  const unsigned nv = in_nv > out_nv ? in_nv : out_nv;
  const unsigned step = gridDim.x * blockDim.x, first = blockIdx.x * blockDim.x + threadIdx.x;
  for (unsigned i = first; i < unsigned(tokens) * nv; i += step) {
    const unsigned t = i / nv, j = i % nv;
    uint4 acc = make_uint4(j, 0, 0, 0);
    if (j < in_nv) {
      for (int r0 = offsets[t], end = offsets[t + 1]; r0 < end; r0 += GATHER_CHUNK) {
        uint4 v[GATHER_CHUNK];
#pragma unroll
        for (int u = 0; u < GATHER_CHUNK; ++u)
          if (r0 + u < end) v[u] = *reinterpret_cast<const uint4*>(src + size_t(r0 + u) * src_stride + j * 16);
#pragma unroll
        for (int u = 0; u < GATHER_CHUNK; ++u)
          if (r0 + u < end) acc = xor4(acc, v[u]);
      }
    }
    if (j < out_nv) *reinterpret_cast<uint4*>(dst + size_t(t) * dst_stride + j * 16) = acc;
  }
  const unsigned in_tail = in_bytes % 16, out_tail = out_bytes % 16;
  const unsigned nt = in_tail > out_tail ? in_tail : out_tail;
  for (unsigned i = first; i < unsigned(tokens) * nt; i += step) {
    const unsigned t = i / nt, b = i % nt;
    unsigned char c = static_cast<unsigned char>(b);
    if (b < in_tail)
      for (int r = offsets[t], end = offsets[t + 1]; r < end; ++r) c ^= src[size_t(r) * src_stride + in_nv * 16 + b];
    if (b < out_tail) dst[size_t(t) * dst_stride + out_nv * 16 + b] = c;
  }
}

// Launched with one block of 32 threads. The dependents may launch at once: the next phase's
// kernel still waits (its own griddep_wait) for this one, which completes after the stamp.
// No early trigger: the kernel after a stamp starts once the stamp has completed. The
// benchmark launches stamps without PDL, so they never wait resident beside the protocol
// kernels, whose grids fill the GPU exactly (bench.py says why).
extern "C" __global__ void ep_timestamp(uint64_t* out) {
  griddep_wait();
  if (threadIdx.x == 0) *out = globaltimer_ns();
}
