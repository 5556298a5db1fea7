// The steps FENCE and SENTINEL share (paper §4): warming the parameters, workspace access,
// the step counter, the bounded wait and its failure record, the last-block election,
// publishing flags to the peers, and the hand-over between the protocols (protocol="auto").
//
// Names follow the paper: s is this rank, f the step (flag value), done the local counter
// of finished blocks, F[r][s] the flag source s writes on rank r.
#pragma once
#include "ptx.cuh"
#include "generated/params.cuh"

// ---- parts of a phase
// A kernel runs a whole dispatch or combine, or one half of it (the overlap API,
// ep_a2a/halves.py): the send half issues every store and flag and returns without waiting on
// a peer; the receive half, a later kernel of the same stream, waits and delivers. One
// template parameter, so the whole kernels compile as before.
enum : int { EP_WHOLE = 0, EP_SEND = 1, EP_RECEIVE = 2 };

// ---- parameters
// The parameters live in constant bank 0, which a kernel finds cold: the address
// computations after griddep_wait would chain several line misses. One load per 64-byte line,
// issued by the first warp before griddep_wait, moves those misses onto the previous kernel's
// tail. Only grids that trigger their successor early do it (launched early themselves in
// steady state); elsewhere the misses would sit on the kernel's own path. The shared store is
// a use that ptxas cannot drop; every thread writes its own word.
EP_DEVICE void warm_params(const A2AParams& p) {
  if (!p.trigger_early) return;
  constexpr unsigned LINE = 64 / sizeof(unsigned), N = sizeof(A2AParams) / sizeof(unsigned);
  static_assert(N <= 32 * LINE, "the first warp warms every line");
  __shared__ unsigned sink[32];
  const unsigned i = threadIdx.x * LINE;
  if (i < N) st_volatile(&sink[threadIdx.x], reinterpret_cast<const unsigned*>(&p)[i]);
}

// ---- workspaces
// Rank r's workspace as mapped here (r == p.rank: our own).
EP_DEVICE char* workspace(const A2AParams& p, int r) { return reinterpret_cast<char*>(p.peer_base[r]); }
// The section at byte `offset` of rank r's workspace, as an array of T.
template <typename T>
EP_DEVICE T* section(const A2AParams& p, int r, unsigned long long offset) {
  return reinterpret_cast<T*>(workspace(p, r) + offset);
}
EP_DEVICE bool rank_active(const A2AParams& p, int r) { return (p.active[r >> 5] >> (r & 31)) & 1u; }
EP_DEVICE unsigned* abort_word(const A2AParams& p, int r) { return section<unsigned>(p, r, p.off_abort); }

// ---- the peers' scope
// The flags order the peers' accesses to each other's workspaces. When every rank of the
// group lives on this GPU (p.peers_on_device), every such access is made by a thread of this
// device to this device's memory, so gpu scope orders them all; its fence waits for this
// GPU's L2 alone, not for the system's acknowledgements, and sits on the critical path of
// both phases at small batches. Otherwise system scope (other GPUs over NVLink). The branch
// is uniform: one parameter of the launch.
EP_DEVICE void fence_release_peers(const A2AParams& p) {
  if (p.peers_on_device) fence_acq_rel_gpu(); else fence_release_sys();
}
template <typename W>
EP_DEVICE W ld_acquire_peers(const A2AParams& p, const W* w) {
  return p.peers_on_device ? ld_acquire_gpu(w) : ld_acquire_sys(w);
}
template <typename W>
EP_DEVICE void st_relaxed_peers(const A2AParams& p, W* w, W v) {
  if (p.peers_on_device) st_relaxed_gpu(w, v); else st_relaxed_sys(w, v);
}

// The step counter (epoch) of this rank: the previous kernel of this stream left it, so
// every block reads it before the last block of a dispatch moves it on.
EP_DEVICE unsigned read_epoch(const A2AParams& p) { return ld_volatile(section<unsigned>(p, p.rank, p.off_epoch)); }
EP_DEVICE void advance_epoch(const A2AParams& p, unsigned f) { *section<unsigned>(p, p.rank, p.off_epoch) = f; }
// The word after the epoch: 1 when this rank's last combine was SENTINEL's, 0 after FENCE's
// (the protocol switch below). Kept on the device, not decided by the host from its last
// call: an engine replays graphs captured in one order in any other.
EP_DEVICE unsigned* last_combine_sentinel(const A2AParams& p) { return section<unsigned>(p, p.rank, p.off_epoch) + 1; }

// ---- failure record
// Why a wait failed, in host-mapped memory that outlives a lost context (the first failing
// thread of the rank writes it). Then trap (the default: nothing runs on stale data), or with
// abort_on_timeout tell every active peer through its abort word, so that all ranks stop
// waiting at once, and return without the data (indices stay within our own workspace).
// Out of line (EP_COLD) in SENTINEL's sm_90 kernels, off the code decode batches fetch; inline
// in FENCE's (EP_COLD_INLINE) and on sm_100/103, where calls spill. (`inline`: linkage only.)
#if __CUDA_ARCH__ >= 1000 || defined(EP_COLD_INLINE)
#define EP_COLD EP_DEVICE
#else
#define EP_COLD __device__ __noinline__ inline
#endif
EP_COLD void write_record(const A2AParams& p, unsigned kind, int phase, int peer,
                             unsigned epoch, unsigned observed, unsigned expected) {
  ErrorRecord* rec = reinterpret_cast<ErrorRecord*>(p.error_record);
  // The host decodes the record as soon as `kind` is non-zero, so `kind` is written last,
  // with release order after the fields; the claim word decides which thread writes them.
  if (atomicCAS(&rec->claim, 0u, 1u) == 0u) {
    st_volatile(&rec->rank, p.rank); st_volatile(&rec->phase, phase); st_volatile(&rec->peer, peer);
    st_volatile(&rec->epoch, epoch); st_volatile(&rec->observed, observed); st_volatile(&rec->expected, expected);
    st_release_sys(&rec->kind, kind);
    fence_release_sys();  // (pushes the record out before a trap)
  }
}
EP_COLD void report_failure(const A2AParams& p, unsigned kind, int phase, int peer,
                             unsigned epoch, unsigned observed, unsigned expected) {
  write_record(p, kind, phase, peer, epoch, observed, expected);
  if (!p.abort_on_timeout) trap();
  for (int r = 0; r < p.ep_size; ++r)
    if (rank_active(p, r)) atomicCAS(abort_word(p, r), 0u, static_cast<unsigned>(p.rank) + 1);
}

// A peer's step tag (T^ and active-set hash) differs from ours: the ranks disagree on the step.
// A peer that rejected its input takes part without tokens and says so in its tag: that is
// recorded (the host raises it at the next dispatch) and the step goes on, in either mode.
// The rejecting rank itself checks nothing: its host has raised already.
EP_COLD void step_tags_differ(const A2AParams& p, int phase, int peer, unsigned f, unsigned peer_tag) {
  if (peer_tag & EP_TAG_REJECT) {
    write_record(p, EP_ERR_PEER_REJECTED, phase, peer, f, peer_tag, p.step_tag);
    // The rejecting rank never launches again, and our host may have queued more steps
    // before it reads the record: our abort word makes their waits give up (Deadline),
    // in trap mode too, and their outputs poisoned, instead of waiting out the timeout.
    atomicCAS(abort_word(p, p.rank), 0u, static_cast<unsigned>(peer) + 1);
  } else
    report_failure(p, EP_ERR_TMAX_MISMATCH, phase, peer, f, peer_tag, p.step_tag);
}
EP_DEVICE void check_step_tag(const A2AParams& p, int phase, int peer, unsigned f, unsigned peer_tag) {
  if (peer_tag != p.step_tag && !(p.step_tag & EP_TAG_REJECT)) step_tags_differ(p, phase, peer, f, peer_tag);
}

// ---- after an abort: outputs that say so
// A failed wait in abort mode leaves the outputs as the workspace held them, so once its
// waits are over every kernel asks whether any rank gave up (our abort word, sticky) and
// writes poison instead: -1 expert ids, all-ones (NaN) combined rows, which an engine
// replaying graphs sees without a Python call (MoeAlltoAll.error() says why). The answer is
// block-uniform, a barrier too. In trap mode it is false without a load: only a rejection
// ends a wait there, and missing data poisons itself (FENCE: count 0 and the combine's
// failed wait; SENTINEL: an unwritten slot still holds its all-ones sentinel).
EP_DEVICE bool block_sees_abort(const A2AParams& p) {
  return __syncthreads_or(p.abort_on_timeout && threadIdx.x == 0 && ld_volatile(abort_word(p, p.rank)) != 0);
}
// Bytes [b0, b1) of an output row set to all-ones (a failure path: plain byte stores).
EP_DEVICE void poison_bytes(char* row, size_t b0, size_t b1) {
  for (size_t b = b0 + threadIdx.x; b < b1; b += blockDim.x) row[b] = static_cast<char>(0xFF);
}

// ---- FENCE's dispatch flag F[r][s]
// Two 64-bit words, f << 32 | C[r][s] and f << 32 | the step tag of s (T^ and the active-set
// hash: check_step_tag), stored to a peer as one vector. The two words are separate accesses
// with no order between them, so a reader takes the flag once both carry step f: both are
// then this step's (a peer cannot publish step f + 1 before we have finished step f), and
// line 11's acquire delivers the count and the tag with no dependent load after it.
EP_DEVICE ulonglong2 dispatch_flag(unsigned f, unsigned count, unsigned tag) {
  return make_ulonglong2((static_cast<uint64_t>(f) << 32) | count, (static_cast<uint64_t>(f) << 32) | tag);
}
EP_DEVICE unsigned flag_step(uint64_t w) { return static_cast<unsigned>(w >> 32); }
EP_DEVICE unsigned flag_count(const ulonglong2& v) { return static_cast<unsigned>(v.x); }
EP_DEVICE unsigned flag_tag(const ulonglong2& v) { return static_cast<unsigned>(v.y); }
// C[s][r] as the flag F[s][r] of this rank's last dispatch delivered it (that dispatch, an
// earlier kernel of this stream, acquired it); flags: our section at off_dispatch_flags.
EP_DEVICE unsigned dispatched_count(const char* flags, int r) {
  return static_cast<unsigned>(ld_volatile(reinterpret_cast<const uint64_t*>(flags) + 2 * r));
}
// The step the flag has reached: the older of its two words.
EP_DEVICE unsigned flag_reached(const ulonglong2& v, unsigned f) {
  const unsigned a = flag_step(v.x), b = flag_step(v.y);
  return static_cast<int>(a - f) < 0 ? a : b;
}

// ---- the wait with a deadline
// `give_up` is called once per failed poll: the deadline is set on first use (a wait that
// succeeds at once never reads the timer); every 16th poll also looks at our abort word,
// so that in abort mode one rank's failure ends every rank's waits, and in either mode a
// peer's rejected step ends the waits of the steps queued after it (check_step_tag). Only
// the rank's own timeout traps (trap mode).
// Returns true when the caller must stop waiting (never on a trap-mode timeout: that traps).
// A wait whose loop keeps many values in registers asks `expired` and, once it has let go of
// them, reports through `failed` itself (SENTINEL's combine poll): a call with those values
// live makes ptxas spill them.
struct Deadline {
  uint64_t end = 0;
  unsigned polls = 0;
  // 0 while the wait goes on; else why it stops: EP_ERR_PEER_ABORTED (`peer` becomes the
  // rank that aborted) or EP_ERR_TIMEOUT.
  EP_DEVICE unsigned expired(const A2AParams& p, int& peer) {
    if ((++polls & 15) == 0) {
      const unsigned a = ld_volatile(abort_word(p, p.rank));
      if (a != 0) {
        peer = static_cast<int>(a) - 1;
        return EP_ERR_PEER_ABORTED;
      }
    }
    const uint64_t now = globaltimer_ns();
    if (end == 0) end = now + p.timeout_ns;
    return now <= end ? 0u : static_cast<unsigned>(EP_ERR_TIMEOUT);
  }
  // The record of a wait that stopped for `why`; only our own timeout in trap mode traps.
  static EP_COLD void failed(const A2AParams& p, unsigned why, int phase, int peer, unsigned epoch, unsigned observed,
                             unsigned expected) {
    if (why == EP_ERR_PEER_ABORTED && !p.abort_on_timeout)
      write_record(p, why, phase, peer, epoch, observed, expected);
    else
      report_failure(p, why, phase, peer, epoch, observed, expected);
  }
  EP_DEVICE bool give_up(const A2AParams& p, int phase, int peer, unsigned epoch, unsigned observed,
                         unsigned expected) {
    const unsigned why = expired(p, peer);
    if (why) failed(p, why, phase, peer, epoch, observed, expected);
    return why != 0;
  }
};

// Every wait of the protocols: poll(seen) reads once, leaves what it read for the failure
// record in `seen` and says whether the wait is over. Returns false when the wait gave up
// (abort mode; otherwise the failure traps): the caller's last read stands.
template <typename Poll>
EP_DEVICE bool wait_until(const A2AParams& p, int phase, int peer, unsigned epoch, unsigned expected, Poll&& poll) {
  Deadline dl;
  unsigned seen;
  while (!poll(seen))
    if (dl.give_up(p, phase, peer, epoch, seen, expected)) return false;
  return true;
}

// Wait until a peer's 32-bit step word reaches f (wrap-safe): F[s][peer] = f.
EP_DEVICE uint32_t wait_step(const A2AParams& p, const uint32_t* flag, uint32_t f, int phase, int peer) {
  uint32_t v;
  wait_until(p, phase, peer, f, f, [&](unsigned& seen) {
    seen = v = ld_acquire_peers(p, flag);
    return static_cast<int>(v - f) >= 0;
  });
  return v;
}

// "wait until all F[s][r] = f", thread-strided over the active ranks only: an inactive
// rank is never waited for. False when one of this thread's waits gave up.
EP_DEVICE bool wait_steps(const A2AParams& p, unsigned long long off_flags, uint32_t f, int phase) {
  const unsigned* flags = section<const unsigned>(p, p.rank, off_flags);
  bool all = true;
  for (int r = threadIdx.x; r < p.ep_size; r += blockDim.x)
    if (rank_active(p, r)) all &= static_cast<int>(wait_step(p, flags + r, f, phase, r) - f) >= 0;
  return all;
}

// ---- the last-block election: one release fence per rank and step
//
// Why one fence by the last block covers every block's remote stores: each block's stores
// are ordered before its increment of `done` (bar.sync, then the release half of thread 0's
// atom.acq_rel); the last block's increment reads the final value, so its acquire half
// synchronizes with every one of those releases. Gpu scope suffices: only our blocks touch
// `done`. All those stores therefore precede, in causality order, the release fence
// (fence_release_peers) that each publishing lane executes next (cumulativity: a fence
// orders what its thread has observed, not only what it wrote), once that lane has acquired
// `done` itself or is ordered after thread 0 by a bar.sync. A peer that reads the flag with
// an acquire of the same scope then observes every store we made before it.
struct FinishedBlocks {
  unsigned* done;  // the local counter of finished blocks, 0 between kernels
  EP_DEVICE explicit FinishedBlocks(const A2AParams& p) : done(section<unsigned>(p, p.rank, p.off_done)) {}

  // Every thread of the block calls it; true in all threads of the last block to get here.
  // one_block: a grid of one block is its own last block (the counter is not touched).
  EP_DEVICE bool elect_last(bool one_block = false) const {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) s_last = one_block || atomic_add_acq_rel_gpu(done, 1u) == gridDim.x - 1;
    __syncthreads();
    return s_last;
  }
  // A publishing lane's own acquire of the final count (see above).
  EP_DEVICE void acquire() const { ld_acquire_gpu(done); }
  // By the last block, once every block has incremented: ready for the next kernel.
  EP_DEVICE void reset() const { *done = 0; }
};

// ---- publishing: F[r][s] <- value(r) for every active rank r
// Warp 0 of the publishing block. The release fence orders everything this thread wrote or
// observed (the election's argument) before the flags. value(r) runs for every rank r in
// order, active or not, so it may also reset per-rank state.
template <typename Flag, typename Value>
EP_DEVICE void publish_flags(const A2AParams& p, unsigned long long off_flags, const Value& value) {
  fence_release_peers(p);
  for (int r = threadIdx.x; r < p.ep_size; r += 32) {
    const Flag v = value(r);
    if (rank_active(p, r)) st_relaxed_peers(p, section<Flag>(p, r, off_flags) + p.rank, v);
  }
}
// The combine flag: "this rank is done reading for step f" (FENCE combine, and SENTINEL's tail).
EP_DEVICE void publish_combine_flag(const A2AParams& p, unsigned f) {
  publish_flags<uint32_t>(p, p.off_combine_flags, [&](int) { return f; });
}

// ---- protocol switch (protocol="auto")
// A SENTINEL combine waits only on the ranks our tokens went to, so another rank may still
// read its dispatch workspace for step f when our FENCE dispatch of f + 1 writes into it.
// So every SENTINEL combine publishes its combine flag, and a FENCE dispatch after a SENTINEL
// step (last_combine_sentinel, ordered by the kernel boundary) waits for every rank's flag.
//
// The flag is published at the combine's start, by one warp without an election: it promises
// only that we no longer touch what a peer's FENCE dispatch writes, which earlier kernels of
// this stream alone did (performed once griddep_wait returned; the release fence orders them
// anyway). Nor does the combine: it reads its records, the has bytes (never the received
// ids), its own partial results and the combine slots.
EP_DEVICE void sentinel_combine_begins(const A2AParams& p, unsigned f) {  // warp 0 of one block
  publish_combine_flag(p, f);
  if (threadIdx.x == 0) *last_combine_sentinel(p) = 1;
}
EP_DEVICE void record_fence_combine(const A2AParams& p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *last_combine_sentinel(p) = 0;
}
// Before a FENCE dispatch of step f writes to any peer, when step f - 1 was SENTINEL's.
EP_DEVICE void wait_sentinel_step_done(const A2AParams& p, unsigned f) {
  if (ld_volatile(last_combine_sentinel(p))) {
    wait_steps(p, p.off_combine_flags, f - 1, EP_PHASE_DISPATCH);
    __syncthreads();
  }
}
