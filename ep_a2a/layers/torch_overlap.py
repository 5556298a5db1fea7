"""Two-batch overlap in the PyTorch MoE layer: two micro-batches per step, each on its own
all-to-all of one group, their dispatch and combine split into send and receive halves
(ep_a2a/halves.py, ops/torch_halves.py) and issued in an engine's order.

    tb = TwoBatchMoe(a2a_a, a2a_b, w_gate_up, w_down)            # every expert's weights
    (outs_a, outs_b) = tb.step(xs_a, logits_a, xs_b, logits_b)  # order="overlapped" (TBO)
    (outs_a, outs_b) = tb.step(..., order="sequential")         # A's whole step, then B's

Each rank holds two HalvesMoeLayer (TorchMoeLayer plus the halves), one per micro-batch,
sharing its expert weights; both run on the rank's stream, so the order the host issues
their pieces in is the order the GPU runs them. The overlapped order (TBO) is SGLang's
two-batch overlap for the MoE part: B's dispatch is in flight while A's experts run, and
A's combine while B's dispatch is received:

    A.dispatch_send  A.dispatch_recv  B.dispatch_send  A.experts  A.combine_send
    B.dispatch_recv  A.combine_recv   B.experts        B.combine_send  B.combine_recv

(an engine puts B's attention between A's dispatch halves and A's next attention between
B's combine halves: the layer alone has no attention to put there).

In-process ranks (layers/base.py says why): every rank's routers run first (prepare may
block), then one gate, then each piece of the order for every rank before the next piece.
So a piece that may block the host (the loop GEMM's count read in the experts) only waits
for halves whose peers' halves were all issued earlier. No further gate is needed: no send
half waits for a peer, and a receive half holds at most half the rank's share of the SMs
(the SM rule of halves), so the other ranks' routers, experts and sends always find room.

Both orders run the same kernels on the same data, so their outputs are equal bit for bit
(tests/layers/test_torch_moe_overlap_gpu.py); only the time differs
(`python -m ep_a2a.bench_layer --graph --overlap`).
"""
from __future__ import annotations

from .base import phase_gate, prepare_all
from .torch import TorchMoeLayer

PIECES = ("dispatch_send", "dispatch_recv", "experts", "combine_send", "combine_recv")
TBO = (("A", "dispatch_send"), ("A", "dispatch_recv"), ("B", "dispatch_send"), ("A", "experts"),
       ("A", "combine_send"), ("B", "dispatch_recv"), ("A", "combine_recv"), ("B", "experts"),
       ("B", "combine_send"), ("B", "combine_recv"))
SEQUENTIAL = tuple((m, p) for m in "AB" for p in PIECES)
ORDERS = {"overlapped": TBO, "sequential": SEQUENTIAL}


def check_order(order) -> tuple:
    """`order` (a name of ORDERS or (micro-batch, piece) pairs) as pairs, after checking that
    each of A and B has every piece once, in PIECES' order."""
    pairs = ORDERS.get(order) if isinstance(order, str) else tuple(tuple(p) for p in order)
    if pairs is None:
        raise ValueError(f"order: must be one of {sorted(ORDERS)} or (micro-batch, piece) pairs, got {order!r}")
    for m in "AB":
        got = tuple(p for name, p in pairs if name == m)
        if got != PIECES:
            raise ValueError(f"order: micro-batch {m} must run {PIECES} in turn, got {got}")
    if len(pairs) != 2 * len(PIECES):
        raise ValueError(f"order: only micro-batches 'A' and 'B', got {sorted({name for name, _ in pairs})}")
    return pairs


class HalvesMoeLayer(TorchMoeLayer):
    """A TorchMoeLayer whose dispatch and combine may also run as halves: prepare(), then
    dispatch_send(), dispatch_recv(), experts(), combine_send(), combine_recv() (which returns
    the output [T, hidden], a view valid until the layer's next step). The whole calls
    (dispatch(), combine(), moe_forward_all_ranks) keep working; each step is one or the other."""

    def __init__(self, a2a_rank, w_gate_up, w_down, **options):
        import torch
        super().__init__(a2a_rank, w_gate_up, w_down, **options)
        # (a buffer of our own: the whole combine's output stays the parent's)
        self.half_output = torch.empty(a2a_rank.a2a.max_tokens_per_rank, self.hidden, dtype=torch.bfloat16,
                                       device=self.device)

    def dispatch_send(self) -> None:
        st = self._step
        with self._on:
            self._ops.dispatch_send(self.tr, st["ids"], [st["x"], st["w"]], st["runtime_max"])

    def dispatch_recv(self) -> None:
        st = self._step
        with self._on:
            st["views"] = self._ops.dispatch_recv(self.tr, st["runtime_max"])

    def experts(self) -> None:
        """The layer's phase 3 (compute()) on what dispatch_recv delivered."""
        self.compute()

    def combine_send(self) -> None:
        st = self._step
        T, runtime_max = st["T"], st["runtime_max"]
        with self._on:
            self._ops.combine_send(self.tr, self._ops.combine_input(self.tr, runtime_max, fp8=self._fp8), runtime_max,
                                   out=self.half_output[:T])

    def combine_recv(self):
        T = self._step["T"]
        with self._on:
            self._ops.combine_recv(self.tr, self.half_output[:T])
        self._step = None
        self.output = self.half_output[:T]
        return self.output


class TwoBatchMoe:
    """The two micro-batch layers of every in-process rank: layers_a[r] on a2a_a.ranks[r],
    layers_b[r] on a2a_b.ranks[r] (two all-to-alls of one group, built alike with
    payloads=payload_specs(hidden, top_k), combine_hidden_size=hidden, combine bf16),
    sharing rank r's block of w_gate_up bf16 [E, 2*I, hidden] and w_down bf16 [E, hidden, I].
    Options (renormalize, gemm) go to every layer. close() releases the layers, not the
    all-to-alls."""

    def __init__(self, a2a_a, a2a_b, w_gate_up, w_down, **options):
        from ..moe import local_experts
        if a2a_a.group is not a2a_b.group or a2a_a is a2a_b:
            raise ValueError("a2a_a, a2a_b: must be two all-to-alls of one group (one per micro-batch)")
        self.layers_a, self.layers_b = [], []
        try:
            for ra, rb in zip(a2a_a.ranks, a2a_b.ranks):
                first, n = local_experts(a2a_a.num_experts, a2a_a.ep_size, ra.rank)
                w1, w2 = w_gate_up[first:first + n], w_down[first:first + n]
                self.layers_a.append(HalvesMoeLayer(ra, w1, w2, **options))
                self.layers_b.append(HalvesMoeLayer(rb, w1, w2, **options))
                if ra.default_stream != rb.default_stream:  # the order is the host's only on one stream
                    raise ValueError(f"rank {ra.rank}: the two all-to-alls' ranks must share their stream")
        except BaseException:
            self.close()
            raise

    @property
    def layers(self) -> list:
        return self.layers_a + self.layers_b

    def step(self, xs_a, routers_a, xs_b, routers_b, runtime_max_tokens_per_rank=None, order="overlapped"):
        """One step of both micro-batches on every rank: (outputs of A, outputs of B), bf16
        [T_r, hidden] per rank, views valid until the next step, ready on the caller's current
        stream (nothing blocks the host). routers: logits [T_r, num_experts] or (ids, weights),
        as TorchMoeLayer.prepare. runtime_max_tokens_per_rank: one T^ or (T^ of A, T^ of B);
        default each micro-batch's largest T_r (at least 1). order: "overlapped" (TBO),
        "sequential" or (micro-batch, piece) pairs (check_order)."""
        import torch
        pairs = check_order(order)
        mb = {"A": (self.layers_a, xs_a, routers_a), "B": (self.layers_b, xs_b, routers_b)}
        tmax = runtime_max_tokens_per_rank
        tmaxes = tmax if isinstance(tmax, (tuple, list)) else (tmax, tmax)
        prepare_all([(layers, xs, routers, t) for (layers, xs, routers), t in zip(mb.values(), tmaxes)])
        phase_gate(self.layers_a)  # every rank's routers (both micro-batches: one stream) before any half
        for name, piece in pairs:
            for layer in mb[name][0]:
                getattr(layer, piece)()
        for layer in self.layers_a:
            torch.cuda.current_stream(layer.device).wait_stream(layer.stream)
        return [layer.output for layer in self.layers_a], [layer.output for layer in self.layers_b]

    def close(self) -> None:
        for layer in self.layers:
            layer.close()
        self.layers_a, self.layers_b = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
