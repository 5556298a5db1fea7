"""The MoE layer of layers/torch.py in JAX (eager), on the rank-major all-to-all.

    router -> dispatch -> build_index -> gather_rows -> FC1 / SiLU(gate) * up / FC2 (jnp)
    -> finalize (into the combine input) -> combine

Same weights layout, router and numerics as TorchMoeLayer (read its module docstring): bf16
w_gate_up [E_local, 2*I, hidden], w_down [E_local, hidden, I]; bf16 GEMMs accumulating in
fp32 (XLA may keep SiLU(gate) * up in fp32 inside a fusion: that only removes roundings).
The router is ep_a2a's kernel (moe.route; traced, JaxAlltoAll.route) where it takes the
logits (fp32 / bf16 / fp16, num_experts <= 1024, top_k <= 32), else XLA's top_k and softmax.

Data exchange is DLPack both ways, never through the host: the gathered rows and the index
counts reach JAX with jax.dlpack.from_dlpack (zero copy; JAX's stream waits for ours), and
the FC2 output reaches finalize as a jax array through ep_a2a.as_tensor (our stream waits for
JAX's). JAX arrays whose memory an ep_a2a launch still reads are kept alive until the step's
end, when moe_forward_all_ranks synchronizes (JAX would otherwise reuse their memory on its
own stream, unaware of ours).

The ways to run the experts (gemm=), none with a host sync but "loop":
  "padded": each local expert's rows padded to a bound and multiplied as one batched GEMM
    (padded_ffn). The bound is ep_size * T^ rows (a token picks an expert at most once)
    where the router is ours, and every row of the workspace where the caller passes ids
    (which may repeat an expert); one compile per T^.
  "ragged": jax.lax.ragged_dot over all index.capacity rows with the device counts as group
    sizes. XLA lowers it on CUDA to one dense GEMM per expert over all those rows, masked:
    num_local times the work of "padded" (docs/jax.md).
  "loop": host counts (one sync per rank, in the compute phase), one jitted FFN per expert
    with rows (compiled once per distinct row count), outputs copied into a buffer of ours
    with cuMemcpyDtoDAsync.
  "fused": ep_a2a's expert kernels (moe_experts.expert_fc1 / expert_fc2, FC2's kernel finalizing into
    the combine input): FC1 reads the dispatched rows in place, no gather; traced, the
    experts, finalize and combine are one XLA call (JaxAlltoAll.experts_combine). bf16, hidden
    and I multiples of 64.
  "auto": "fused" while an expert may get at most auto_fused_rows rows (ep_size * T^), else
    "ragged" below RAGGED_BELOW tokens per rank (T^), where the masked work is small and
    padded's gathers cost more, "padded" from there (expert_gemm).
    Where the kernels may run beside the jnp functions the layer keeps its weights in both
    layouts (nn.Linear's for the kernels, transposed for the jnp functions).

In-process ranks: the same phases as layers.torch.moe_forward_all_ranks (route, dispatch every
rank, compute, combine every rank), for the same reason. JAX preallocates most of the GPU by
default: set XLA_PYTHON_CLIENT_PREALLOCATE=false (or XLA_PYTHON_CLIENT_MEM_FRACTION) before
importing jax when ep_a2a's workspaces share the GPU. jax is imported inside functions only.
"""
from __future__ import annotations

import numpy as np

from ..driver.memory import copy_dtod_async, copy_dtoh
from ..driver.stream import synchronize_stream
from ..interop.arrays import empty
from ..interop.tensor import as_tensor
from ..moe import ExpertIndex
from ..moe_experts import auto_expert_rows, expert_fc1, expert_fc2, expert_gemms_unsupported
from ..router import route as moe_route, route_unsupported
from .base import LayerBase, payload_specs, run_phases  # noqa: F401  (payload_specs: for the callers)

GEMMS = ("auto", "padded", "ragged", "loop", "fused")
RAGGED_BELOW = 16
# XLA's expert functions do a multiple of the rows' work (padded: ep_size * T^ rows per expert;
# ragged: every row per expert), so the expert kernels beat them where torch's grouped GEMM
# beats the kernels: up to this many rows per expert, at every hidden size the kernels take,
# as the JAX layer benchmark found (docs/jax.md: the small and DeepSeek-V3-like profiles).
FUSED_MAX_ROWS_XLA = 1024
_JIT = {}


def _jitted():
    """The jitted pieces, built on first use (jax imported lazily)."""
    if _JIT:
        return _JIT
    import jax

    def gated(h, inter):
        return jax.nn.silu(h[..., :inter]) * h[..., inter:]

    def ffn(x, w1t, w2t):  # x [n, H], w1t [H, 2I], w2t [I, H]
        return gated(x @ w1t, w2t.shape[0]) @ w2t

    def ragged_ffn(x, counts, w1t, w2t):  # x [rows, H], w1t [L, H, 2I], w2t [L, I, H]
        h = jax.lax.ragged_dot(x, w1t, counts)
        return jax.lax.ragged_dot(gated(h, w2t.shape[1]), w2t, counts)

    def padded_ffn(x, counts, w1t, w2t, per_expert):
        """ragged_ffn's result, each expert's rows padded to `per_expert` (static, at least
        its count) and multiplied as one batched GEMM; rows past sum(counts) are zeros."""
        jnp = jax.numpy
        L, R = counts.shape[0], x.shape[0]
        ends = jnp.cumsum(counts)
        starts = ends - counts
        slot = jnp.arange(per_expert, dtype=counts.dtype)
        live = slot[None, :] < counts[:, None]                                   # [L, C]
        xp = jnp.where(live[..., None], x[jnp.minimum(starts[:, None] + slot, R - 1)], 0)
        h = jnp.einsum("lch,lhf->lcf", xp, w1t)
        yp = jnp.einsum("lci,lih->lch", gated(h, w2t.shape[1]), w2t).reshape(L * per_expert, -1)
        row = jnp.arange(R, dtype=counts.dtype)
        expert = jnp.minimum(jnp.searchsorted(ends, row, side="right"), L - 1)
        y = yp[expert * per_expert + jnp.minimum(row - starts[expert], per_expert - 1)]
        return jnp.where((row < ends[-1])[:, None], y, 0).astype(x.dtype)

    def router(logits, top_k, renormalize):
        logits = logits.astype(jax.numpy.float32)
        top, ids = jax.lax.top_k(logits, top_k)
        if renormalize:
            w = jax.nn.softmax(top, axis=-1)
        else:
            w = jax.numpy.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=1)
        return ids.astype(jax.numpy.int32), w

    _JIT.update(ffn=jax.jit(ffn), ragged_ffn=jax.jit(ragged_ffn), padded_ffn=jax.jit(padded_ffn, static_argnums=4),
                router=jax.jit(router, static_argnums=(1, 2)),
                traced=dict(ragged_ffn=ragged_ffn, padded_ffn=padded_ffn, router=router))  # (for jit callers)
    return _JIT


def _copies(views) -> tuple:
    """New jax arrays holding these tensors of ours (a from_dlpack alias lives only for the copy)."""
    import jax
    import jax.numpy as jnp
    return tuple(jnp.array(jax.dlpack.from_dlpack(v), copy=True) for v in views)


def traced_functions() -> dict:
    """The router and expert functions of the layer, unjitted, for callers tracing their own
    programs: router(logits, top_k, renormalize) -> (ids, weights); ragged_ffn(x, counts, w1t, w2t);
    padded_ffn(x, counts, w1t, w2t, per_expert)."""
    return _jitted()["traced"]


def expert_gemm(gemm: str, runtime_max: int, fused_max_rows: int = 0, ep_size: int = 1) -> str:
    """The expert function a step of T^ = runtime_max runs for a layer's `gemm` (eager and traced
    alike, so the two stay bitwise equal); "auto" takes the expert kernels while ep_size * T^
    is at most fused_max_rows (0: never)."""
    import jax
    if gemm != "auto":
        return gemm
    if ep_size * max(1, runtime_max) <= fused_max_rows:
        return "fused"
    return "ragged" if runtime_max < RAGGED_BELOW and hasattr(jax.lax, "ragged_dot") else "padded"


def auto_fused_rows(hidden: int, inter: int) -> int:
    """The most rows an expert may get (ep_size * T^) for which gemm="auto" takes the expert
    kernels: FUSED_MAX_ROWS_XLA (or torch's moe_experts.auto_expert_rows where that is more), 0
    where the kernels do not take the shapes."""
    rows = auto_expert_rows(hidden, inter)
    return max(rows, FUSED_MAX_ROWS_XLA) if rows else 0


def step_weights(gemm: str) -> tuple:
    """The names (JaxMoeLayer.params) of the weights a traced step with this expert function reads."""
    return ("w1", "w2") if gemm == "fused" else ("w1t", "w2t")


def expert_rows_bound(layer, runtime_max: int, our_router: bool, capacity: int) -> int:
    """The most rows one local expert can receive in a step of T^ = runtime_max: a token picks
    an expert at most once through our router (top_k distinct experts); ids from the caller
    may repeat one, so then every row of the workspace."""
    return min(capacity, layer.ep_size * max(1, runtime_max)) if our_router else capacity


def jax_device(ordinal: int):
    """The JAX GPU device of CUDA ordinal `ordinal`."""
    import jax
    gpus = jax.devices("gpu")
    for d in gpus:
        if getattr(d, "local_hardware_id", d.id) == ordinal:
            return d
    raise ValueError(f"JAX sees no GPU with CUDA ordinal {ordinal} (it has {gpus})")


class JaxMoeLayer(LayerBase):
    """The MoE layer of one rank in JAX. Arguments as TorchMoeLayer; the weights may be any
    array (jax, numpy) and are placed on the rank's GPU as bf16."""

    def __init__(self, a2a_rank, w_gate_up, w_down, *, renormalize: bool = True, gemm: str = "auto"):
        import jax
        import jax.numpy as jnp
        super().__init__(a2a_rank, "layers.jax", renormalize, gemm, GEMMS)
        a = a2a_rank.a2a
        self.gemm = gemm
        L, H = self.num_local, self.hidden
        if tuple(np.shape(w_gate_up))[0::2] != (L, H) or np.shape(w_gate_up)[1] % 2 or len(np.shape(w_gate_up)) != 3:
            raise ValueError(f"w_gate_up: must be [E_local={L}, 2*I, hidden={H}], got {list(np.shape(w_gate_up))}")
        self.inter = I = np.shape(w_gate_up)[1] // 2
        if tuple(np.shape(w_down)) != (L, H, I):
            raise ValueError(f"w_down: must be [E_local={L}, hidden={H}, I={I}], got {list(np.shape(w_down))}")
        self.jdev = jax_device(a2a_rank.device.ordinal)
        put = lambda w: jax.device_put(jnp.swapaxes(jnp.asarray(w, jnp.bfloat16), 1, 2), self.jdev)  # noqa: E731
        self.w1t, self.w2t = put(w_gate_up), put(w_down)  # [L, H, 2I], [L, I, H]: x @ w
        if self.gemm == "loop":
            self._w1_e = [self.w1t[e] for e in range(L)]
            self._w2_e = [self.w2t[e] for e in range(L)]
        dev = a2a_rank.device
        self.index = ExpertIndex.for_rank(a2a_rank)
        cap = self.ep_size * a.max_tokens_per_rank * self.top_k
        self.w1 = self.w2 = None
        why = expert_gemms_unsupported(H, I)
        if gemm == "fused" and why is not None:
            raise ValueError(f"gemm='fused': the expert kernels do not take {why}")
        self.fused_max_rows = 1 << 62 if gemm == "fused" else auto_fused_rows(H, I) if gemm == "auto" else 0
        if self.ep_size <= self.fused_max_rows:  # (the kernels run at T^ = 1 at least)
            put = lambda w: jax.device_put(jnp.asarray(w, jnp.bfloat16), self.jdev)  # noqa: E731
            self.w1, self.w2 = put(w_gate_up), put(w_down)  # nn.Linear's layout, the kernels'
            jax.block_until_ready((self.w1, self.w2))
            self._w1_t, self._w2_t = as_tensor(self.w1, stream=self.s), as_tensor(self.w2, stream=self.s)
            self._act = empty((cap, I), "bfloat16", dev)
        self._xg = empty((cap, H), "bfloat16", dev)       # expert-major rows (gather_rows); fused: FC2's output
        self._y = empty((cap, H), "bfloat16", dev) if self.gemm == "loop" else None
        self._out = empty((a.max_tokens_per_rank, H), "bfloat16", dev)
        self._routes = empty((2 * a.max_tokens_per_rank * self.top_k,), "int32", dev)  # route(): ids, then weights
        self._routing = None
        self._keep = []   # jax arrays an ep_a2a launch of this step still reads, or that alias our memory
        self._jit_ops = None  # the ops.jax.JaxAlltoAll of traced steps (moe_forward_traced), made on first use
        _jitted()

    @property
    def params(self) -> dict:
        """The weights a traced step reads, by name: w1t, w2t (XLA's experts) and, where the expert
        kernels may run, w1, w2 (their layout). Hand them to jax.jit as arguments
        (jit_forward_all_ranks does): a jitted function that closes over them embeds them in its
        program as constants (a DeepSeek-V3-like layer's 22.5 GB: its lowering did not end)."""
        return {k: v for k, v in (("w1t", self.w1t), ("w2t", self.w2t), ("w1", self.w1), ("w2", self.w2)) if v is not None}

    def expert_gemm(self, runtime_max: int) -> str:
        """The expert function of a step of T^ = runtime_max (module function expert_gemm)."""
        return expert_gemm(self.gemm, runtime_max, self.fused_max_rows, self.ep_size)

    # -- phases ------------------------------------------------------------------------------------
    def route(self, logits):
        """(ids int32 [T, top_k], weights fp32 [T, top_k]) as new jax arrays: top_k logits, softmax
        over them (renormalize=False: the full softmax's probabilities of those experts).
        ep_a2a's router kernel on this rank's stream where it takes the logits (fused_route),
        else XLA's top_k and softmax."""
        if not self.fused_route(logits):
            return _JIT["router"](logits, self.top_k, self.renormalize)
        return _copies(self._fused_routes(logits))

    def _fused_routes(self, logits) -> list:
        """ep_a2a's router kernel on this rank's stream into the layer's routing buffers: their
        views (ids, weights), valid until the next step's routing."""
        T = int(logits.shape[0])
        views = [self._routes.view(0, (T, self.top_k), "int32"),
                 self._routes.view(self._routes.nbytes // 2, (T, self.top_k), "float32")]
        moe_route(as_tensor(logits, stream=self.s), *views, renormalize=self.renormalize, stream=self.s)
        for v in views:
            v.stream = self.s  # (JAX's stream waits for the router when it reads them)
        self._keep.append(logits)
        return views

    @property
    def routing(self):
        """The last step's (ids, weights) as jax arrays (copies, made on first access: no jax
        array aliases the layer's buffers past the call that reads them)."""
        if self._routing is not None and not hasattr(self._routing[0], "block_until_ready"):
            self._routing = _copies(self._routing)
        return self._routing

    def fused_route(self, logits) -> bool:
        """Whether route() runs ep_a2a's router kernel on these logits (eager and traced alike):
        the kernel takes them (router.route_unsupported) and there are tokens."""
        return int(logits.shape[0]) > 0 and route_unsupported(self.num_experts, self.top_k,
                                                              str(np.dtype(logits.dtype))) is None

    def check_inputs(self, x, router) -> int:
        """The number of tokens of x, after the rules on x and router (eager and traced alike)."""
        import jax.numpy as jnp
        if getattr(x, "ndim", 0) != 2 or x.shape[1] != self.hidden or x.dtype != jnp.bfloat16:
            raise ValueError(f"x: must be a bf16 jax array [tokens, hidden={self.hidden}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
        T = int(x.shape[0])
        if isinstance(router, (tuple, list)):
            if len(router) != 2 or any(tuple(np.shape(t)) != (T, self.top_k) for t in router):
                raise ValueError(f"router: (ids, weights) must both be [{T}, top_k={self.top_k}], got "
                                 f"{[list(np.shape(t)) for t in router]}")
        elif tuple(np.shape(router)) != (T, self.num_experts):
            raise ValueError(f"router: logits must be [{T}, num_experts={self.num_experts}], got {list(np.shape(router))}")
        return T

    def prepare(self, x, router, runtime_max_tokens_per_rank: int) -> None:
        """Phase 1: route, wait for the inputs, stage their DLPack views (no ep_a2a launch)."""
        import jax
        import jax.numpy as jnp
        if self._step is not None:
            raise RuntimeError(f"rank {self.rank}: prepare() called twice without combine()")
        T = self.check_inputs(x, router)
        x = jax.device_put(x, self.jdev)
        fused = not isinstance(router, (tuple, list)) and self.fused_route(router)
        if isinstance(router, (tuple, list)):
            ids, w = (jax.device_put(jnp.asarray(router[0], jnp.int32), self.jdev),
                      jax.device_put(jnp.asarray(router[1], jnp.float32), self.jdev))
        elif fused:
            ids, w = self._fused_routes(jax.device_put(router, self.jdev))
        else:
            ids, w = self.route(jax.device_put(router, self.jdev))
        jax.block_until_ready(x if fused else (x, ids, w))  # the host may block now, before any rank dispatches
        if T:
            staged = [ids if fused else as_tensor(ids, stream=self.s), as_tensor(x, stream=self.s),
                      w if fused else as_tensor(w, stream=self.s)]
        else:  # zero-token views of our own memory (nothing is read)
            staged = [self._out.view(0, (0, self.top_k), "int32"), self._out.view(0, (0, self.hidden)),
                      self._out.view(0, (0, self.top_k), "float32")]
        self._keep += [x] if fused else [x, ids, w]
        self._routing = (ids, w)
        self._step = dict(T=T, runtime_max=int(runtime_max_tokens_per_rank), ids=staged[0], x=staged[1], w=staged[2],
                          our_router=not isinstance(router, (tuple, list)))

    def compute(self) -> None:
        """Phase 3 (once every rank of the process has dispatched): index and gather on our
        stream, the experts in JAX, finalize into the combine input on our stream."""
        import jax
        s, H = self.s, self.hidden
        gemm = self.expert_gemm(self._step["runtime_max"])
        if gemm == "fused":  # (FC1 reads the dispatched rows in place; FC2 writes our rows buffer)
            idx = self.expert_index()
            expert_fc1(idx, self._step["views"][1][0], self._w1_t, self._act, stream=s)
            if self._fc2_finalizes:
                expert_fc2(idx, self._act, self._w2_t, self._xg, stream=s,
                           finalize_into=self.a2a_rank.combine_input(self._step["runtime_max"]))
            else:
                expert_fc2(idx, self._act, self._w2_t, self._xg, stream=s)
                self.finalize_partials(idx, self._xg)
            return
        idx = self.index_and_gather(self._xg)
        cap = idx.capacity
        if gemm in ("padded", "ragged"):
            rows = self._xg.view(0, (cap, H))
            rows.stream = s  # JAX's stream waits for gather_rows
            xj = jax.dlpack.from_dlpack(rows)
            counts = jax.dlpack.from_dlpack(idx.counts)
            if gemm == "padded":  # [cap, H]; rows past the total unused
                y = _JIT["padded_ffn"](xj, counts, self.w1t, self.w2t,
                                       expert_rows_bound(self, self._step["runtime_max"], self._step["our_router"], cap))
            else:
                y = _JIT["ragged_ffn"](xj, counts, self.w1t, self.w2t)
            self._keep += [xj, counts, y]
            fc2 = y  # finalize's as_tensor makes our stream wait for it
        else:
            synchronize_stream(s)  # all ranks have dispatched: this returns
            bounds = np.empty(self.num_local + 1, np.int32)
            copy_dtoh(bounds.ctypes.data, idx.offsets.ptr, bounds.nbytes)
            row_bytes = H * self._xg.itemsize
            for e in range(self.num_local):
                a, b = int(bounds[e]), int(bounds[e + 1])
                if b == a:
                    continue
                xe = jax.dlpack.from_dlpack(self._xg.view(a * row_bytes, (b - a, H)))
                ye = _JIT["ffn"](xe, self._w1_e[e], self._w2_e[e])
                src = as_tensor(ye, stream=s)  # our stream waits for JAX's result
                copy_dtod_async(self._y.ptr + a * row_bytes, src.ptr, (b - a) * row_bytes, s)
                self._keep += [xe, ye, src]
            fc2 = self._y
        self.finalize_partials(idx, fc2)

    def combine(self) -> None:
        """Phase 4: launch this rank's combine into our output buffer (no host blocking)."""
        T = self._step["T"]
        self.combine_into(self._out.view(0, (T, self.hidden)))
        self._step = dict(T=T)

    def result(self):
        """After combine: wait for this rank and return its output as a new jax array [T, hidden]."""
        import jax
        import jax.numpy as jnp
        T = self._step["T"]
        synchronize_stream(self.s)
        self._step = None
        self._keep = []  # every launch of this step that read them has finished
        if T == 0:
            return jax.device_put(jnp.zeros((0, self.hidden), jnp.bfloat16), self.jdev)
        out, = _copies([self._out.view(0, (T, self.hidden))])
        out.block_until_ready()  # the next step's combine overwrites our buffer
        return out

    def forward(self, x, router, runtime_max_tokens_per_rank: int = None):
        """One step for a rank alone in its process (see TorchMoeLayer.forward). Inside jax.jit
        (x traced) it is moe_forward_traced([self], ...), for a rank alone on its GPU, with the
        weights as constants of the program: jit_forward_all_ranks([layer]) passes them as arguments."""
        import jax
        runtime_max = self.a2a_rank.a2a.max_tokens_per_rank if runtime_max_tokens_per_rank is None else runtime_max_tokens_per_rank
        if isinstance(x, jax.core.Tracer):
            return moe_forward_traced([self], [x], [router], runtime_max)[0]
        self.prepare(x, router, runtime_max)
        self.dispatch()
        self.compute()
        self.combine()
        return self.result()

    __call__ = forward

    def native_calls(self, updates: bool = False) -> int:
        """How often the FFI handler has run the launch plans of this layer's traced steps on its
        GPU (0 before any traced step or on the Python path): once per call without XLA's
        command buffers; with them, only when XLA records the step. `updates`: the kernel nodes
        of the handler's own graphs that those runs re-set (ops.native_calls)."""
        ops = self._jit_ops
        return 0 if ops is None else ops.native_calls(self.a2a_rank.device.ordinal, updates=updates)

    def close(self) -> None:
        """Release what the layer made (its expert index and buffers); the all-to-all is the caller's."""
        self.close_gate()
        if self._jit_ops is not None:  # (shared by the layers of one traced step: closing twice is a no-op)
            self._jit_ops.close()
            self._jit_ops = None
        if self.index is not None:
            self.a2a_rank.synchronize()
            self._keep = []
            self.index.close()
            self.index = None


def moe_forward_all_ranks(layers, xs, routers, runtime_max_tokens_per_rank: int = None):
    """One step of every in-process rank (phases as layers.torch.moe_forward_all_ranks): returns a
    new bf16 jax array [T_r, hidden] per rank. Blocks the host until the step is done."""
    run_phases(layers, xs, routers, runtime_max_tokens_per_rank)
    return [layer.result() for layer in layers]


def moe_forward_traced(layers, xs, routers, runtime_max_tokens_per_rank: int = None, params=None):
    """One step of the layers of every in-process rank on one GPU as traced JAX: call it inside
    jax.jit (jit_forward_all_ranks does). The same numerics as moe_forward_all_ranks (the same
    router and expert functions: expert_gemm of the layers' gemm, "ragged" for "loop" layers),
    with dispatch, index and gather in one XLA call and finalize and combine in another
    (ep_a2a/ops/jax.py): the dispatched rows are gathered straight into XLA's buffer and
    combine writes straight into the result, so no workspace copy remains. With the expert
    kernels ("fused") there is no gather, and the experts, finalize and combine are one call.
    layers: one per rank of the all-to-all on that GPU, in a2a.ranks
    order; xs, routers: as moe_forward_all_ranks (T^ defaults to the largest T_r, at least 1).
    params: each layer's weights as the jitted function's arguments (a list of layer.params
    dicts, traced); None reads the layers' own arrays, which jax.jit then embeds as constants.
    Returns one bf16 [T_r, hidden] array per rank. JAX runs a jitted call asynchronously: wait
    for its results (jax.block_until_ready) before an eager step of the same layers."""
    import jax
    from ..ops.jax import JaxAlltoAll
    if not (len(layers) == len(xs) == len(routers)) or not layers:
        raise ValueError(f"layers, xs, routers: need one per rank, got {len(layers)}, {len(xs)}, {len(routers)}")
    if not hasattr(jax.lax, "ragged_dot") and any(layer.gemm in ("ragged", "loop") for layer in layers):
        raise RuntimeError(f"traced layers with gemm={layers[0].gemm!r} need jax.lax.ragged_dot (jax {jax.__version__} "
                           f"has none): use gemm='padded'")
    a2a = layers[0].a2a_rank.a2a
    on_gpu = [r for r in a2a.ranks if r.device.ordinal == layers[0].a2a_rank.device.ordinal]
    if [layer.a2a_rank for layer in layers] != on_gpu:
        raise ValueError(f"layers: a traced step takes the layers of every rank of the all-to-all on cuda:"
                         f"{on_gpu[0].device.ordinal}, in a2a.ranks order (ranks {[r.rank for r in on_gpu]}); got "
                         f"ranks {[layer.rank for layer in layers]}")
    params = [layer.params for layer in layers] if params is None else list(params)
    if len(params) != len(layers):
        raise ValueError(f"params: need one dict of weights per layer ({len(layers)}), got {len(params)}")
    ops = layers[0]._jit_ops
    if ops is None:
        ops = JaxAlltoAll(a2a, indexes={layer.rank: layer.index for layer in layers})
        for layer in layers:
            layer._jit_ops = ops
    tokens = [layer.check_inputs(x, router) for layer, x, router in zip(layers, xs, routers)]
    runtime_max = max([1] + tokens) if runtime_max_tokens_per_rank is None else runtime_max_tokens_per_rank
    gemms = [layer.expert_gemm(runtime_max) for layer in layers]
    fused = gemms[0] == "fused"
    if fused != all(g == "fused" for g in gemms):
        raise ValueError(f"layers: a traced step runs the expert kernels for every rank or none, got {gemms} "
                         f"(gemm={[layer.gemm for layer in layers]}) at T^={runtime_max}")
    for i, p in enumerate(params):
        need = step_weights(gemms[i])
        missing = [k for k in need if k not in p]
        if missing:
            raise ValueError(f"params[{i}]: a step of T^={runtime_max} ({gemms[i]}) reads {list(need)}, missing "
                             f"{missing} (traced_params(layers, T^) gives what a T^ reads)")
    fns = traced_functions()
    routes = [tuple(router) if isinstance(router, (tuple, list)) else
              None if layer.fused_route(router) else fns["router"](router, layer.top_k, layer.renormalize)
              for layer, router in zip(layers, routers)]
    if None in routes:  # ep_a2a's router kernel, one call for the ranks it routes (no tokens for the others)
        lgs = [jax.numpy.zeros((0, layer.num_experts), jax.numpy.float32) if r is not None else lg
               for layer, r, lg in zip(layers, routes, routers)]
        ids, ws = ops.route(lgs, [layer.renormalize for layer in layers])
        routes = [r if r is not None else (i, w) for r, i, w in zip(routes, ids, ws)]
    routes = [(jax.numpy.asarray(i, jax.numpy.int32), jax.numpy.asarray(w, jax.numpy.float32)) for i, w in routes]
    d = ops.dispatch_to_experts([i for i, _ in routes], [[x, w] for x, (_, w) in zip(xs, routes)], runtime_max,
                                rows=not fused, counts=not fused)
    if fused:  # (FC1 reads the dispatched rows in place; FC2 finalizes into the combine input)
        return ops.experts_combine(d, [p["w1"] for p in params], [p["w2"] for p in params])
    ours = not any(isinstance(router, (tuple, list)) for router in routers)
    fc2 = [fns["padded_ffn"](rows, counts, p["w1t"], p["w2t"], expert_rows_bound(layer, runtime_max, ours, rows.shape[0]))
           if g == "padded" else fns["ragged_ffn"](rows, counts, p["w1t"], p["w2t"])
           for layer, p, g, rows, counts in zip(layers, params, gemms, d.rows, d.counts)]
    return ops.combine_from_experts(fc2, d)


def traced_params(layers, runtime_max_tokens_per_rank: int = None) -> list:
    """Per layer, the weights (layer.params) a traced step of this T^ reads: the expert kernels'
    layout or XLA's, both where T^ is left to the trace. JAX handles every argument of a jitted
    call on every call, so a step takes only those it reads."""
    if runtime_max_tokens_per_rank is None:
        return [layer.params for layer in layers]
    out = []
    for layer in layers:
        p = layer.params
        out.append({k: p[k] for k in step_weights(layer.expert_gemm(runtime_max_tokens_per_rank))})
    return out


def jit_forward_all_ranks(layers, runtime_max_tokens_per_rank: int = None):
    """jax.jit(moe_forward_traced) over these layers: f(xs, routers) -> one array per rank. The
    layers' weights are the jitted program's arguments (traced_params), not constants in it."""
    import jax
    params = traced_params(layers, runtime_max_tokens_per_rank)
    step = jax.jit(lambda ps, xs, routers: moe_forward_traced(layers, xs, routers, runtime_max_tokens_per_rank, ps))
    return lambda xs, routers: step(params, xs, routers)
