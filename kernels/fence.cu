// NVLinkOneSided, FENCE protocol (paper §4.1, Algorithm 1).
//
// One thread block per token (grid-stride over tokens: grids are capped so that the
// kernels of every rank sharing a GPU are co-resident, since they spin on each other).
#include "moe_common.cuh"

namespace {
EP_DEVICE char* workspace(const A2AParams& p, int r) { return reinterpret_cast<char*>(p.peer_base[r]); }
}
#include "combine_q8.cuh"

// Launch bounds (512, 2): at most 64 registers, so 4 blocks of 256 threads fit on an SM (the
// host sizes grids by the occupancy of every protocol kernel). Without a minimum, ptxas
// squeezed some kernels to 40 registers with spills to fit 3 blocks of 512.
extern "C" __global__ void __launch_bounds__(512, 2) fence_dispatch(const __grid_constant__ A2AParams p) {
  __shared__ int s_target[EP_MAX_TOP_K];
  __shared__ int s_slot[EP_MAX_TOP_K];
  __shared__ int s_ntargets;
  __shared__ int s_last;
  __shared__ unsigned s_count[EP_MAX_RANKS];  // C[s][r]: slots source r filled in our region
  __shared__ unsigned s_sent[EP_MAX_RANKS];   // one-block grids: slots we took on each target

  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank;
  char* const ws = workspace(p, s);
  unsigned* const cnt = reinterpret_cast<unsigned*>(ws + p.off_counters);
  unsigned* const done = reinterpret_cast<unsigned*>(ws + p.off_done);
  int* const records = reinterpret_cast<int*>(ws + p.off_records);

  // A grid of one block (small batches) keeps its slot counters in shared memory and skips
  // the last-block election: the global counter atomics and the election's two dependent
  // gpu-scope round trips sat on the 1-token critical path, and one block's bar.sync alone
  // orders every thread's pushes before the publishing lanes' fence.
  // (Warp 0 alone takes the slots and publishes the counts: it zeroes them itself.)
  const bool single = gridDim.x == 1;
  if (single && threadIdx.x < 32) {
    for (int r = threadIdx.x; r < p.ep_size; r += 32) s_sent[r] = 0;
    __syncwarp();
  }

  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const unsigned step = *reinterpret_cast<volatile unsigned*>(ws + p.off_epoch) + 1;
  // After a SENTINEL step (protocol="auto"), every target must have finished that step's
  // combine before we write into its dispatch workspace (see the end of sentinel_combine).
  // After a FENCE step our own combine already waited for every rank's flag.
  if (p.wait_prev_combine) {
    wait_steps(p, p.off_combine_flags, step - 1, 1);
    __syncthreads();
  }

  // Algorithm 1, lines 2-6: pick a slot on every distinct target rank, push the token.
  for (int i = blockIdx.x; i < p.local_num_tokens; i += gridDim.x) {
    if (threadIdx.x < 32) {
      const Selection sel = select_targets(p, reinterpret_cast<const int*>(p.payloads[0].src) + i * p.top_k);
      const int lane = threadIdx.x;
      int rec = -1;
      if (sel.first) {
        const int slot = atomicAdd(single ? &s_sent[sel.target] : &cnt[sel.target], 1u);
        const int j = __popc(sel.firsts & ((1u << lane) - 1));
        s_target[j] = sel.target;
        s_slot[j] = slot;
        rec = pack_record(slot, sel.target);
      }
      if (lane < p.top_k) records[i * p.top_k + lane] = rec;
      if (lane == 0) s_ntargets = __popc(sel.firsts);
    }
    __syncthreads();
    const int nt = s_ntargets;
    for (int q = 0; q < p.num_payloads; ++q) {
      const PayloadDesc& d = p.payloads[q];
      const Targets tg{p.peer_base, s_target, s_slot, nt, static_cast<size_t>(s) * tmax, d.recv_offset};
      push_payload(d.vec, reinterpret_cast<const char*>(d.src) + static_cast<size_t>(i) * d.bytes_per_token,
                   tg, d.bytes_per_token);
    }
    __syncthreads();
  }

  // Lines 7-12: the last block to finish publishes for the whole rank.
  //
  // Why one system-scope fence by the last block covers every block's remote stores: each
  // block's stores are ordered before its release increment of `done` (bar.sync, then
  // atom.release by thread 0); the last block's acquire of `done` synchronizes with every
  // one of those releases, so all those stores precede, in causality order, the
  // fence.acq_rel.sys that each publishing lane executes next (cumulativity); a peer that
  // reads our flag with ld.acquire.sys therefore observes every token we pushed to it.
  __syncthreads();
  if (threadIdx.x == 0) s_last = single || atomic_add_acq_rel_gpu(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (s_last && threadIdx.x < 32) {
    if (!single) ld_acquire_gpu(done);  // every publishing lane acquires, not only thread 0
    for (int r = threadIdx.x; r < p.ep_size; r += 32)
      if (rank_active(p, r)) reinterpret_cast<unsigned*>(workspace(p, r) + p.off_tmax)[s] = p.step_tag;
    fence_release_sys();
    for (int r = threadIdx.x; r < p.ep_size; r += 32) {
      const unsigned c = single ? s_sent[r] : cnt[r];
      if (!single) cnt[r] = 0;
      if (rank_active(p, r))
        st_relaxed_sys(reinterpret_cast<uint64_t*>(workspace(p, r) + p.off_dispatch_flags) + s,
                       (static_cast<uint64_t>(step) << 32) | c);
    }
    if (threadIdx.x == 0) {
      if (!single) *done = 0;
      *reinterpret_cast<unsigned*>(ws + p.off_epoch) = step;  // every block read it already
    }
  }

  // Line 11, in every block (the sanitize below is spread over the grid): wait for the
  // flags of all active source ranks; each carries that source's slot count for our region
  // (an inactive rank sent nothing: count 0). After a failed wait (abort mode) the count is
  // the previous step's, bounded by max_tokens_per_rank like every count.
  for (int r = threadIdx.x; r < p.ep_size; r += blockDim.x) {
    s_count[r] = 0;
    if (!rank_active(p, r)) continue;
    const uint64_t* f = reinterpret_cast<const uint64_t*>(ws + p.off_dispatch_flags) + r;
    Deadline dl;
    uint64_t v;
    while (static_cast<int>(static_cast<unsigned>((v = ld_acquire_sys(f)) >> 32) - step) < 0)
      if (dl.give_up(p, 1, r, step, unsigned(v >> 32), step)) break;
    s_count[r] = min(static_cast<unsigned>(v), static_cast<unsigned>(tmax));
    const unsigned peer_tag = reinterpret_cast<const unsigned*>(ws + p.off_tmax)[r];
    if (peer_tag != p.step_tag) report_failure(p, EP_ERR_TMAX_MISMATCH, 1, r, step, peer_tag, p.step_tag);
  }
  __syncthreads();
  // With large grids the next kernel may launch only now: its blocks then wait on work that
  // finishes unconditionally, so they never crowd out a peer's kernel we are waiting for.
  // Small grids (the host sets trigger_early when two kernels of every rank fit on the GPU
  // together) trigger at the start instead, hiding the next launch entirely.
  if (!p.trigger_early) griddep_launch_dependents();

  // Lines 13-15: slots past each source's count get invalid expert ids.
  int* const ids = reinterpret_cast<int*>(ws + p.payloads[0].recv_offset);
  const size_t region = static_cast<size_t>(tmax) * p.top_k;
  const size_t total = region * p.ep_size;
  for (size_t x = blockIdx.x * blockDim.x + threadIdx.x; x < total; x += gridDim.x * blockDim.x) {
    const int r = static_cast<int>(x / region);
    if (x - r * region >= static_cast<size_t>(s_count[r]) * p.top_k) ids[x] = -1;
  }
}

// Lines 16-23. T: the element type of the partial results (bf16, fp16, fp32); Q8: pull
// FP8 copies of them (combine_quant; its own kernels, so the plain path keeps its registers).
template <typename T, bool Q8>
__device__ void fence_combine(const A2AParams& p) {
  __shared__ const char* s_src[EP_MAX_TOP_K];
  __shared__ const char* s_scale[EP_MAX_TOP_K];
  __shared__ int s_n;
  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank;
  char* const ws = workspace(p, s);
  const int* const records = reinterpret_cast<const int*>(ws + p.off_records);

  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const unsigned step = *reinterpret_cast<volatile unsigned*>(ws + p.off_epoch);

  // Who publishes: block 0 at once (our partial results were written by earlier kernels of
  // this stream: MoE compute or the staging copy; FP8 ones by the MoE epilogue when
  // combine_prequantized), or, quantizing here, the last block.
  bool publish = blockIdx.x == 0;
  const bool quantize = Q8 && !p.combine_prequantized;
  if constexpr (Q8)
    if (quantize) quantize_partials<T>(p, ws, tmax, publish);
  if (publish && threadIdx.x < 32) {
    // the release fence makes the partial results visible to peers before our flag is
    fence_release_sys();
    for (int r = threadIdx.x; r < p.ep_size; r += 32)
      if (rank_active(p, r)) st_relaxed_sys(reinterpret_cast<unsigned*>(workspace(p, r) + p.off_combine_flags) + s, step);
    if (quantize && threadIdx.x == 0) *reinterpret_cast<unsigned*>(ws + p.off_done) = 0;
  }
  wait_steps(p, p.off_combine_flags, step, 2);
  __syncthreads();  // the pollers' acquires order the whole block's pulls (bar.sync is cumulative)
  if (!p.trigger_early) griddep_launch_dependents();

  // Work item w: token w / splits, slice w % splits of its vectors (small batches spread a
  // token over several blocks so each thread issues one round of loads).
  const int splits = p.combine_splits;
  const unsigned H = p.combine_bytes / sizeof(T);
  const unsigned nvec = Q8 ? H / Q8_UNIT : p.combine_bytes / p.combine_vec;
  for (int w = blockIdx.x; w < p.local_num_tokens * splits; w += gridDim.x) {
    const int i = w / splits, part = w % splits;
    const unsigned v0 = nvec * part / splits, v1 = nvec * (part + 1) / splits;
    char* const out = reinterpret_cast<char*>(p.combine_out) + static_cast<size_t>(i) * p.combine_bytes;
    if constexpr (Q8) {
      collect_sources(records, p.top_k, i, [&](int t, int slot) -> const char* {
        return workspace(p, t) + p.off_combine_q + (static_cast<size_t>(s) * tmax + slot) * H;
      }, s_src, nullptr, &s_n);
      collect_sources(records, p.top_k, i, [&](int t, int slot) -> const char* {
        return workspace(p, t) + p.off_combine_scales + (static_cast<size_t>(s) * tmax + slot) * (H / EP_Q8_BLOCK) * 4;
      }, s_scale, nullptr, &s_n);
      __syncthreads();
      reduce_q8<T>(s_src, s_scale, s_n, reinterpret_cast<T*>(out), v0, v1, p.combine_vec == 16);
    } else {
      collect_sources(records, p.top_k, i, [&](int t, int slot) -> const char* {
        return workspace(p, t) + p.off_combine + (static_cast<size_t>(s) * tmax + slot) * p.combine_bytes;
      }, s_src, nullptr, &s_n);
      __syncthreads();
      reduce_token<T>(p.combine_vec, s_src, s_n, out, v0, v1);
    }
    __syncthreads();
  }
}

// 512, 2: as fence_dispatch (the FP8 ones too: their reduction holds 8-byte loads for that).
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_bf16(const __grid_constant__ A2AParams p) { fence_combine<__nv_bfloat16, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_f16(const __grid_constant__ A2AParams p) { fence_combine<__half, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_f32(const __grid_constant__ A2AParams p) { fence_combine<float, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_bf16(const __grid_constant__ A2AParams p) { fence_combine<__nv_bfloat16, true>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_f16(const __grid_constant__ A2AParams p) { fence_combine<__half, true>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_f32(const __grid_constant__ A2AParams p) { fence_combine<float, true>(p); }
