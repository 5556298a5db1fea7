"""The MoE router inside jax.jit: ep_a2a's router kernel (moe.route, one warp per token, one
launch per rank) as one XLA call, for the layer's step before dispatch_to_experts.

    ids, weights = ops.route(logits)               # int32 / fp32 [T_r, top_k] per rank
    d = ops.dispatch_to_experts(ids, [x, weights], T_hat)

The same kernel as the eager layers' router, so a jitted step routes as an eager one does, bit
for bit; XLA's top_k and softmax would take several kernels per rank, one rank after another on
XLA's stream. Logits fp32 / bf16 / fp16 [T_r, num_experts], num_experts <= 1024 and top_k <=
32 (router.route_unsupported), checked while tracing. On the native path (jax_ffi.py) each
rank's launch is planned while tracing; otherwise a Python callback launches it at run time.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import numpy as np

from ..interop.tensor import CUDA, Tensor
from ..router import route_unsupported, router_for
from ..validate import require
from .jax_calls import buffer_ptr
from .jax_plan import fake, recorded


class RouteCalls(NamedTuple):
    """What the router call takes from its JaxAlltoAll (ops/jax.py), handed over when it is made."""
    options: object               # the all-to-all's config.Options
    native: bool                  # whether the native FFI path is in use
    native_call: Callable         # (ops_for, outs, *args) -> results: one FFI call
    callback_call: Callable       # (body, outs, *args) -> results: one Python callback call
    per_rank: Callable            # (x, name) -> (one entry per rank, single)
    device_of: Callable           # an operand buffer -> the jax_calls.DeviceRanks that holds it


def route(calls: RouteCalls, logits, renormalize=True):
    """(ids int32, weights fp32), each [T_r, top_k] per rank (a pair of lists for in-process
    ranks). renormalize: one flag, or one per rank."""
    a = calls.options
    lgs, single = calls.per_rank(logits, "logits")
    flags = [bool(f) for f in renormalize] if isinstance(renormalize, (list, tuple)) else [bool(renormalize)] * len(lgs)
    require(len(flags) == len(lgs), "renormalize", f"needs one flag per rank ({len(lgs)}), got {len(flags)}")
    for i, lg in enumerate(lgs):
        name = "logits" if single else f"logits[{i}]"
        if not hasattr(lg, "shape") or not hasattr(lg, "dtype"):
            raise TypeError(f"{name}: expected a JAX array, got {type(lg).__name__}")
        require(len(lg.shape) == 2 and lg.shape[1] == a.num_experts, name,
                f"shape must be [tokens, num_experts={a.num_experts}], got {list(lg.shape)}")
        why = route_unsupported(a.num_experts, a.top_k, str(np.dtype(lg.dtype)))
        require(why is None, name, f"the router kernel does not take {why}")
    geo = [(int(lg.shape[0]), str(np.dtype(lg.dtype))) for lg in lgs]
    outs = ([jax.ShapeDtypeStruct((T, a.top_k), np.int32) for T, _ in geo],
            [jax.ShapeDtypeStruct((T, a.top_k), np.float32) for T, _ in geo])
    if calls.native:
        ids, ws = calls.native_call(functools.partial(_ops, a, geo, flags), outs, lgs)
    else:
        body = functools.partial(_body, calls, geo, flags)
        ids, ws = calls.callback_call(body, outs, lgs)
    return (ids[0], ws[0]) if single else (ids, ws)


def _launch(a, dev, i, T, dtype, at, renormalize, stream) -> None:
    """moe.route of rank i's logits; at(k) -> the address of argument k (logits, ids, weights)."""
    ordinal = dev.device.ordinal
    lg = Tensor(at(0), (T, a.num_experts), dtype, device=(CUDA, ordinal))
    ids = Tensor(at(1), (T, a.top_k), "int32", device=(CUDA, ordinal))
    w = Tensor(at(2), (T, a.top_k), "float32", device=(CUDA, ordinal))
    router_for(dev.device)(lg, ids, w, renormalize=renormalize, stream=stream)


def _ops(a, geo, renormalize, dev, n_in):
    """ops_for of the call: operands logits[n]; results ids[n], weights[n]."""
    n, ops = len(dev.ranks), []
    for i, (r, (T, dtype)) in enumerate(zip(dev.ranks, geo)):
        if T:  # (no tokens: no launch, and XLA's empty buffers may have no address)
            at = (fake(i), fake(n_in + i), fake(n_in + n + i)).__getitem__
            ops += recorded(i, lambda: _launch(a, dev, i, T, dtype, at, renormalize[i], r.default_stream))
    return ops


def _body(calls, geo, renormalize, ctx, out, lgs) -> None:
    live = [i for i, (T, _) in enumerate(geo) if T]
    if not live:
        return
    dev = calls.device_of(lgs[live[0]])  # (a buffer with an address)
    a = calls.options

    def launch(streams):
        for i, ((T, dtype), s) in enumerate(zip(geo, streams)):
            if T:
                bufs = (lgs[i], out[0][i], out[1][i])
                _launch(a, dev, i, T, dtype, lambda k: buffer_ptr(bufs[k]), renormalize[i], s)
    dev.run(ctx.stream, launch)
