"""One dispatch/combine step through the torch ops (ep_a2a/ops/torch.py), every byte checked
against the NumPy reference: the torch counterpart of harness.run_step, for the GPU tests
and examples/torch_distributed.py. Inputs are drawn for every rank from `rng` (the same seed
in every process of a multi-process run); each process runs and checks its own ranks.
torch is imported only when this runs."""
from __future__ import annotations

import numpy as np

from ..interop.torch_tensor import TensorSlot, torch_dtype
from ..layout import sentinel_kind
from . import reference as ref
from .formats import random_payload, routing
from .harness import StepReport, check_dispatch, read_records

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def to_torch(array: np.ndarray, device, dtype: str):
    """A torch tensor on `device` holding `array`'s bytes as `dtype` (bf16 from uint16 bits...)."""
    import torch
    a = np.ascontiguousarray(array)
    return torch.from_numpy(a.view(_SIGNED[a.itemsize])).to(device).view(torch_dtype(dtype))


def host_bits(t) -> np.ndarray:
    """The bytes of a torch tensor on the host as unsigned ints of its element size."""
    import torch
    return t.contiguous().view(torch.uint8).cpu().numpy().view(f"u{t.element_size()}").reshape(t.shape)


def run_torch_step(a2a, binds, rng, tokens, tmax: int, route: str = "uniform", streams=None,
                   out_given: bool = True, staged: bool = False) -> StepReport:
    """dispatch -> random exact partial results written into combine_input (or, `staged`, in a
    tensor of their own that combine stages) -> combine, through the torch ops, for the
    TorchRanks `binds` of this process (each on streams[rank], default torch's current
    stream). out_given: combine into a poisoned tensor of ours, else into the one it makes.
    Returns a StepReport whose mismatches list what differs from the reference."""
    import torch
    from ..ops import torch as ops
    ep, top_k, E, H = a2a.ep_size, a2a.top_k, a2a.num_experts, a2a.combine_hidden_size
    cdt = a2a.combine_dtype.name
    local = {b.rank: b for b in binds}
    streams = streams or {}
    rep = StepReport(list(tokens), tmax)
    ids_h = rep.expert_ids = [routing(route, rng, tokens[s], top_k, E, ep, s) for s in range(ep)]
    pay_h = [[random_payload(rng, spec, tokens[s]) for spec in a2a.payload_specs] for s in range(ep)]
    partial_h = rep.partials = [ref.from_float32(rng.integers(-64, 65, (ep, tmax, H)).astype(np.float32), cdt)
                                for _ in range(ep)]
    sentinel = a2a.protocol_for(tmax) == "sentinel"
    # every upload and allocation before the first launch: in-process ranks spin on each other
    ins, parts, outs = {}, {}, {}
    for s, b in local.items():
        ins[s] = (to_torch(ids_h[s], b.device, "int32"),
                  [to_torch(x, b.device, spec.dtype) for x, spec in zip(pay_h[s], a2a.payload_specs)])
        parts[s] = to_torch(partial_h[s], b.device, cdt)
        outs[s] = torch.empty((tokens[s], H), dtype=torch_dtype(cdt), device=b.device)
        outs[s].view(torch.uint8).fill_(0xFF)  # poison: NaN in every float format
    torch.cuda.synchronize()
    views = {}
    for s, b in local.items():
        with torch.cuda.stream(streams.get(s, torch.cuda.current_stream(b.device))):
            views[s] = ops.dispatch(b, *ins[s], tmax)
    torch.cuda.synchronize()
    records = rep.records = {s: read_records(b.r, tokens[s]) for s, b in local.items()}
    want_pay = [[ref.sentinel_escape(x, k) for x, k in zip(pay_h[s], a2a.kinds[1:])] for s in range(ep)] \
        if sentinel else pay_h
    seen = {s: (TensorSlot("ids")(v[0]), [TensorSlot(f"p{q}")(p) for q, p in enumerate(v[1])]) for s, v in views.items()}
    check_dispatch(a2a, rep, ids_h, want_pay, records, seen, sentinel)  # reads the torch views' memory
    got = {}
    for s, b in local.items():
        with torch.cuda.stream(streams.get(s, torch.cuda.current_stream(b.device))):
            cin = ops.combine_input(b, tmax)
            if not staged:
                cin.copy_(parts[s].view(cin.shape))
            got[s] = ops.combine(b, parts[s] if staged else cin, tmax, out=outs[s] if out_given else None)
    torch.cuda.synchronize()
    arrived = partial_h  # what the protocol delivers: SENTINEL rewrites sentinel-colliding words (layout.py)
    if sentinel:
        arrived = [ref.sentinel_escape(p.reshape(-1, H), sentinel_kind(cdt)).reshape(p.shape) for p in partial_h]
    want = ref.combine(arrived, [records.get(s, np.full((tokens[s], top_k, 2), -1)) for s in range(ep)], cdt)
    for s in local:
        if out_given and got[s].data_ptr() != outs[s].data_ptr():
            rep.mismatches.append(f"combine rank {s}: did not return the out tensor it was given")
        g = rep.outputs[s] = host_bits(got[s])
        if not np.array_equal(g.view(np.uint8), want[s].view(np.uint8)):
            bad = np.argwhere((g != want[s].view(g.dtype)).reshape(tokens[s], -1).any(axis=1)).ravel()
            rep.mismatches.append(f"combine rank {s}: {len(bad)} of {tokens[s]} rows differ, first token {int(bad[0])}")
        rep.combine_rows_checked += tokens[s]
    return rep
