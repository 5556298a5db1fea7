"""Run dispatch -> stand-in MoE -> combine on real ranks and check every byte against the
NumPy reference. Used by the demo, the tests and the soak tool (one harness, one oracle).
The inputs come from formats.py; only the public API of ep_a2a is used."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..interop.arrays import copy_from_numpy, empty, from_numpy, to_numpy
from ..layout import record_slot, record_target, sentinel_kind
from . import reference as ref
from .formats import random_payload, routing


@dataclass
class StepReport:
    tokens: list
    runtime_max: int
    dispatch_bytes_checked: int = 0
    combine_rows_checked: int = 0
    mismatches: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)   # rank -> combine output (host copy)
    expert_ids: list = field(default_factory=list)  # the routing drawn for every rank
    partials: list = field(default_factory=list)    # the stand-in MoE's partial results, per rank
    records: dict = field(default_factory=dict)     # rank -> its (target, slot) records


def read_records(rank_a2a, T: int) -> np.ndarray:
    """The (target, slot) records dispatch left on the device for combine: int [T, top_k, 2]."""
    raw = to_numpy(rank_a2a.dispatch_records(int(T)))
    out = np.stack([np.where(raw >= 0, record_target(raw), -1), np.where(raw >= 0, record_slot(raw), -1)], axis=-1)
    return out.astype(np.int64)


def run_step(a2a, rng, tokens, runtime_max, route="uniform", exact=True, zero_copy=True, verify=True,
             alpha=1.2, invalid_fraction=0.0, payload_fn=None, upload=None, out_fn=None,
             prequantize=False, id_fn=None) -> StepReport:
    """One dispatch/combine step on the ranks of `a2a` that live in this process.

    Every process draws the inputs of *all* ranks from `rng` (same seed everywhere in a
    multi-process run), runs its own ranks, and checks what its own ranks received and
    combined. The stand-in MoE writes random partial results into every slot (small
    integers when `exact`, so sums are exact; random normals otherwise, still compared
    bitwise since the reference sums in the kernels' order).
    Ranks outside a2a.active_ranks (set_active_ranks) must have 0 tokens and are not run.
    out_fn(rank, (T, hidden), dtype) -> tensor: where combine writes (default: a new tensor).
    prequantize (combine_quant="fp8"): the stand-in MoE writes the FP8 combine input itself
    (reference.q8_quantize of its partial results into combine_input(T^, fp8=True)), as a
    quantizing epilogue does; the expected output is the same.
    id_fn(ids) -> ids: rewrites each source's drawn expert ids (hostile ids, validation off);
    what SENTINEL delivers of them follows reference.sentinel_ids.
    """
    ep, top_k, E = a2a.ep_size, a2a.top_k, a2a.num_experts
    active = set(a2a.active_ranks)
    assert all(tokens[s] == 0 for s in range(ep) if s not in active), "inactive ranks have no tokens"
    local = {r.rank: r for r in a2a.ranks if r.rank in active}
    rep = StepReport(list(tokens), runtime_max)
    ids_h = rep.expert_ids = [routing(route, rng, tokens[s], top_k, E, ep, s, alpha, invalid_fraction) for s in range(ep)]
    if id_fn is not None:
        ids_h = rep.expert_ids = [id_fn(x) for x in ids_h]
    payload_fn = payload_fn or random_payload
    pay_h = [[payload_fn(rng, spec, tokens[s]) for spec in a2a.payload_specs] for s in range(ep)]
    H, cdt = a2a.combine_hidden_size, a2a.combine_dtype.name
    shape = (ep, runtime_max, H)
    sentinel = a2a.protocol_for(runtime_max) == "sentinel"
    draw = (lambda: rng.integers(-64, 65, shape).astype(np.float32)) if exact else \
        (lambda: rng.standard_normal(shape).astype(np.float32))
    partial_h = rep.partials = [ref.from_float32(draw(), cdt) for _ in range(ep)]

    # Every allocation and host copy happens before the first launch: in-process ranks spin
    # on each other, and a device-synchronizing call (cuMemFree, a pageable copy) issued
    # between two ranks' launches would wait for a kernel that waits for the next launch.
    upload = upload or from_numpy  # (array, device, dtype) -> device tensor holding a copy
    ins = {s: (upload(ids_h[s], r.device, "int32"),
               [upload(x, r.device, spec.dtype) for x, spec in zip(pay_h[s], a2a.payload_specs)])
           for s, r in local.items()}
    staged = {s: from_numpy(partial_h[s], r.device, cdt) for s, r in local.items()} if not zero_copy else {}
    out_fn = out_fn or (lambda r, shape, dtype: empty(shape, dtype, r.device))
    outs = {s: out_fn(r, (tokens[s], H), cdt) for s, r in local.items()}
    for o in outs.values():
        copy_from_numpy(o, np.full(o.nbytes, 0xFF, np.uint8))  # poison: NaN in every float format
    views = {s: r.dispatch(ins[s][0], ins[s][1], runtime_max) for s, r in local.items()}
    a2a.synchronize()
    records = rep.records = {s: read_records(r, tokens[s]) for s, r in local.items()}
    if verify:
        # what the protocol delivers: SENTINEL rewrites sentinel-colliding NaN words (layout.py)
        want_pay = [[ref.sentinel_escape(x, k) for x, k in zip(pay_h[s], a2a.kinds[1:])] for s in range(ep)] \
            if sentinel else pay_h
        want_ids = [ref.sentinel_ids(x) for x in ids_h] if sentinel else ids_h
        check_dispatch(a2a, rep, want_ids, want_pay, records, views, sentinel)
    if prequantize:
        for s, r in local.items():
            q = r.combine_input(runtime_max, fp8=True)
            codes, scales = ref.q8_quantize(ref.to_float32(partial_h[s], cdt))
            copy_from_numpy(q.values, codes)
            copy_from_numpy(q.scales, scales)
    elif zero_copy:
        for s, r in local.items():
            copy_from_numpy(r.combine_input(runtime_max), partial_h[s])
    for s, r in local.items():
        part = r.combine_input(runtime_max, fp8=True) if prequantize else \
            r.combine_input(runtime_max) if zero_copy else staged[s]
        r.combine(part, runtime_max, out=outs[s])
    a2a.synchronize()
    if verify:
        ckind = sentinel_kind(cdt)
        arrived = [ref.sentinel_escape(p.reshape(-1, H), ckind).reshape(p.shape) for p in partial_h] if sentinel else partial_h
        in_dtype = None
        if a2a.combine_quant == "fp8":
            arrived, in_dtype = [ref.q8_roundtrip(ref.to_float32(p, cdt)) for p in arrived], "float32"
        want = ref.combine(arrived, [records.get(s, np.full((tokens[s], top_k, 2), -1)) for s in range(ep)], cdt, in_dtype)
        for s in local:
            got = rep.outputs[s] = to_numpy(outs[s])
            if not np.array_equal(got.view(np.uint8), want[s].view(np.uint8)):
                bad = np.argwhere((got != want[s]).reshape(tokens[s], -1).any(axis=1)).ravel()
                rep.mismatches.append(f"combine rank {s}: {len(bad)} rows differ, first token {int(bad[0])}")
            rep.combine_rows_checked += tokens[s]
    return rep


def rows_of(*arrays) -> np.ndarray:
    """Each row of the arrays (same first dimension) as one byte string, for set comparison."""
    n = arrays[0].shape[0]
    flat = np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(n, a[0].nbytes if n else a.itemsize * int(np.prod(a.shape[1:])))
                           for a in arrays], axis=1)
    return np.ascontiguousarray(flat).view(np.dtype((np.void, flat.shape[1]))).ravel()


def check_dispatch(a2a, rep, ids_h, pay_h, records, views, sentinel: bool) -> None:
    """For every (source, local target) region: the occupied slots hold exactly the
    reference's tokens (as a set for FENCE, whose slot order is nondeterministic; slot i =
    token i for SENTINEL), bitwise in every payload; every other slot carries expert id -1.
    The records of local sources name the reference's target ranks."""
    ep, T_hat = a2a.ep_size, rep.runtime_max
    received, ref_records = ref.dispatch(ids_h, pay_h, ep, a2a.num_experts, T_hat, set(a2a.active_ranks))
    for s, rec in records.items():
        if not np.array_equal(rec[..., 0], ref_records[s][..., 0]):
            rep.mismatches.append(f"rank {s}: target ranks of its selections differ from the reference")
    fence = not sentinel
    for t, (ids_v, pay_v) in views.items():
        got_ids = to_numpy(ids_v)
        got_pay = [to_numpy(v) for v in pay_v]
        r = received[t]
        for s in range(ep):
            n = int(r["counts"][s])
            tok = np.asarray(r["tokens"][s], np.int64)
            slots = np.arange(n) if fence else tok
            want = rows_of(r["expert_ids"][s, :n], *[p[s, :n] for p in r["payloads"]])
            got = rows_of(got_ids[s, slots], *[p[s, slots] for p in got_pay])
            same = np.array_equal(np.sort(got), np.sort(want)) if fence else np.array_equal(got, want)
            if not same:
                rep.mismatches.append(f"region {s}->{t}: the {n} received tokens differ from the reference")
            rep.dispatch_bytes_checked += int(want.nbytes)
            empty_slots = np.setdiff1d(np.arange(T_hat), slots)
            if (got_ids[s, empty_slots] != -1).any():
                rep.mismatches.append(f"region {s}->{t}: an empty slot carries a valid expert id")
