// Small kernels the library and its benchmark need besides the protocols.
#include "ptx.cuh"

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
