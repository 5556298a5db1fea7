"""A whole dispatch -> MoE -> combine step of every in-process rank captured as one CUDA graph
per rank and T^, replayed with fresh inputs, every replay checkable against the reference.

The stand-in MoE inside the graph copies the received hidden states into the combine input
(one device-to-device copy of the [ep_size, T^, hidden] region), so a token's combined row
is its own hidden row summed once per distinct target rank, in the kernels' order; invalid
ids (-1) and tokens without a valid id sum to zeros. Inputs live in buffers fixed at capture
(a graph bakes their addresses and the token counts): each replay draws new expert ids and
hidden states into them. Needs a bf16 "hidden" payload of combine_hidden_size and a bf16
combine. Eager steps (issue()) run the same calls outside a graph.
"""
from __future__ import annotations

import numpy as np

from ..driver.memory import copy_dtod_async
from ..driver.stream import Graph
from ..interop.arrays import copy_from_numpy, empty, to_numpy
from . import reference as ref
from .formats import random_payload, routing


class RankGraphStep:
    """One rank's buffers (fixed for its graph) for a step of `tokens` tokens at T^."""

    def __init__(self, a2a, rank, tokens: int, runtime_max: int):
        self.a2a, self.rank, self.tokens, self.runtime_max = a2a, rank, int(tokens), int(runtime_max)
        specs = a2a.payload_specs
        self.ids = empty((self.tokens, a2a.top_k), "int32", rank.device)
        self.payloads = [empty((self.tokens,) + tuple(s.shape), s.dtype, rank.device) for s in specs]
        self.out = empty((self.tokens, a2a.combine_hidden_size), a2a.combine_dtype.name, rank.device)
        self.hidden_index = [s.name for s in specs].index("hidden")
        self.graph = None

    def fill(self, rng, route: str = "uniform", invalid_fraction: float = 0.0) -> tuple:
        """Fresh expert ids and payloads into the fixed buffers, poison into the output; returns
        the host copies (ids, hidden). Synchronous copies: call before any rank launches."""
        a2a = self.a2a
        ids = routing(route, rng, self.tokens, a2a.top_k, a2a.num_experts, a2a.ep_size, self.rank.rank,
                      invalid_fraction=invalid_fraction)
        pays = [random_payload(rng, s, self.tokens) for s in a2a.payload_specs]
        copy_from_numpy(self.ids, ids)
        for buf, x in zip(self.payloads, pays):
            copy_from_numpy(buf, x)
        copy_from_numpy(self.out, np.full(self.out.nbytes, 0xFF, np.uint8))  # NaN in every float format
        return ids, pays[self.hidden_index]

    def dispatch(self) -> None:
        self.views = self.rank.dispatch(self.ids, self.payloads, self.runtime_max)

    def moe(self) -> None:
        hidden = self.views[1][self.hidden_index]
        self.rank.device.make_current()
        copy_dtod_async(self.rank.combine_input(self.runtime_max).ptr, hidden.ptr, hidden.nbytes,
                        self.rank.default_stream)

    def combine(self) -> None:
        self.rank.combine(self.rank.combine_input(self.runtime_max), self.runtime_max, out=self.out)

    def capture(self) -> Graph:
        """This rank's whole step as a graph on its default stream (launches nothing)."""
        stream = self.rank.default_stream
        Graph.begin(stream)
        try:
            self.dispatch()
            self.moe()
            self.combine()
        finally:
            graph = Graph.end(stream)
        self.graph = graph
        return graph

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None


def issue_eager(steps: list) -> None:
    """The step of every rank in `steps` as plain calls: every dispatch before any combine
    (in-process ranks spin on each other's launches)."""
    for st in steps:
        st.dispatch()
    for st in steps:
        st.moe()
        st.combine()


def replay(steps: list) -> None:
    for st in steps:
        st.graph.launch(st.rank.default_stream)


def expected(a2a, ids: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """The combined rows (bf16 bits) of one rank's tokens under the copying stand-in MoE."""
    owner = ref.expert_owner(a2a.num_experts, a2a.ep_size)
    active = set(a2a.active_ranks)
    width = hidden.shape[1]
    out = np.zeros((ids.shape[0], width), np.float32)
    for i, row in enumerate(ids):
        n = sum(1 for t in ref.targets_of(row, owner) if t in active)
        out[i] = ref.tree_sum([ref.to_float32(hidden[i], "bfloat16")] * n, width)
    return ref.from_float32(out, "bfloat16")


def check(steps: list, drawn: list, what: str) -> list:
    """Mismatches (strings) of every rank's output against expected(); call after synchronize."""
    bad = []
    for st, (ids, hidden) in zip(steps, drawn):
        got = to_numpy(st.out).view(np.uint16)
        want = expected(st.a2a, ids, hidden)
        rows = np.flatnonzero((got != want).reshape(st.tokens, -1).any(axis=1)) if st.tokens else []
        if len(rows):
            bad.append(f"{what}: rank {st.rank.rank}, {len(rows)} of {st.tokens} rows differ (first {int(rows[0])})")
    return bad
