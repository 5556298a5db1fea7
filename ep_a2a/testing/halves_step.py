"""One step of two micro-batches through the send and receive halves (ep_a2a/halves.py), on
the in-process ranks of two all-to-alls of one group, checked bitwise against the NumPy
reference: the halves tests and the mixed soak share it.

Every input is uploaded and every output poisoned before any launch (a host copy between
in-process ranks' launches may wait for a kernel that spins); the partial results are small
integers, so every sum is exact."""
from __future__ import annotations

import numpy as np

OPS = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
BOTH_SENDS_FIRST = (("A", "dispatch_send"), ("B", "dispatch_send"), ("A", "dispatch_recv"), ("B", "dispatch_recv"),
                    ("A", "combine_send"), ("B", "combine_send"), ("A", "combine_recv"), ("B", "combine_recv"))
# two-batch overlap: B's attention runs while A's dispatch is in flight, A's experts while B's is
TBO = (("A", "dispatch_send"), ("A", "dispatch_recv"), ("B", "dispatch_send"), ("A", "combine_send"),
       ("B", "dispatch_recv"), ("A", "combine_recv"), ("B", "combine_send"), ("B", "combine_recv"))


def interleaving(rnd) -> list:
    """A random merge of A's four halves and B's, each in its own order (`rnd`: random.Random)."""
    a, b, out = list(OPS), list(OPS), []
    while a or b:
        src = rnd.choice([x for x in (a, b) if x])
        out.append(("A" if src is a else "B", src.pop(0)))
    return out


class Micro:
    """One micro-batch's step on every rank of `a2a` (bf16 payloads and combine): inputs,
    partial results staged on the device, poisoned outputs, the halves, the reference check."""

    def __init__(self, a2a, rng, tmax, tokens=None):
        from ..interop.arrays import copy_from_numpy, empty, from_numpy
        from . import reference as ref
        from .formats import random_payload, routing
        ep, K, E, H = a2a.ep_size, a2a.top_k, a2a.num_experts, a2a.combine_hidden_size
        self.a2a, self.tmax = a2a, tmax
        self.tokens = list(tokens) if tokens is not None else [int(rng.integers(0, tmax + 1)) for _ in range(ep)]
        self.ids_h = [routing("uniform", rng, t, K, E, ep, s, 1.2, 0.0) for s, t in enumerate(self.tokens)]
        self.pay_h = [[random_payload(rng, sp, t) for sp in a2a.payload_specs] for t in self.tokens]
        self.partial_h = [ref.from_float32(rng.integers(-64, 65, (ep, tmax, H)).astype(np.float32), "bfloat16")
                          for _ in range(ep)]
        self.ins = [(from_numpy(self.ids_h[s], r.device, "int32"),
                     [from_numpy(x, r.device, sp.dtype) for x, sp in zip(self.pay_h[s], a2a.payload_specs)])
                    for s, r in enumerate(a2a.ranks)]
        self.staged = [from_numpy(self.partial_h[s], r.device, "bfloat16") for s, r in enumerate(a2a.ranks)]
        self.outs = [empty((t, H), "bfloat16", r.device) for t, r in zip(self.tokens, a2a.ranks)]
        for o in self.outs:
            copy_from_numpy(o, np.full(o.nbytes, 0xFF, np.uint8))  # poison: NaN
        self.views = {}

    def half(self, op, s):
        r = self.a2a.ranks[s]
        if op == "dispatch_send":
            r.dispatch_send(self.ins[s][0], self.ins[s][1], self.tmax)
        elif op == "dispatch_recv":
            self.views[s] = r.dispatch_recv()
        elif op == "combine_send":
            r.combine_send(self.staged[s], self.tmax, out=self.outs[s])
        else:
            r.combine_recv()

    def mismatches(self) -> list:
        """What differs from the reference (after the ranks' streams are synchronized)."""
        from ..interop.arrays import to_numpy
        from ..layout import sentinel_kind
        from . import reference as ref
        from .harness import StepReport, check_dispatch, read_records
        a2a, H = self.a2a, self.a2a.combine_hidden_size
        sentinel = a2a.protocol_for(self.tmax) == "sentinel"
        rep = StepReport(list(self.tokens), self.tmax)
        records = {s: read_records(r, self.tokens[s]) for s, r in enumerate(a2a.ranks)}
        want_pay = [[ref.sentinel_escape(x, k) for x, k in zip(p, a2a.kinds[1:])] for p in self.pay_h] \
            if sentinel else self.pay_h
        want_ids = [ref.sentinel_ids(x) for x in self.ids_h] if sentinel else self.ids_h
        check_dispatch(a2a, rep, want_ids, want_pay, records, self.views, sentinel)
        arrived = [ref.sentinel_escape(p.reshape(-1, H), sentinel_kind("bfloat16")).reshape(p.shape)
                   for p in self.partial_h] if sentinel else self.partial_h
        in_dtype = None
        if a2a.combine_quant == "fp8":
            arrived, in_dtype = [ref.q8_roundtrip(ref.to_float32(p, "bfloat16")) for p in arrived], "float32"
        want = ref.combine(arrived, [records[s] for s in range(a2a.ep_size)], "bfloat16", in_dtype)
        for s in range(a2a.ep_size):
            if not np.array_equal(to_numpy(self.outs[s]).view(np.uint8), want[s].view(np.uint8)):
                rep.mismatches.append(f"combine rank {s}: rows differ")
        return rep.mismatches


def run_two(m: dict, order, rank_order, between=None) -> None:
    """Issue micro-batches m["A"], m["B"]: each rank of `rank_order` issues every half of
    `order` in turn; `between(s)` (compute, say) runs after each half of rank s."""
    for s in rank_order:
        for name, op in order:
            m[name].half(op, s)
            if between is not None:
                between(s)
