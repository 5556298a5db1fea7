// Every inline PTX instruction and volatile access of the kernels, as tiny helpers named by
// operation, memory order and scope (ld_acquire_sys, fence_acq_rel_gpu, ...), so that every
// ordering decision is visible at its call. A fence_ name is always a PTX fence; the FENCE
// protocol's steps are named by their role, its kernels alone by the protocol.
//
// Scopes: `.sys` covers peers on other GPUs and ranks of this GPU mapped at other addresses;
// `.gpu` suffices for counters only this rank's blocks touch, and for the flags when every
// rank lives on this GPU (protocol.cuh's peer-scope helpers pick per launch).
#pragma once
#include <stdint.h>

#define EP_DEVICE __device__ __forceinline__

// ---- acquire loads: later accesses of this thread are ordered after them
EP_DEVICE uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
EP_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v; asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}
EP_DEVICE uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
EP_DEVICE uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v; asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}
// Two 64-bit words, each an acquire of its own with no order between the two (a vector
// access is a set of accesses): FENCE's dispatch flag (protocol.cuh) is made for that.
EP_DEVICE ulonglong2 ld_acquire_sys(const ulonglong2* p) {
  ulonglong2 v;
  asm volatile("ld.acquire.sys.global.v2.u64 {%0,%1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
}
EP_DEVICE ulonglong2 ld_acquire_gpu(const ulonglong2* p) {
  ulonglong2 v;
  asm volatile("ld.acquire.gpu.global.v2.u64 {%0,%1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
}

// ---- volatile loads: read memory on every call (never a value the compiler kept), no
// ordering. For counters written by an earlier kernel of this stream and for the abort word
// (advisory: it only ends a wait sooner). SENTINEL's data polls use the strong loads below.
EP_DEVICE uint32_t ld_volatile(const uint32_t* p) { return *reinterpret_cast<const volatile uint32_t*>(p); }
EP_DEVICE uint64_t ld_volatile(const uint64_t* p) { return *reinterpret_cast<const volatile uint64_t*>(p); }
// ---- strong (relaxed, system scope) loads and stores: SENTINEL's data words
// The promise that each aligned 32-bit word arrives whole and is eventually seen (PTX memory
// model: morally strong accesses) holds only when the store and the load that polls it are
// both strong; NCCL's LL protocol pairs volatile / relaxed.sys accesses the same way. A vector
// access is a set of 32-bit accesses with no order among them, each as strong as the whole,
// which is all a SENTINEL poll needs: every word is checked on its own. The "memory" clobber
// keeps the compiler from moving other accesses of this thread across them, or from reusing
// a value it read before.
EP_DEVICE uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v; asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
EP_DEVICE uint4 ld_relaxed_sys(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
EP_DEVICE void st_relaxed_sys(uint4* p, uint4 v) {
  asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Volatile stores: the error record, which the host reads through a mapping of its own.
EP_DEVICE void st_volatile(uint32_t* p, uint32_t v) { *reinterpret_cast<volatile uint32_t*>(p) = v; }
EP_DEVICE void st_volatile(int* p, int v) { *reinterpret_cast<volatile int*>(p) = v; }

// ---- stores to peers
EP_DEVICE void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
EP_DEVICE void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
EP_DEVICE void st_relaxed_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
EP_DEVICE void st_relaxed_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
EP_DEVICE void st_relaxed_sys(ulonglong2* p, ulonglong2 v) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1,%2};" :: "l"(p), "l"(v.x), "l"(v.y) : "memory");
}
EP_DEVICE void st_relaxed_gpu(ulonglong2* p, ulonglong2 v) {
  asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1,%2};" :: "l"(p), "l"(v.x), "l"(v.y) : "memory");
}
EP_DEVICE void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// The release fence of the protocols. PTX spells the paper's fence.release.sys as the
// acq_rel fence on sm_90; it orders every prior access of this thread (and, by
// cumulativity, every write this thread has observed) before its later writes.
EP_DEVICE void fence_release_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Read-modify-write with both orders at gpu scope (the finished-blocks counter: protocol.cuh).
EP_DEVICE uint32_t atomic_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old; asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Release-only increment (SENTINEL dispatch's arrival count, sentinel.cu): orders this
// thread's earlier accesses before it without waiting for its result; the one thread that
// needs the acquire half adds fence_acq_rel_gpu once it has seen the result.
EP_DEVICE uint32_t atomic_add_release_gpu(uint32_t* p, uint32_t v) {
  uint32_t old; asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
EP_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Asynchronous 4-byte copy from global to shared memory (cp.async, sm_80+): no register
// holds the value while it is in flight, so it can be issued long before its use; the
// issuing thread reads it after cp_async_wait_all.
EP_DEVICE void cp_async_4(void* shared, const void* global) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(s), "l"(global) : "memory");
}
EP_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// 16 bytes, bypassing L1 (.cg); with !valid nothing is read and the 16 bytes become zeros.
// Groups: cp_async_commit closes the copies issued since the last one into a group;
// cp_async_wait<N> returns once at most N of this thread's groups are still in flight.
EP_DEVICE void cp_async_16(void* shared, const void* global, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(global), "r"(valid ? 16 : 0) : "memory");
}
EP_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
EP_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

EP_DEVICE uint64_t globaltimer_ns() {
  uint64_t t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}

// Ends the kernel with an error: the context is lost, so nothing runs on stale data.
EP_DEVICE void trap() { asm volatile("trap;"); }

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

// Thread block clusters (sm_90+): this block's rank in its cluster, and a barrier of every
// thread of the cluster whose arrival releases and whose wait acquires at cluster scope
// (every thread of the cluster calls it, warps converged).
EP_DEVICE uint32_t cluster_block_rank() {
  uint32_t r = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
EP_DEVICE void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// d += a * b over one m16n8k16 tile of bf16 inputs with fp32 accumulation (sm_80+; the
// fragments' layout is the PTX ISA's for mma.m16n8k16 .row.col: kernels/moe_experts.cu).
EP_DEVICE void mma_bf16_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                              unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
