// NVLinkOneSided, FENCE protocol (paper §4.1, Algorithm 1).
//
// One thread block per token, or at small batches per part of one (dispatch_splits;
// grid-stride over tokens: grids are capped so that the kernels of every rank sharing a
// GPU are co-resident, since they spin on each other).
// Names as in Algorithm 1: s this rank, f the step, D the target ranks of a token, cnt[t]
// the slot counters, done the finished blocks, C[r][s] and F[r][s] the slot count and flag
// source s leaves on rank r, Wd / Wc the dispatch and combine workspaces.
#define EP_COLD_INLINE  // (protocol.cuh: the failure reports stay inline in FENCE's kernels)
#include "combine_q8.cuh"

namespace {
// F[r][s] of dispatch carries C[r][s] and our step tag too (dispatch_flag, protocol.cuh), so
// lines 8-10 are one store per peer and line 11's acquire of the flag delivers both.

// cnt[t]. A grid of one block keeps its slot counters in shared memory and elects no last
// block (its bar.sync orders every thread's pushes before the publishing lanes' fence), which
// takes the counter atomics and the election's gpu-scope round trips off small batches. Warp
// 0 alone takes the slots and publishes the counts, so it zeroes them itself.
struct SlotCounters {
  unsigned* cnt;    // the local section's counters (grids of several blocks), 0 between kernels
  unsigned* local;  // shared memory, one-block grids
  bool one_block;
  EP_DEVICE SlotCounters(const A2AParams& p, unsigned* shared)
      : cnt(section<unsigned>(p, p.rank, p.off_counters)), local(shared), one_block(gridDim.x == 1) {}
  EP_DEVICE void zero_local(const A2AParams& p) const {
    if (one_block && threadIdx.x < 32) {
      for (int r = threadIdx.x; r < p.ep_size; r += 32) local[r] = 0;
      __syncwarp();
    }
  }
  EP_DEVICE unsigned take(int t) const { return atomicAdd(one_block ? &local[t] : &cnt[t], 1u); }
  // By the publishing lanes: C for target t, leaving cnt[t] at 0 for the next step.
  EP_DEVICE unsigned read_and_reset(int t) const {
    const unsigned c = one_block ? local[t] : cnt[t];
    if (!one_block) cnt[t] = 0;
    return c;
  }
};

// A token's payloads as one sequence of p.push_groups 16-byte groups, when the host found
// that every payload moves in 16-byte vectors and the sequence fits in one round of the block
// (U groups per thread): then each thread loads all its groups of the token before the
// selection, so that those loads are in flight together with the ids' (else the chain ids ->
// selection -> payload 1 -> payload 2 ... costs a memory round trip per payload).
constexpr int PRELOAD_U = EP_PRELOAD_GROUPS;

// Token i's slot on target t when the token's push is split over blocks (dispatch_splits
// > 1): every block of the token must pick the same slot, so none can take it from a
// counter. Slot = the tokens before i that select t (the order the counters would give if
// tokens were taken in turn). Warp 0, for the nt distinct targets of token i in s_target:
// returns, in lane j < nt, the slot on s_target[j]. The lanes read the earlier tokens' ids
// in rounds of whole tokens, one id per lane (e0: the first round's, loaded by the caller
// together with token i's own ids): read token by token, the dependent loads cost more
// than the split saved.
EP_DEVICE int earlier_selections(const A2AParams& p, int i, const int* s_target, int nt, int e0) {
  const int lane = threadIdx.x & 31, k = p.top_k, n = i * k, round = p.ids_per_round;
  const int* const ids = reinterpret_cast<const int*>(p.payloads[0].src);
  const unsigned same_token_below = ((1u << lane) - 1) & ~((1u << (lane / k * k)) - 1);
  int slot = 0;
  for (int base = 0; base < n; base += round) {
    const bool mine = lane < round && base + lane < n;
    const int t = mine ? selected_rank(p, base ? ids[base + lane] : e0) : -1;
    for (int j = 0; j < nt; ++j) {
      const unsigned hits = __ballot_sync(0xffffffffu, t >= 0 && t == s_target[j]);
      const bool first = (hits >> lane) & 1u && !(hits & same_token_below);  // once per token
      const int c = __popc(__ballot_sync(0xffffffffu, first));
      if (lane == j) slot += c;
    }
  }
  return slot;
}

// Token i's targets D and the slot j_t taken on each: warp 0 writes them, the block pushes.
struct ItemTargets {
  int target[EP_MAX_TOP_K];  // D, in the order of first selection
  int slot[EP_MAX_TOP_K];    // j_t
  int n;
};
// Lines 2-4 for a token pushed by one block: each first selection takes its slot from the
// counter. Returns this lane's record.
EP_DEVICE int take_slot(const SlotCounters& cnt, const Selection& sel, int j, ItemTargets& sh) {
  if (!sel.first) return -1;
  const int slot = cnt.take(sel.target);
  sh.target[j] = sel.target;
  sh.slot[j] = slot;
  return pack_record(slot, sel.target);
}
// Lines 2-4 for part `part` of a split token: the slots every block of the token agrees on
// (earlier_selections); part 0 alone counts the token in C[t].
EP_DEVICE int agree_slot(const A2AParams& p, const SlotCounters& cnt, const Selection& sel, int j, int nt,
                         int i, int part, int e0, ItemTargets& sh) {
  const int lane = threadIdx.x & 31;
  if (sel.first) sh.target[j] = sel.target;
  __syncwarp();
  const int slot = earlier_selections(p, i, sh.target, nt, e0);
  if (lane < nt) sh.slot[lane] = slot;
  __syncwarp();
  if (!sel.first) return -1;
  if (part == 0) cnt.take(sel.target);  // (only to count: C[t] for the flags)
  return pack_record(sh.slot[j], sel.target);
}
// Warp 0, lines 2-4: token i's distinct targets from its ids (e: this lane's, e0: for
// earlier_selections), a slot on each, and (part 0) the records combine reads.
EP_DEVICE void select_slots(const A2AParams& p, const SlotCounters& cnt, int* records, int i, int part, int e, int e0,
                            ItemTargets& sh) {
  const int lane = threadIdx.x & 31;
  const Selection sel = select_targets(p, e, part == 0);
  const int j = __popc(sel.firsts & ((1u << lane) - 1)), nt = __popc(sel.firsts);
  const int rec = p.dispatch_splits == 1 ? take_slot(cnt, sel, j, sh) : agree_slot(p, cnt, sel, j, nt, i, part, e0, sh);
  if (part == 0 && lane < p.top_k) records[i * p.top_k + lane] = rec;
  if (lane == 0) sh.n = nt;
}
// Group x of token i's payloads, from its input rows.
EP_DEVICE uint4 input_group(const A2AParams& p, int i, unsigned x) {
  const PayloadDesc& d = p.payloads[payload_of_group(p, x)];
  return reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(d.src) + static_cast<size_t>(i) * d.bytes_per_token)[x];
}
// Lines 5-6 of a preloaded part: every thread's groups, from its registers, to every target.
EP_DEVICE void push_loaded(const A2AParams& p, const uint4 (&v)[PRELOAD_U], unsigned g0, unsigned g1, const ItemTargets& sh) {
  const int nt = sh.n;
  store_round(v, g0 + threadIdx.x, g1, [&](unsigned x, const uint4& value) {
    const PayloadDesc& d = p.payloads[payload_of_group(p, x)];
    const Targets tg{p.peer_base, sh.target, sh.slot, nt, static_cast<size_t>(p.rank) * p.runtime_max_tokens_per_rank, d.recv_offset};
#pragma unroll 1  // (rolled, as in push_vectors)
    for (int j = 0; j < nt; ++j) reinterpret_cast<uint4*>(tg.dst(j, d.bytes_per_token))[x] = value;
  });
}
// Lines 5-6 payload by payload, in each one's widest vectors (a token that does not preload).
EP_DEVICE void push_payloads(const A2AParams& p, int i, const ItemTargets& sh) {
  const int nt = sh.n;
  for (int q = 0; q < p.num_payloads; ++q) {
    const PayloadDesc& d = p.payloads[q];
    const Targets tg{p.peer_base, sh.target, sh.slot, nt, static_cast<size_t>(p.rank) * p.runtime_max_tokens_per_rank, d.recv_offset};
    push_payload(d.vec, reinterpret_cast<const char*>(d.src) + static_cast<size_t>(i) * d.bytes_per_token, tg, d.bytes_per_token);
  }
}

// Lines 2-6: pick a slot on every distinct target rank, push the token. Work item w: token
// w / S, part w % S of its 16-byte groups (S = dispatch_splits: at small batches a token's
// pushes from one SM would take most of the dispatch, so its groups are spread over S blocks).
// prologue: run by the whole block once, after its first item's payload and id loads are
// issued (a block with no item: at the end) and before any of its slots or stores, so that
// what it reads overlaps those loads.
template <typename Prologue>
EP_DEVICE void push_tokens(const A2AParams& p, const SlotCounters& cnt, int* records, const Prologue& prologue) {
  __shared__ ItemTargets sh;
  const unsigned groups = p.push_groups;
  const int S = p.dispatch_splits;  // (the host splits only tokens whose groups preload)
  const int items = p.local_num_tokens * S;
  const int* const ids = reinterpret_cast<const int*>(p.payloads[0].src);
  for (int w = blockIdx.x; w < items; w += gridDim.x) {
    const int i = w / S, part = w % S;
    const unsigned g0 = groups * part / S, g1 = groups * (part + 1) / S;
    uint4 v[PRELOAD_U];
    load_groups(v, g0, g1, [&](unsigned x) { return input_group(p, i, x); });
    const int lane = threadIdx.x & 31;
    int e = -1, e0 = -1;
    if (threadIdx.x < 32) {
      e = load_ids(p, ids + i * p.top_k);
      e0 = S > 1 && lane < p.ids_per_round && lane < i * p.top_k ? ids[lane] : -1;  // (earlier_selections)
    }
    if (w == static_cast<int>(blockIdx.x)) prologue();
    if (threadIdx.x < 32) select_slots(p, cnt, records, i, part, e, e0, sh);
    __syncthreads();
    if (groups) push_loaded(p, v, g0, g1, sh);
    else push_payloads(p, i, sh);
    __syncthreads();
  }
  if (static_cast<int>(blockIdx.x) >= items) prologue();
}

// Lines 7-10: the last block to finish publishes for the whole rank (FinishedBlocks says why
// its one fence covers every block's pushes): F[r][s] <- (f, C[r][s], our step tag). It also
// moves the step counter, which every block has read.
// A grid that is one cluster (the host launches small split batches so) elects no block:
// the cluster barrier orders every block's pushes and counts before block 0's fence, as
// bar.sync does within one block, without the counter's dependent gpu-scope round trip.
EP_DEVICE void publish_counts(const A2AParams& p, const SlotCounters& cnt, unsigned f) {
  const FinishedBlocks blocks(p);
  const bool cluster = p.dispatch_cluster;
  if (cluster) cluster_barrier();
  const bool elected = !cnt.one_block && !cluster;
  if ((cluster ? cluster_block_rank() == 0 : blocks.elect_last(cnt.one_block)) && threadIdx.x < 32) {
    if (elected) blocks.acquire();  // every publishing lane acquires, not only thread 0
    publish_flags<ulonglong2>(p, p.off_dispatch_flags,
                              [&](int r) { return dispatch_flag(f, cnt.read_and_reset(r), p.step_tag); });
    if (threadIdx.x == 0) {
      if (elected) blocks.reset();
      advance_epoch(p, f);
      // (every block read it before the election or cluster barrier): the wait it asked for is done, so a
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
    const ulonglong2* F = section<const ulonglong2>(p, s, p.off_dispatch_flags) + r;
    ulonglong2 v;
    const bool came = wait_until(p, EP_PHASE_DISPATCH, r, f, f, [&](unsigned& seen) {
      v = ld_acquire_peers(p, F);
      seen = flag_reached(v, f);
      return static_cast<int>(seen - f) >= 0;
    });
    if (!came) continue;  // (abort mode) r's region holds nothing of this step: count 0
    s_count[r] = min(flag_count(v), static_cast<unsigned>(p.runtime_max_tokens_per_rank));
    check_step_tag(p, EP_PHASE_DISPATCH, r, f, flag_tag(v));
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


#ifdef EP_HALVES
// The halves of lines 1-15 (EP_SEND, EP_RECEIVE: protocol.cuh), each fence_dispatch's code
// up to or from the wait. Between them the epoch word carries the step: the send half's
// publishing block moved it on (publish_counts), and the receive half, a later kernel of
// this stream, reads it back after griddep_wait.
EP_DEVICE void dispatch_send(const A2AParams& p) {
  __shared__ unsigned s_cnt[EP_MAX_RANKS];
  const SlotCounters cnt(p, s_cnt);
  int* const records = section<int>(p, p.rank, p.off_records);
  cnt.zero_local(p);
  warm_params(p);
  griddep_wait();
  unsigned f;
  push_tokens(p, cnt, records, [&] {
    f = read_epoch(p) + 1;
    wait_sentinel_step_done(p, f);  // (waits only on the combine of a SENTINEL step before)
  });  // lines 2-6
  if (p.trigger_early) griddep_launch_dependents();
  publish_counts(p, cnt, f);  // lines 7-10
}
EP_DEVICE void dispatch_receive(const A2AParams& p) {
  __shared__ unsigned s_count[EP_MAX_RANKS];
  griddep_wait();
  const unsigned f = read_epoch(p);
  wait_counts(p, f, s_count);  // line 11
  griddep_launch_dependents();
  sanitize_expert_ids(p, s_count);  // lines 13-15
}
#endif
}  // namespace

#ifndef EP_HALVES
// Launch bounds (512, 2): at most 64 registers, so 4 blocks of 256 threads fit on an SM (the
// host sizes grids by the occupancy of every protocol kernel) without ptxas trading spills
// for a third block of 512.
extern "C" __global__ void __launch_bounds__(512, 2) fence_dispatch(const __grid_constant__ A2AParams p) {
  __shared__ unsigned s_cnt[EP_MAX_RANKS];    // cnt[t] of one-block grids
  __shared__ unsigned s_count[EP_MAX_RANKS];  // C[s][r]: slots source r filled in our region
  const SlotCounters cnt(p, s_cnt);
  // Addresses from the parameters are taken before griddep_wait: they overlap the tail of
  // the previous kernel instead of following it.
  int* const records = section<int>(p, p.rank, p.off_records);
  cnt.zero_local(p);
  warm_params(p);

  griddep_wait();
  // The step and the end of a SENTINEL step before it are read while the block's first token
  // loads are in flight: only the pushes must wait for them.
  unsigned f;
  push_tokens(p, cnt, records, [&] {
    f = read_epoch(p) + 1;
    wait_sentinel_step_done(p, f);
  });  // lines 2-6
  // Small grids (the host sets trigger_early when two kernels of every rank fit on the GPU
  // together) let the next kernel launch once their pushes are issued: its launch is still
  // hidden behind our publish and wait, and its blocks are not placed while we push.
  if (p.trigger_early) griddep_launch_dependents();
  publish_counts(p, cnt, f);  // lines 7-10
  wait_counts(p, f, s_count); // line 11
  // With large grids the next kernel may launch only now: its blocks then wait on work that
  // finishes unconditionally, so they never crowd out a peer's kernel we are waiting for.
  if (!p.trigger_early) griddep_launch_dependents();
  sanitize_expert_ids(p, s_count);  // lines 13-15
}

#else
extern "C" __global__ void __launch_bounds__(512, 2) fence_dispatch_send(const __grid_constant__ A2AParams p) { dispatch_send(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_dispatch_recv(const __grid_constant__ A2AParams p) { dispatch_receive(p); }
#endif

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
struct Sources {
  const char* src[EP_MAX_TOP_K];    // the partial results (FP8: values) of the item's targets
  const char* scale[EP_MAX_TOP_K];  // FP8: their scales
  int n;
};
// Warp 0: where a work item's partial results wait, from rec (its records: written by our
// dispatch, a kernel before us, so the block's first item is collected while the peers'
// flags are still polled). The FP8 kernels place values and scales from that one load of the
// records. The caller synchronizes the block.
template <typename T, bool Q8>
EP_DEVICE void collect_item(const A2AParams& p, int rec, Sources& sh) {
  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank;
  if constexpr (Q8) {
    const unsigned H = p.combine_bytes / sizeof(T);
    place_sources(rec, [&](int t, int slot) -> const char* {
      return workspace(p, t) + p.off_combine_q + (static_cast<size_t>(s) * tmax + slot) * H;
    }, sh.src, nullptr, &sh.n);
    place_sources(rec, [&](int t, int slot) -> const char* {
      return workspace(p, t) + p.off_combine_scales + (static_cast<size_t>(s) * tmax + slot) * (H / EP_Q8_BLOCK) * 4;
    }, sh.scale, nullptr, &sh.n);
  } else {
    place_sources(rec, [&](int t, int slot) -> const char* {
      return workspace(p, t) + p.off_combine + (static_cast<size_t>(s) * tmax + slot) * p.combine_bytes;
    }, sh.src, nullptr, &sh.n);
  }
}
// Every item of the block; the first one's sources are in `sh` already (collect_item).
// Warp 0 copies the next item's records into shared memory while it reduces this one, so
// that between two items the block waits for its barriers, not for a load too (cp.async:
// a register held across the reduction would spill in the FP8 kernels on sm_100/103).
template <typename T, bool Q8>
EP_DEVICE void pull_and_reduce(const A2AParams& p, const int* records, Sources& sh) {
  __shared__ int s_next[32];  // lane k < top_k: record k of the next item
  const int splits = p.combine_splits, items = p.local_num_tokens * splits;
  const unsigned H = p.combine_bytes / sizeof(T);
  const unsigned nvec = Q8 ? H / Q8_UNIT : p.combine_bytes / p.combine_vec;
  for (int w = blockIdx.x; w < items; w += gridDim.x) {
    const int i = w / splits, part = w % splits;
    const unsigned v0 = nvec * part / splits, v1 = nvec * (part + 1) / splits;
    char* const out = reinterpret_cast<char*>(p.combine_out) + static_cast<size_t>(i) * p.combine_bytes;
    if (w != static_cast<int>(blockIdx.x)) {
      if (threadIdx.x < 32) {
        cp_async_wait_all();
        collect_item<T, Q8>(p, static_cast<int>(threadIdx.x) < p.top_k ? s_next[threadIdx.x] : -1, sh);
      }
      __syncthreads();
    }
    const int next = w + static_cast<int>(gridDim.x);
    if (static_cast<int>(threadIdx.x) < p.top_k && next < items)
      cp_async_4(&s_next[threadIdx.x], records + (next / splits) * p.top_k + threadIdx.x);
    if constexpr (Q8)
      reduce_q8<T>(sh.src, sh.scale, sh.n, reinterpret_cast<T*>(out), v0, v1, p.combine_vec == 16);
    else
      reduce_token<T>(p.combine_vec, sh.src, sh.n, out, v0, v1);
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
// PART: the send half publishes that our partial results are ready (lines 17-19: quantized
// first, with Q8) and that we read no dispatch data of this step any more; the receive half
// waits for every rank's (line 20) and pulls and reduces.
template <typename T, bool Q8, int PART = EP_WHOLE>
__device__ void combine_kernel(const A2AParams& p) {
  const int* const records = section<const int>(p, p.rank, p.off_records);  // (before the wait, as in dispatch)
  if constexpr (!Q8) warm_params(p);  // (not in the FP8 kernels: it makes them spill on sm_100/103)
  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const unsigned f = read_epoch(p);

  if constexpr (PART != EP_RECEIVE) {
    record_fence_combine(p);                               // (for the next dispatch: protocol.cuh)
    publish_partials<T, Q8>(p, f);                         // lines 17-19
    if constexpr (PART == EP_SEND) return;
  }
  __shared__ Sources sh;
  if (static_cast<int>(blockIdx.x) < p.local_num_tokens * p.combine_splits && threadIdx.x < 32)
    collect_item<T, Q8>(p, load_record(records, p.top_k, blockIdx.x / p.combine_splits), sh);
  __shared__ int s_missing;
  const bool came = wait_steps(p, p.off_combine_flags, f, EP_PHASE_COMBINE);  // line 20
  // line 21: the pollers' acquires order the whole block's pulls (the barrier is cumulative)
  const bool missing = __syncthreads_or(!came);
  if (threadIdx.x == 0) s_missing = missing;
  if (!p.trigger_early) griddep_launch_dependents();
  pull_and_reduce<T, Q8>(p, records, sh);                  // lines 22-23
  // Poison after the reduction, not instead of it, and from shared memory (a value live
  // across the reduction spills in the FP8 kernels): a block whose wait gave up, or in abort
  // mode one that sees the abort word at its end (a peer may have given up earlier).
  const bool poison = __syncthreads_or(threadIdx.x == 0 &&
                                       (s_missing || (p.abort_on_timeout && ld_volatile(abort_word(p, p.rank)) != 0)));
  if (poison) poison_rows<T, Q8>(p);
}

#ifndef EP_HALVES
// 512, 2: as fence_dispatch (the FP8 ones too: their reduction holds 8-byte loads for that).
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_bf16(const __grid_constant__ A2AParams p) { combine_kernel<__nv_bfloat16, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_f16(const __grid_constant__ A2AParams p) { combine_kernel<__half, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_f32(const __grid_constant__ A2AParams p) { combine_kernel<float, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_bf16(const __grid_constant__ A2AParams p) { combine_kernel<__nv_bfloat16, true>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_f16(const __grid_constant__ A2AParams p) { combine_kernel<__half, true>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_q8_f32(const __grid_constant__ A2AParams p) { combine_kernel<float, true>(p); }
#else
// The halves (the name says which; kernels/protocol.cuh: EP_PART).
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_send_bf16(const __grid_constant__ A2AParams p) { combine_kernel<__nv_bfloat16, false, EP_SEND>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_recv_bf16(const __grid_constant__ A2AParams p) { combine_kernel<__nv_bfloat16, false, EP_RECEIVE>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_send_f16(const __grid_constant__ A2AParams p) { combine_kernel<__half, false, EP_SEND>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_recv_f16(const __grid_constant__ A2AParams p) { combine_kernel<__half, false, EP_RECEIVE>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_send_f32(const __grid_constant__ A2AParams p) { combine_kernel<float, false, EP_SEND>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_recv_f32(const __grid_constant__ A2AParams p) { combine_kernel<float, false, EP_RECEIVE>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_send_q8_bf16(const __grid_constant__ A2AParams p) { combine_kernel<__nv_bfloat16, true, EP_SEND>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_recv_q8_bf16(const __grid_constant__ A2AParams p) { combine_kernel<__nv_bfloat16, true, EP_RECEIVE>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_send_q8_f16(const __grid_constant__ A2AParams p) { combine_kernel<__half, true, EP_SEND>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_recv_q8_f16(const __grid_constant__ A2AParams p) { combine_kernel<__half, true, EP_RECEIVE>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_send_q8_f32(const __grid_constant__ A2AParams p) { combine_kernel<float, true, EP_SEND>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) fence_combine_recv_q8_f32(const __grid_constant__ A2AParams p) { combine_kernel<float, true, EP_RECEIVE>(p); }
#endif
