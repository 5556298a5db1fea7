// NVLinkOneSided, SENTINEL protocol (paper §4.2, Algorithm 2): the data words themselves
// signal arrival. Landing, expert-id and combine slots hold the sentinel between uses; a
// slot is complete when none of its (aligned, whole-arriving) 32-bit words equals it.
//
// No fence orders these stores. A slot is reused only after a message the peer sends in a
// later kernel (paper §4.2): landing slots after the combine data of the step, combine slots
// after the expert ids of the next step, expert-id slots (two alternating sets) after the
// expert ids of the step after; every reset is a store to our own memory that precedes,
// through kernel boundaries, the message that lets the peer write the slot again.
#include "moe_common.cuh"

namespace {
// Slot addresses, as in Algorithm 2. L and M are strided by max_tokens_per_rank, never by T^;
// I has two sets, alternating by step f.
// I[owner][source][i]: the expert ids of token slot i of `source`, then the sender's step tag.
EP_DEVICE unsigned* id_slot(const A2AParams& p, int owner, int source, int i, unsigned f) {
  const int W = p.top_k + 1;
  const size_t set = static_cast<size_t>(f & 1) * p.ep_size * p.max_tokens_per_rank * W;
  return section<unsigned>(p, owner, p.off_id_slots) + set + (static_cast<size_t>(source) * p.max_tokens_per_rank + i) * W;
}
// L[.][source][i] of payload d: its byte offset in every workspace.
EP_DEVICE size_t landing_slot(const A2AParams& p, const PayloadDesc& d, int source, int i) {
  return d.landing_offset + (static_cast<size_t>(source) * p.max_tokens_per_rank + i) * d.landing_bytes;
}
// M[owner][i][source]: the partial result of `owner`'s token i computed on `source`.
EP_DEVICE char* combine_slot(const A2AParams& p, int owner, int i, int source) {
  return workspace(p, owner) + p.off_combine_slots + (static_cast<size_t>(i) * p.ep_size + source) * p.combine_slot_bytes;
}

EP_DEVICE bool any_sentinel(uint4 v) {
  return v.x == EP_SENTINEL_WORD || v.y == EP_SENTINEL_WORD || v.z == EP_SENTINEL_WORD || v.w == EP_SENTINEL_WORD;
}
// Keep a data word off the sentinel by the payload's documented rule (layout.py).
EP_DEVICE unsigned escape(unsigned w, unsigned kind) {
  if (w != EP_SENTINEL_WORD) return w;
  return kind == EP_KIND_F16 ? 0x7FFF7FFFu : kind == EP_KIND_F32 ? 0x7FFFFFFFu : 0x7F7F7F7Fu;
}
EP_DEVICE uint4 escape4(uint4 v, unsigned kind) {
  return make_uint4(escape(v.x, kind), escape(v.y, kind), escape(v.z, kind), escape(v.w, kind));
}
EP_DEVICE uint4 sentinel4() { return make_uint4(EP_SENTINEL_WORD, EP_SENTINEL_WORD, EP_SENTINEL_WORD, EP_SENTINEL_WORD); }

// Word w (4 bytes) of a token's payload, zero past its end; any source alignment.
EP_DEVICE unsigned load_word(const unsigned char* src, unsigned bytes, unsigned vec, unsigned w) {
  const unsigned o = 4 * w;
  if (vec >= 4 && o + 4 <= bytes) return *reinterpret_cast<const unsigned*>(src + o);
  unsigned v = 0;
  for (unsigned b = 0; b < 4 && o + b < bytes; ++b) v |= unsigned(src[o + b]) << (8 * b);
  return v;
}
EP_DEVICE void store_word(unsigned char* dst, unsigned bytes, unsigned vec, unsigned w, unsigned v) {
  const unsigned o = 4 * w;
  if (vec >= 4 && o + 4 <= bytes) { *reinterpret_cast<unsigned*>(dst + o) = v; return; }
  for (unsigned b = 0; b < 4 && o + b < bytes; ++b) dst[o + b] = static_cast<unsigned char>(v >> (8 * b));
}

// Words 4g..4g+3 of a row of `bytes` bytes (zero past its end), whatever its alignment.
EP_DEVICE uint4 load_group(const unsigned char* src, unsigned bytes, unsigned vec, unsigned g) {
  if (vec == 16) return reinterpret_cast<const uint4*>(src)[g];
  return make_uint4(load_word(src, bytes, vec, 4 * g), load_word(src, bytes, vec, 4 * g + 1),
                    load_word(src, bytes, vec, 4 * g + 2), load_word(src, bytes, vec, 4 * g + 3));
}

// Wait until no word of a 16-byte landing or combine vector equals the sentinel.
EP_DEVICE uint4 poll_v4(const A2AParams& p, const uint4* a, int phase, int peer, unsigned f) {
  uint4 v = ld_volatile_poll(a);
  if (!any_sentinel(v)) return v;
  wait_until(p, phase, peer, f, 0, [&](unsigned& seen) {
    v = ld_volatile_poll(a);
    seen = v.x;
    return !any_sentinel(v);
  });
  return v;
}

// Push one token's payload q (bytes) to the landing slot at byte `slot_offset` of each of
// the n target workspaces, in 16-byte landing vectors: escaped words, or (KIND_RAW16) 16
// data bits per landing word. Targets are read from shared memory, not kept in a per-thread
// pointer array (that array spilled to a 176-byte stack frame).
EP_DEVICE void push_landing(const A2AParams& p, const PayloadDesc& d, const unsigned char* src,
                            const int* target, int n, size_t slot_offset) {
  const unsigned words = (d.bytes_per_token + 3) / 4;
  const bool raw = d.sentinel_kind == EP_KIND_RAW16;
  for (unsigned g = threadIdx.x; 4 * g < words; g += blockDim.x) {  // group g: words 4g..4g+3
    uint4 v = load_group(src, d.bytes_per_token, d.vec, g);
    if (raw) {
      const uint4 lo = make_uint4(v.x & 0xFFFF, v.x >> 16, v.y & 0xFFFF, v.y >> 16);
      const uint4 hi = make_uint4(v.z & 0xFFFF, v.z >> 16, v.w & 0xFFFF, v.w >> 16);
#pragma unroll 1  // rolled: unrolled, it held several target pointers live (register pressure)
      for (int j = 0; j < n; ++j) {
        uint4* o = reinterpret_cast<uint4*>(workspace(p, target[j]) + slot_offset) + 2 * g;
        o[0] = lo;
        o[1] = hi;
      }
    } else {
      v = escape4(v, d.sentinel_kind);
#pragma unroll 1
      for (int j = 0; j < n; ++j) reinterpret_cast<uint4*>(workspace(p, target[j]) + slot_offset)[g] = v;
    }
  }
}

// Wait for a landing slot, copy it into the dispatch workspace slot, reset it.
EP_DEVICE void receive_landing(const A2AParams& p, const PayloadDesc& d, char* land, unsigned char* out,
                               int peer, unsigned f) {
  const unsigned words = (d.bytes_per_token + 3) / 4;
  const bool raw = d.sentinel_kind == EP_KIND_RAW16;
  const bool fast = d.vec == 16;
  for (unsigned g = threadIdx.x; 4 * g < words; g += blockDim.x) {
    uint4 v;
    uint4* l = reinterpret_cast<uint4*>(land) + (raw ? 2 * g : g);
    if (raw) {
      const uint4 lo = poll_v4(p, l, EP_PHASE_SENTINEL_DISPATCH, peer, f), hi = poll_v4(p, l + 1, EP_PHASE_SENTINEL_DISPATCH, peer, f);
      v = make_uint4(lo.x | (lo.y << 16), lo.z | (lo.w << 16), hi.x | (hi.y << 16), hi.z | (hi.w << 16));
      l[0] = sentinel4();
      l[1] = sentinel4();
    } else {
      v = poll_v4(p, l, EP_PHASE_SENTINEL_DISPATCH, peer, f);
      l[0] = sentinel4();
    }
    if (fast) {
      reinterpret_cast<uint4*>(out)[g] = v;
    } else {
      store_word(out, d.bytes_per_token, d.vec, 4 * g, v.x);
      store_word(out, d.bytes_per_token, d.vec, 4 * g + 1, v.y);
      store_word(out, d.bytes_per_token, d.vec, 4 * g + 2, v.z);
      store_word(out, d.bytes_per_token, d.vec, 4 * g + 3, v.w);
    }
  }
}
// Lines 2-4 for token slot i < T^: push token i to L[t][s][i] for every t in D (none when
// i >= T: no payload row exists to read), and I[r][s][i] <- its expert ids (-1 where r is
// not in D), then our step tag, for every active r.
EP_DEVICE void send_slot(const A2AParams& p, int i, unsigned f, int* records) {
  __shared__ int s_target[EP_MAX_TOP_K];  // D
  __shared__ int s_n;
  __shared__ unsigned char s_is_target[EP_MAX_RANKS];
  const int s = p.rank, K = p.top_k, W = p.top_k + 1;
  for (int r = threadIdx.x; r < p.ep_size; r += blockDim.x) s_is_target[r] = 0;
  __syncthreads();
  const int* ids = reinterpret_cast<const int*>(p.payloads[0].src) + static_cast<size_t>(i) * K;
  if (threadIdx.x < 32) {
    int t = -1;
    bool first = false;
    unsigned firsts = 0;
    if (i < p.local_num_tokens) {
      const Selection sel = select_targets(p, ids);
      t = sel.target; first = sel.first; firsts = sel.firsts;
    }
    const int lane = threadIdx.x;
    if (first) {
      s_target[__popc(firsts & ((1u << lane) - 1))] = t;
      s_is_target[t] = 1;
    }
    if (i < p.local_num_tokens && lane < K) records[i * K + lane] = first ? pack_record(i, t) : -1;
    if (lane == 0) s_n = __popc(firsts);
  }
  __syncthreads();
  const int n = s_n;
  for (int q = 1; n > 0 && q < p.num_payloads; ++q) {
    const PayloadDesc& d = p.payloads[q];
    push_landing(p, d, reinterpret_cast<const unsigned char*>(d.src) + static_cast<size_t>(i) * d.bytes_per_token,
                 s_target, n, landing_slot(p, d, s, i));
  }
  for (int x = threadIdx.x; x < p.ep_size * W; x += blockDim.x) {
    const int r = x / W, k = x % W;
    if (!rank_active(p, r)) continue;
    int v = k == K ? static_cast<int>(p.step_tag) : (s_is_target[r] ? ids[k] : -1);
    // An input id equal to the slot's sentinel (invalid anyway: it is negative) would read as
    // "not arrived" and stall the receiver: it travels as -1, like every invalid id here.
    if (v == static_cast<int>(EP_SENTINEL_IDS)) v = -1;
    id_slot(p, r, s, i, f)[k] = static_cast<unsigned>(v);
  }
  __syncthreads();
}

// Lines 6-10 for slot i of source r: wait for I[s][r][i] and reset it (our part of line 14:
// a reset to our own memory), write the ids into Wd[s][r][i]; if a token came, wait for
// each L[s][r][i], copy it into Wd[s][r][i] and reset it.
EP_DEVICE void receive_slot(const A2AParams& p, int r, int i, unsigned f) {
  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank, K = p.top_k, W = p.top_k + 1;
  int* const out_ids = section<int>(p, s, p.payloads[0].recv_offset) + (static_cast<size_t>(r) * tmax + i) * K;
  int has = 0;
  unsigned v = static_cast<unsigned>(-1);
  const bool active = rank_active(p, r);  // an inactive rank sends nothing: its region holds no token
  if (active && threadIdx.x < W) {
    unsigned* const word = id_slot(p, s, r, i, f) + threadIdx.x;
    v = ld_volatile_poll(word);
    if (v == EP_SENTINEL_IDS) {
      const bool came = wait_until(p, EP_PHASE_SENTINEL_DISPATCH, r, f, 0, [&](unsigned& seen) {
        seen = v = ld_volatile_poll(word);
        return v != EP_SENTINEL_IDS;
      });
      if (!came) v = static_cast<unsigned>(-1);
    }
    *word = EP_SENTINEL_IDS;
    if (threadIdx.x == K && v != static_cast<unsigned>(-1)) check_step_tag(p, EP_PHASE_SENTINEL_DISPATCH, r, f, v);
  }
  if (p.abort_on_timeout && block_sees_abort(p)) v = static_cast<unsigned>(-1);  // poison (protocol.cuh)
  if (threadIdx.x < K) {
    out_ids[threadIdx.x] = static_cast<int>(v);
    has = static_cast<int>(v) != -1;
  }
  if (__syncthreads_or(has)) {
    for (int q = 1; q < p.num_payloads; ++q) {
      const PayloadDesc& d = p.payloads[q];
      receive_landing(p, d, workspace(p, s) + landing_slot(p, d, r, i),
                      section<unsigned char>(p, s, d.recv_offset) + (static_cast<size_t>(r) * tmax + i) * d.bytes_per_token,
                      r, f);
    }
  }
}

// Line 13: M[r][i][s] <- Wc[s][r][i] for every slot (r, i) that held a token, at once.
EP_DEVICE void push_partials(const A2AParams& p, const int* ids) {
  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank, K = p.top_k;
  const unsigned groups = (p.combine_bytes + 15) / 16;
  for (int w = blockIdx.x; w < p.ep_size * tmax; w += gridDim.x) {
    const int r = w / tmax, i = w % tmax;
    const int* row = ids + (static_cast<size_t>(r) * tmax + i) * K;
    int has = 0;
    if (threadIdx.x < K) has = row[threadIdx.x] != -1;
    if (!__syncthreads_or(has)) continue;
    const unsigned char* src = section<const unsigned char>(p, s, p.off_combine) +
                               (static_cast<size_t>(r) * tmax + i) * p.combine_bytes;
    uint4* dst = reinterpret_cast<uint4*>(combine_slot(p, r, i, s));
    for (unsigned g = threadIdx.x; g < groups; g += blockDim.x)
      dst[g] = escape4(load_group(src, p.combine_bytes, p.combine_vec, g), p.combine_kind);
  }
}

// Lines 15-19: for every t in D poll M[s][i][t], reduce (FENCE's order), reset it.
template <typename T>
EP_DEVICE void poll_and_reduce(const A2AParams& p, unsigned f, const int* records) {
  __shared__ const char* s_src[EP_MAX_TOP_K];
  __shared__ int s_tgt[EP_MAX_TOP_K];
  __shared__ int s_n;
  const int s = p.rank;
  const unsigned groups = (p.combine_bytes + 15) / 16;
  const int splits = p.combine_splits;
  const unsigned nvec = p.combine_bytes / p.combine_vec;
  for (int w = blockIdx.x; w < p.local_num_tokens * splits; w += gridDim.x) {
    const int i = w / splits, part = w % splits;
    collect_sources(records, p.top_k, i, [&](int t, int) -> const char* { return combine_slot(p, s, i, t); },
                    s_src, s_tgt, &s_n);
    __syncthreads();
    // Wait for this slice of every target's slot, then reduce it from there (L2: the
    // polling loads bypassed L1), then reset it. The host splits a token over blocks only
    // when combine_vec is 16, so each block reduces exactly the 16-byte groups it polled.
    const unsigned g0 = groups * part / splits, g1 = groups * (part + 1) / splits;
    for (int k = 0; k < s_n; ++k)
      for (unsigned g = g0 + threadIdx.x; g < g1; g += blockDim.x)
        poll_v4(p, reinterpret_cast<const uint4*>(s_src[k]) + g, EP_PHASE_SENTINEL_COMBINE, s_tgt[k], f);
    const bool poison = block_sees_abort(p);  // (also the barrier before the reduction)
    const unsigned v0 = nvec * part / splits, v1 = nvec * (part + 1) / splits;
    char* const out = reinterpret_cast<char*>(p.combine_out) + static_cast<size_t>(i) * p.combine_bytes;
    if (poison)
      poison_bytes(out, static_cast<size_t>(v0) * p.combine_vec, static_cast<size_t>(v1) * p.combine_vec);
    else
      reduce_token<T>(p.combine_vec, s_src, s_n, out, v0, v1);
    __syncthreads();
    for (int k = 0; k < s_n; ++k)
      for (unsigned g = g0 + threadIdx.x; g < g1; g += blockDim.x)
        reinterpret_cast<uint4*>(const_cast<char*>(s_src[k]))[g] = sentinel4();
    __syncthreads();
  }
}
}  // namespace

// Launch bounds (512, 2): at most 64 registers, so 4 blocks of 256 threads fit on an SM (the
// host sizes grids by the occupancy of every protocol kernel); as in fence.cu.
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_dispatch(const __grid_constant__ A2AParams p) {
  // Addresses from the parameters are taken before griddep_wait: they overlap the tail of
  // the previous kernel instead of following it (as in fence.cu).
  int* const records = section<int>(p, p.rank, p.off_records);
  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const unsigned f = read_epoch(p) + 1;
  const int tmax = p.runtime_max_tokens_per_rank;

  // Lines 2-4: token i lands in slot i of our region on each target; every rank gets the
  // expert ids of every one of our T^ slots (-1 where nothing goes), plus our T^.
  for (int i = blockIdx.x; i < tmax; i += gridDim.x) send_slot(p, i, f, records);
  // Lines 5-11: for every source r and slot i (of region r of Wd[s]).
  for (int w = blockIdx.x; w < p.ep_size * tmax; w += gridDim.x) receive_slot(p, w / tmax, w % tmax, f);

  if (!p.trigger_early) griddep_launch_dependents();
  // The step counter moves once every block has read it (the last block to finish).
  const FinishedBlocks blocks(p);
  if (blocks.elect_last() && threadIdx.x == 0) {
    blocks.reset();
    advance_epoch(p, f);
  }
}

// Lines 12-19. T: element type of the partial results.
template <typename T>
__device__ void sentinel_combine(const A2AParams& p) {
  const int* const records = section<const int>(p, p.rank, p.off_records);  // (before the wait, as in dispatch)
  const int* const ids = section<const int>(p, p.rank, p.payloads[0].recv_offset);
  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const unsigned f = read_epoch(p);

  push_partials(p, ids);               // line 13
  poll_and_reduce<T>(p, f, records);   // lines 15-19
  if (!p.trigger_early) griddep_launch_dependents();  // no block waits on a peer any more
  sentinel_step_done(p, f);   // protocol switch: tell a FENCE dispatch that may follow
}

extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_bf16(const __grid_constant__ A2AParams p) { sentinel_combine<__nv_bfloat16>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_f16(const __grid_constant__ A2AParams p) { sentinel_combine<__half>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_f32(const __grid_constant__ A2AParams p) { sentinel_combine<float>(p); }
