"""The experts' GEMMs of the MoE pair inside jax.jit: ep_a2a's expert kernels
(moe_experts.expert_fc1 / expert_fc2, kernels/moe_experts.cu) as one XLA call between
dispatch_to_experts and combine_from_experts.

    d = ops.dispatch_to_experts(ids, [x, w], T_hat)
    fc2 = ops.experts(d, w_gate_up, w_down)       # [ep_size * T^ * top_k, hidden] bf16 per rank
    y = ops.combine_from_experts(fc2, d)

FC1 reads each row where dispatch left it in the workspace (the index's rows), with SiLU(gate)
* up fused, so d.rows is not read; FC2's input (the activations) is a second result of the
call that XLA allocates and nobody needs after it. The weights are TorchMoeLayer's: bf16
w_gate_up [E_local, 2 I, hidden], w_down [E_local, hidden, I]; hidden and I multiples of 64
(moe_experts.expert_gemms_unsupported), checked while tracing. Rows past the device total of each
rank are not written. On the native path (jax_ffi.py) both launches of every rank are planned
while tracing, as moe.* would make them for this T^ (jax_plan.recorded); otherwise a Python
callback launches them through moe.* at run time.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import numpy as np

from ..interop.tensor import CUDA, Tensor
from ..moe import build_index, finalize
from ..moe_experts import expert_fc1, expert_fc2, expert_gemms_unsupported, fc2_finalizes
from ..schedule import COMBINE
from ..validate import require
from .jax_plan import fake, recorded, renumbered


class ExpertsCalls(NamedTuple):
    """What the expert call takes from its JaxAlltoAll (ops/jax.py), handed over when it is made."""
    options: object               # the all-to-all's config.Options
    a2a: object                   # its MoeAlltoAll (None: traced_only)
    native: bool                  # whether the native FFI path is in use
    order: object                 # its jax_halves.TraceOrder (the trace's order of calls)
    site: Callable                # () -> a new call site number
    native_call: Callable         # (ops_for, outs, *args) -> results: one FFI call
    callback_call: Callable       # (body, outs, *args) -> results: one Python callback call
    check_ticket: Callable        # (dispatched, kind) -> (T^, single)
    per_rank: Callable            # (x, name) -> (one entry per rank, single)
    num_local: Callable           # rank number -> its local experts
    rank_indexes: Callable        # () -> the ExpertIndex of every rank of the all-to-all (trace time)
    index_of: Callable            # rank number -> its ExpertIndex (run time)
    device_of: Callable           # ticket buffer -> the jax_calls.DeviceRanks that holds it
    roles_of: Callable            # dispatch site -> (gather payload, weights payload, whether it gathers, counts)
    planned_combine: Callable     # (dispatched, dev, rank position) -> the combine launch its dispatch planned
    rank_numbers: tuple           # the ranks of one call, by position


class JaxExperts:
    """JaxAlltoAll.experts (module docstring)."""

    def __init__(self, calls: ExpertsCalls):
        self.calls = calls

    def experts(self, dispatched, w_gate_up, w_down) -> list:
        c = self.calls
        tmax, single, gather, H, inter, w1s, w2s = self._checked(dispatched, w_gate_up, w_down)
        cap = c.options.ep_size * tmax * c.options.top_k
        outs = ([jax.ShapeDtypeStruct((cap, H), jax.numpy.bfloat16)] * len(w1s),
                [jax.ShapeDtypeStruct((cap, inter), jax.numpy.bfloat16)] * len(w1s))
        site = c.site()
        if c.native:
            fc2, _ = c.native_call(self._ops(dispatched, gather, H, inter), outs, w1s, w2s, dispatched.ticket)
        else:
            body = functools.partial(self._body, site, tmax, gather, H, inter, False)
            fc2, _ = c.callback_call(body, outs, w1s, w2s, dispatched.ticket)
        return fc2[0] if single else fc2

    def experts_combine(self, dispatched, w_gate_up, w_down):
        """experts(), then the finalize into the combine input (in FC2's kernel; a finalize launch
        of its own under FP8 combine, which FC2's kernel does not write) and the combine that
        dispatched's dispatch planned, as one call. Results: the combine's output [T_r, hidden]
        per rank, then FC2's rows and FC1's activations (scratch that nobody reads after it)."""
        c = self.calls
        a = c.options
        tmax, single, gather, H, inter, w1s, w2s = self._checked(dispatched, w_gate_up, w_down)
        require(a.combine_hidden_size == H and a.combine_dtype.name == "bfloat16", "dispatched",
                f"the combine must take the experts' bf16 rows of hidden={H}, got combine_hidden_size="
                f"{a.combine_hidden_size}, combine_dtype={a.combine_dtype.name}")
        cap, n = a.ep_size * tmax * a.top_k, len(w1s)
        outs = ([jax.ShapeDtypeStruct((T, H), jax.numpy.bfloat16) for T in dispatched.num_tokens],
                [jax.ShapeDtypeStruct((cap, H), jax.numpy.bfloat16)] * n,
                [jax.ShapeDtypeStruct((cap, inter), jax.numpy.bfloat16)] * n)
        c.order.check("experts_combine", COMBINE)
        if c.native:
            res = c.native_call(self._ops(dispatched, gather, H, inter, combine=True), outs, w1s, w2s, dispatched.ticket)
        else:
            body = functools.partial(self._body, c.site(), tmax, gather, H, inter, dispatched.num_tokens)
            res = c.callback_call(body, outs, w1s, w2s, dispatched.ticket)
        c.order.done(COMBINE)
        return res[0][0] if single else res[0]

    def _checked(self, dispatched, w_gate_up, w_down) -> tuple:
        """(T^, single, gather payload, hidden, I, w_gate_up per rank, w_down per rank), after the rules."""
        c = self.calls
        a = c.options
        tmax, single = c.check_ticket(dispatched, "dispatch_to_experts")
        gather = c.roles_of(dispatched.site)[0]
        H = a.payloads[gather].shape[0]
        w1s, w2s = c.per_rank(w_gate_up, "w_gate_up")[0], c.per_rank(w_down, "w_down")[0]
        inter = None
        for i, (w1, w2, r) in enumerate(zip(w1s, w2s, c.rank_numbers)):
            at = "" if single else f"[{i}]"
            L = c.num_local(r)
            for name, w in ((f"w_gate_up{at}", w1), (f"w_down{at}", w2)):
                if not hasattr(w, "shape") or not hasattr(w, "dtype"):
                    raise TypeError(f"{name}: expected a JAX array, got {type(w).__name__}")
                if str(np.dtype(w.dtype)) != "bfloat16":
                    raise TypeError(f"{name}: dtype must be bfloat16, got {w.dtype}")
            require(len(w1.shape) == 3 and w1.shape[0] == L and w1.shape[2] == H and w1.shape[1] % 2 == 0,
                    f"w_gate_up{at}", f"shape must be [E_local={L}, 2 * I, hidden={H}], got {list(w1.shape)}")
            inter = w1.shape[1] // 2
            require(tuple(w2.shape) == (L, H, inter), f"w_down{at}",
                    f"shape must be [E_local={L}, hidden={H}, I={inter}], got {list(w2.shape)}")
            why = expert_gemms_unsupported(H, inter)
            require(why is None, f"w_gate_up{at}", f"the expert kernels do not take {why}")
        return tmax, single, gather, H, inter, w1s, w2s

    def _ops(self, dispatched, gather, H, inter, combine: bool = False):
        """ops_for of the call: operands w_gate_up[n], w_down[n], ticket; results fc2[n], act[n]
        (combine: out[n] before them, and the finalize and the planned combine after FC2)."""
        c, tmax = self.calls, dispatched.tmax
        a = c.options

        def ops_for(dev, n_in):
            n, ops, ordinal = len(dev.ranks), [], dev.device.ordinal
            res = n_in + n if combine else n_in   # (where fc2[n], act[n] start)
            for i, r in enumerate(dev.ranks):
                idx = c.rank_indexes()[c.a2a.ranks.index(r)]
                L, cap = idx.num_local_experts, a.ep_size * tmax * a.top_k
                ids_v, pays_v = r.dispatch_views(tmax)
                w1 = Tensor(fake(i), (L, 2 * inter, H), "bfloat16", device=(CUDA, ordinal))
                w2 = Tensor(fake(n + i), (L, H, inter), "bfloat16", device=(CUDA, ordinal))
                y = Tensor(fake(res + i), (cap, H), "bfloat16", device=(CUDA, ordinal))
                act = Tensor(fake(res + n + i), (cap, inter), "bfloat16", device=(CUDA, ordinal))
                weights = c.roles_of(dispatched.site)[1]
                # (the index is rebuilt, unlaunched, so that its sizes are this T^'s: they pick the kernels)
                recorded(i, lambda: build_index(ids_v, pays_v[weights], num_experts=a.num_experts, ep_size=a.ep_size,
                                                rank=r.rank, stream=r.default_stream, out=idx))
                ops += recorded(i, lambda: self._experts(idx, r, pays_v[gather], w1, w2, act, y, r.default_stream,
                                                         tmax if combine else None))
                if combine:  # (planned with its output at buffer n + 1 + i: the combine call's layout)
                    ops.append(renumbered(c.planned_combine(dispatched, dev, i), {n + 1 + i: n_in + i}))
            return ops
        return ops_for

    def _experts(self, idx, r, x, w1, w2, act, y, s, combine_tmax) -> None:
        """FC1 and FC2 of rank r's experts on stream s; combine_tmax (a T^, or None): FC2's rows
        finalized into the rank's combine input of that T^ too, by FC2's kernel where it writes
        that input (moe_experts.fc2_finalizes), else by a finalize launch."""
        expert_fc1(idx, x, w1, act, stream=s)
        fp8 = self.calls.options.combine_quant == "fp8"
        target = None if combine_tmax is None else r.combine_input(combine_tmax, fp8=fp8)
        in_fc2 = target is not None and fc2_finalizes(y.shape[1], fp8)
        expert_fc2(idx, act, w2, y, stream=s, finalize_into=target if in_fc2 else None)
        if target is not None and not in_fc2:
            finalize(idx, y, target, stream=s)

    def _body(self, site, tmax, gather, H, inter, tokens, ctx, out, w1s, w2s, ticket) -> None:
        """The Python callback of experts (tokens False) or experts_combine (tokens: per rank)."""
        c = self.calls
        dev = c.device_of(ticket)
        if tokens:
            outs, out = out[0], out[1:]

        def launch(streams):
            for i, (r, s) in enumerate(zip(dev.ranks, streams)):
                idx = c.index_of(r.rank)
                L, cap = idx.num_local_experts, idx.capacity
                w1 = dev.slot((site, i, "w1"), (L, 2 * inter, H), "bfloat16", i).at(w1s[i])
                w2 = dev.slot((site, i, "w2"), (L, H, inter), "bfloat16", i).at(w2s[i])
                y = dev.slot((site, i, "y"), (cap, H), "bfloat16", i).at(out[0][i])
                act = dev.slot((site, i, "act"), (cap, inter), "bfloat16", i).at(out[1][i])
                self._experts(idx, r, r.dispatch_views(tmax)[1][gather], w1, w2, act, y, s, tmax if tokens else None)
            fp8 = c.options.combine_quant == "fp8"
            for i, (r, s) in enumerate(zip(dev.ranks, streams) if tokens else ()):
                y = dev.slot((site, i, "out"), (tokens[i], H), "bfloat16", i).at(outs[i])
                r.combine(r.combine_input(tmax, fp8=fp8), tmax, stream=s, out=y)
        dev.run(ctx.stream, launch)
