"""dispatch and combine inside jax.jit, on XLA's stream.

How a call runs: natively where libep_a2a_jax.so is built (jax_ffi.py): the launches are
planned while tracing (jax_plan.py) and an XLA FFI handler issues them, no Python per call;
otherwise through Python callbacks (jax_calls.py), with one warning saying why.

    ops = JaxAlltoAll(a2a)                 # once; a2a's ranks of this process, grouped by GPU
    @jax.jit
    def step(ids, x, w, ...):
        d = ops.dispatch(ids, [x, w], runtime_max_tokens_per_rank=T_hat)
        partial = experts(d.expert_ids, d.payloads)            # [ep_size, T^, hidden], any JAX
        return ops.combine(partial, d)                         # [local tokens, hidden]

Ranks: one call covers the ranks of this process on the GPU it runs on. With one rank per
GPU an argument is one array; with n in-process ranks on a GPU (a single controller; the
test setting) it is a list of n arrays, one per rank in a2a.ranks order, and so is every
result. Over several GPUs, run the same function under shard_map (one call per GPU, each
finding its ranks from the address of its buffers): every GPU must hold the same number of
this process's ranks.

Checks: shapes and dtypes are static under jit, so the rules eager dispatch and combine apply
(ep_a2a/validate.py) are checked while tracing, with the same exception types and messages;
values (expert ids with validate_expert_ids) are checked by the Python callbacks at run time;
the native path drops out-of-range ids in the kernels, as a captured graph does (a host check
would synchronize). A failure a kernel recorded refuses the next call on either path, except
a replay of a command buffer (XLA's CUDA graph), which runs no host code: there a2a.error()
reports it.

Order: every call is pure to XLA (jax_calls.py: the fast dispatch path); dispatch returns a
ticket that combine takes, so combine runs after its dispatch and both run once per step.
A dispatch of an all-to-all may not follow another without its combine in between (the eager
phase rule, raised at run time): the data flow of one step after another gives that order.
The halves (dispatch_send / dispatch_recv / combine_send / combine_recv: jax_halves.py, native
path only) chain their tickets the same way; a whole call while a send half awaits its
receive is refused while tracing (HalvesOrderError).

Copies per call and rank (bytes_copied() computes them): the received tokens live in the
symmetric workspace, where peers write them, and XLA wants results in buffers it allocates,
so dispatch copies ep_size * T^ * (4 * top_k + payload bytes per token) out of the workspace
(on the GPU, after the kernel). combine stages the partial results into the workspace
(ep_size * T^ * hidden * itemsize) and its kernel writes the output straight into XLA's result
(no copy). There is nothing to alias (input_output_aliases): no result is an operand's
memory. The MoE pair avoids both big copies: dispatch_to_experts gathers the dispatched rows
expert-major (moe.gather_rows) straight into XLA's result, copying only the counts (4 bytes
per local expert), and combine_from_experts finalizes the experts' output straight into the
workspace's combine input (moe.finalize): then the only data moved are the two the eager layer
moves too.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from ..driver.memory import copy_dtod_async
from ..driver.module import load
from ..driver.stream import is_capturing
from ..interop.dlpack import DLDeviceType
from ..interop.tensor import CUDA, Tensor, as_dtype
from ..schedule import COMBINE, DISPATCH
from ..moe import ExpertIndex, build_index, finalize, gather_rows, local_experts
from ..validate import check_dispatch_inputs, check_expert_ids_on_host, check_partial_shape, check_runtime_max, require, token_tensor
from . import jax_ffi
from .jax_calls import RanksByDevice, buffer_ptr
from .jax_dispatched import Dispatched
from .jax_experts import ExpertsCalls, JaxExperts
from .jax_halves import HalvesCalls, JaxHalves, SendTicket, TraceOrder
from .jax_plan import CopyOp, Group, copy_launch, encode, fake, pair_params, recorded, steady_pair, step_launch
from .jax_route import RouteCalls, route

jnp_dtype = jax.numpy.dtype
_PROBE_PTR = 256  # the address of the trace-time stand-ins (aligned for every dtype; never read)


def _probe(arr, name: str, inner: tuple, dtype: str, rows, max_tokens: int, leading_dims=(1,)) -> Tensor:
    """The eager rule of a per-token argument (validate.token_tensor) applied to a traced
    array's shape and dtype, through a stand-in Tensor no kernel ever reads."""
    if arr is None:
        raise TypeError(f"{name}: expected a tensor, got None")
    if not (hasattr(arr, "shape") and hasattr(arr, "dtype")):
        raise TypeError(f"{name}: expected a JAX array, got {type(arr).__name__}")
    try:
        dt = as_dtype(np.dtype(arr.dtype))
    except TypeError:
        raise TypeError(f"{name}: dtype must be {dtype}, got {arr.dtype}") from None
    t = Tensor(_PROBE_PTR, tuple(arr.shape), dt, device=(CUDA, 0))
    return token_tensor(t, name, inner, dtype, rows, 0, ordinal=None, max_tokens=max_tokens,
                        leading_dims=leading_dims)


def _on_gpu(buf) -> None:
    if buf.__dlpack_device__()[0] != DLDeviceType.kDLCUDA:
        raise RuntimeError("ep_a2a's jit calls run on CUDA GPUs only: this program runs on "
                           f"{DLDeviceType(buf.__dlpack_device__()[0]).name} (put the arrays on a GPU)")


class JaxAlltoAll:
    """The jit-callable dispatch and combine of a MoeAlltoAll's ranks in this process (module
    docstring). indexes: rank -> ExpertIndex for dispatch_to_experts (default: made on first
    use, one per rank, closed by close())."""

    def __init__(self, a2a, indexes: dict = None):
        self.a2a, self.o = a2a, a2a.options
        self.by_device = RanksByDevice(a2a.ranks)
        self.per_device = self.by_device.per_device
        # the ranks of every GPU's call, by position (the traced shapes follow the first GPU's)
        self.rank_numbers = tuple(r.rank for r in next(iter(self.by_device.devices.values())).ranks)
        self._indexes, self._own_indexes = dict(indexes or {}), []
        self._sites = 0  # each traced call site keeps its own Tensor slots
        # the native path (jax_ffi.py): launch plans made while tracing, run by an FFI handler
        self.native = jax_ffi.native_or_warn()
        self._plans, self._combines = [], {}  # registered plans; dispatch site -> its combine's planned steps
        self._roles = {}  # dispatch_to_experts site -> its (gather, weights) payloads, whether it gathers, counts
        self._order = TraceOrder()  # the trace's order of calls, whole and halves
        self._halves, self._experts = JaxHalves(self._halves_calls()), JaxExperts(self._experts_calls())
        a2a.on_close(self._release_plans)  # (a plan holds the ranks' streams and records: never past them)

    @classmethod
    def traced_only(cls, options, rank_numbers=(0,)) -> "JaxAlltoAll":
        """The same calls for tracing alone (jax.eval_shape, lowering; no GPU needed) from the
        checked MoeAlltoAll options (config.Options) and the ranks one call covers: what
        they produce and refuse is what the real object's calls would. Running one raises."""
        self = cls.__new__(cls)
        self.a2a, self.o, self.by_device = None, options, None
        self.rank_numbers = tuple(int(r) for r in rank_numbers)
        self.per_device = len(self.rank_numbers)
        self._indexes, self._own_indexes, self._sites = {}, [], 0
        self.native, self._plans, self._combines, self._roles = False, [], {}, {}
        self._order = TraceOrder()
        self._halves, self._experts = JaxHalves(self._halves_calls()), JaxExperts(self._experts_calls())
        return self

    def _halves_calls(self) -> HalvesCalls:
        return HalvesCalls(self, self.o, self.a2a, self.native, self._order, self._site, self._native,
                           self._check_dispatch, self._check_ticket, self._check_partials, Dispatched)

    def _experts_calls(self) -> ExpertsCalls:
        return ExpertsCalls(self.o, self.a2a, self.native, self._order, self._site, self._native, self._call,
                            self._check_ticket, self._per_rank, self._num_local, self._rank_indexes,
                            self._indexes.__getitem__, self._device, self._roles.__getitem__, self._planned_combine,
                            self.rank_numbers)

    def experts(self, dispatched, w_gate_up, w_down):
        """The experts' FC1, SiLU(gate) * up and FC2 on what dispatch_to_experts delivered, as
        ep_a2a's expert kernels (jax_experts.py): bf16 w_gate_up [E_local, 2 I, hidden] and
        w_down [E_local, hidden, I] per rank -> fc2_out [ep_size * T^ * top_k, hidden] per rank,
        for combine_from_experts."""
        return self._experts.experts(dispatched, w_gate_up, w_down)

    def route(self, logits, renormalize=True):
        """The MoE router (moe.route, one kernel per rank; jax_route.py): logits [T_r, num_experts]
        per rank -> (ids int32, weights fp32 [T_r, top_k]), as dispatch_to_experts takes them;
        renormalize: one flag, or one per rank."""
        return route(RouteCalls(self.o, self.native, self._native, self._call, self._per_rank, self._device),
                     logits, renormalize)

    def experts_combine(self, dispatched, w_gate_up, w_down):
        """experts(), its finalize and combine_from_experts' combine in one call (FC2's kernel
        finalizes into the combine input): what combine_from_experts(experts(...)) returns."""
        return self._experts.experts_combine(dispatched, w_gate_up, w_down)

    # -- the halves (jax_halves.py) -----------------------------------------------------------------
    def dispatch_send(self, token_selected_experts, payloads=(), runtime_max_tokens_per_rank: int = None) -> SendTicket:
        """dispatch()'s send half (its arguments): issues every store and flag and waits on no
        peer; returns the ticket dispatch_recv takes."""
        return self._halves.dispatch_send(token_selected_experts, payloads, runtime_max_tokens_per_rank)

    def dispatch_recv(self, ticket: SendTicket) -> Dispatched:
        """The receive half of dispatch_send's `ticket`: waits for every peer, then returns what
        dispatch() returns, for combine_send."""
        return self._halves.dispatch_recv(ticket)

    def combine_send(self, partial, dispatched: Dispatched) -> SendTicket:
        """combine()'s send half (`dispatched` from dispatch_recv): stages and publishes (FENCE)
        or pushes (SENTINEL) the partial results; returns the ticket combine_recv takes."""
        return self._halves.combine_send(partial, dispatched)

    def combine_recv(self, ticket: SendTicket):
        """The receive half of combine_send's `ticket`: waits for every peer, reduces; returns
        what combine() returns."""
        return self._halves.combine_recv(ticket)

    def native_calls(self, ordinal: int = 0, graphed: bool = False, updates: bool = False) -> int:
        """How many times the FFI handler has run this object's launch plans on cuda:`ordinal`
        (0 on the Python path). Under XLA's command buffers it runs only when XLA records;
        `graphed`: the runs that replayed the handler's own graph (calls XLA did not capture);
        `updates`: the kernel nodes of those graphs that calls re-set (XLA's buffers moved)."""
        return sum(plan.node_updates(ordinal) if updates else plan.calls(ordinal, graphed) for plan in self._plans)

    def _release_plans(self) -> None:
        """Release the launch plans (a jitted call of one after this gets a clean FFI error)."""
        if self._plans:
            try:
                for dev in self.by_device.devices.values():
                    dev.device.synchronize()  # (XLA's stream may still run a plan's launches)
            finally:
                for plan in self._plans:
                    plan.release()
                self._plans = []

    def close(self) -> None:
        """Free the all-to-all and the per-device launch state."""
        self._release_plans()
        if self.by_device is not None:
            self.by_device.close()
        for idx in self._own_indexes:
            idx.close()
        self._own_indexes = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- static facts -----------------------------------------------------------------------------
    def bytes_copied(self, op: str, runtime_max_tokens_per_rank: int) -> int:
        """Device bytes one call of `op` copies per rank besides its kernels' own traffic."""
        o, tmax = self.o, int(runtime_max_tokens_per_rank)
        slots = o.ep_size * tmax
        if op == "dispatch":
            return slots * (4 * o.top_k + sum(p.bytes_per_token for p in o.payloads))
        if op == "combine":
            return slots * o.combine_hidden_size * o.combine_dtype.itemsize
        if op == "dispatch_to_experts":
            return 4 * max(self._num_local(r) for r in self.rank_numbers)
        if op == "combine_from_experts":
            return 0
        raise ValueError(f"op: must be dispatch, combine, dispatch_to_experts or combine_from_experts, got {op!r}")

    # -- helpers ----------------------------------------------------------------------------------
    def _per_rank(self, x, name: str) -> tuple:
        """(one entry per rank of a GPU, whether the caller passed a bare array for one rank)."""
        n = self.per_device
        if n == 1 and not isinstance(x, (list, tuple)):
            return [x], True
        if not isinstance(x, (list, tuple)) or len(x) != n:
            got = f"{len(x)} entries" if isinstance(x, (list, tuple)) else \
                "one array" if hasattr(x, "shape") else type(x).__name__
            raise ValueError(f"{name}: needs one entry per rank of this process on a GPU ({n}: a list), got {got}")
        return list(x), False

    def _site(self) -> int:
        self._sites += 1
        return self._sites

    def _num_local(self, rank: int) -> int:
        return local_experts(self.o.num_experts, self.o.ep_size, rank)[1]

    def _rank_indexes(self) -> list:
        out = []
        for r in self.a2a.ranks:
            idx = self._indexes.get(r.rank)
            if idx is None:
                idx = self._indexes[r.rank] = ExpertIndex.for_rank(r)
                self._own_indexes.append(idx)
            out.append(idx)
        return out

    def _check_dispatch(self, token_selected_experts, payloads, tmax) -> tuple:
        a = self.o
        check_runtime_max(tmax, a.max_tokens_per_rank)
        tmax = int(tmax)
        ids_l, single = self._per_rank(token_selected_experts, "token_selected_experts")
        pays_l = [payloads] if single else self._per_rank(payloads, "payloads")[0]
        tokens = []
        for i, (ids, pays) in enumerate(zip(ids_l, pays_l)):
            at = "" if single else f"[{i}]"
            name = f"token_selected_experts{at}"
            T = _probe(ids, name, (a.top_k,), "int32", None, a.max_tokens_per_rank).shape[0]
            check_dispatch_inputs(T, tmax, pays, a.payloads, at)
            for q, (p, spec) in enumerate(zip(pays, a.payloads)):
                _probe(p, f"payloads{at}[{q}] ({spec.name})", tuple(spec.shape), spec.dtype, T, a.max_tokens_per_rank)
            tokens.append(T)
        return tmax, ids_l, [list(p) for p in pays_l], single, tuple(tokens)

    def _call(self, body, outs, *args):
        return buffer_callback(body, outs)(*args)

    # -- dispatch / combine -----------------------------------------------------------------------
    def dispatch(self, token_selected_experts, payloads=(), runtime_max_tokens_per_rank: int = None) -> Dispatched:
        """RankAlltoAll.dispatch under jit: returns a Dispatched whose expert_ids and payloads
        are copies of the received views (new XLA arrays; see the copies above)."""
        a = self.o
        tmax, ids_l, pays_l, single, tokens = self._check_dispatch(token_selected_experts, payloads,
                                                                   runtime_max_tokens_per_rank)
        shapes = [jax.ShapeDtypeStruct((a.ep_size, tmax) + tuple(s.shape), jnp_dtype(s.dtype)) for s in a.payloads]
        n = len(ids_l)
        outs = ([jax.ShapeDtypeStruct((a.ep_size, tmax, a.top_k), np.int32)] * n, [shapes] * n,
                jax.ShapeDtypeStruct((1,), np.uint32))
        site = self._site()
        self._order.check("dispatch", DISPATCH)
        if self.native:
            ids_o, pays_o, ticket = self._native(self._dispatch_ops(site, tmax, tokens, None), outs, ids_l, pays_l)
        else:
            body = functools.partial(self._dispatch_body, site, tmax, tokens, None)
            ids_o, pays_o, ticket = self._call(body, outs, ids_l, pays_l)
        self._order.done(DISPATCH)
        return Dispatched(ids_o[0] if single else ids_o, pays_o[0] if single else pays_o, ticket,
                          ops=self, kind="dispatch", tmax=tmax, num_tokens=tokens, site=site, single=single)

    def _launch_dispatch(self, dev, site, tmax, tokens, ids_l, pays_l, streams) -> list:
        a, args = self.o, []
        for i, (r, s) in enumerate(zip(dev.ranks, streams)):
            T = tokens[i]
            ids_t = dev.slot((site, i, -1), (T, a.top_k), "int32", i).at(ids_l[i])
            ins = [dev.slot((site, i, q), (T,) + tuple(spec.shape), spec.dtype, i).at(b)
                   for q, (b, spec) in enumerate(zip(pays_l[i], a.payloads))]
            args.append((r, ids_t, ins, s))
        # Every rank's ids are checked before any rank launches: the ranks of this process
        # spin on each other, so a rank refusing its ids after another launched would leave
        # that one waiting until its timeout.
        for r, ids_t, _, s in args:
            if r.validate_expert_ids and ids_t.shape[0] and not is_capturing(s):
                check_expert_ids_on_host(ids_t, s, r.a2a.num_experts)
        return [r.dispatch(ids_t, ins, tmax, stream=s) for r, ids_t, ins, s in args]

    def _device(self, ticket):
        _on_gpu(ticket)
        if self.by_device is None:
            raise RuntimeError("this JaxAlltoAll was made by traced_only(): it traces, it does not run "
                               "(make it from a MoeAlltoAll)")
        return self.by_device.for_buffer(ticket)

    def _dispatch_body(self, site, tmax, tokens, roles, ctx, out, ids_l, pays_l) -> None:
        dev = self._device(out[2])

        def launch(streams):
            views = self._launch_dispatch(dev, site, tmax, tokens, ids_l, pays_l, streams)
            for i, ((ids_v, pays_v), s) in enumerate(zip(views, streams)):
                if roles is not None:
                    self._index_and_gather(dev, site, roles, i, ids_v, pays_v, out, s)
                    continue
                copy_dtod_async(buffer_ptr(out[0][i]), ids_v.ptr, ids_v.nbytes, s)
                for v, o in zip(pays_v, out[1][i]):
                    copy_dtod_async(buffer_ptr(o), v.ptr, v.nbytes, s)
        dev.run(ctx.stream, launch)

    def combine(self, partial, dispatched: Dispatched):
        """RankAlltoAll.combine under jit: partial [ep_size, T^, hidden] (or [ep_size * T^,
        hidden]) of combine_dtype per rank; returns [local tokens, hidden] per rank, written by
        the combine kernel straight into XLA's result."""
        a = self.o
        tmax, single = self._check_ticket(dispatched, "dispatch")
        parts = self._check_partials(partial, tmax, single)
        outs = [jax.ShapeDtypeStruct((T, a.combine_hidden_size), jnp_dtype(a.combine_dtype.name))
                for T in dispatched.num_tokens]
        self._order.check("combine", COMBINE)
        if self.native:
            res = self._native(self._combine_ops(dispatched, None), outs, parts, dispatched.ticket)
        else:
            body = functools.partial(self._combine_body, self._site(), tmax, dispatched.num_tokens,
                                     [tuple(p.shape) for p in parts])
            res = self._call(body, outs, parts, dispatched.ticket)
        self._order.done(COMBINE)
        return res[0] if single else res

    def _check_partials(self, partial, tmax: int, single: bool) -> list:
        """combine()'s rule for `partial`, per rank: [ep_size, T^, hidden] or [ep_size * T^, hidden]."""
        a = self.o
        parts = self._per_rank(partial, "partial")[0]
        H, dt = a.combine_hidden_size, a.combine_dtype.name
        for i, p in enumerate(parts):
            name = "partial" if single else f"partial[{i}]"
            t = _probe(p, name, (H,), dt, None, a.max_tokens_per_rank, leading_dims=(1, 2))
            check_partial_shape(t.shape, a.ep_size, tmax, H, name)
        return parts

    def _check_ticket(self, dispatched, kind: str) -> tuple:
        if not isinstance(dispatched, Dispatched) or dispatched.ops is not self:
            raise TypeError(f"dispatched: expected what this JaxAlltoAll's {kind}() returned in this step, "
                            f"got {type(dispatched).__name__}")
        if dispatched.kind != kind:
            raise ValueError(f"dispatched: came from {dispatched.kind}(); this call pairs with {kind}()")
        return dispatched.tmax, dispatched.single

    def _combine_body(self, site, tmax, tokens, part_shapes, ctx, out, parts, ticket) -> None:
        dev = self._device(ticket)
        a = self.o

        def launch(streams):
            for i, (r, s) in enumerate(zip(dev.ranks, streams)):
                part = dev.slot((site, i, 0), part_shapes[i], a.combine_dtype, i).at(parts[i])
                y = dev.slot((site, i, 1), (tokens[i], a.combine_hidden_size), a.combine_dtype, i).at(out[i])
                r.combine(part, tmax, stream=s, out=y)
        dev.run(ctx.stream, launch)

    # -- the MoE pair -------------------------------------------------------------------------------
    def dispatch_to_experts(self, token_selected_experts, payloads, runtime_max_tokens_per_rank: int, *,
                            gather: int = 0, weights: int = 1, rows: bool = True, counts: bool = True) -> Dispatched:
        """dispatch, then moe.build_index over the dispatched ids and router weights (payload
        `weights`: fp32 [top_k]) and moe.gather_rows of payload `gather`, in one call. Returns a
        Dispatched whose .rows per rank are [ep_size * T^ * top_k, *shape] expert-major (rows
        past the total are not written) and .counts int32 [local experts]: the grouped GEMM's
        input and group sizes (jax.lax.ragged_dot). Pair it with combine_from_experts.
        rows=False: no gather (.rows is None), for expert kernels that read payload `gather` where
        dispatch left it (experts, experts_combine). counts=False: no counts (.counts is None), which
        those kernels read from the index itself: one copy fewer per rank, each a kernel that XLA
        launches on every step."""
        a = self.o
        specs = a.payloads
        require(isinstance(gather, int) and 0 <= gather < len(specs), "gather",
                f"must index one of the {len(specs)} payloads, got {gather!r}")
        require(isinstance(weights, int) and 0 <= weights < len(specs) and (tuple(specs[weights].shape), specs[weights].dtype)
                == ((a.top_k,), "float32"), "weights", f"must index a float32 [top_k={a.top_k}] payload (the router "
                f"weights), got {weights!r} of {[(s.name, tuple(s.shape), s.dtype) for s in specs]}")
        tmax, ids_l, pays_l, single, tokens = self._check_dispatch(token_selected_experts, payloads,
                                                                   runtime_max_tokens_per_rank)
        if self.a2a is not None:
            self._rank_indexes()  # (allocated now, while tracing: never inside a call)
        g, n, roles = specs[gather], len(ids_l), (gather, weights, bool(rows), bool(counts))
        gathered = jax.ShapeDtypeStruct((a.ep_size * tmax * a.top_k,) + tuple(g.shape), jnp_dtype(g.dtype))
        sizes = [jax.ShapeDtypeStruct((self._num_local(r),), np.int32) for r in self.rank_numbers]
        outs = (sizes if counts else None, [gathered] * n if rows else None, jax.ShapeDtypeStruct((1,), np.uint32))
        site = self._site()
        self._roles[site] = roles
        self._order.check("dispatch_to_experts", DISPATCH)
        if self.native:
            counts_o, rows_o, ticket = self._native(self._dispatch_ops(site, tmax, tokens, roles), outs, ids_l, pays_l)
        else:
            body = functools.partial(self._dispatch_body, site, tmax, tokens, roles)
            counts_o, rows_o, ticket = self._call(body, outs, ids_l, pays_l)
        self._order.done(DISPATCH)
        counts_o = counts_o[0] if single and counts else counts_o
        rows_o = rows_o[0] if single and rows else rows_o
        return Dispatched(counts_o, rows_o, ticket, ops=self, kind="dispatch_to_experts", tmax=tmax, num_tokens=tokens,
                          site=site, single=single)

    def _index_and_gather(self, dev, site, roles, i, ids_v, pays_v, out, s) -> None:
        gather, weights, into_rows, with_counts = roles
        r, a = dev.ranks[i], self.o
        idx = self._indexes[r.rank]
        expected = self._num_local(self.rank_numbers[i])
        if expected != idx.num_local_experts:  # (before the index overwrites anything)
            raise RuntimeError(f"rank {r.rank} owns {idx.num_local_experts} local experts, but the traced call "
                               f"expected {expected}: under shard_map every GPU's ranks must own as many")
        build_index(ids_v, pays_v[weights], num_experts=a.num_experts, ep_size=a.ep_size, rank=r.rank, stream=s, out=idx)
        if into_rows:
            g = a.payloads[gather]
            rows = dev.slot((site, i, "rows"), (idx.capacity,) + tuple(g.shape), g.dtype, i).at(out[1][i])
            gather_rows(idx, pays_v[gather], rows, stream=s)
        if with_counts:
            copy_dtod_async(buffer_ptr(out[0][i]), idx.counts.ptr, idx.counts.nbytes, s)

    def combine_from_experts(self, fc2_out, dispatched: Dispatched):
        """moe.finalize of the experts' output (in the rows' order) into the combine input, then
        combine, in one call: fc2_out [rows >= ep_size * T^ * top_k, hidden] (bf16, fp16, fp32)
        per rank. Returns [local tokens, hidden] per rank (combine_dtype), written straight into
        XLA's result. With combine_quant='fp8', finalize writes the FP8 input (no quantize pass)."""
        a = self.o
        tmax, single = self._check_ticket(dispatched, "dispatch_to_experts")
        fc2 = self._per_rank(fc2_out, "fc2_out")[0]
        H, cap = a.combine_hidden_size, a.ep_size * tmax * a.top_k
        for i, x in enumerate(fc2):
            name = "fc2_out" if single else f"fc2_out[{i}]"
            if x is None or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected a JAX array, got {type(x).__name__}")
            require(str(np.dtype(x.dtype)) in ("bfloat16", "float16", "float32"), name,
                    f"dtype must be one of ('bfloat16', 'float16', 'float32'), got {x.dtype}")
            require(len(x.shape) == 2 and x.shape[1] == H and x.shape[0] >= cap, name,
                    f"shape must be [rows >= capacity={cap}, hidden={H}], got {list(x.shape)}")
        outs = [jax.ShapeDtypeStruct((T, H), jnp_dtype(a.combine_dtype.name)) for T in dispatched.num_tokens]
        geo = [(tuple(x.shape), str(np.dtype(x.dtype))) for x in fc2]
        self._order.check("combine_from_experts", COMBINE)
        if self.native:
            res = self._native(self._combine_ops(dispatched, geo), outs, fc2, dispatched.ticket)
        else:
            body = functools.partial(self._finalize_combine_body, self._site(), tmax, dispatched.num_tokens, geo)
            res = self._call(body, outs, fc2, dispatched.ticket)
        self._order.done(COMBINE)
        return res[0] if single else res

    def _finalize_combine_body(self, site, tmax, tokens, fc2_geo, ctx, out, fc2, ticket) -> None:
        dev = self._device(ticket)
        a = self.o
        fp8 = a.combine_quant == "fp8"

        def launch(streams):
            for i, (r, s) in enumerate(zip(dev.ranks, streams)):
                x = dev.slot((site, i, 0), fc2_geo[i][0], fc2_geo[i][1], i).at(fc2[i])
                finalize(self._indexes[r.rank], x, r.combine_input(tmax, fp8=fp8), stream=s)
            for i, (r, s) in enumerate(zip(dev.ranks, streams)):
                y = dev.slot((site, i, 1), (tokens[i], a.combine_hidden_size), a.combine_dtype, i).at(out[i])
                r.combine(r.combine_input(tmax, fp8=fp8), tmax, stream=s, out=y)
        dev.run(ctx.stream, launch)

    # -- the native path: launch plans made while tracing (jax_plan.py, jax_ffi.py) ---------------
    def _native(self, ops_for, outs, *args):
        """One FFI call whose handler runs, on every GPU, the launches ops_for(dev, n_in) plans
        (dev: a jax_calls.DeviceRanks; n_in: the number of operands, after which the results
        are numbered)."""
        flat_in = jax.tree_util.tree_leaves(args)
        flat_out, tree = jax.tree_util.tree_flatten(outs)
        groups = []
        for dev in self.by_device.devices.values():
            ranks = dev.ranks
            fork, joins = dev.native_events()  # (the handler records and waits on them)
            members = [(r.rank, r.default_stream, j, r.record_page.host_ptr) for r, j in zip(ranks, joins)]
            copy = load("util", dev.device).function("ep_copy_bytes")  # (copies run as kernels: copy_launch)
            ops = [copy_launch(op, copy, dev.device.sm_count) if isinstance(op, CopyOp) else op
                   for op in ops_for(dev, len(flat_in))]
            groups.append(Group(dev.device.ordinal, fork, members, ops))
        first_steps = self.a2a.ranks[0].plan.first_steps
        plan = jax_ffi.Plan(encode(groups, len(flat_in) + len(flat_out), first_steps))
        self._plans.append(plan)
        res = jax.ffi.ffi_call(jax_ffi.target(), flat_out, has_side_effect=False)(*flat_in, plan=np.int64(plan.id))
        return jax.tree_util.tree_unflatten(tree, res)

    def _dispatch_ops(self, site, tmax, tokens, roles):
        """ops_for of a dispatch: operands ids[n] then payloads[n][P]; results ids or counts [n],
        payloads [n][P] or rows [n], ticket. Plans the paired combine too (its call's layout:
        operands partial[n] then the ticket, results out[n]) from the same steady state."""
        a, P = self.o, len(self.o.payloads)
        fp8 = a.combine_quant == "fp8"
        prequantized = roles is not None and fp8  # (combine_from_experts' finalize writes the FP8 input)
        per_device = {}
        self._combines[site] = (roles, per_device)

        def ops_for(dev, n_in):
            n, ops, combines = len(dev.ranks), [], []
            for i, r in enumerate(dev.ranks):
                # (a rank without tokens: XLA's empty buffers may have no address; an aligned one
                # of ours that nothing reads stands in, as in jax_calls.Slot)
                sources = [fake(i)] + [fake(n + i * P + q) for q in range(P)] if tokens[i] else [r.base] * (P + 1)
                d, c = steady_pair(r.plan, r.state.tag_hi, r.a2a.protocol, tokens[i], tmax, sources,
                                   fake(n + 1 + i) if tokens[i] else r.base, prequantized)
                d_bytes, c_bytes = pair_params(r.plan, d, c)
                combines.append((c, c_bytes))
                ops.append(step_launch(r.plan, i, d, d_bytes, first=True))
                ids_v, pays_v = r.dispatch_views(tmax)
                if roles is None:
                    ops.append(CopyOp(i, fake(n_in + i), ids_v.ptr, ids_v.nbytes))
                    ops += [CopyOp(i, fake(n_in + n + i * P + q), v.ptr, v.nbytes) for q, v in enumerate(pays_v)]
                else:
                    counted = roles[3]  # (results: counts [n] if any, then rows [n] if any, then the ticket)
                    ops += self._index_ops(dev, i, roles, tmax, ids_v, pays_v, fake(n_in + i) if counted else None,
                                           fake(n_in + n * counted + i))
            per_device[dev.device.ordinal] = combines
            return ops
        return ops_for

    def _index_ops(self, dev, i, roles, tmax, ids_v, pays_v, counts_at, rows_at) -> list:
        """The MoE index and gather of rank i, as moe.build_index and moe.gather_rows launch them."""
        gather, weights, into_rows, _ = roles
        r, a = dev.ranks[i], self.o
        idx = self._rank_indexes()[self.a2a.ranks.index(r)]
        counts = self._num_local(self.rank_numbers[i])
        if counts != idx.num_local_experts:
            raise RuntimeError(f"rank {r.rank} owns {idx.num_local_experts} local experts, but the traced call "
                               f"expected {counts}: under shard_map every GPU's ranks must own as many")
        g = a.payloads[gather]
        rows = Tensor(rows_at, (a.ep_size * tmax * a.top_k,) + tuple(g.shape), g.dtype, device=(CUDA, dev.device.ordinal))

        def run():
            build_index(ids_v, pays_v[weights], num_experts=a.num_experts, ep_size=a.ep_size, rank=r.rank,
                        stream=r.default_stream, out=idx)
            if into_rows:
                gather_rows(idx, pays_v[gather], rows, stream=r.default_stream)
        return recorded(i, run) + ([CopyOp(i, counts_at, idx.counts.ptr, idx.counts.nbytes)] if counts_at else [])

    def _combine_ops(self, dispatched, fc2_geo):
        """ops_for of a combine (fc2_geo None: stage the partial results into the workspace) or of
        combine_from_experts (fc2_geo: each rank's fc2_out (shape, dtype), finalized into it)."""
        a, tmax = self.o, dispatched.tmax
        if dispatched.site not in self._combines:
            raise RuntimeError("combine: its dispatch was traced by another JaxAlltoAll or not at all")
        roles = self._combines[dispatched.site][0]
        fp8 = a.combine_quant == "fp8"

        def ops_for(dev, n_in):
            ops = []
            for i, r in enumerate(dev.ranks):
                if fc2_geo is None:
                    ops.append(CopyOp(i, r.plan.combine_input, fake(i), a.ep_size * tmax * r.plan.combine_bytes))
                else:
                    ops += self._finalize_ops(dev, i, tmax, fc2_geo[i], fp8, roles[1])
                ops.append(self._planned_combine(dispatched, dev, i))
            return ops
        return ops_for

    def _planned_combine(self, dispatched, dev, i):
        """The combine launch of rank i of dev that dispatched's dispatch planned, its output
        buffer n + 1 + i (the combine call's: operands partial[n] and the ticket, then out[n])."""
        c, c_bytes = self._combines[dispatched.site][1][dev.device.ordinal][i]
        return step_launch(dev.ranks[i].plan, i, c, c_bytes)

    def _finalize_ops(self, dev, i, tmax, geo, fp8, weights) -> list:
        """moe.finalize of rank i's fc2_out (operand i) into its combine input, as it launches it."""
        r = dev.ranks[i]
        idx = self._rank_indexes()[self.a2a.ranks.index(r)]
        ids_v, pays_v = r.dispatch_views(tmax)
        x = Tensor(fake(i), geo[0], geo[1], device=(CUDA, dev.device.ordinal))
        # (the index is rebuilt, unlaunched, so that its sizes are this T^'s whatever was traced since)
        recorded(i, lambda: build_index(ids_v, pays_v[weights], num_experts=self.o.num_experts, ep_size=self.o.ep_size,
                                        rank=r.rank, stream=r.default_stream, out=idx))
        return recorded(i, lambda: finalize(idx, x, r.combine_input(tmax, fp8=fp8), stream=r.default_stream))
