// XLA FFI handler that replays a launch plan prepared in Python at trace time
// (ep_a2a/ops/jax_plan.py writes it, docs/jax.md explains it).
//
// Everything a step decides (T^, protocol, grids, each rank's kernel argument bytes) is
// fixed when JAX traces the call; a plan is registered once through the plain C entry
// points below (loaded with ctypes: no Python ABI here) and named by the call's "plan"
// attribute. A call then only writes the buffer addresses XLA hands it into copies of the
// argument bytes and issues the launches and copies, forked from XLA's stream to every
// in-process rank's stream and joined back: no Python, no GIL, no allocation.
//
// The kernels keep their per-step state (epochs, flags) on the device, so a replay of a
// captured call is a valid next step: the handler is declared command-buffer compatible.
// A call XLA does not capture replays a CUDA graph of its own instead of launching kernel by
// kernel (one cuGraphLaunch for every rank's ops; later calls re-set only the kernels whose
// argument bytes changed); EP_A2A_JAX_OWN_GRAPHS=0 at registration launches kernel by kernel.
#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Plan words (uint64, little-endian), the format ep_a2a/ops/jax_plan.py writes.
constexpr uint64_t kMagic = 0x6570613261666669ull;  // "epa2affi"
constexpr uint64_t kVersion = 1;
enum OpKind : uint64_t { kLaunch = 1, kCopy = 2 };
constexpr uint64_t kAbsolute = ~0ull;  // a copy end that is a fixed address, not an XLA buffer
constexpr int kMaxBuffers = 512;
constexpr int kMaxPlans = 1 << 14;

struct Patch { uint32_t offset; uint32_t buffer; uint64_t add; };

struct Launch {
  CUfunction function;
  unsigned grid, block, shared, cluster;
  bool pdl;
  std::vector<uint64_t> arg_words;   // every argument, each starting on an 8-byte boundary
  std::vector<uint64_t> arg_offsets; // byte offset of each argument in arg_words
  std::vector<Patch> patches;        // 8-byte fields that take an XLA buffer's address
  int64_t timeout_offset;            // -1, or where the wait timeout lives (first steps wait longer)
  uint64_t first_timeout, timeout;
  // per-call scratch: the patched bytes and the kernelParams array pointing into them
  std::vector<uint64_t> scratch;
  std::vector<void*> params;
  CUlaunchAttribute attrs[2];
  unsigned num_attrs;
  // in the group's own graph: its node and the argument bytes that node holds
  CUgraphNode node = nullptr;
  std::vector<uint64_t> live;
};

struct Copy { uint64_t dst_buffer, dst, src_buffer, src, bytes; uint64_t live_dst = 0, live_src = 0; };

struct Op { uint64_t kind; uint32_t rank; Launch launch; Copy copy; };

struct Group {                 // the ranks of one GPU
  int64_t ordinal;
  CUevent fork;
  std::vector<CUstream> streams;
  std::vector<CUevent> joins;
  std::vector<const volatile uint32_t*> records;  // host-mapped ErrorRecord.kind per rank
  std::vector<int64_t> rank_numbers;
  std::vector<Op> ops;
  std::mutex lock;              // one call at a time per GPU (the scratch is per plan)
  uint64_t calls = 0;
  // The own graph (calls XLA does not capture): captured from private streams, so nothing
  // else queued on the ranks' streams can fall into it.
  struct Own {
    bool off = false;           // not used (turned off, or its graph APIs failed once)
    CUstream origin = nullptr;
    std::vector<CUstream> branches;
    CUevent fork = nullptr;
    std::vector<CUevent> joins;
    CUgraph graph = nullptr;
    CUgraphExec exec = nullptr;
    CUcontext ctx = nullptr;    // the context its streams and events were created in
    uint64_t launches = 0;      // calls it served (tests: this path really ran)
    uint64_t updates = 0;       // kernel nodes re-set (benchmarks: how often XLA's buffers move)
  } own;
  ~Group();
};

struct Plan {
  int64_t id = -1;              // never reused: a stale program naming a released plan finds none
  uint64_t buffers;             // operands then results
  uint64_t first_steps;
  bool own_graphs = true;       // calls XLA does not capture replay the group's own graph
  std::vector<Group*> groups;
  ~Plan() { for (auto* g : groups) delete g; }
};

std::atomic<Plan*> plans[kMaxPlans];  // plan id % kMaxPlans
std::mutex registry;
std::shared_mutex in_use;  // shared by every call for its whole run, exclusive while a plan is deleted
int64_t next_id = 0;

Plan* find(int64_t id) {
  if (id < 0) return nullptr;
  Plan* p = plans[id % kMaxPlans].load(std::memory_order_acquire);
  return p && p->id == id ? p : nullptr;
}

// The driver, opened once (libcuda.so.1 is the driver's own library: nothing to link).
struct Driver {
  CUresult (*launch)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*copy)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*record)(CUevent, CUstream) = nullptr;
  CUresult (*wait)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
  CUresult (*get_ctx)(CUcontext*) = nullptr;
  CUresult (*set_ctx)(CUcontext) = nullptr;
  CUresult (*stream_ctx)(CUstream, CUcontext*) = nullptr;
  // the own graph's (absent ones leave it off)
  CUresult (*is_capturing)(CUstream, CUstreamCaptureStatus*) = nullptr;
  CUresult (*begin_capture)(CUstream, CUstreamCaptureMode) = nullptr;
  CUresult (*end_capture)(CUstream, CUgraph*) = nullptr;
  CUresult (*capture_info)(CUstream, CUstreamCaptureStatus*, cuuint64_t*, CUgraph*, const CUgraphNode**, size_t*) = nullptr;
  CUresult (*capture_info3)(CUstream, CUstreamCaptureStatus*, cuuint64_t*, CUgraph*, const CUgraphNode**,
                            const CUgraphEdgeData**, size_t*) = nullptr;
  CUresult (*instantiate)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;
  CUresult (*graph_launch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*set_kernel)(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS*) = nullptr;
  CUresult (*graph_destroy)(CUgraph) = nullptr;
  CUresult (*exec_destroy)(CUgraphExec) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_destroy)(CUstream) = nullptr;
  CUresult (*event_create)(CUevent*, unsigned) = nullptr;
  CUresult (*event_destroy)(CUevent) = nullptr;
  bool ok = false;
  bool graphs = false;
};

const Driver& driver() {
  static Driver d = [] {
    Driver x;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return x;
    x.launch = reinterpret_cast<decltype(x.launch)>(dlsym(lib, "cuLaunchKernelEx"));
    x.copy = reinterpret_cast<decltype(x.copy)>(dlsym(lib, "cuMemcpyDtoDAsync_v2"));
    x.record = reinterpret_cast<decltype(x.record)>(dlsym(lib, "cuEventRecord"));
    x.wait = reinterpret_cast<decltype(x.wait)>(dlsym(lib, "cuStreamWaitEvent"));
    x.error_name = reinterpret_cast<decltype(x.error_name)>(dlsym(lib, "cuGetErrorName"));
    x.get_ctx = reinterpret_cast<decltype(x.get_ctx)>(dlsym(lib, "cuCtxGetCurrent"));
    x.set_ctx = reinterpret_cast<decltype(x.set_ctx)>(dlsym(lib, "cuCtxSetCurrent"));
    x.stream_ctx = reinterpret_cast<decltype(x.stream_ctx)>(dlsym(lib, "cuStreamGetCtx"));
    x.ok = x.launch && x.copy && x.record && x.wait && x.error_name && x.get_ctx && x.set_ctx && x.stream_ctx;
    // (the versioned names: the plain ones are the oldest ABI of each call)
    x.is_capturing = reinterpret_cast<decltype(x.is_capturing)>(dlsym(lib, "cuStreamIsCapturing"));
    x.begin_capture = reinterpret_cast<decltype(x.begin_capture)>(dlsym(lib, "cuStreamBeginCapture_v2"));
    x.end_capture = reinterpret_cast<decltype(x.end_capture)>(dlsym(lib, "cuStreamEndCapture"));
    x.capture_info = reinterpret_cast<decltype(x.capture_info)>(dlsym(lib, "cuStreamGetCaptureInfo_v2"));
    x.capture_info3 = reinterpret_cast<decltype(x.capture_info3)>(dlsym(lib, "cuStreamGetCaptureInfo_v3"));
    x.instantiate = reinterpret_cast<decltype(x.instantiate)>(dlsym(lib, "cuGraphInstantiateWithFlags"));
    x.graph_launch = reinterpret_cast<decltype(x.graph_launch)>(dlsym(lib, "cuGraphLaunch"));
    x.set_kernel = reinterpret_cast<decltype(x.set_kernel)>(dlsym(lib, "cuGraphExecKernelNodeSetParams_v2"));
    x.graph_destroy = reinterpret_cast<decltype(x.graph_destroy)>(dlsym(lib, "cuGraphDestroy"));
    x.exec_destroy = reinterpret_cast<decltype(x.exec_destroy)>(dlsym(lib, "cuGraphExecDestroy"));
    x.stream_create = reinterpret_cast<decltype(x.stream_create)>(dlsym(lib, "cuStreamCreate"));
    x.stream_destroy = reinterpret_cast<decltype(x.stream_destroy)>(dlsym(lib, "cuStreamDestroy_v2"));
    x.event_create = reinterpret_cast<decltype(x.event_create)>(dlsym(lib, "cuEventCreate"));
    x.event_destroy = reinterpret_cast<decltype(x.event_destroy)>(dlsym(lib, "cuEventDestroy_v2"));
    x.graphs = x.is_capturing && x.begin_capture && x.end_capture && (x.capture_info || x.capture_info3) && x.instantiate &&
               x.graph_launch && x.set_kernel && x.graph_destroy && x.exec_destroy && x.stream_create &&
               x.stream_destroy && x.event_create && x.event_destroy;
    return x;
  }();
  return d;
}

struct Reader {
  const uint64_t* w;
  size_t n, i = 0;
  bool bad = false;
  uint64_t next() {
    if (i >= n) { bad = true; return 0; }
    return w[i++];
  }
};

Plan* parse(const uint64_t* words, size_t n, char* why, size_t why_len) {
  Reader r{words, n};
  if (r.next() != kMagic || r.next() != kVersion) {
    snprintf(why, why_len, "not an ep_a2a FFI plan of version %llu", (unsigned long long)kVersion);
    return nullptr;
  }
  auto* plan = new Plan();
  plan->buffers = r.next();
  plan->first_steps = r.next();
  uint64_t groups = r.next();
  if (groups > 1024) r.bad = true;
  for (uint64_t g = 0; g < groups && !r.bad; ++g) {
    auto* grp = new Group();
    plan->groups.push_back(grp);
    grp->ordinal = (int64_t)r.next();
    grp->fork = reinterpret_cast<CUevent>(r.next());
    uint64_t ranks = r.next();
    if (ranks == 0 || ranks > 1024) r.bad = true;
    for (uint64_t k = 0; k < ranks && !r.bad; ++k) {
      grp->rank_numbers.push_back((int64_t)r.next());
      grp->streams.push_back(reinterpret_cast<CUstream>(r.next()));
      grp->joins.push_back(reinterpret_cast<CUevent>(r.next()));
      grp->records.push_back(reinterpret_cast<const volatile uint32_t*>(r.next()));
    }
    uint64_t ops = r.next();
    if (ops > n) r.bad = true;  // (every op takes several words: a count beyond them is garbage)
    grp->ops.resize(r.bad ? 0 : ops);
    for (uint64_t k = 0; k < ops && !r.bad; ++k) {
      Op& op = grp->ops[k];
      op.kind = r.next();
      op.rank = (uint32_t)r.next();
      if (op.rank >= ranks) r.bad = true;
      if (op.kind == kLaunch) {
        Launch& l = op.launch;
        l.function = reinterpret_cast<CUfunction>(r.next());
        l.grid = (unsigned)r.next(); l.block = (unsigned)r.next(); l.shared = (unsigned)r.next();
        l.cluster = (unsigned)r.next(); l.pdl = r.next() != 0;
        uint64_t nargs = r.next(), words_n = r.next();
        if (nargs > 64 || words_n > 8192) { r.bad = true; break; }
        for (uint64_t a = 0; a < nargs; ++a) l.arg_offsets.push_back(r.next());
        for (uint64_t a = 0; a < words_n; ++a) l.arg_words.push_back(r.next());
        uint64_t patches = r.next();
        if (patches > 256) { r.bad = true; break; }
        for (uint64_t p = 0; p < patches; ++p) {
          Patch pt;
          pt.offset = (uint32_t)r.next(); pt.buffer = (uint32_t)r.next(); pt.add = r.next();
          if ((uint64_t)pt.offset + 8 > words_n * 8 || pt.offset % 8 || pt.buffer >= plan->buffers) r.bad = true;
          l.patches.push_back(pt);
        }
        l.timeout_offset = (int64_t)r.next();
        l.first_timeout = r.next(); l.timeout = r.next();
        if (l.timeout_offset >= 0 && ((uint64_t)l.timeout_offset + 8 > words_n * 8 || l.timeout_offset % 8)) r.bad = true;
        for (uint64_t off : l.arg_offsets) if (off >= words_n * 8) r.bad = true;
        l.scratch = l.arg_words;
        for (uint64_t off : l.arg_offsets) l.params.push_back(reinterpret_cast<char*>(l.scratch.data()) + off);
        l.num_attrs = 0;
        if (l.pdl) {
          CUlaunchAttribute& a = l.attrs[l.num_attrs++];
          memset(&a, 0, sizeof a);
          a.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
          a.value.programmaticStreamSerializationAllowed = 1;
        }
        if (l.cluster > 1) {
          CUlaunchAttribute& a = l.attrs[l.num_attrs++];
          memset(&a, 0, sizeof a);
          a.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
          a.value.clusterDim.x = l.cluster; a.value.clusterDim.y = 1; a.value.clusterDim.z = 1;
        }
      } else if (op.kind == kCopy) {
        Copy& c = op.copy;
        c.dst_buffer = r.next(); c.dst = r.next(); c.src_buffer = r.next(); c.src = r.next(); c.bytes = r.next();
        if ((c.dst_buffer != kAbsolute && c.dst_buffer >= plan->buffers) ||
            (c.src_buffer != kAbsolute && c.src_buffer >= plan->buffers)) r.bad = true;
      } else {
        r.bad = true;
      }
    }
  }
  if (r.bad || r.i != n || plan->buffers > kMaxBuffers) {
    snprintf(why, why_len, "malformed plan (word %zu of %zu)", r.i, n);
    delete plan;
    return nullptr;
  }
  return plan;
}

ffi::Error cuda_error(CUresult err, const char* what, int64_t rank) {
  const char* name = "?";
  driver().error_name(err, &name);
  char msg[256];
  snprintf(msg, sizeof msg, "ep_a2a: %s failed for rank %lld: %s", what, (long long)rank, name);
  return ffi::Error(ffi::ErrorCode::kInternal, msg);
}

Group::~Group() {
  const Driver& d = driver();
  CUcontext before = nullptr;
  if (own.ctx) {  // (the streams and events are the context's: it is current while they go)
    d.get_ctx(&before);
    if (before != own.ctx) d.set_ctx(own.ctx);
  }
  if (own.exec) d.exec_destroy(own.exec);
  if (own.graph) d.graph_destroy(own.graph);
  for (CUevent e : own.joins) d.event_destroy(e);
  if (own.fork) d.event_destroy(own.fork);
  for (CUstream s : own.branches) d.stream_destroy(s);
  if (own.origin) d.stream_destroy(own.origin);
  if (own.ctx && before != own.ctx) d.set_ctx(before);
}

void patch(Launch& l, const uint64_t* addr, bool first) {
  for (const Patch& p : l.patches) l.scratch[p.offset / 8] = addr[p.buffer] + p.add;
  if (l.timeout_offset >= 0) l.scratch[l.timeout_offset / 8] = first ? l.first_timeout : l.timeout;
}

uint64_t copy_end(uint64_t buffer, uint64_t offset, const uint64_t* addr) {
  return (buffer == kAbsolute ? 0 : addr[buffer]) + offset;
}

// Issues the group's ops, each on its rank's stream (patched already); while `capture`, notes
// each op's graph node (the one node its stream then depends on).
ffi::Error issue(Group& g, const CUstream* streams, const uint64_t* addr, bool capture) {
  const Driver& d = driver();
  for (Op& op : g.ops) {
    CUstream s = streams[op.rank];
    int64_t who = g.rank_numbers[op.rank];
    if (op.kind == kLaunch) {
      Launch& l = op.launch;
      CUlaunchConfig cfg;
      memset(&cfg, 0, sizeof cfg);
      cfg.gridDimX = l.grid; cfg.gridDimY = cfg.gridDimZ = 1;
      cfg.blockDimX = l.block; cfg.blockDimY = cfg.blockDimZ = 1;
      cfg.sharedMemBytes = l.shared;
      cfg.hStream = s;
      cfg.attrs = l.num_attrs ? l.attrs : nullptr;
      cfg.numAttrs = l.num_attrs;
      if (CUresult e = d.launch(&cfg, l.function, l.params.data(), nullptr)) return cuda_error(e, "cuLaunchKernelEx", who);
    } else {
      Copy& c = op.copy;
      uint64_t dst = copy_end(c.dst_buffer, c.dst, addr), src = copy_end(c.src_buffer, c.src, addr);
      if (capture) c.live_dst = dst, c.live_src = src;  // (what the own graph's copy node holds)
      if (c.bytes)
        if (CUresult e = d.copy(dst, src, c.bytes, s)) return cuda_error(e, "cuMemcpyDtoDAsync", who);
    }
    if (capture && op.kind == kLaunch) {
      CUstreamCaptureStatus status;
      cuuint64_t id;
      CUgraph graph;
      const CUgraphNode* deps = nullptr;
      size_t n = 0;
      const CUgraphEdgeData* edges = nullptr;  // (v3 where the driver has it: PDL edges carry data)
      CUresult e = d.capture_info3 ? d.capture_info3(s, &status, &id, &graph, &deps, &edges, &n)
                                   : d.capture_info(s, &status, &id, &graph, &deps, &n);
      if (e) return cuda_error(e, "cuStreamGetCaptureInfo", who);
      if (n != 1) return ffi::Error(ffi::ErrorCode::kInternal, "ep_a2a: a captured launch left its stream on no single node");
      op.launch.node = deps[0];
      op.launch.live = op.launch.scratch;
    }
  }
  return ffi::Error::Success();
}

void drop_graph(Group::Own& o) {
  const Driver& d = driver();
  if (o.exec) d.exec_destroy(o.exec);
  if (o.graph) d.graph_destroy(o.graph);
  o.exec = nullptr;
  o.graph = nullptr;
}

// Captures the group's ops (patched) into its own graph: a private origin stream forks to one
// private stream per rank and joins them, as the direct path does on the ranks' streams.
ffi::Error capture(Group& g, const uint64_t* addr) {
  const Driver& d = driver();
  Group::Own& o = g.own;
  drop_graph(o);
  int64_t who = g.rank_numbers[0];
  if (!o.origin) {
    d.get_ctx(&o.ctx);
    if (CUresult e = d.stream_create(&o.origin, CU_STREAM_NON_BLOCKING)) return cuda_error(e, "cuStreamCreate", who);
    if (CUresult e = d.event_create(&o.fork, CU_EVENT_DISABLE_TIMING)) return cuda_error(e, "cuEventCreate", who);
    for (size_t k = 0; k < g.streams.size(); ++k) {
      CUstream s;
      CUevent j;
      if (CUresult e = d.stream_create(&s, CU_STREAM_NON_BLOCKING)) return cuda_error(e, "cuStreamCreate", who);
      o.branches.push_back(s);
      if (CUresult e = d.event_create(&j, CU_EVENT_DISABLE_TIMING)) return cuda_error(e, "cuEventCreate", who);
      o.joins.push_back(j);
    }
  }
  if (CUresult e = d.begin_capture(o.origin, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)) return cuda_error(e, "cuStreamBeginCapture", who);
  ffi::Error failed = ffi::Error::Success();
  CUresult e = d.record(o.fork, o.origin);
  for (size_t k = 0; k < o.branches.size() && !e; ++k) e = d.wait(o.branches[k], o.fork, 0);
  if (e) failed = cuda_error(e, "cuStreamWaitEvent (capture fork)", who);
  if (failed.success()) failed = issue(g, o.branches.data(), addr, true);
  // (every branch joins, also after a failure: the capture ends only with all of them joined)
  for (size_t k = 0; k < o.branches.size(); ++k)
    if (!d.record(o.joins[k], o.branches[k])) d.wait(o.origin, o.joins[k], 0);
  CUgraph graph = nullptr;
  e = d.end_capture(o.origin, &graph);
  if (failed.success() && e) failed = cuda_error(e, "cuStreamEndCapture", who);
  o.graph = graph;
  if (failed.success())
    if (CUresult e2 = d.instantiate(&o.exec, o.graph, 0)) failed = cuda_error(e2, "cuGraphInstantiate", who);
  if (!failed.success()) drop_graph(o);
  return failed;
}

// One call through the own graph: re-set the kernels whose bytes changed (a changed copy
// end re-captures), then launch it on XLA's stream.
ffi::Error replay(Group& g, CUstream xla, const uint64_t* addr) {
  const Driver& d = driver();
  bool recapture = !g.own.exec;
  for (const Op& op : g.ops)
    if (op.kind == kCopy && (copy_end(op.copy.dst_buffer, op.copy.dst, addr) != op.copy.live_dst ||
                             copy_end(op.copy.src_buffer, op.copy.src, addr) != op.copy.live_src))
      recapture = true;
  if (recapture) {
    if (ffi::Error e = capture(g, addr); !e.success()) return e;
  } else {
    for (Op& op : g.ops) {
      Launch& l = op.launch;
      if (op.kind != kLaunch || l.scratch == l.live) continue;
      CUDA_KERNEL_NODE_PARAMS p;
      memset(&p, 0, sizeof p);
      p.func = l.function;
      p.gridDimX = l.grid; p.gridDimY = p.gridDimZ = 1;
      p.blockDimX = l.block; p.blockDimY = p.blockDimZ = 1;
      p.sharedMemBytes = l.shared;
      p.kernelParams = l.params.data();
      if (CUresult e = d.set_kernel(g.own.exec, l.node, &p)) return cuda_error(e, "cuGraphExecKernelNodeSetParams", g.rank_numbers[op.rank]);
      l.live = l.scratch;
      ++g.own.updates;
    }
  }
  if (CUresult e = d.graph_launch(g.own.exec, xla)) return cuda_error(e, "cuGraphLaunch", g.rank_numbers[0]);
  ++g.own.launches;
  return ffi::Error::Success();
}

ffi::Error run_group(Plan& plan, Group& g, CUstream xla, uint64_t* addr) {
  const Driver& d = driver();
  // A failure a kernel recorded in an earlier step (a peer timed out, a step aborted): the
  // next call refuses to run, naming it; MoeAlltoAll.error() holds the details.
  for (size_t k = 0; k < g.records.size(); ++k) {
    if (*g.records[k] != 0) {
      char msg[256];
      snprintf(msg, sizeof msg, "ep_a2a: rank %lld recorded a failure (error kind %u) in an earlier step; "
               "a2a.error() says which peer and phase", (long long)g.rank_numbers[k], *g.records[k]);
      return ffi::Error(ffi::ErrorCode::kAborted, msg);
    }
  }
  // Every patched buffer is checked before anything is launched: a refusal after some ranks'
  // kernels were queued would leave them waiting on peers that never launch.
  for (const Op& op : g.ops) {
    if (op.kind != kLaunch) continue;
    for (const Patch& p : op.launch.patches) {
      if (addr[p.buffer] % 16) {  // the plan chose vector widths for 16-byte aligned buffers
        char msg[200];
        snprintf(msg, sizeof msg, "ep_a2a: XLA buffer %u at 0x%llx is not 16-byte aligned (rank %lld)",
                 p.buffer, (unsigned long long)addr[p.buffer], (long long)g.rank_numbers[op.rank]);
        return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
      }
    }
  }
  std::lock_guard<std::mutex> hold(g.lock);
  bool first = g.calls < plan.first_steps;
  ++g.calls;
  for (Op& op : g.ops)
    if (op.kind == kLaunch) patch(op.launch, addr, first);
  // Outside a capture of XLA's, the own graph; inside one, XLA records the launches below.
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (plan.own_graphs && d.graphs && !g.own.off && !d.is_capturing(xla, &status) &&
      status == CU_STREAM_CAPTURE_STATUS_NONE) {
    ffi::Error e = replay(g, xla, addr);
    if (e.success() || g.own.launches) return e;
    // the graph APIs refused from the start: launch directly from now on
    g.own.off = true;
    drop_graph(g.own);
  }
  const bool fork = g.streams.size() > 1;
  if (fork) {
    // every rank's stream first waits for what XLA queued, so no spinning kernel of ours
    // holds SMs that XLA's earlier work needs; XLA's stream then waits for every rank
    if (CUresult e = d.record(g.fork, xla)) return cuda_error(e, "cuEventRecord (fork)", g.rank_numbers[0]);
    for (size_t k = 0; k < g.streams.size(); ++k)
      if (CUresult e = d.wait(g.streams[k], g.fork, 0)) return cuda_error(e, "cuStreamWaitEvent (fork)", g.rank_numbers[k]);
  }
  CUstream alone[1] = {xla};  // (a group of one rank runs on XLA's stream)
  ffi::Error failed = issue(g, fork ? g.streams.data() : alone, addr, false);
  if (fork)  // (every rank, also after a failure: XLA frees its buffers after whatever was launched)
    for (size_t k = 0; k < g.streams.size(); ++k) {
      if (CUresult e = d.record(g.joins[k], g.streams[k])) {
        if (failed.success()) failed = cuda_error(e, "cuEventRecord (join)", g.rank_numbers[k]);
      } else if (CUresult e = d.wait(xla, g.joins[k], 0)) {
        if (failed.success()) failed = cuda_error(e, "cuStreamWaitEvent (join)", g.rank_numbers[k]);
      }
    }
  return failed;
}

// The plan's group on GPU `ordinal` (a plan of one group whose GPU is not known serves any).
Group* group_on(const Plan& plan, int64_t ordinal) {
  for (Group* g : plan.groups)
    if (g->ordinal == ordinal) return g;
  return plan.groups.size() == 1 && plan.groups[0]->ordinal < 0 ? plan.groups[0] : nullptr;
}

ffi::Error Run(CUstream stream, int32_t ordinal, int64_t plan_id, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (!driver().ok) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "ep_a2a: libcuda.so.1 could not be opened");
  std::shared_lock<std::shared_mutex> using_plans(in_use);
  Plan* plan = find(plan_id);
  if (!plan) return ffi::Error(ffi::ErrorCode::kNotFound, "ep_a2a: this call's launch plan was released (its JaxAlltoAll is closed)");
  size_t n_args = args.size(), n = n_args + rets.size();
  if (n != plan->buffers) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ep_a2a: the call's buffers do not match its plan");
  uint64_t addr[kMaxBuffers];
  for (size_t i = 0; i < n_args; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    addr[i] = reinterpret_cast<uint64_t>(b->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    addr[n_args + i] = reinterpret_cast<uint64_t>((*b)->untyped_data());
  }
  Group* g = group_on(*plan, ordinal);
  if (!g) {
    char msg[160];
    snprintf(msg, sizeof msg, "ep_a2a: this call runs on device %d, where the all-to-all has no rank", ordinal);
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
  }
  // Our kernels live in the GPU's primary context, XLA's too: make the stream's context
  // current for the launches if XLA's thread holds another (or none), and put it back after.
  const Driver& d = driver();
  CUcontext mine = nullptr, before = nullptr;
  if (CUresult e = d.stream_ctx(stream, &mine)) return cuda_error(e, "cuStreamGetCtx", g->rank_numbers[0]);
  d.get_ctx(&before);
  if (before != mine)
    if (CUresult e = d.set_ctx(mine)) return cuda_error(e, "cuCtxSetCurrent", g->rank_numbers[0]);
  ffi::Error result = run_group(*plan, *g, stream, addr);
  if (before != mine && before) d.set_ctx(before);
  return result;
}

}  // namespace

#define EP_A2A_BINDING                                                                         \
  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<CUstream>>().Ctx<ffi::DeviceOrdinal>().Attr<int64_t>("plan") \
      .RemainingArgs().RemainingRets()

// Captured into XLA's command buffers: what a replay needs lives on the device.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ep_a2a_ffi_run, Run, EP_A2A_BINDING, {ffi::Traits::kCmdBufferCompatible});
// The same, never captured (EP_A2A_JAX_COMMAND_BUFFERS=0 picks it).
XLA_FFI_DEFINE_HANDLER_SYMBOL(ep_a2a_ffi_run_uncaptured, Run, EP_A2A_BINDING);

extern "C" {

// Version of the plan format this library reads.
uint64_t ep_a2a_ffi_plan_version() { return kVersion; }

// XLA FFI API version of the headers this library was built with (major * 1000 + minor).
int ep_a2a_ffi_api_version() { return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR; }

// Register a plan (words: `n` uint64): its id (>= 0), or -1 with `why` filled.
int64_t ep_a2a_ffi_register(const uint64_t* words, uint64_t n, char* why, uint64_t why_len) {
  Plan* plan = parse(words, n, why, why_len);
  if (!plan) return -1;
  const char* own = getenv("EP_A2A_JAX_OWN_GRAPHS");
  plan->own_graphs = !(own && strcmp(own, "0") == 0);
  std::lock_guard<std::mutex> hold(registry);
  for (int64_t tries = 0; tries < kMaxPlans; ++tries) {
    int64_t id = next_id++;
    plan->id = id;
    Plan* none = nullptr;
    if (plans[id % kMaxPlans].compare_exchange_strong(none, plan)) return id;
  }
  snprintf(why, why_len, "more than %d plans registered at once", kMaxPlans);
  delete plan;
  return -1;
}

// Release a plan (its calls must have completed: the owner synchronizes first).
void ep_a2a_ffi_release(int64_t id) {
  std::lock_guard<std::mutex> hold(registry);
  std::unique_lock<std::shared_mutex> no_call_runs(in_use);
  Plan* p = find(id);
  if (p && plans[id % kMaxPlans].compare_exchange_strong(p, nullptr)) delete p;
}

// Calls a plan has served on one GPU (tests: the native path really ran).
uint64_t ep_a2a_ffi_calls(int64_t id, int64_t ordinal) {
  std::shared_lock<std::shared_mutex> using_plans(in_use);
  Plan* p = find(id);
  Group* g = p ? group_on(*p, ordinal) : nullptr;
  return g ? g->calls : 0;
}

// Calls a plan's own graph has served on one GPU (tests: that path really ran), or with
// `updates` the kernel nodes those calls re-set.
uint64_t ep_a2a_ffi_own_graph(int64_t id, int64_t ordinal, int updates) {
  std::shared_lock<std::shared_mutex> using_plans(in_use);
  Plan* p = find(id);
  Group* g = p ? group_on(*p, ordinal) : nullptr;
  return !g ? 0 : updates ? g->own.updates : g->own.launches;
}

}  // extern "C"
