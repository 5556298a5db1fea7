// Small kernels the library and its benchmark need besides the protocols.
#include "ptx.cuh"
#include "generated/params.cuh"

// The latency floor: the same parameter block and launch shape as a protocol kernel, no work.
extern "C" __global__ void ep_empty(const __grid_constant__ A2AParams p) {
  griddep_wait();
  griddep_launch_dependents();
}

// Fill n 32-bit words with `value` (SENTINEL initialisation, poisoning in tests).
extern "C" __global__ void ep_fill_u32(unsigned* dst, unsigned long long n, unsigned value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = value;
}

// Flag ping-pong between two ranks (driver-layer tests of peer mappings): rank `me` waits
// for `flag_in` to reach i and writes i to `flag_out`, `rounds` times.
extern "C" __global__ void ep_pingpong(unsigned* flag_in, unsigned* flag_out, int rounds, int first) {
  if (threadIdx.x || blockIdx.x) return;
  for (int i = 1; i <= rounds; ++i) {
    if (!(first && i == 1)) while (static_cast<int>(ld_acquire_sys(flag_in) - (first ? i - 1 : i)) < 0) {}
    st_release_sys(flag_out, i);
  }
}

// The benchmark's barrier floor (in-process ranks on one GPU): one cross-rank flag round
// shaped like each protocol phase's: a release fence, our step to every rank's inbox, then
// acquire polls of every rank's flag in ours. flags: [ep][ep] words, row r = rank r's
// inbox; state: [ep + 1] words, our step counter at [rank], a failure word at [ep]. A poll
// that never sees its peer gives up after ~2^24 rounds and sets the failure word, which
// the host reads (a benchmark must not hang either).
extern "C" __global__ void ep_flag_round(unsigned* flags, unsigned* state, int ep, int rank) {
  griddep_wait();
  griddep_launch_dependents();
  if (blockIdx.x || threadIdx.x >= 32) return;
  const unsigned step = ld_volatile(state + rank) + 1;
  fence_release_sys();
  for (int r = threadIdx.x; r < ep; r += 32) st_relaxed_sys(flags + r * ep + rank, step);
  for (int r = threadIdx.x; r < ep; r += 32) {
    unsigned polls = 0;
    while (static_cast<int>(ld_acquire_sys(flags + rank * ep + r) - step) < 0)
      if (++polls == (1u << 24)) { atomicExch(state + ep, 1u); break; }
  }
  __syncwarp();
  if (threadIdx.x == 0) state[rank] = step;
}

// Compute of a controllable duration, the work an engine runs between the send and receive
// halves (the overlap tests and benchmark): every thread runs `iters` dependent FMAs. The
// store happens only for an impossible value, so the loop stays and no memory is touched.
extern "C" __global__ void ep_busy(float* sink, unsigned iters) {
  float y = 1.0f;
  const float x = threadIdx.x * 1e-3f;
  for (unsigned i = 0; i < iters; ++i) y = fmaf(y, 0.999999f, x);
  if (y == -1.0f) sink[0] = y;
}

// A device-to-device copy of n bytes as a kernel: the jitted calls' copies between our
// buffers and XLA's, which the FFI handler issues faster as a kernel launch than as
// cuMemcpyDtoDAsync. 16-byte vectors where both ends and n allow them.
extern "C" __global__ void ep_copy_bytes(unsigned char* dst, const unsigned char* src, unsigned long long n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x, first = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (((reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src) | n) & 15) == 0) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (size_t i = first; i < n / 16; i += stride) d[i] = s[i];
  } else {
    for (size_t i = first; i < n; i += stride) dst[i] = src[i];
  }
}
