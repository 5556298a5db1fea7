// NVLinkOneSided, SENTINEL protocol (paper §4.2, Algorithm 2): the data words themselves
// signal arrival. Landing, expert-id and combine slots hold the sentinel between uses; a
// slot is complete when none of its (aligned, whole-arriving) 32-bit words equals it.
//
// Memory model. Every word a peer polls is pushed with a strong store (st.relaxed.sys) and
// polled with a strong load (ld.relaxed.sys): only strong accesses promise that each aligned
// 32-bit word is seen whole and that a poll eventually sees the store. Data is copied or
// reduced from the registers the successful poll returned, never from a second load by
// another thread (more than 8 combine targets: a strong reload by the polling thread itself,
// which read-read coherence orders after its own successful poll).
//
// No fence orders these stores. A slot is reused only after a message the peer sends in a
// later kernel (paper §4.2): landing slots after the combine data of the step, combine slots
// after the expert ids of the next step, expert-id slots (two alternating sets) after the
// expert ids of the step after. Why a kernel boundary suffices: every reset is a store to
// our own memory, whose point of coherence is our own L2. The kernel that sends the message
// runs after griddepcontrol.wait (or a plain stream boundary), which returns only once every
// memory operation of the kernel before it has been performed; so the reset is already at
// that point of coherence before the message store is even issued, and the peer's next
// write, issued only after its poll saw the message, reaches the same place later: it
// follows the reset in coherence order and is never overwritten by it.
//
// Latency: a round's loads are all issued before their first use, only missing vectors are
// re-polled, and a (source, slot) pair's id slot and landing slot are polled together.
#include "moe_common.cuh"

namespace {
constexpr int U = 4;  // 16-byte groups one thread keeps in flight per round

// Slot addresses, as in Algorithm 2. L and M are strided by max_tokens_per_rank, never by T^;
// I has two sets, alternating by step f.
// I[owner][source][i]: the expert ids of token slot i of `source`, then the sender's step tag.
EP_DEVICE unsigned* id_slot(const A2AParams& p, int owner, int source, int i, unsigned f) {
  const int W = p.top_k + 1;
  const size_t set = static_cast<size_t>(f & 1) * p.ep_size * p.max_tokens_per_rank * W;
  return section<unsigned>(p, owner, p.off_id_slots) + set + (static_cast<size_t>(source) * p.max_tokens_per_rank + i) * W;
}
// M[owner][i][source]: the partial result of `owner`'s token i computed on `source`.
EP_DEVICE char* combine_slot(const A2AParams& p, int owner, int i, int source) {
  return workspace(p, owner) + p.off_combine_slots + (static_cast<size_t>(i) * p.ep_size + source) * p.combine_slot_bytes;
}
// Whether slot i of source r held a token in the last dispatch (layout.py: has).
EP_DEVICE unsigned char* has_slot(const A2AParams& p, int r, int i) {
  return section<unsigned char>(p, p.rank, p.off_sentinel_has) + static_cast<size_t>(r) * p.max_tokens_per_rank + i;
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
// Code size: rows that do not move in 16-byte vectors, and KIND_RAW16 payloads, take the
// out-of-line paths below (EP_COLD, protocol.cuh), since their byte loops inlined at every
// unrolled use would multiply the code that decode batches spend their time fetching.

// Words 4g..4g+3 of a row of `bytes` bytes (zero past its end), whatever its alignment.
EP_COLD uint4 load_group_any(const unsigned char* src, unsigned bytes, unsigned vec, unsigned g) {
  return make_uint4(load_word(src, bytes, vec, 4 * g), load_word(src, bytes, vec, 4 * g + 1),
                    load_word(src, bytes, vec, 4 * g + 2), load_word(src, bytes, vec, 4 * g + 3));
}
EP_DEVICE uint4 load_group(const unsigned char* src, unsigned bytes, unsigned vec, unsigned g) {
  return vec == 16 ? reinterpret_cast<const uint4*>(src)[g] : load_group_any(src, bytes, vec, g);
}
// The same four words into a row (nothing past its end).
EP_COLD void store_group_any(unsigned char* dst, unsigned bytes, unsigned vec, unsigned g, uint4 v) {
  store_word(dst, bytes, vec, 4 * g, v.x); store_word(dst, bytes, vec, 4 * g + 1, v.y);
  store_word(dst, bytes, vec, 4 * g + 2, v.z); store_word(dst, bytes, vec, 4 * g + 3, v.w);
}
EP_DEVICE void store_group(unsigned char* dst, unsigned bytes, unsigned vec, unsigned g, uint4 v) {
  if (vec == 16) reinterpret_cast<uint4*>(dst)[g] = v;
  else store_group_any(dst, bytes, vec, g, v);
}

// ---- landing groups: the 16-byte vectors of one token slot's landing slots, payloads 1..,
// as one sequence (moe_common.cuh: landing_groups, payload_of_landing_group).
// Landing group g of payload d, from the token's row: escaped words, or (KIND_RAW16) data
// words 2g, 2g + 1 as four 16-bit halves, so that no landing word can equal the sentinel.
EP_COLD uint4 landing_value_any(const PayloadDesc& d, const unsigned char* row, unsigned g) {
  if (d.sentinel_kind == EP_KIND_RAW16) {
    const unsigned a = load_word(row, d.bytes_per_token, d.vec, 2 * g), b = load_word(row, d.bytes_per_token, d.vec, 2 * g + 1);
    return make_uint4(a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16);
  }
  return escape4(load_group_any(row, d.bytes_per_token, d.vec, g), d.sentinel_kind);
}
EP_DEVICE bool vector_path(const PayloadDesc& d) { return d.vec == 16 && d.sentinel_kind != EP_KIND_RAW16; }
EP_DEVICE uint4 landing_value(const PayloadDesc& d, const unsigned char* row, unsigned g) {
  return vector_path(d) ? escape4(reinterpret_cast<const uint4*>(row)[g], d.sentinel_kind) : landing_value_any(d, row, g);
}
// Its inverse, into the dispatch workspace row.
EP_COLD void store_received_any(const PayloadDesc& d, unsigned char* row, unsigned g, uint4 v) {
  if (d.sentinel_kind == EP_KIND_RAW16) {
    store_word(row, d.bytes_per_token, d.vec, 2 * g, v.x | (v.y << 16));
    store_word(row, d.bytes_per_token, d.vec, 2 * g + 1, v.z | (v.w << 16));
  } else {
    store_group_any(row, d.bytes_per_token, d.vec, g, v);
  }
}
EP_DEVICE void store_received(const PayloadDesc& d, unsigned char* row, unsigned g, uint4 v) {
  if (vector_path(d)) reinterpret_cast<uint4*>(row)[g] = v;
  else store_received_any(d, row, g, v);
}
// Byte offset, in every workspace, of landing group g of payload d in slot i of `source`.
EP_DEVICE size_t landing_at(const A2AParams& p, const PayloadDesc& d, int source, int i, unsigned g) {
  return d.landing_offset + (static_cast<size_t>(source) * p.max_tokens_per_rank + i) * d.landing_bytes + 16 * static_cast<size_t>(g);
}

// The step counter moves once every block of the dispatch has read it. One thread of each
// block (counter_thread) reads it for the block and then counts the block in: the release
// orders that read before the increment, so the last block to arrive, which acquires
// (sentinel_dispatch's end), moves the counter after every read. Counting at the start keeps
// the election's round trip off the end of the kernel. The thread is the last warp's first,
// which selects no targets, so its release waits for the counter read, not for stores.
EP_DEVICE unsigned counter_thread() { return blockDim.x - 32; }
// By counter_thread: the step f into `f`, then the block counted in; returns the blocks
// counted before it.
EP_DEVICE unsigned arrive(const A2AParams& p, unsigned& f) {
  f = read_epoch(p) + 1;
  return atomic_add_release_gpu(section<unsigned>(p, p.rank, p.off_done), 1u);
}

// ---- dispatch, lines 2-4: part c of C of token slot i
// The first round's payload loads, the selection's id loads and (first) the step counter
// are all in flight together; the stores follow the one barrier. C blocks share a token,
// so at decode batches a token's stores leave many SMs, not one.
struct Send {
  int target[EP_MAX_TOP_K];  // D, in the order of first selection
  int n;
  unsigned f;                // the step, read by counter_thread (see arrive)
  unsigned char is_target[EP_MAX_RANKS];
};
EP_DEVICE void send_part(const A2AParams& p, Send& sh, int i, int c, int C, int* records, bool first, unsigned& arrival) {
  const int s = p.rank, K = p.top_k, W = K + 1;
  const bool token = i < p.local_num_tokens;
  const unsigned total = token ? landing_groups(p) : 0;
  const unsigned g0 = total * c / C, g1 = total * (c + 1) / C;
  const auto load = [&](unsigned x) {
    const PayloadDesc& d = p.payloads[payload_of_landing_group(p, x)];
    return landing_value(d, reinterpret_cast<const unsigned char*>(d.src) + static_cast<size_t>(i) * d.bytes_per_token, x);
  };
  uint4 v[U];
  load_groups(v, g0, g1, load);
  const int* ids = reinterpret_cast<const int*>(p.payloads[0].src) + static_cast<size_t>(i) * K;
  // Line 2, warp 0: token i's distinct targets D (part 0 also marks them in is_target and
  // writes the records). Inline, like line 4 below: as functions they reshaped the whole
  // sentinel_dispatch's code.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    if (c == 0)
      for (int r = lane; r < p.ep_size; r += 32) sh.is_target[r] = 0;
    int t = -1;
    bool sel_first = false;
    unsigned firsts = 0;
    if (token) {
      const Selection sel = select_targets(p, ids, c == 0);  // (a dropped selection counted once)
      t = sel.target; sel_first = sel.first; firsts = sel.firsts;
    }
    __syncwarp();
    if (sel_first) {
      sh.target[__popc(firsts & ((1u << lane) - 1))] = t;
      if (c == 0) sh.is_target[t] = 1;
    }
    if (c == 0 && token && lane < K) records[i * K + lane] = sel_first ? pack_record(i, t) : -1;
    if (lane == 0) sh.n = __popc(firsts);
  }
  if (first && threadIdx.x == counter_thread()) arrival = arrive(p, sh.f);
  __syncthreads();
  const int n = sh.n;
  if (n > 0)  // (later rounds: large payloads only)
    store_rounds(v, g0 + threadIdx.x, g1, load, [&](unsigned x, const uint4& value) {
      const PayloadDesc& d = p.payloads[payload_of_landing_group(p, x)];  // (x becomes the group within d)
      const size_t off = landing_at(p, d, s, i, x);
#pragma unroll 1  // rolled: unrolled, it held several target pointers live (register pressure)
      for (int j = 0; j < n; ++j) st_relaxed_sys(reinterpret_cast<uint4*>(workspace(p, sh.target[j]) + off), value);
    });
  if (c == 0) {
    // Line 4: I[r][s][i] <- the expert ids (-1 where r is not in D), then our step tag.
    for (int x = threadIdx.x; x < p.ep_size * W; x += blockDim.x) {
      const int r = x / W, k = x % W;
      if (!rank_active(p, r)) continue;
      int id = k == K ? static_cast<int>(p.step_tag) : (sh.is_target[r] ? ids[k] : -1);
      // An input id equal to the slot's sentinel (invalid anyway: it is negative) would read as
      // "not arrived" and stall the receiver: it travels as -1, like every invalid id here.
      if (id == static_cast<int>(EP_SENTINEL_IDS)) id = -1;
      st_relaxed_sys(id_slot(p, r, s, i, sh.f) + k, static_cast<unsigned>(id));
    }
  }
  __syncthreads();  // (the shared arrays of the next part)
}

// ---- dispatch, lines 5-11 for slot i of source r
// Warp 0 polls the expert-id slot while every thread already polls its landing groups; the
// ids' verdict (a token comes, or none) reaches the landing pollers through shared memory,
// tagged with the work item so that an earlier item's verdict is never taken for this one.
// Shared-memory atomics, not plain or volatile accesses: the word is written and read
// concurrently on purpose, and racecheck reports no hazard between atomics.
enum Verdict : unsigned { UNKNOWN = 0, TOKEN = 1, NONE = 2 };
EP_DEVICE unsigned verdict(unsigned* s_state, unsigned tag) {
  const unsigned v = atomicOr(s_state, 0u);
  return (v >> 2) == tag ? (v & 3) : UNKNOWN;
}
EP_DEVICE const uint4* landing_ptr(const A2AParams& p, int r, int i, unsigned x) {
  const PayloadDesc& d = p.payloads[payload_of_landing_group(p, x)];
  return reinterpret_cast<const uint4*>(workspace(p, p.rank) + landing_at(p, d, r, i, x));
}
// Copy landing group x of slot (r, i) from the registers that polled it into Wd[s][r][i],
// and reset it (line 9).
EP_DEVICE void take_group(const A2AParams& p, int r, int i, unsigned x, uint4 v) {
  const PayloadDesc& d = p.payloads[payload_of_landing_group(p, x)];
  store_received(d, section<unsigned char>(p, p.rank, d.recv_offset) +
                        (static_cast<size_t>(r) * p.runtime_max_tokens_per_rank + i) * d.bytes_per_token, x, v);
  *reinterpret_cast<uint4*>(workspace(p, p.rank) + landing_at(p, d, r, i, x)) = sentinel4();
}
// Poll again the groups of this round still missing (bit u of miss: group x0 + u * blockDim.x).
EP_DEVICE void repoll(const A2AParams& p, int r, int i, unsigned x0, uint4 (&v)[U], unsigned& miss, unsigned& seen) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    if ((miss >> u) & 1) {
      v[u] = ld_relaxed_sys(landing_ptr(p, r, i, x0 + u * blockDim.x));
      seen = v[u].x;
      if (!any_sentinel(v[u])) miss &= ~(1u << u);
    }
}

// Line 9 for a slot whose token came: round 1 from the registers that polled it, then every
// later round (large payloads) polled until whole; each group copied and reset.
EP_DEVICE void take_landing(const A2AParams& p, int r, int i, unsigned f, unsigned total, uint4 (&v)[U]) {
  const auto take = [&](unsigned x, const uint4& value) { take_group(p, r, i, x, value); };
  store_round(v, threadIdx.x, total, take);
  for (unsigned x0 = threadIdx.x + U * blockDim.x; x0 < total; x0 += U * blockDim.x) {
    unsigned miss = 0, seen = 0;
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (x0 + u * blockDim.x < total) miss |= 1u << u;
    repoll(p, r, i, x0, v, miss, seen);
    if (miss)
      wait_until(p, EP_PHASE_SENTINEL_DISPATCH, r, f, 0, [&](unsigned& sn) {
        repoll(p, r, i, x0, v, miss, sn);
        return miss == 0;
      });
    store_round(v, x0, total, take);
  }
}

// Lines 5-11 for slot i of source r: the first poll of its landing groups and of its ids all
// in flight, the ids (warp 0) and the missing groups (every thread) awaited, then taken.
// Lines 6-8 stay inline: as functions they changed how ptxas kept the polled values.
EP_DEVICE void receive_slot(const A2AParams& p, unsigned* s_state, int r, int i, unsigned f, unsigned tag) {
  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank, K = p.top_k, W = K + 1;
  const bool active = rank_active(p, r);  // an inactive rank sends nothing: its region holds no token
  const unsigned total = active ? landing_groups(p) : 0;
  // Round 1: the first poll of every landing group and of the id words, all in flight.
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = sentinel4();
  load_round(v, threadIdx.x, total, [&](unsigned x) { return ld_relaxed_sys(landing_ptr(p, r, i, x)); });
  unsigned* const word = id_slot(p, s, r, i, f) + threadIdx.x;
  unsigned id = static_cast<unsigned>(-1);
  if (active && threadIdx.x < W) id = ld_relaxed_sys(word);
  unsigned miss = 0;
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (threadIdx.x + u * blockDim.x < total && any_sentinel(v[u])) miss |= 1u << u;

  // Lines 6-7, warp 0: the ids (and our part of line 14: their reset, to our own memory).
  int* const out_ids = section<int>(p, s, p.payloads[0].recv_offset) + (static_cast<size_t>(r) * tmax + i) * K;
  bool has = false;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    if (active && lane < W) {
      if (id == EP_SENTINEL_IDS) {
        const bool came = wait_until(p, EP_PHASE_SENTINEL_DISPATCH, r, f, 0, [&](unsigned& seen) {
          seen = id = ld_relaxed_sys(word);
          return id != EP_SENTINEL_IDS;
        });
        if (!came) id = static_cast<unsigned>(-1);
      }
      *word = EP_SENTINEL_IDS;
      if (lane == K && id != static_cast<unsigned>(-1)) check_step_tag(p, EP_PHASE_SENTINEL_DISPATCH, r, f, id);
    }
    // poison once any rank gave up (protocol.cuh; abort mode only)
    const int poison = __shfl_sync(0xffffffffu, p.abort_on_timeout && lane == 0 && ld_volatile(abort_word(p, s)) != 0, 0);
    if (poison) id = static_cast<unsigned>(-1);
    has = __ballot_sync(0xffffffffu, lane < K && static_cast<int>(id) != -1) != 0;
    if (lane < K) out_ids[lane] = static_cast<int>(id);
    if (lane == 0) {
      *has_slot(p, r, i) = has;
      atomicExch(s_state, tag << 2 | (has ? TOKEN : NONE));
    }
  }
  // Line 8, every thread: the groups still missing, until they come or the verdict is "none".
  bool gave_up = false;
  if (miss && verdict(s_state, tag) != NONE)
    gave_up = !wait_until(p, EP_PHASE_SENTINEL_DISPATCH, r, f, 0, [&](unsigned& seen) {
      seen = 0;
      if (verdict(s_state, tag) == NONE) return true;
      repoll(p, r, i, threadIdx.x, v, miss, seen);
      return miss == 0;
    });
  // true: a token came whole (thread 0 holds warp 0's verdict; a failed wait spoils it)
  const bool ok = __syncthreads_and(!gave_up && (threadIdx.x != 0 || has));
  if (threadIdx.x < 32 && has && !ok) {  // (a wait gave up: the slot reads as empty)
    if (threadIdx.x < K) out_ids[threadIdx.x] = -1;
    if (threadIdx.x == 0) *has_slot(p, r, i) = 0;
  }
  if (ok) take_landing(p, r, i, f, total, v);
}

// ---- combine, line 13: part c of C of M[r][i][s] <- Wc[s][r][i], for a slot that held a token
// (has, written by our dispatch: never the received ids, see layout.py). The loads of the
// round are issued before the has byte is looked at.
EP_DEVICE void push_part(const A2AParams& p, int r, int i, int c, int C) {
  const int s = p.rank, tmax = p.runtime_max_tokens_per_rank;
  const unsigned groups = (p.combine_bytes + 15) / 16, g0 = groups * c / C, g1 = groups * (c + 1) / C;
  const unsigned char* const src = section<const unsigned char>(p, s, p.off_combine) +
                                   (static_cast<size_t>(r) * tmax + i) * p.combine_bytes;
  const auto load = [&](unsigned x) { return load_group(src, p.combine_bytes, p.combine_vec, x); };
  uint4 v[U];
  load_groups(v, g0, g1, load);
  if (!*has_slot(p, r, i)) return;
  uint4* const dst = reinterpret_cast<uint4*>(combine_slot(p, r, i, s));
  for (unsigned x0 = g0 + threadIdx.x;; x0 += U * blockDim.x) {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (x0 + u * blockDim.x < g1) st_relaxed_sys(dst + x0 + u * blockDim.x, escape4(v[u], p.combine_kind));
    if (x0 + U * blockDim.x >= g1) break;
    load_round(v, x0 + U * blockDim.x, g1, load);
  }
}

// Line 13 by blocks [0, p.combine_push_blocks) (the host's split of the grid): every received
// slot, in C parts of at least a warp's worth of groups when there are blocks to spare.
EP_DEVICE void push_received(const A2AParams& p) {
  const int tmax = p.runtime_max_tokens_per_rank, slots = p.ep_size * tmax, pushers = p.combine_push_blocks;
  const int cap = static_cast<int>((p.combine_bytes + 15) / 16 + 31) / 32;
  const int C = max(1, min(pushers / slots, cap));
  if (static_cast<int>(blockIdx.x) < pushers)
    for (int w = blockIdx.x; w < slots * C; w += pushers) push_part(p, (w / C) / tmax, (w / C) % tmax, w % C, C);
}

// ---- combine, lines 15-19: slice `part` of token i. Each thread polls its 16-byte group of
// every target's combine slot at once (up to 8 in flight, re-polling only the missing), and
// reduces from those registers in FENCE's order (moe_common.cuh: pairwise tree over groups
// of 8, absent members +0, group sums in order); then resets the slots.
template <typename T>
union Group {
  uint4 raw;
  T el[16 / sizeof(T)];
};
// Member k's slot, addressed from its target rank (shared memory) on use: eight 64-bit
// pointers held live through the poll loop spilled.
struct Members {
  const char* slot0;  // this thread's group of M[s][i][0]
  const int* target;  // shared: the targets, in the order of their first selection
  unsigned stride;    // combine_slot_bytes
  EP_DEVICE const uint4* at(int k) const {
    return reinterpret_cast<const uint4*>(slot0 + static_cast<size_t>(target[k]) * stride);
  }
};
// Members c..c+7 (those present: bits of `present`) polled together until none holds a
// sentinel word; absent ones read +0 (as in reduce_vectors).
template <typename T>
EP_DEVICE void poll_chunk(const A2AParams& p, unsigned f, const Members& m, int c, unsigned present, Group<T> (&in)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    in[k].raw = make_uint4(0, 0, 0, 0);
    if ((present >> k) & 1) in[k].raw = ld_relaxed_sys(m.at(c + k));
  }
  unsigned miss = present;
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (((present >> k) & 1) && !any_sentinel(in[k].raw)) miss &= ~(1u << k);
  // wait_until's loop, with the peer a failure names taken at each failed poll: the first
  // member still missing then (at the first poll even our own push may not have landed).
  Deadline dl;
  unsigned why = 0, seen = 0;  // (seen: the first word of the member a failure names)
  int peer = 0;
  while (miss) {
    bool named = false;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if ((miss >> k) & 1) {
        in[k].raw = ld_relaxed_sys(m.at(c + k));
        if (!any_sentinel(in[k].raw))
          miss &= ~(1u << k);
        else if (!named) {
          seen = in[k].raw.x;
          named = true;
        }
      }
    if (miss) {
      peer = m.target[c + __ffs(miss) - 1];
      if ((why = dl.expired(p, peer)) != 0) break;
    }
  }
  if (why) {
    // The step failed. Reported first, so that no polled register is live across the call
    // (it would spill them); then every member reads as the sentinel, whose all-ones
    // words are NaN in every float format: the group's sum is NaN in every lane, where a
    // member whose vector had partly landed left NaN only in its missing lanes.
    Deadline::failed(p, why, EP_PHASE_SENTINEL_COMBINE, peer, f, seen, 0);
#pragma unroll
    for (int k = 0; k < 8; ++k) in[k].raw = (present >> k) & 1 ? sentinel4() : make_uint4(0, 0, 0, 0);
  }
}
// The 8-member tree of reduce_vectors, its first level formed straight from the vectors.
template <typename T>
EP_DEVICE void tree8(const Group<T> (&in)[8], float (&sum)[16 / sizeof(T)]) {
  constexpr int E = 16 / sizeof(T);
  float x[4][E];
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int e = 0; e < E; ++e) x[k][e] = to_float<T>(in[2 * k].el[e]) + to_float<T>(in[2 * k + 1].el[e]);
#pragma unroll
  for (int e = 0; e < E; ++e) sum[e] = (x[0][e] + x[1][e]) + (x[2][e] + x[3][e]);
}
EP_DEVICE unsigned present_bits(int n, int c) { return n - c >= 8 ? 0xFFu : (1u << max(n - c, 0)) - 1; }

template <typename T>
EP_DEVICE void reduce_part(const A2AParams& p, unsigned f, const int* records, int i, int part,
                           const char** s_src, int* s_tgt, int* s_n) {
  constexpr int E = 16 / sizeof(T);
  const int s = p.rank;
  collect_sources(records, p.top_k, i, [&](int t, int) -> const char* { return combine_slot(p, s, i, t); },
                  s_src, s_tgt, s_n);
  __syncthreads();
  const int n = *s_n, splits = p.combine_splits;
  const unsigned groups = (p.combine_bytes + 15) / 16;
  const unsigned g0 = groups * part / splits, g1 = groups * (part + 1) / splits;
  unsigned char* const out = reinterpret_cast<unsigned char*>(p.combine_out) + static_cast<size_t>(i) * p.combine_bytes;
  for (unsigned gb = g0; gb < g1; gb += blockDim.x) {  // (uniform trip count: a barrier inside)
    const unsigned g = gb + threadIdx.x;
    const bool mine = g < g1;
    const Members m{combine_slot(p, s, i, 0) + 16 * static_cast<size_t>(g), s_tgt, static_cast<unsigned>(p.combine_slot_bytes)};
    float acc[E];
    Group<T> in[8];
    if (n <= 8) {  // (n <= min(top_k, ep_size)): one chunk, reduced from the polled registers
      poll_chunk<T>(p, f, m, 0, mine ? present_bits(n, 0) : 0u, in);
      tree8<T>(in, acc);
    } else {
      // More members than one chunk holds in registers: poll every chunk to completion
      // first, then reduce chunk by chunk from strong reloads by this same thread, which
      // read-read coherence orders after its own polls (they can only see the same data).
      for (int c = 0; c < n; c += 8) poll_chunk<T>(p, f, m, c, mine ? present_bits(n, c) : 0u, in);
      for (int c = 0; c < n; c += 8) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          in[k].raw = make_uint4(0, 0, 0, 0);
          if (mine && c + k < n) in[k].raw = ld_relaxed_sys(m.at(c + k));
        }
        float x[E];
        tree8<T>(in, x);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = c == 0 ? x[e] : acc[e] + x[e];
      }
    }
    Group<T> o;
#pragma unroll
    for (int e = 0; e < E; ++e) o.el[e] = from_float<T>(acc[e]);
    if (block_sees_abort(p)) o.raw = make_uint4(~0u, ~0u, ~0u, ~0u);  // poison (protocol.cuh)
    if (mine) {
      store_group(out, p.combine_bytes, p.combine_vec, g, o.raw);
      for (int k = 0; k < n; ++k) *const_cast<uint4*>(m.at(k)) = sentinel4();
    }
  }
  __syncthreads();  // (the shared sources of the next token)
}


// Lines 1-11, or one half of them (EP_PART, protocol.cuh): the send half pushes (lines 2-4)
// and its last block moves the epoch on; the receive half, a later kernel of this stream,
// reads the step back from it and polls (lines 5-11).
template <int PART>
EP_DEVICE void sentinel_dispatch_part(const A2AParams& p) {
  __shared__ Send sh;
  __shared__ unsigned s_state;  // receive_slot's verdict
  // Addresses from the parameters are taken before griddep_wait: they overlap the tail of
  // the previous kernel instead of following it (as in fence.cu).
  int* const records = section<int>(p, p.rank, p.off_records);
  if (threadIdx.x == 0) s_state = ~0u;  // no item's tag (the first barrier below publishes it)
  warm_params(p);
  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const int tmax = p.runtime_max_tokens_per_rank;
  unsigned f, arrival = 0;
  if constexpr (PART != EP_RECEIVE) {
    // C blocks share each token slot's push: the grid, but at least a warp's worth of groups each.
    const int C = max(1, min(static_cast<int>(gridDim.x) / tmax, static_cast<int>((landing_groups(p) + 31) / 32)));

    // Lines 2-4: token i lands in slot i of our region on each target; every rank gets the
    // expert ids of every one of our T^ slots (-1 where nothing goes), plus our step tag.
    bool first = true;
    for (int w = blockIdx.x; w < tmax * C; w += gridDim.x, first = false) send_part(p, sh, w / C, w % C, C, records, first, arrival);
    if (first) {  // no part to send: the step counter as in send_part
      if (threadIdx.x == counter_thread()) arrival = arrive(p, sh.f);
      __syncthreads();
    }
    f = sh.f;
  } else {
    f = read_epoch(p);  // (the send half's last block moved it on)
    __syncthreads();    // (s_state)
  }
  if constexpr (PART != EP_SEND)  // Lines 5-11: for every source r and slot i (of region r of Wd[s]).
    for (int w = blockIdx.x; w < p.ep_size * tmax; w += gridDim.x) receive_slot(p, &s_state, w / tmax, w % tmax, f, w);

  if (!p.trigger_early) griddep_launch_dependents();
  if constexpr (PART != EP_RECEIVE)
    if (threadIdx.x == counter_thread() && arrival == gridDim.x - 1) {  // the last block to arrive (arrive())
      fence_acq_rel_gpu();  // acquire: every block's read of the counter comes first
      advance_epoch(p, f);
      *section<unsigned>(p, p.rank, p.off_done) = 0;  // every block has arrived: 0 for the next kernel
    }
}

// Lines 12-19. T: element type of the partial results.
template <typename T>
__device__ void sentinel_combine(const A2AParams& p) {
  __shared__ const char* s_src[EP_MAX_TOP_K];
  __shared__ int s_tgt[EP_MAX_TOP_K];
  __shared__ int s_n;
  const int* const records = section<const int>(p, p.rank, p.off_records);  // (before the wait, as in dispatch)
  warm_params(p);
  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();
  const unsigned f = read_epoch(p);
  // The host gives the grid one block more than the work, so at small batches the last
  // block does nothing but this (its release fence stays off every other block's path).
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < 32) sentinel_combine_begins(p, f);  // protocol.cuh

  const int G = gridDim.x, reduces = p.local_num_tokens * p.combine_splits, splits = p.combine_splits;
  // Small batches (the host sizes the grid for it): the reducing blocks are not the pushing
  // ones, so they collect their sources and start polling at once; blocks [0, pushers) push,
  // the next `reduces` reduce, the last publishes. Otherwise every block does both.
  const int pushers = p.combine_push_blocks;
  const bool apart = pushers < G;
  push_received(p);  // line 13
  const int r0 = apart ? static_cast<int>(blockIdx.x) - pushers : static_cast<int>(blockIdx.x);
  for (int w = r0; w >= 0 && w < reduces; w += apart ? reduces : G)  // lines 15-19
    reduce_part<T>(p, f, records, w / splits, w % splits, s_src, s_tgt, &s_n);
  if (!p.trigger_early) griddep_launch_dependents();  // no block waits on a peer any more
}

#ifdef EP_HALVES

// The halves of lines 12-19 (EP_SEND, EP_RECEIVE: protocol.cuh). The send half publishes the
// combine flag from its last block (as the whole kernel) and pushes our partial results from
// the others (line 13); the receive half polls and reduces (lines 15-19) in every block.
EP_DEVICE void combine_send(const A2AParams& p) {
  griddep_wait();
  if (p.trigger_early) griddep_launch_dependents();  // (the receive half only waits for us to end)
  const unsigned f = read_epoch(p);
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < 32) sentinel_combine_begins(p, f);  // protocol.cuh
  push_received(p);  // line 13: every block but the publishing one (one block alone does both)
  if (!p.trigger_early) griddep_launch_dependents();
}
template <typename T>
EP_DEVICE void combine_receive(const A2AParams& p) {
  __shared__ const char* s_src[EP_MAX_TOP_K];
  __shared__ int s_tgt[EP_MAX_TOP_K];
  __shared__ int s_n;
  const int* const records = section<const int>(p, p.rank, p.off_records);
  griddep_wait();
  const unsigned f = read_epoch(p);
  const int splits = p.combine_splits, reduces = p.local_num_tokens * splits;
  for (int w = blockIdx.x; w < reduces; w += gridDim.x)  // lines 15-19
    reduce_part<T>(p, f, records, w / splits, w % splits, s_src, s_tgt, &s_n);
  griddep_launch_dependents();
}
#endif
}  // namespace

// Launch bounds (512, 2): at most 64 registers, so 4 blocks of 256 threads fit on an SM (the
// host sizes grids by the occupancy of every protocol kernel); as in fence.cu.
#ifndef EP_HALVES
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_dispatch(const __grid_constant__ A2AParams p) { sentinel_dispatch_part<EP_WHOLE>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_bf16(const __grid_constant__ A2AParams p) { sentinel_combine<__nv_bfloat16>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_f16(const __grid_constant__ A2AParams p) { sentinel_combine<__half>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_f32(const __grid_constant__ A2AParams p) { sentinel_combine<float>(p); }
#else  // the halves (the name says which; kernels/protocol.cuh: EP_WHOLE)
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_dispatch_send(const __grid_constant__ A2AParams p) { sentinel_dispatch_part<EP_SEND>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_dispatch_recv(const __grid_constant__ A2AParams p) { sentinel_dispatch_part<EP_RECEIVE>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_send_bf16(const __grid_constant__ A2AParams p) { combine_send(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_recv_bf16(const __grid_constant__ A2AParams p) { combine_receive<__nv_bfloat16>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_send_f16(const __grid_constant__ A2AParams p) { combine_send(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_recv_f16(const __grid_constant__ A2AParams p) { combine_receive<__half>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_send_f32(const __grid_constant__ A2AParams p) { combine_send(p); }
extern "C" __global__ void __launch_bounds__(512, 2) sentinel_combine_recv_f32(const __grid_constant__ A2AParams p) { combine_receive<float>(p); }
#endif
