// Pieces shared by the FENCE and SENTINEL kernels: expert -> rank, slot records, vector
// copies and the pairwise reduction of combine.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <type_traits>
#include "protocol.cuh"

// Experts are split over ranks in contiguous blocks; the first `experts_remainder` ranks
// own one more.
EP_DEVICE int rank_of_expert(const A2AParams& p, int e) {
  const int big = p.experts_remainder * (p.experts_per_rank + 1);
  if (e < big) return e / (p.experts_per_rank + 1);
  return p.experts_remainder + (e - big) / p.experts_per_rank;
}

// One selection's record for combine: -1 (no slot: invalid expert, or a second expert of a
// rank the token already reaches) or slot << EP_RECORD_TARGET_BITS | target rank
// (layout.py: RECORD_TARGET_BITS, record_target, record_slot).
EP_DEVICE int pack_record(int slot, int target) { return (slot << EP_RECORD_TARGET_BITS) | target; }
EP_DEVICE int record_target(int rec) { return rec & EP_RECORD_TARGET_MASK; }
EP_DEVICE int record_slot(int rec) { return rec >> EP_RECORD_TARGET_BITS; }

template <int W> struct VecT;
template <> struct VecT<16> { using T = uint4; };
template <> struct VecT<8> { using T = uint2; };
template <> struct VecT<4> { using T = unsigned int; };
template <> struct VecT<2> { using T = unsigned short; };
template <> struct VecT<1> { using T = unsigned char; };

// The rank selection of expert e reaches: -1 for an id outside 0..num_experts-1 (only
// possible when the host check is off: dropped, never followed) or an expert of an
// inactive rank. FENCE's split pushes (earlier_selections) count with it too, so that
// their slots agree with the selections taken here.
EP_DEVICE int selected_rank(const A2AParams& p, int e) {
  const int t = (e >= 0 && e < p.num_experts) ? rank_of_expert(p, e) : -1;
  return t >= 0 && rank_active(p, t) ? t : -1;
}

// Warp 0 of a block turns token i's top_k expert ids into its distinct target ranks, in
// the order of their first selection. Returns, in lanes < top_k, this selection's target
// or -1, and whether this lane is the first selection of its target. Selections of experts
// on inactive ranks are dropped and counted in our `dropped` word (the host reports it) when
// count_lost (where several blocks share a token, only the first of them counts it).
struct Selection { int target; bool first; unsigned firsts; };
// Lane k < top_k: the token's id k (the others -1). Apart from the selection, so that a caller
// can have the load in flight while it waits for something else (FENCE dispatch: the step).
EP_DEVICE int load_ids(const A2AParams& p, const int* ids_of_token) {
  const int lane = threadIdx.x & 31;
  return lane < p.top_k ? ids_of_token[lane] : -1;
}
// e: this lane's id, from load_ids.
EP_DEVICE Selection select_targets(const A2AParams& p, int e, bool count_lost = true) {
  const int lane = threadIdx.x & 31;
  int t = -1;
  bool inactive = false;
  if (lane < p.top_k) {
    t = selected_rank(p, e);
    inactive = t < 0 && e >= 0 && e < p.num_experts;
  }
  const unsigned lost = __ballot_sync(0xffffffffu, inactive);
  if (lost && count_lost && lane == 0)
    atomicAdd(section<unsigned>(p, p.rank, p.off_dropped), __popc(lost));
  const unsigned same = __match_any_sync(0xffffffffu, t);
  const bool first = lane < p.top_k && t >= 0 && (__ffs(same) - 1) == lane;
  return {t, first, __ballot_sync(0xffffffffu, first)};
}
EP_DEVICE Selection select_targets(const A2AParams& p, const int* ids_of_token, bool count_lost = true) {
  return select_targets(p, load_ids(p, ids_of_token), count_lost);
}

// ---- rounds
// A thread moves vectors (16-byte groups, or push_vectors' W-byte vectors) x0, x0 + blockDim.x, ... (x0 counts threadIdx.x in) in rounds of U
// held in registers: every load of a round is issued before any of its stores, so that a
// round's loads are in flight together. load(x) reads vector x; store(x, v) writes it;
// vectors from `end` on are left alone.
template <int U, typename V, typename Load>
EP_DEVICE void load_round(V (&v)[U], unsigned x0, unsigned end, const Load& load) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (x0 + u * blockDim.x < end) v[u] = load(x0 + u * blockDim.x);
}
template <int U, typename V, typename Store>
EP_DEVICE void store_round(const V (&v)[U], unsigned x0, unsigned end, const Store& store) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (x0 + u * blockDim.x < end) store(x0 + u * blockDim.x, v[u]);
}
// The round in v (loaded early by the caller, at x0), then every later one up to `end`.
template <int U, typename V, typename Load, typename Store>
EP_DEVICE void store_rounds(V (&v)[U], unsigned x0, unsigned end, const Load& load, const Store& store) {
  for (;; x0 += U * blockDim.x) {
    store_round(v, x0, end, store);
    if (x0 + U * blockDim.x >= end) break;
    load_round(v, x0 + U * blockDim.x, end, load);
  }
}
// The first round of groups [g0, g1), zero past g1: ptxas then sees every v[u] written
// (each zeroed just before its load: zeroed all first, the callers compiled differently).
template <int U, typename Load>
EP_DEVICE void load_groups(uint4 (&v)[U], unsigned g0, unsigned g1, const Load& load) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const unsigned x = g0 + threadIdx.x + u * blockDim.x;
    v[u] = make_uint4(0, 0, 0, 0);
    if (x < g1) v[u] = load(x);
  }
}

// Each thread loads a vector of the token once and stores it to every target (the stores
// of one token are in flight together); U vectors per thread per round for ILP.
// The distinct targets of one token: the destination of target j is computed on use from
// the shared arrays, so that no per-thread pointer array lands in local memory.
struct Targets {
  const unsigned long long* peer_base;  // A2AParams::peer_base
  const int* target;                    // shared: distinct target ranks of the token
  const int* slot;                      // shared: slot taken on each
  int n;
  size_t region_slot0;                  // source rank * runtime_max_tokens_per_rank
  unsigned long long offset;            // section offset in every workspace
  EP_DEVICE char* dst(int j, unsigned bytes) const {
    return reinterpret_cast<char*>(peer_base[target[j]]) + offset + (region_slot0 + slot[j]) * bytes;
  }
};

// Register pressure: x[] is zeroed before its guarded load, so ptxas sees it written before
// read and the five widths of push_payload share registers. The loop over targets stays
// rolled: unrolled, it would hold several destination pointers at once.
template <int W>
EP_DEVICE void push_vectors(const char* src, const Targets& tg, unsigned bytes) {
  using T = typename VecT<W>::T;
  constexpr int U = 4;
  const unsigned n = bytes / W;
  const T* s = reinterpret_cast<const T*>(src);
  for (unsigned base = threadIdx.x; base < n; base += blockDim.x * U) {
    T x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) x[u] = T{};
    load_round(x, base, n, [&](unsigned v) { return s[v]; });
#pragma unroll 1
    for (int j = 0; j < tg.n; ++j) {
      T* const d = reinterpret_cast<T*>(tg.dst(j, bytes));
      store_round(x, base, n, [&](unsigned v, const T& value) { d[v] = value; });
    }
  }
}

EP_DEVICE void push_payload(unsigned vec, const char* src, const Targets& tg, unsigned bytes) {
  switch (vec) {
    case 16: push_vectors<16>(src, tg, bytes); break;
    case 8: push_vectors<8>(src, tg, bytes); break;
    case 4: push_vectors<4>(src, tg, bytes); break;
    case 2: push_vectors<2>(src, tg, bytes); break;
    default: push_vectors<1>(src, tg, bytes); break;
  }
}

// A token's payloads [FIRST, num_payloads) as one sequence of 16-byte groups, groups(d) of
// payload d each, so that a block's threads share them whatever the payloads: FENCE's
// preloaded push (every payload, its bytes) and SENTINEL's landing slots (payloads 1.., their
// landing bytes). Returns the payload of group x; x becomes the group within it.
template <int FIRST, typename Groups>
EP_DEVICE int payload_of(const A2AParams& p, unsigned& x, const Groups& groups) {
  int q = FIRST;
  while (x >= groups(p.payloads[q])) x -= groups(p.payloads[q++]);
  return q;
}
EP_DEVICE int payload_of_group(const A2AParams& p, unsigned& x) {
  return payload_of<0>(p, x, [](const PayloadDesc& d) { return d.bytes_per_token / 16; });
}
EP_DEVICE int payload_of_landing_group(const A2AParams& p, unsigned& x) {
  return payload_of<1>(p, x, [](const PayloadDesc& d) { return d.landing_bytes / 16; });
}
// SENTINEL: the landing groups of one token slot (FENCE's count is the host's: p.push_groups).
EP_DEVICE unsigned landing_groups(const A2AParams& p) {
  unsigned n = 0;
  for (int q = 1; q < p.num_payloads; ++q) n += p.payloads[q].landing_bytes / 16;
  return n;
}

template <typename T> EP_DEVICE float to_float(T x);
template <> EP_DEVICE float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> EP_DEVICE float to_float<__half>(__half x) { return __half2float(x); }
template <> EP_DEVICE float to_float<float>(float x) { return x; }
template <typename T> EP_DEVICE T from_float(float x);
template <> EP_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> EP_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> EP_DEVICE float from_float<float>(float x) { return x; }

// The reduction of combine, in fp32: the partial results of a token's targets (in the order
// of their first selection) are summed as a pairwise tree over groups of 8 (absent members
// read +0), and the group sums are added in order. reference.py mirrors this order exactly.
//
// The FP8 reduction (combine_q8.cuh) does not dequantize or add absent members: a group of
// M < 8 present members (they are always a prefix) is summed as the tree over those M alone,
// plus +0 once. That is the same number, bit for bit: an add of +0 changes only -0 (to +0),
// the 8-member tree with +0 members returns +0 wherever the present-only tree returns -0,
// and nothing else differs (x + y is -0 only when both are -0, so a subtree holding an
// absent member is never -0).
// The compiler keeps `t + 0.f` (it folds only x + -0, which is exact for every x).

// Members [LO, LO + LEN) of a tree whose first M (>= 1) leaves are present; get(k) reads leaf k.
template <int LO, int LEN, int M, typename Get>
EP_DEVICE float tree_sum(const Get& get) {
  if constexpr (LEN == 1) return get(LO);
  else if constexpr (LO + LEN / 2 >= M) return tree_sum<LO, LEN / 2, M>(get);  // right half absent
  else return tree_sum<LO, LEN / 2, M>(get) + tree_sum<LO + LEN / 2, LEN / 2, M>(get);
}
// A group of M present members, given the sums of its first tree level (pair(j): members
// 2j and 2j + 1, or member 2j alone when 2j + 1 == M). The first level is formed straight
// from the loaded vectors by the callers, so a vector's registers free as its pair is summed.
template <int M, typename Pair>
EP_DEVICE float group_sum(const Pair& pair) {
  if constexpr (M == 0) return 0.f;  // no member at all (a token that reached no rank): +0
  else if constexpr (M == 8) return tree_sum<0, 4, 4>(pair);
  else return tree_sum<0, 4, (M + 1) / 2>(pair) + 0.f;
}

// Calls f(std::integral_constant<int, M>{}) for a group's member count m (0..8), so each
// count gets its own unrolled code; the count is uniform over the block (one token).
template <typename F>
EP_DEVICE void with_members(int m, const F& f) {
  switch (m) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 0>{}); break;
  }
}

// The bf16/fp16/fp32 reduction below keeps all 8 members of a group (absent ones predicated
// off, reading +0): with one add of work per member, specializing per count does not pay.
// Vectors [v0, v1) of one token (v counted in units of W bytes).
template <typename T, int W>
EP_DEVICE void reduce_vectors(const char* const* src, int n, char* out, unsigned v0, unsigned v1) {
  using V = typename VecT<W>::T;
  constexpr int E = W / sizeof(T);
  for (unsigned v = v0 + threadIdx.x; v < v1; v += blockDim.x) {
    float acc[E];
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.f;
    for (int c = 0; c < n || c == 0; c += 8) {
      // An absent member is a zero vector, +0 in bf16, fp16 and fp32; zeroed, each in[k] is
      // seen written before read, so the widths share registers. All 8 loads precede the adds.
      union { V raw; T el[E]; } in[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        in[k].raw = V{};
        if (c + k < n) in[k].raw = __ldcg(reinterpret_cast<const V*>(src[c + k]) + v);
      }
      // First tree level straight from the loaded vectors keeps the live registers low.
      float x[4][E];
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int e = 0; e < E; ++e)
          x[k][e] = to_float<T>(in[2 * k].el[e]) + to_float<T>(in[2 * k + 1].el[e]);
#pragma unroll
      for (int e = 0; e < E; ++e) x[0][e] = (x[0][e] + x[1][e]) + (x[2][e] + x[3][e]);
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = (c == 0) ? x[0][e] : acc[e] + x[0][e];
    }
    union { V raw; T el[E]; } o;
#pragma unroll
    for (int e = 0; e < E; ++e) o.el[e] = from_float<T>(acc[e]);
    reinterpret_cast<V*>(out)[v] = o.raw;
  }
}

template <typename T>
EP_DEVICE void reduce_token(unsigned vec, const char* const* src, int n, char* out, unsigned v0, unsigned v1) {
  if constexpr (sizeof(T) == 4) {
    if (vec == 16) reduce_vectors<T, 16>(src, n, out, v0, v1);
    else if (vec == 8) reduce_vectors<T, 8>(src, n, out, v0, v1);
    else reduce_vectors<T, 4>(src, n, out, v0, v1);
  } else {
    if (vec == 16) reduce_vectors<T, 16>(src, n, out, v0, v1);
    else if (vec == 8) reduce_vectors<T, 8>(src, n, out, v0, v1);
    else if (vec == 4) reduce_vectors<T, 4>(src, n, out, v0, v1);
    else reduce_vectors<T, 2>(src, n, out, v0, v1);
  }
}

// Warp 0 (lane = threadIdx.x), the two halves of collect_sources below, for a caller that
// gets the records its own way (FENCE combine: the block's later items copy theirs ahead).
// load_record: lane k < top_k gets selection k's record of token i, the others -1.
EP_DEVICE int load_record(const int* records, int top_k, int i) {
  const int lane = threadIdx.x & 31;
  return lane < top_k ? records[i * top_k + lane] : -1;
}
// place_sources: the targets of the records `rec` (one per lane), in the order of their first
// selection, into shared memory: src[j] = where(target, slot) and tgt[j] = target; *n (shared)
// gets the count.
template <typename Where>
EP_DEVICE void place_sources(int rec, Where where, const char** src, int* tgt, int* n) {
  const int lane = threadIdx.x;
  const unsigned valid = __ballot_sync(0xffffffffu, rec >= 0);
  if (rec >= 0) {
    const int j = __popc(valid & ((1u << lane) - 1));
    src[j] = where(record_target(rec), record_slot(rec));
    if (tgt) tgt[j] = record_target(rec);
  }
  if (lane == 0) *n = __popc(valid);
}
// Warp 0: the targets recorded for token i by dispatch, placed as place_sources does. Returns
// nothing; the caller synchronizes the block.
template <typename Where>
EP_DEVICE void collect_sources(const int* records, int top_k, int i, Where where, const char** src, int* tgt, int* n) {
  if (threadIdx.x >= 32) return;
  place_sources(load_record(records, top_k, i), where, src, tgt, n);
}

// The finalize's selections (moe_compute.cu, and FC2's in moe_experts.cu): the rows of FIN_K of
// them are loaded together, so each local one then costs one latency, not a chain.
constexpr int FIN_K = 4;

// Rows of selections k0 .. k0 + FIN_K - 1 of one slot (-1: none).
EP_DEVICE void load_selections(const int* sel, int k0, int top_k, int (&row)[FIN_K]) {
#pragma unroll
  for (int j = 0; j < FIN_K; ++j) row[j] = k0 + j < top_k ? sel[k0 + j] : -1;
}
