// Memory-model operations as small named helpers, plus the bounded wait every protocol uses.
//
// Scopes: peers may be other GPUs (NVLink) or other ranks on this GPU mapped through other
// virtual addresses; `.sys` covers both. `.gpu` suffices for counters only this rank's
// blocks touch.
#pragma once
#include <stdint.h>
#include "generated/params.cuh"

#define EP_DEVICE __device__ __forceinline__

EP_DEVICE uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
EP_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v; asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}
EP_DEVICE uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
EP_DEVICE void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
EP_DEVICE void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
EP_DEVICE void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
// The release fence of the protocols. PTX spells the paper's fence.release.sys as the
// acq_rel fence on sm_90; it orders every prior access of this thread (and, by
// cumulativity, every write this thread has observed) before its later writes.
EP_DEVICE void fence_release_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// Finished-blocks counter: release so that the block's stores are ordered before it,
// acquire so that the last block sees every other block's (gpu scope: only our blocks).
EP_DEVICE uint32_t atomic_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old; asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
EP_DEVICE uint64_t globaltimer_ns() {
  uint64_t t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}

// Programmatic dependent launch (sm_90+): wait for the previous kernel in the stream before
// touching what it wrote; let the next kernel start launching early.
EP_DEVICE void griddep_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
EP_DEVICE void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::);
#endif
}

EP_DEVICE bool rank_active(const A2AParams& p, int r) { return (p.active[r >> 5] >> (r & 31)) & 1u; }
EP_DEVICE unsigned* abort_word(const A2AParams& p, int r) {
  return reinterpret_cast<unsigned*>(reinterpret_cast<char*>(p.peer_base[r]) + p.off_abort);
}

// Record why a wait failed where the host can read it even after the context is lost
// (host-mapped pinned memory); the first failing thread of this rank wins the record.
// Then either trap (the default: the context is lost, nothing can run on stale data), or,
// with abort_on_timeout, tell every active peer through its abort word so that all ranks
// stop waiting at once, and return: the caller carries on without the data it waited for
// (every index it uses stays within this rank's own workspace), and the host refuses the
// all-to-all from then on.
EP_DEVICE void report_failure(const A2AParams& p, unsigned kind, int phase, int peer,
                             unsigned epoch, unsigned observed, unsigned expected) {
  ErrorRecord* rec = reinterpret_cast<ErrorRecord*>(p.error_record);
  if (atomicCAS(&rec->kind, 0u, kind) == 0u) {
    volatile ErrorRecord* v = rec;
    v->rank = p.rank; v->phase = phase; v->peer = peer; v->epoch = epoch;
    v->observed = observed; v->expected = expected;
    __threadfence_system();
  }
  if (!p.abort_on_timeout) asm volatile("trap;");
  for (int r = 0; r < p.ep_size; ++r)
    if (rank_active(p, r)) atomicCAS(abort_word(p, r), 0u, static_cast<unsigned>(p.rank) + 1);
}

// A bounded spin. `give_up` is called once per failed poll: the deadline is set on first
// use (a wait that succeeds at once never reads the timer); every 16th poll also looks at
// our abort word, so that in abort mode one rank's failure ends every rank's waits.
// Returns true when the caller must stop waiting (only ever in abort mode).
struct Deadline {
  uint64_t end = 0;
  unsigned polls = 0;
  EP_DEVICE bool give_up(const A2AParams& p, int phase, int peer, unsigned epoch, unsigned observed,
                         unsigned expected) {
    if (p.abort_on_timeout && (++polls & 15) == 0) {
      const unsigned a = *reinterpret_cast<volatile unsigned*>(abort_word(p, p.rank));
      if (a != 0) {
        report_failure(p, EP_ERR_PEER_ABORTED, phase, static_cast<int>(a) - 1, epoch, observed, expected);
        return true;
      }
    }
    const uint64_t now = globaltimer_ns();
    if (end == 0) end = now + p.timeout_ns;
    if (now <= end) return false;
    report_failure(p, EP_ERR_TIMEOUT, phase, peer, epoch, observed, expected);
    return true;
  }
};
