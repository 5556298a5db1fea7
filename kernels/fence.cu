// NVLinkOneSided, FENCE protocol (paper §4.1, Algorithm 1).
//
// One thread block per token, or several per token at small batches (grid-stride over
// tokens: grids are capped so that the kernels of every rank sharing a GPU are co-resident,
// since they spin on each other).
// Names as in Algorithm 1: s this rank, f the step, D the target ranks of a token, cnt[t]
// the slot counters, done the finished blocks, C[r][s] and F[r][s] the slot count and flag
// source s leaves on rank r, Wd / Wc the dispatch and combine workspaces.
#include "combine_q8.cuh"

namespace {
// F[r][s] of dispatch carries C[r][s] too: f << 32 | C in one 64-bit word, so lines 8-10
// are one store per peer and line 11's acquire of the flag also delivers the count.
EP_DEVICE uint64_t dispatch_flag(unsigned f, unsigned count) { return (static_cast<uint64_t>(f) << 32) | count; }
EP_DEVICE unsigned flag_step(uint64_t v) { return static_cast<unsigned>(v >> 32); }
EP_DEVICE unsigned flag_count(uint64_t v) { return static_cast<unsigned>(v); }

// cnt[t], two ways. Small batches (T <= SLOT_TABLE_TOKENS) take no counters at all: every
// block reads all T tokens' expert ids (one round of loads, the same round trip as its own
// token's) and marks in shared memory which tokens reach which rank; the slot of token i on
// t is then the number of tokens before i that reach t, and C for t the number of all. So
// the slot atomic (a dependent gpu-scope round trip before each push) and the last block's
// reads of the counters go off the critical path, and the slots are the same in every
// block, which lets several blocks share one token's push (below). FENCE's slot order in a
// source region was never promised (the tests compare slots as sets); it is token order
// here. Larger batches count with atomics: in shared memory for a grid of one block (which
// also skips the last-block election: its bar.sync alone orders every thread's pushes
// before the publishing lanes' fence), else in the local section's counters.
constexpr int SLOT_TABLE_TOKENS = 128;  // (schedule.py DISPATCH_TABLE_TOKENS: splits only below it)
constexpr int TABLE_WORDS = SLOT_TABLE_TOKENS / 32;
struct Slots {
  unsigned* cnt;                  // the local section's counters (atomic path, several blocks), 0 between kernels
  unsigned* local;                // shared memory (atomic path, one-block grids)
  unsigned (*reach)[TABLE_WORDS]; // shared, [EP_MAX_RANKS]: bit i % 32 of word i / 32 is set when token i reaches t
  bool one_block, table;
  int tokens;                     // T
  int words;                      // table words in use: ceil(T / 32)
  EP_DEVICE Slots(const A2AParams& p, unsigned* s_cnt, unsigned (*s_reach)[TABLE_WORDS])
      : cnt(section<unsigned>(p, p.rank, p.off_counters)), local(s_cnt), reach(s_reach), one_block(gridDim.x == 1),
        table(p.local_num_tokens <= SLOT_TABLE_TOKENS), tokens(p.local_num_tokens), words((p.local_num_tokens + 31) / 32) {}
  // Blocks that share a token: all the grid has for it (the host sizes the grid for that,
  // schedule.py). Only on the table path, where every block takes the same slots.
  EP_DEVICE int splits() const { return table ? max(1, static_cast<int>(gridDim.x) / max(1, tokens)) : 1; }
  // Before griddep_wait (shared memory only): the barrier after it is off the critical path.
  EP_DEVICE void zero(const A2AParams& p) const {
    if (table) {
      for (int x = threadIdx.x; x < p.ep_size * TABLE_WORDS; x += blockDim.x) reach[x / TABLE_WORDS][x % TABLE_WORDS] = 0;
      __syncthreads();
    } else if (one_block && threadIdx.x < 32) {  // warp 0 alone takes these slots and publishes them
      for (int r = threadIdx.x; r < p.ep_size; r += 32) local[r] = 0;
      __syncwarp();
    }
  }
  // The table: the same rules as select_targets (invalid ids and inactive ranks reach nothing).
  EP_DEVICE void build(const A2AParams& p) const {
    if (!table) return;
    const int* ids = reinterpret_cast<const int*>(p.payloads[0].src);
    const int n = p.local_num_tokens * p.top_k;
    constexpr int B = 4;  // loads in flight per thread before the first use
    for (int x0 = threadIdx.x; x0 < n; x0 += B * blockDim.x) {
      int e[B];
#pragma unroll
      for (int u = 0; u < B; ++u) {
        const int x = x0 + u * blockDim.x;
        e[u] = x < n ? ids[x] : -1;
      }
#pragma unroll
      for (int u = 0; u < B; ++u) {
        const int t = (e[u] >= 0 && e[u] < p.num_experts) ? rank_of_expert(p, e[u]) : -1;
        if (t >= 0 && rank_active(p, t)) {
          const int i = (x0 + u * blockDim.x) / p.top_k;
          atomicOr(&reach[t][i >> 5], 1u << (i & 31));
        }
      }
    }
    __syncthreads();
  }
  // j_t: line 4 (by warp 0, once per target of token i).
  EP_DEVICE unsigned take(int t, int i) const {
    if (!table) return atomicAdd(one_block ? &local[t] : &cnt[t], 1u);
    unsigned c = __popc(reach[t][i >> 5] & ((1u << (i & 31)) - 1));
    for (int w = 0; w < (i >> 5); ++w) c += __popc(reach[t][w]);
    return c;
  }
  // C for target t, by the publishing lanes once elected, leaving cnt[t] at 0 for the next
  // step. (Volatile: read at L2, never from a line this SM's L1 may hold.)
  EP_DEVICE unsigned count_and_reset(int t) const {
    if (table) {
      unsigned c = 0;
      for (int w = 0; w < words; ++w) c += __popc(reach[t][w]);
      return c;
    }
    if (one_block) return local[t];
    const unsigned c = ld_volatile(&cnt[t]);
    cnt[t] = 0;
    return c;
  }
};

// Hints that bring item w's bytes of every payload (token w / splits, part w % splits) into
// L1 while the selection and the slots are worked out, or while the previous item's stores
// drain: the loads of the push then hit L1 instead of making a round trip each, one payload
// after the other. Only after griddep_wait: the inputs may come from the previous kernel.
EP_DEVICE void prefetch_item(const A2AParams& p, int w, int splits) {
  const int i = w / splits, part = w % splits;
  for (int q = 0; q < p.num_payloads; ++q) {
    const PayloadDesc& d = p.payloads[q];
    unsigned b0, b1;
    token_part(d.bytes_per_token, d.vec, part, splits, &b0, &b1);
    const char* src = reinterpret_cast<const char*>(d.src) + static_cast<size_t>(i) * d.bytes_per_token;
    const uintptr_t end = reinterpret_cast<uintptr_t>(src + b1);
    for (uintptr_t a = (reinterpret_cast<uintptr_t>(src + b0) & ~uintptr_t(127)) + 128 * threadIdx.x; a < end; a += 128 * blockDim.x)
      prefetch_l1(reinterpret_cast<const void*>(a));
  }
}

// Lines 2-6: pick a slot on every distinct target rank, push the token. Work item w: token
// w / splits, part w % splits of its bytes (small batches: the bytes leave from several SMs).
// Every block of a token selects its targets (the same ones, in the same order) and takes
// the same slots (the table); the first one records them and counts dropped selections.
EP_DEVICE void push_tokens(const A2AParams& p, const Slots& slots, int* records) {
  __shared__ int s_target[EP_MAX_TOP_K];  // D, in the order of first selection
  __shared__ int s_slot[EP_MAX_TOP_K];    // j_t
  __shared__ int s_ntargets;
  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank;
  const int splits = slots.splits(), items = p.local_num_tokens * splits;
  slots.build(p);
  for (int w = blockIdx.x; w < items; w += gridDim.x) {
    const int i = w / splits, part = w % splits;
    if (threadIdx.x < 32) {
      const Selection sel = select_targets(p, reinterpret_cast<const int*>(p.payloads[0].src) + i * p.top_k, part == 0);
      const int lane = threadIdx.x;
      int rec = -1;
      if (sel.first) {
        const int slot = slots.take(sel.target, i);
        const int j = __popc(sel.firsts & ((1u << lane) - 1));
        s_target[j] = sel.target;
        s_slot[j] = slot;
        rec = pack_record(slot, sel.target);
      }
      if (part == 0 && lane < p.top_k) records[i * p.top_k + lane] = rec;
      if (lane == 0) s_ntargets = __popc(sel.firsts);
    }
    __syncthreads();
    if (w + static_cast<int>(gridDim.x) < items) prefetch_item(p, w + gridDim.x, splits);
    const int nt = s_ntargets;
    for (int q = 0; q < p.num_payloads; ++q) {
      const PayloadDesc& d = p.payloads[q];
      const Targets tg{p.peer_base, s_target, s_slot, nt, static_cast<size_t>(s) * tmax, d.recv_offset};
      unsigned b0, b1;
      token_part(d.bytes_per_token, d.vec, part, splits, &b0, &b1);
      push_payload(d.vec, reinterpret_cast<const char*>(d.src) + static_cast<size_t>(i) * d.bytes_per_token,
                   tg, d.bytes_per_token, b0, b1);
    }
    __syncthreads();
  }
}

// Lines 7-10: the last block to finish publishes for the whole rank (FinishedBlocks says why
// its one fence covers every block's pushes): our step tag to every peer, then
// F[r][s] <- f << 32 | C[r][s]. It also moves the step counter, which every block has read.
// The publishing lanes do not acquire `done` again: elect_last's bar.sync orders them after
// thread 0's acquire (protocol.cuh). They read C before the fence (final once elected), so
// those reads overlap it instead of following it.
EP_DEVICE void publish_counts(const A2AParams& p, const Slots& slots, unsigned f) {
  const FinishedBlocks blocks(p);
  if (blocks.elect_last(slots.one_block) && threadIdx.x < 32) {
    constexpr int K = (EP_MAX_RANKS + 31) / 32;  // ranks per lane
    uint64_t flag[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int r = threadIdx.x + 32 * k;
      flag[k] = r < p.ep_size ? dispatch_flag(f, slots.count_and_reset(r)) : 0;
    }
    for (int r = threadIdx.x; r < p.ep_size; r += 32)
      if (rank_active(p, r)) section<unsigned>(p, r, p.off_tmax)[p.rank] = p.step_tag;
    fence_release_sys();  // (publish_flags' fence: it orders everything this lane wrote or observed)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int r = threadIdx.x + 32 * k;
      if (r < p.ep_size && rank_active(p, r)) st_relaxed_sys(section<uint64_t>(p, r, p.off_dispatch_flags) + p.rank, flag[k]);
    }
    if (threadIdx.x == 0) {
      if (!slots.one_block) blocks.reset();
      advance_epoch(p, f);
      // (every block read it before the election): the wait it asked for is done, so a
      // dispatch-only repeat of this kernel does not wait for a combine that never ran
      *last_combine_sentinel(p) = 0;
    }
  }
}

// Line 11, in every block (the sanitize is spread over the grid): wait for the flags of all
// active source ranks; C[s][r] into s_count (an inactive rank sent nothing: count 0, and so
// does a rank whose flag never came). Once any rank gave up (abort mode) every count is 0,
// so that every slot reads as empty.
EP_DEVICE void wait_counts(const A2AParams& p, unsigned f, unsigned* s_count) {
  const int s = p.rank;
  for (int r = threadIdx.x; r < p.ep_size; r += blockDim.x) {
    s_count[r] = 0;
    if (!rank_active(p, r)) continue;
    const uint64_t* F = section<const uint64_t>(p, s, p.off_dispatch_flags) + r;
    uint64_t v;
    const bool came = wait_until(p, EP_PHASE_DISPATCH, r, f, f, [&](unsigned& seen) {
      v = ld_acquire_sys(F);
      seen = flag_step(v);
      return static_cast<int>(seen - f) >= 0;
    });
    if (!came) continue;  // (abort mode) r's region holds nothing of this step: count 0
    s_count[r] = min(flag_count(v), static_cast<unsigned>(p.runtime_max_tokens_per_rank));
    check_step_tag(p, EP_PHASE_DISPATCH, r, f, section<const unsigned>(p, s, p.off_tmax)[r]);
  }
  if (block_sees_abort(p)) {  // poison: no slot holds a token (protocol.cuh)
    for (int r = threadIdx.x; r < p.ep_size; r += blockDim.x) s_count[r] = 0;
    __syncthreads();
  }
}

// Lines 13-15: slots past each source's count get invalid expert ids.
EP_DEVICE void sanitize_expert_ids(const A2AParams& p, const unsigned* s_count) {
  int* const ids = section<int>(p, p.rank, p.payloads[0].recv_offset);
  const size_t region = static_cast<size_t>(p.runtime_max_tokens_per_rank) * p.top_k;
  const size_t total = region * p.ep_size;
  for (size_t x = blockIdx.x * blockDim.x + threadIdx.x; x < total; x += gridDim.x * blockDim.x) {
    const int r = static_cast<int>(x / region);
    if (x - r * region >= static_cast<size_t>(s_count[r]) * p.top_k) ids[x] = -1;
  }
}
}  // namespace

// Launch bounds (512, 2): at most 64 registers, so 4 blocks of 256 threads fit on an SM (the
// host sizes grids by the occupancy of every protocol kernel). Without a minimum, ptxas
// squeezed some kernels to 40 registers with spills to fit 3 blocks of 512.
extern "C" __global__ void __launch_bounds__(512, 2) fence_dispatch(const __grid_constant__ A2AParams p) {
  __shared__ unsigned s_cnt[EP_MAX_RANKS];    // cnt[t] of one-block grids (atomic path)
  __shared__ unsigned s_reach[EP_MAX_RANKS][TABLE_WORDS];  // the slot table (small batches)
  __shared__ unsigned s_count[EP_MAX_RANKS];  // C[s][r]: slots source r filled in our region
  const Slots slots(p, s_cnt, s_reach);
  // Addresses from the parameters are taken before griddep_wait: they overlap the tail of
  // the previous kernel instead of following it.
  int* const records = section<int>(p, p.rank, p.off_records);
  slots.zero(p);

  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const int splits = slots.splits();
  if (static_cast<int>(blockIdx.x) < p.local_num_tokens * splits) prefetch_item(p, blockIdx.x, splits);
  const unsigned f = read_epoch(p) + 1;
  wait_sentinel_step_done(p, f);

  push_tokens(p, slots, records);  // lines 2-6
  publish_counts(p, slots, f);  // lines 7-10
  wait_counts(p, f, s_count); // line 11
  // With large grids the next kernel may launch only now: its blocks then wait on work that
  // finishes unconditionally, so they never crowd out a peer's kernel we are waiting for.
  // Small grids (the host sets trigger_early when two kernels of every rank fit on the GPU
  // together) trigger at the start instead, hiding the next launch entirely.
  if (!p.trigger_early) griddep_launch_dependents();
  sanitize_expert_ids(p, s_count);  // lines 13-15
}

namespace {
// Lines 17-19: F[r][s] <- f. Block 0 publishes at once (our partial results were written by
// earlier kernels of this stream: MoE compute or the staging copy; FP8 ones by the MoE
// epilogue when combine_prequantized), or, quantizing here, the last block.
template <typename T, bool Q8>
EP_DEVICE void publish_partials(const A2AParams& p, unsigned f) {
  bool publish = blockIdx.x == 0;
  const bool quantize = Q8 && !p.combine_prequantized;
  if constexpr (Q8)
    if (quantize) publish = quantize_partials<T>(p, workspace(p, p.rank), p.runtime_max_tokens_per_rank);
  if (publish && threadIdx.x < 32) {
    publish_combine_flag(p, f);  // its release fence orders the partial results first
    if (quantize && threadIdx.x == 0) FinishedBlocks(p).reset();
  }
}

// Lines 22-23: pull p_t = Wc[t][s][j_t] for every t in D and reduce. Work item w: token
// w / splits, slice w % splits of its vectors (small batches spread a token over several
// blocks so each thread issues one round of loads).
// Sources: where item w's partial results (and FP8 scales) lie on each target, collected
// by warp 0 from the records. They depend only on what our dispatch (an earlier kernel of
// this stream) wrote, so a block collects its first item's before it publishes and waits
// (early_sources): the records' round trip then overlaps the epoch's and the wait instead
// of following it. Not the FP8 kernels: collecting early, or even a prefetch of the records
// there, spilled registers in their reduction (sm_90, sm_100).
struct Sources {
  const char* src[EP_MAX_TOP_K];
  const char* scale[EP_MAX_TOP_K];
  int n;
};
__shared__ Sources s_sources;  // (one per block; named here so both steps address it as shared memory)
template <typename T, bool Q8>
EP_DEVICE void collect_item(const A2AParams& p, const int* records, int w) {
  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank;
  const int i = w / p.combine_splits;
  const unsigned H = p.combine_bytes / sizeof(T);
  if constexpr (Q8) {
    collect_sources(records, p.top_k, i, [&](int t, int slot) -> const char* {
      return workspace(p, t) + p.off_combine_q + (static_cast<size_t>(s) * tmax + slot) * H;
    }, s_sources.src, nullptr, &s_sources.n);
    collect_sources(records, p.top_k, i, [&](int t, int slot) -> const char* {
      return workspace(p, t) + p.off_combine_scales + (static_cast<size_t>(s) * tmax + slot) * (H / EP_Q8_BLOCK) * 4;
    }, s_sources.scale, nullptr, &s_sources.n);
  } else {
    collect_sources(records, p.top_k, i, [&](int t, int slot) -> const char* {
      return workspace(p, t) + p.off_combine + (static_cast<size_t>(s) * tmax + slot) * p.combine_bytes;
    }, s_sources.src, nullptr, &s_sources.n);
  }
}

template <typename T, bool Q8>
EP_DEVICE void early_sources(const A2AParams& p, const int* records) {
  if constexpr (!Q8)
    if (static_cast<int>(blockIdx.x) < p.local_num_tokens * p.combine_splits) collect_item<T, Q8>(p, records, blockIdx.x);
}

// Plain kernels: s_sources holds the block's first item's sources already (early_sources; the
// barrier after the wait orders them before every thread's use).
template <typename T, bool Q8>
EP_DEVICE void pull_and_reduce(const A2AParams& p, const int* records) {
  const int splits = p.combine_splits;
  const unsigned H = p.combine_bytes / sizeof(T);
  const unsigned nvec = Q8 ? H / Q8_UNIT : p.combine_bytes / p.combine_vec;
  for (int w = blockIdx.x; w < p.local_num_tokens * splits; w += gridDim.x) {
    const int i = w / splits, part = w % splits;
    const unsigned v0 = nvec * part / splits, v1 = nvec * (part + 1) / splits;
    char* const out = reinterpret_cast<char*>(p.combine_out) + static_cast<size_t>(i) * p.combine_bytes;
    if (Q8 || w != static_cast<int>(blockIdx.x)) {
      collect_item<T, Q8>(p, records, w);
      __syncthreads();
    }
    if constexpr (Q8)
      reduce_q8<T>(s_sources.src, s_sources.scale, s_sources.n, reinterpret_cast<T*>(out), v0, v1, p.combine_vec == 16);
    else
      reduce_token<T>(p.combine_vec, s_sources.src, s_sources.n, out, v0, v1);
    __syncthreads();
  }
}
// After an abort (protocol.cuh): the bytes pull_and_reduce would have written, all-ones.
template <typename T, bool Q8>
EP_DEVICE void poison_rows(const A2AParams& p) {
  const int splits = p.combine_splits;
  const unsigned unit = Q8 ? Q8_UNIT * sizeof(T) : p.combine_vec;  // bytes of one vector v
  const unsigned nvec = p.combine_bytes / unit;
  for (int w = blockIdx.x; w < p.local_num_tokens * splits; w += gridDim.x) {
    const int i = w / splits, part = w % splits;
    poison_bytes(reinterpret_cast<char*>(p.combine_out) + static_cast<size_t>(i) * p.combine_bytes,
                 static_cast<size_t>(nvec * part / splits) * unit, static_cast<size_t>(nvec * (part + 1) / splits) * unit);
  }
}
}  // namespace

// Lines 16-23. T: the element type of the partial results (bf16, fp16, fp32); Q8: pull
// FP8 copies of them (combine_quant; its own kernels, so the plain path keeps its registers).
template <typename T, bool Q8>
__device__ void fence_combine(const A2AParams& p) {
  const int* const records = section<const int>(p, p.rank, p.off_records);  // (before the wait, as in dispatch)
  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const unsigned f = read_epoch(p);
  early_sources<T, Q8>(p, records);                       // (its loads in flight with the epoch's)

  fence_step_done(p);                                      // (for the next dispatch: protocol.cuh)
  publish_partials<T, Q8>(p, f);                           // lines 17-19
  __shared__ int s_missing;
  const bool came = wait_steps(p, p.off_combine_flags, f, EP_PHASE_COMBINE);  // line 20
  // line 21: the pollers' acquires order the whole block's pulls (the barrier is cumulative)
  const bool missing = __syncthreads_or(!came);
  if (threadIdx.x == 0) s_missing = missing;
  if (!p.trigger_early) griddep_launch_dependents();
  pull_and_reduce<T, Q8>(p, records);                      // lines 22-23
  // Poison after the reduction, not instead of it, and from shared memory: a value live
  // across the reduction cost the FP8 kernels spills. A block whose wait gave up poisons;
  // so does, in abort mode, one that sees the abort word at its end (its inputs may come
  // from a peer that gave up earlier in the step).
  const bool poison = __syncthreads_or(threadIdx.x == 0 &&
                                       (s_missing || (p.abort_on_timeout && ld_volatile(abort_word(p, p.rank)) != 0)));
  if (poison) poison_rows<T, Q8>(p);
}

// 512, 2: as fence_dispatch (the FP8 ones too: their reduction holds 8-byte loads for that).
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_bf16(const __grid_constant__ A2AParams p) { fence_combine<__nv_bfloat16, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_f16(const __grid_constant__ A2AParams p) { fence_combine<__half, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_f32(const __grid_constant__ A2AParams p) { fence_combine<float, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_bf16(const __grid_constant__ A2AParams p) { fence_combine<__nv_bfloat16, true>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_f16(const __grid_constant__ A2AParams p) { fence_combine<__half, true>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_f32(const __grid_constant__ A2AParams p) { fence_combine<float, true>(p); }
