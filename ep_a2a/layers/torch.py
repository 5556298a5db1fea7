"""A complete MoE layer in PyTorch on the rank-major all-to-all (paper §3.3, Figure 3).

    router -> dispatch (bf16 hidden + fp32 router weights) -> build_index -> gather_rows ->
    FC1 (grouped GEMM) -> SiLU(gate) * up -> FC2 (grouped GEMM) -> finalize (into the combine
    input) -> combine

One TorchMoeLayer per rank holds that rank's local experts (the all-to-all's contiguous split,
moe.local_experts): FC1 = gate and up projections stacked, w_gate_up [E_local, 2*I, hidden]
(rows [0, I) gate, [I, 2I) up), FC2 w_down [E_local, hidden, I], both bf16, laid out like
nn.Linear weights (out_features, in_features). Every GEMM takes bf16 inputs, accumulates in
fp32 and rounds its output to bf16; finalize and combine accumulate in fp32. On an all-to-all
built with combine_quant="fp8", finalize writes the partial results as FP8 (e4m3, a scale per
128 values) straight into the combine input, and combine pulls those.

Router (route()): logits fp32 [T, num_experts] -> the top_k largest logits -> softmax over
those k (= softmax over all experts, top_k, then renormalize to sum 1). With
renormalize=False the weights are the full softmax's probabilities of the k experts. One
ep_a2a kernel per rank (moe.route, the ep_a2a::route op) where it takes the shapes
(num_experts <= 1024, top_k <= 32, fp32 / bf16 / fp16 contiguous logits), else torch.topk
and torch.softmax; layer.routing then holds views valid until the layer's next step.
forward() also takes the routing ready-made: (expert ids int [T, top_k], weights [T, top_k];
-1 = no expert; repeated experts count once per selection).

Grouped GEMMs: torch.nn.functional.grouped_mm (or torch._grouped_mm in older releases) with
the index's device offsets, so the layer never reads a count on the host; a per-expert loop
over host counts where that is missing or fails on this GPU (checked once, at construction).
The grouped path's activation is ep_a2a's fused SiLU(gate) * up (moe.activation), which reads
the row total on the device (the host does not know it) and computes those rows only, bitwise
as torch's F.silu and torch.mul would; rows past the total hold garbage that nothing reads.

Every ep_a2a step runs through the registered torch ops (ep_a2a/ops/torch.py: dispatch,
build_index, gather_rows, activation, finalize, combine) on the rank's stream, with torch
tensors: no DLPack exchange per call. Ranks in one process (ep_a2a.LocalGroup): moe_forward_all_ranks()
runs a step in phases (layers/base.run_phases says why); the layer's buffers are allocated
at construction and the dispatch and combine phases allocate nothing and never block the
host. A rank alone in its process (ProcessGroup) may simply call forward().

torch is imported inside functions only: `import ep_a2a` never needs it. (This module is
ep_a2a.layers.torch; `import torch` in it is an absolute import and finds PyTorch itself.)
The NumPy oracle of the layer (dense_reference, check_layer_output, ...) is
ep_a2a.testing.layer_oracle.
"""
from __future__ import annotations

import numpy as np

from ..driver.stream import Event
from .base import LayerBase, payload_specs, run_phases  # noqa: F401  (payload_specs: for the callers)

GEMMS = ("auto", "grouped", "loop", "fused")


# -- PyTorch ---------------------------------------------------------------------------------------
def _grouped_mm_function():
    import torch
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


_PROBED = {}


def grouped_mm_support(device) -> tuple:
    """(grouped mm function or None, reason): whether torch's grouped GEMM runs bf16 with device
    offsets on `device` and matches a per-group matmul. Probed once per device (synchronizes:
    call it before any dispatch)."""
    import torch
    device = torch.device(device)
    if device in _PROBED:
        return _PROBED[device]
    fn = _grouped_mm_function()
    if fn is None:
        result = (None, f"torch {torch.__version__} has no grouped_mm")
    else:
        try:
            g = torch.Generator(device=device).manual_seed(1)
            a = torch.randn(48, 64, device=device, generator=g).to(torch.bfloat16)
            b = torch.randn(3, 32, 64, device=device, generator=g).to(torch.bfloat16)  # [groups, N, K]
            bounds = [0, 7, 7, 40]  # an empty group, and rows past the last offset
            offs = torch.tensor(bounds[1:], dtype=torch.int32, device=device)
            got = fn(a, b.transpose(1, 2), offs=offs).float()
            want = torch.cat([a[bounds[i]:bounds[i + 1]].float() @ b[i].float().t() for i in range(3)])
            ok = torch.allclose(got[:bounds[-1]], want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))
            result = (fn, "ok") if ok else (None, "grouped_mm disagrees with a per-group matmul on this GPU")
        except Exception as e:  # not built for this GPU / dtype: the loop is the fallback
            result = (None, f"grouped_mm failed on {device}: {type(e).__name__}: {e}")
    _PROBED[device] = result
    return result


_VIEW_PROBED = {}


def grouped_mm_takes_offset_views(device) -> bool:
    """Whether grouped_mm accepts offsets whose data pointer is 4 bytes past a 16-byte boundary
    (the index's offsets[1:], read in place instead of copied each step) and gives the bits it
    gives with aligned offsets. torch's source says it does: its checks on offs are 1-D and
    int32 (alignment is checked on the matrices only), and the kernel that reads them
    (prepare_grouped_gemm_data) loads single int32 values. Probed once per device anyway
    (synchronizes), so that another torch costs a copy per step, never a wrong result."""
    import torch
    device = torch.device(device)
    if device not in _VIEW_PROBED:
        fn, ok = grouped_mm_support(device)[0], False
        if fn is not None:
            try:
                g = torch.Generator(device=device).manual_seed(2)
                a = torch.randn(48, 64, device=device, generator=g).to(torch.bfloat16)
                b = torch.randn(3, 32, 64, device=device, generator=g).to(torch.bfloat16).transpose(1, 2)
                full = torch.tensor([0, 7, 7, 40], dtype=torch.int32, device=device)
                view = full[1:]
                if view.data_ptr() % 16 == 4:
                    got, want = fn(a, b, offs=view), fn(a, b, offs=view.clone())
                    ok = bool(torch.equal(got[:40].view(torch.int16), want[:40].view(torch.int16)))
            except Exception:  # (a torch that refuses the view: the layer copies the offsets)
                ok = False
        _VIEW_PROBED[device] = ok
    return _VIEW_PROBED[device]


class TorchMoeLayer(LayerBase):
    """The MoE layer of one rank: its local experts' weights and every buffer one step needs.

    a2a_rank: a RankAlltoAll (a2a.ranks[i]) of a MoeAlltoAll built with payloads=
      payload_specs(hidden, top_k), combine_hidden_size=hidden, combine_dtype="bfloat16".
    w_gate_up: bf16 [E_local, 2*I, hidden]; w_down: bf16 [E_local, hidden, I], on the rank's GPU.
    gemm: "auto" (ep_a2a's expert kernels while an expert may get at most
      moe_experts.auto_expert_rows rows, else torch's grouped GEMM where it works, else the loop),
      "fused" (the expert kernels at every size), "grouped" or "loop".
    compute_graphs: the compute phase (index to finalize: no peer, no host wait) replayed from a
      CUDA graph of this rank's stream, one per T^, captured at the second eager step with that
      T^ (the first warms it up): an eager step's host time without a launch per piece. Not with
      the loop GEMM (it reads counts on the host). A replay leaves the host's view of `index`
      (its T^, capacity and row views) at the last step the host issued itself.
    """

    def __init__(self, a2a_rank, w_gate_up, w_down, *, renormalize: bool = True, gemm: str = "auto",
                 compute_graphs: bool = False):
        import torch
        super().__init__(a2a_rank, "layers.torch", renormalize, gemm, GEMMS)
        a = a2a_rank.a2a
        self.device = torch.device("cuda", a2a_rank.device.ordinal)
        L, H = self.num_local, self.hidden
        for name, t, inner in (("w_gate_up", w_gate_up, None), ("w_down", w_down, (H,))):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 3 or t.device != self.device:
                raise ValueError(f"{name}: must be a bf16 torch tensor [E_local, ...] on {self.device}")
            if t.shape[0] != L:
                raise ValueError(f"{name}: rank {self.rank} owns {L} experts, got {t.shape[0]}")
        if w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2:
            raise ValueError(f"w_gate_up: must be [E_local={L}, 2*I, hidden={H}], got {list(w_gate_up.shape)}")
        self.inter = w_gate_up.shape[1] // 2
        if tuple(w_down.shape) != (L, H, self.inter):
            raise ValueError(f"w_down: must be [E_local={L}, hidden={H}, I={self.inter}], got {list(w_down.shape)}")
        self.w_gate_up, self.w_down = w_gate_up.contiguous(), w_down.contiguous()
        # grouped_mm's mat_b is [groups, K, N]; the transposed nn.Linear layout is its column-major form
        self._w1t, self._w2t = self.w_gate_up.transpose(1, 2), self.w_down.transpose(1, 2)

        # the expert kernels of ep_a2a (gather, FC1 and activation in one, then FC2) where each
        # expert holds few rows (every step with gemm="fused"; with "auto" while ep_size * T^,
        # the most rows an expert gets through the router, is at most moe_experts.auto_expert_rows)
        from ..moe_experts import auto_expert_rows, expert_gemms_unsupported
        self.fused_reason = expert_gemms_unsupported(H, self.inter)
        if gemm == "fused" and self.fused_reason is not None:
            raise ValueError(f"gemm='fused': the expert kernels do not take {self.fused_reason}")
        self.fused_max_rows = (1 << 62 if gemm == "fused" else
                               auto_expert_rows(H, self.inter) if gemm == "auto" else 0)
        self._gmm, self.gemm_reason = (None, "gemm='loop'") if gemm == "loop" else grouped_mm_support(self.device)
        if gemm == "grouped" and self._gmm is None:
            raise RuntimeError(f"gemm='grouped': {self.gemm_reason}")
        self.gemm = "grouped" if self._gmm is not None else "loop"

        self.stream = torch.cuda.ExternalStream(self.s, device=self.device)  # torch work of this rank runs here
        from ..interop.torch_stream import OnStream
        from ..ops.torch_views import current_stream_handle
        self._on = OnStream(self.stream)  # (`with self._on:` costs far less host time than torch.cuda.stream)
        self._current_stream = current_stream_handle  # (raw handle of torch's current stream on a GPU)
        from ..ops import torch as ep_ops
        self._ops = ep_ops
        self.tr = ep_ops.bind(a2a_rank)
        self.tix = ep_ops.expert_index(self.tr)
        self.index = self.tix.index
        cap, I = self.ep_size * a.max_tokens_per_rank * self.top_k, self.inter
        bf = dict(dtype=torch.bfloat16, device=self.device)
        self._xg = torch.empty(cap, H, **bf)          # expert-major FC1 input (gather_rows); fused: FC2's output
        self._act = torch.empty(cap, I, **bf)         # SiLU(gate) * up
        if self.gemm == "loop":
            self._h = torch.empty(cap, 2 * I, **bf)
            self._y = torch.empty(cap, H, **bf)
        self._out = torch.empty(a.max_tokens_per_rank, H, **bf)
        # the fused router's outputs (made once: the kernels are fetched now, never in a capture)
        from ..moe import route_unsupported
        self.route_reason = route_unsupported(self.num_experts, self.top_k, "float32")
        self._fused_route = self.route_reason is None
        self._route_dtypes = (torch.float32, torch.bfloat16, torch.float16)
        self._route_rows = a.max_tokens_per_rank
        if self._fused_route:
            ep_ops.torch_router(self.device.index)
            self._route_ids = torch.empty(a.max_tokens_per_rank, self.top_k, dtype=torch.int32, device=self.device)
            self._route_w = torch.empty(a.max_tokens_per_rank, self.top_k, dtype=torch.float32, device=self.device)
        self._route_views = {}
        self._offsets = self.tix.offsets  # int32 [E_local + 1] on the device
        self._ends = self._offsets[1:]
        # FC1 and FC2 read the end offsets in place where grouped_mm takes that view (4 bytes past
        # a 16-byte boundary), else from a copy made each step (one more graph node per rank)
        self._offs = self._ends if self.gemm == "grouped" and grouped_mm_takes_offset_views(self.device) else \
            torch.empty(L, dtype=torch.int32, device=self.device)
        # Per-step host work made once: the buffers' views per T^ (or T) and the events that
        # order this rank's stream after the caller's (a driver event recorded on the raw
        # current stream: no torch Stream object per step) and back (Stream.wait_stream would
        # make an event each call).
        self._rows_views, self._out_views = {}, {}
        self._fork, self._join = Event(a2a_rank.device), torch.cuda.Event()
        if compute_graphs and self.gemm == "loop":
            raise ValueError(f"compute_graphs: not with the loop GEMM (gemm={gemm!r}: {self.gemm_reason}), which "
                             f"reads the expert counts on the host")
        # T^ -> the compute phase's graph; T^ seen once (warmed up); one memory pool for them all
        self._graphs, self._warm, self._pool = ({}, set(), torch.cuda.graph_pool_handle()) if compute_graphs else \
            (None, None, None)
        torch.cuda.synchronize(self.device)
        self.output = None

    # -- the grouped GEMMs (also what the graphed benchmark's baseline and GEMM floor run) ----------
    def fc1(self, rows, offs):
        """FC1 of the local experts: rows bf16 [R, hidden] expert-major, offs int32 [E_local]
        end row of each expert (on the device) -> bf16 [R, 2*I]; rows past offs[-1] undefined."""
        return self._gmm(rows, self._w1t, offs=offs)

    def fc2(self, act, offs):
        """FC2 of the local experts: act bf16 [R, I] -> bf16 [R, hidden] (as fc1)."""
        return self._gmm(act, self._w2t, offs=offs)

    @property
    def buffers(self) -> tuple:
        """(gathered rows [cap, hidden], activations [cap, I], expert end offsets int32
        [E_local]): what the last step left there (cap = ep_size * max_tokens * top_k). A step
        on the expert kernels (fused_max_rows) gathers nothing: the first holds FC2's output."""
        return self._xg, self._act, self._offs

    # -- phases ------------------------------------------------------------------------------------
    def route(self, logits):
        """(ids int32 [T, top_k], weights fp32 [T, top_k]) of the router on this rank's stream:
        ep_a2a's fused router (one kernel, moe.route) into the layer's routing buffers (views
        valid until the next step), or torch.topk + softmax where it does not take the logits
        (route_reason says why: num_experts > 1024, top_k > 32, another dtype, non-contiguous)."""
        import torch
        T = logits.shape[0]
        if self._fused_route and logits.dtype in self._route_dtypes and logits.is_contiguous() and T <= self._route_rows:
            views = self._route_views.get(T)
            if views is None:
                views = self._route_views[T] = (self._route_ids[:T], self._route_w[:T])
            with self._on, torch.no_grad():
                return self._ops.route(logits, views[0], views[1], self.renormalize)
        with self._on, torch.no_grad():
            top, ids = torch.topk(logits.float(), self.top_k, dim=-1)
            if self.renormalize:
                w = torch.softmax(top, dim=-1)
            else:
                w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
            return ids.to(torch.int32), w.contiguous()

    def prepare(self, x, router, runtime_max_tokens_per_rank: int) -> None:
        """Phase 1: route and stage the inputs (no ep_a2a launch; may allocate and block)."""
        import torch
        if self._step is not None:
            raise RuntimeError(f"rank {self.rank}: prepare() called twice without combine()")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != torch.bfloat16:
            raise ValueError(f"x: must be a bf16 torch tensor [tokens, hidden={self.hidden}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
        if x.device != self.device:
            raise ValueError(f"x: must be on {self.device} (rank {self.rank}'s GPU), got {x.device}")
        T = x.shape[0]
        # the caller produced x (and the router input) on its current stream
        self._fork.record(self._current_stream(self.device.index)).wait_on(self.s)
        if isinstance(router, (tuple, list)):
            ids, w = router
            if tuple(ids.shape) != (T, self.top_k) or tuple(w.shape) != (T, self.top_k):
                raise ValueError(f"router: (ids, weights) must both be [{T}, top_k={self.top_k}], got "
                                 f"{list(ids.shape)} and {list(w.shape)}")
            with self._on:
                ids, w = ids.to(self.device, torch.int32).contiguous(), w.to(self.device, torch.float32).contiguous()
        else:
            if tuple(router.shape) != (T, self.num_experts):
                raise ValueError(f"router: logits must be [{T}, num_experts={self.num_experts}], got {list(router.shape)}")
            ids, w = self.route(router)
        if not x.is_contiguous():  # (a stream switch costs host time: only when there is a copy to make)
            with self._on:
                x = x.contiguous()
            # No record_stream on this rank's stream: the caching allocator would record an
            # event on it when the tensor is freed, possibly after the group destroyed the
            # stream (a crash). The step keeps x, ids and w alive until its
            # combine is issued, and the caller's stream then waits for ours, so memory the
            # caller frees is reused only after our reads.
        self._step = dict(T=T, runtime_max=int(runtime_max_tokens_per_rank), ids=ids, x=x, w=w)
        self.routing = (ids, w)

    def dispatch(self) -> None:
        """Phase 2: this rank's dispatch, through the torch op on its stream (no host blocking)."""
        st = self._step
        with self._on:
            st["views"] = self._ops.dispatch(self.tr, st["ids"], [st["x"], st["w"]], st["runtime_max"])

    def compute(self) -> None:
        """Phase 3: index, gather, FC1, activation, FC2 (at most fused_max_rows rows per expert:
        the expert kernels, gather, FC1 and activation in one, and FC2 with the finalize but
        under FP8 combine), finalize into the combine input; with compute_graphs, from the
        graph of this T^ once there is one.
        Call it only once every rank of the process has dispatched (the loop GEMM syncs the host,
        a capture synchronizes the device)."""
        if self._graphs is None:
            return self._compute()
        import torch
        runtime_max = self._step["runtime_max"]
        with self._on:
            if torch.cuda.is_current_stream_capturing():  # (inside the caller's graph: no graph of our own)
                return self._compute()
            g = self._graphs.get(runtime_max)
            if g is None:
                if runtime_max not in self._warm:  # (the first step of a T^ runs eagerly: lazy inits happen there)
                    self._warm.add(runtime_max)
                    return self._compute()
                # Every tensor the phase reads or writes sits where it did (the dispatch views and
                # combine input of this T^, the layer's buffers, the weights), so the graph replays
                # any later step of this T^. Capturing on our own stream keeps the ops' stream switch a no-op.
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool, stream=self.stream, capture_error_mode="global"):
                    self._compute()
                self._graphs[runtime_max] = g
            g.replay()

    def _compute(self) -> None:
        import torch
        import torch.nn.functional as F
        I, ops = self.inter, self._ops
        with self._on, torch.no_grad():
            ids_v, (x_v, w_v) = self._step["views"]
            ops.build_index(self.tix, ids_v, w_v)
            runtime_max = self._step["runtime_max"]
            if self.ep_size * runtime_max <= self.fused_max_rows:
                ops.expert_fc1(self.tix, x_v, self.w_gate_up, self._act)  # reads the rows in place
                ci = ops.combine_input(self.tr, runtime_max, fp8=self._fp8)
                if self._fc2_finalizes:  # (one launch fewer)
                    ops.expert_fc2(self.tix, self._act, self.w_down, self._xg, finalize_into=ci)
                else:
                    ops.expert_fc2(self.tix, self._act, self.w_down, self._xg)
                    ops.finalize(self.tix, self._xg, ci)
                return
            ops.gather_rows(self.tix, x_v, self._xg)
            cap = self.index.capacity
            views = self._rows_views.get(cap)
            if views is None:
                views = self._rows_views[cap] = (self._xg[:cap], self._act[:cap])
            xg, act = views
            if self.gemm == "grouped":
                offs = self._offs  # end row of each local expert, on the device
                if offs is not self._ends:
                    offs.copy_(self._ends)  # (a torch whose grouped_mm did not take the view)
                h = self.fc1(xg, offs)
                if not h.is_contiguous():  # (padded rows: grouped_mm aligns them to 16 bytes)
                    h = h.contiguous()
                ops.activation(self.tix, h, act)  # the rows below the device's total only
                y = self.fc2(act, offs)  # (freed on this stream: its reuse waits for finalize)
            else:
                bounds = self._offsets.cpu().tolist()  # blocks until build_index ran (all ranks have dispatched)
                h, total = self._h, bounds[-1]
                for e in range(self.num_local):
                    a, b = bounds[e], bounds[e + 1]
                    if b > a:
                        torch.matmul(xg[a:b], self.w_gate_up[e].t(), out=h[a:b])
                gate, up = h[:total, :I], h[:total, I:]
                F.silu(gate, inplace=True)
                torch.mul(gate, up, out=self._act[:total])
                for e in range(self.num_local):
                    a, b = bounds[e], bounds[e + 1]
                    if b > a:
                        torch.matmul(self._act[a:b], self.w_down[e].t(), out=self._y[a:b])
                y = self._y
            ops.finalize(self.tix, y, ops.combine_input(self.tr, runtime_max, fp8=self._fp8))

    def combine(self):
        """Phase 4: launch this rank's combine into the layer's output buffer (no host blocking).
        Returns the bf16 [T, hidden] output: a view valid until this layer's next step, ready
        on this rank's stream (moe_forward_all_ranks makes the caller's stream wait for it)."""
        T, runtime_max = self._step["T"], self._step["runtime_max"]
        out = self._out_views.get(T)
        if out is None:
            out = self._out_views[T] = self._out[:T]
        with self._on:
            self._ops.combine(self.tr, self._ops.combine_input(self.tr, runtime_max, fp8=self._fp8), runtime_max, out=out)
        self._step = None
        self.output = out
        return out

    def forward(self, x, router, runtime_max_tokens_per_rank: int = None):
        """One step for a rank alone in its process (every rank passes the same T^; default
        max_tokens_per_rank). Ranks sharing a process: use moe_forward_all_ranks."""
        import torch
        runtime_max = self.a2a_rank.a2a.max_tokens_per_rank if runtime_max_tokens_per_rank is None else runtime_max_tokens_per_rank
        self.prepare(x, router, runtime_max)
        self.dispatch()
        self.compute()
        out = self.combine()
        self.join(torch.cuda.current_stream(self.device))
        return out

    __call__ = forward

    def join(self, stream) -> None:
        """`stream` (a torch stream of this rank's GPU) waits for the work issued on this rank's
        stream so far."""
        self._join.record(self.stream)
        stream.wait_event(self._join)

    def close(self) -> None:
        """Release what the layer made (its expert index and buffers); the all-to-all is the caller's."""
        self.close_gate()
        if self._graphs:  # (the device drained, not a peer's error raised: the rest must still be released)
            self.a2a_rank.device.synchronize()
            self._graphs.clear()
        if not self._fork.closed:
            self._fork.close()
        if self.index is not None:
            self.a2a_rank.synchronize()
            self.tix.release()
            self.index.close()
            self.index = None


def moe_forward_all_ranks(layers, xs, routers, runtime_max_tokens_per_rank: int = None):
    """One MoE layer step of every in-process rank: outputs [T_r, hidden] bf16 per rank.

    xs[r]: bf16 [T_r, hidden]; routers[r]: logits [T_r, num_experts] or (ids, weights).
    T^ defaults to the largest T_r (at least 1). Runs in phases (see the module docstring):
    no rank's dispatch or combine launch waits for the host to finish something that needs a
    peer's launch of the same phase. The outputs are views of each layer's buffer, valid until
    its next step; the caller's current stream waits for them (nothing blocks the host).
    """
    import torch
    run_phases(layers, xs, routers, runtime_max_tokens_per_rank)
    outs = [layer.output for layer in layers]
    current = {}
    for layer in layers:
        cur = current.get(layer.device)
        if cur is None:
            cur = current[layer.device] = torch.cuda.current_stream(layer.device)
        layer.join(cur)
    return outs


def dense_reference_torch(x, ids, weights, w_gate_up, w_down):
    """The layer over all tokens and all experts in float64 on the GPU (torch): float64 [N, hidden].
    Same arguments as dense_reference, as torch tensors (weights of every expert)."""
    import torch
    import torch.nn.functional as F
    x64, out = x.double(), torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    inter = w_down.shape[2]
    for e in range(w_gate_up.shape[0]):
        tok, k = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x64[tok] @ w_gate_up[e].double().t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w_down[e].double().t()
        out.index_add_(0, tok, weights[tok, k].double()[:, None] * y)
    return out


def bf16_from_bits(bits, device):
    """A bf16 torch tensor holding numpy uint16 bf16 bits."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).to(device).view(torch.bfloat16)


def bits_from_bf16(t) -> np.ndarray:
    """numpy uint16 bits of a bf16 torch tensor (copied to the host)."""
    import torch
    return t.detach().contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
