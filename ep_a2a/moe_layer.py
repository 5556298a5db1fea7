"""What the PyTorch and JAX MoE layers share, framework-free: the payloads they dispatch, the
checks every rank's layer makes of its all-to-all, the phased step of in-process ranks, and
the NumPy oracle of the whole layer (routing, a float64 dense reference, bf16 tolerances).

Phases (run_phases): the dispatch and combine kernels of a rank spin until every peer's
kernels of the same phase have run, and in-process ranks share one GPU and one host thread.
So within a phase no rank may block the host (a host sync, cuMemFree, a pageable copy, a
blocking framework allocation) before every rank's launch of that phase is issued. A step is
therefore: prepare every rank (route, stage inputs; may block), dispatch every rank (no
blocking), compute every rank (host syncs allowed: every dispatch can complete), combine
every rank (no blocking).

The GPU has the same constraint: a rank's spinning kernels hold SMs, so a peer's work that
precedes its dispatch or combine in its stream (the router, the expert GEMMs) must not have
to wait for room. Before the dispatch phase and before the combine phase, every rank's
stream therefore waits for what every rank has issued so far (events, no host sync); the
spinning kernels then only wait for each other. (One rank per GPU needs no such gate.)
"""
from __future__ import annotations

import numpy as np

from .alltoall import PayloadSpec
from .moe import build_index, finalize, gather_rows, local_experts
from .reference import from_float32, to_float32


class LayerBase:
    """The geometry of one rank's MoE layer, read from (and checked against) its all-to-all."""

    def __init__(self, a2a_rank, module: str, renormalize: bool, gemm: str, gemms: tuple):
        a = a2a_rank.a2a
        self.a2a_rank, self.ep_size, self.rank, self.top_k = a2a_rank, a.ep_size, a2a_rank.rank, a.top_k
        self.num_experts, self.hidden = a.num_experts, a.combine_hidden_size
        self.first_expert, self.num_local = local_experts(a.num_experts, a.ep_size, a2a_rank.rank)
        self.renormalize = bool(renormalize)
        want = [(s.shape, s.dtype) for s in payload_specs(self.hidden, self.top_k)]
        if [(tuple(s.shape), s.dtype) for s in a.payload_specs] != want or a.combine_dtype.name != "bfloat16":
            raise ValueError(f"a2a_rank: the all-to-all must carry payloads={want} and combine bfloat16 "
                             f"(ep_a2a.{module}.payload_specs(hidden, top_k)); it has "
                             f"{[(s.shape, s.dtype) for s in a.payload_specs]}, combine {a.combine_dtype.name}")
        if self.num_local < 1:
            raise ValueError(f"rank {self.rank} owns no expert ({a.num_experts} experts over {a.ep_size} ranks)")
        if gemm not in gemms:
            raise ValueError(f"gemm: must be one of {gemms}, got {gemm!r}")
        self.s = a2a_rank.default_stream
        # FP8 combine: finalize quantizes into the workspace, so combine skips its own pass
        self._fp8 = a.combine_quant == "fp8"
        self._step = None
        self._gate_event = None  # run_phases' cross-rank gate (created on first use)

    def close_gate(self) -> None:
        if self._gate_event is not None:
            self._gate_event.close()
            self._gate_event = None

    def dispatch(self) -> None:
        """Phase 2: launch this rank's dispatch (no host blocking, no framework call)."""
        st = self._step
        st["views"] = self.a2a_rank.dispatch(st["ids"], [st["x"], st["w"]], st["tmax"], stream=self.s)

    def index_and_gather(self, rows):
        """The start of phase 3, on this rank's stream: the expert index of the dispatched ids
        (into self.index) and the dispatched hidden states gathered expert-major into `rows`."""
        ids_v, (x_v, w_v) = self._step["views"]
        idx = build_index(ids_v, w_v, num_experts=self.num_experts, ep_size=self.ep_size, rank=self.rank,
                          stream=self.s, out=self.index)
        gather_rows(idx, x_v, rows, stream=self.s)
        return idx

    def finalize_partials(self, idx, fc2) -> None:
        """The end of phase 3, on this rank's stream: the experts' outputs (in the index's row
        order), weighted and summed per slot, into the combine input (FP8 where combine is)."""
        finalize(idx, fc2, self.a2a_rank.combine_input(self._step["tmax"], fp8=self._fp8), stream=self.s)

    def combine_into(self, out) -> None:
        """Phase 4: launch this rank's combine of that input into `out` [T, hidden] (no host
        blocking)."""
        r, tmax = self.a2a_rank, self._step["tmax"]
        r.combine(r.combine_input(tmax, fp8=self._fp8), tmax, stream=self.s, out=out)


def run_phases(layers, xs, routers, runtime_max_tokens_per_rank: int = None, between=None) -> list:
    """One MoE step of every in-process rank, phase by phase (see the module docstring).
    xs[r]: [T_r, hidden]; routers[r]: logits [T_r, num_experts] or (ids, weights); T^
    defaults to the largest T_r (at least 1). `between(stage)`, if given, runs after the
    dispatch phase ("dispatch") and after the compute phase ("compute") (the layer
    benchmark marks its stage times there). Returns every layer's combine() result."""
    if not (len(layers) == len(xs) == len(routers)):
        raise ValueError(f"layers, xs, routers: need one per rank, got {len(layers)}, {len(xs)}, {len(routers)}")
    tmax = runtime_max_tokens_per_rank
    if tmax is None:
        tmax = max([1] + [int(x.shape[0]) for x in xs])
    prepared = []
    try:
        for layer, x, router in zip(layers, xs, routers):
            layer.prepare(x, router, tmax)
            prepared.append(layer)
    except BaseException:
        for layer in prepared:  # nothing is launched yet: the step is simply dropped
            layer._step = None
        raise
    phase_gate(layers)          # every rank's routing runs before any dispatch spins
    for layer in layers:        # every rank's dispatch is issued before anything may block
        layer.dispatch()
    if between:
        between("dispatch")
    for layer in layers:        # host syncs are safe now: every dispatch can complete
        layer.compute()
    if between:
        between("compute")
    phase_gate(layers)          # every rank's expert compute runs before any combine spins
    return [layer.combine() for layer in layers]  # again nothing in between may block


def phase_gate(layers) -> None:
    """Every rank's stream waits for the work every rank of its GPU has issued (module
    docstring), through the first such rank's stream: the others' events join there, and
    one event recorded after them fans back out (3n driver calls, not n^2)."""
    from .driver.stream import Event
    by_gpu = {}
    for layer in layers:
        by_gpu.setdefault(layer.a2a_rank.device.ordinal, []).append(layer)
    for same in by_gpu.values():
        if len(same) < 2:
            continue  # a rank alone on its GPU starves no peer
        for layer in same:
            if layer._gate_event is None:
                layer._gate_event = Event(layer.a2a_rank.device)
        hub = same[0]
        for layer in same[1:]:
            layer._gate_event.record(layer.s)
            layer._gate_event.wait_on(hub.s)
        hub._gate_event.record(hub.s)
        for layer in same[1:]:
            hub._gate_event.wait_on(layer.s)


def payload_specs(hidden: int, top_k: int) -> list:
    """The payloads the layer dispatches besides the expert ids: bf16 hidden states and the
    fp32 router weights (build the MoeAlltoAll with these and combine_dtype='bfloat16')."""
    return [PayloadSpec("hidden", (hidden,), "bfloat16"), PayloadSpec("weights", (top_k,), "float32")]


# -- NumPy: routing, weights and the dense reference (framework-free; the tests' oracle) ------------
def route_reference(logits: np.ndarray, top_k: int, renormalize: bool = True):
    """(ids int32 [T, top_k] by descending logit, weights float32 [T, top_k]) as route() does."""
    logits = np.asarray(logits, np.float32)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    top = np.take_along_axis(logits, ids, axis=1).astype(np.float64)
    if renormalize:
        e = np.exp(top - top.max(axis=1, keepdims=True)) if len(top) else top
        w = e / e.sum(axis=1, keepdims=True) if len(top) else top
    else:
        full = logits.astype(np.float64)
        z = np.exp(full - full.max(axis=1, keepdims=True)) if len(full) else full
        w = np.take_along_axis(z / z.sum(axis=1, keepdims=True), ids, axis=1) if len(full) else top
    return ids, np.asarray(w, np.float32)


def distinct_logits(rng, tokens: int, num_experts: int) -> np.ndarray:
    """Random float32 router logits [tokens, num_experts] whose values in a row differ by at
    least 2/num_experts, so every top-k is unambiguous (no ties between implementations)."""
    ranks = np.argsort(rng.random((tokens, num_experts)), axis=1).astype(np.float32)
    return ((ranks + rng.uniform(0.0, 0.5, (tokens, num_experts)).astype(np.float32)) * np.float32(4.0 / num_experts)).astype(np.float32)


def random_weights(rng, num_experts: int, hidden: int, intermediate: int):
    """bf16 bits (uint16) of w_gate_up [E, 2*I, hidden] and w_down [E, hidden, I], scaled so that
    each projection keeps unit variance (std 1/sqrt(fan_in))."""
    w1 = rng.standard_normal((num_experts, 2 * intermediate, hidden), np.float32) / np.float32(np.sqrt(hidden))
    w2 = rng.standard_normal((num_experts, hidden, intermediate), np.float32) / np.float32(np.sqrt(intermediate))
    return from_float32(w1, "bfloat16"), from_float32(w2, "bfloat16")


def dense_reference(x_bits, ids, weights, w_gate_up_bits, w_down_bits) -> np.ndarray:
    """The layer in float64 over all tokens and all experts: float64 [N, hidden].

    x_bits: bf16 bits [N, hidden]; ids int [N, top_k] (ids outside 0..E-1 skipped); weights
    [N, top_k]; expert weights as bf16 bits, every expert [E, ...]. No intermediate rounding:
    the layer's error against it is its bf16 roundings (see check_layer_output)."""
    x = to_float32(np.asarray(x_bits), "bfloat16").astype(np.float64)
    w1 = to_float32(np.asarray(w_gate_up_bits), "bfloat16")
    w2 = to_float32(np.asarray(w_down_bits), "bfloat16")
    ids = np.asarray(ids)
    weights = np.asarray(weights, np.float64)
    inter = w2.shape[2]
    out = np.zeros((x.shape[0], x.shape[1]), np.float64)
    for e in range(w1.shape[0]):
        tok, k = np.nonzero(ids == e)
        if tok.size == 0:
            continue
        h = x[tok] @ w1[e].T.astype(np.float64)
        gate, up = h[:, :inter], h[:, inter:]
        y = (gate / (1.0 + np.exp(-gate)) * up) @ w2[e].T.astype(np.float64)
        np.add.at(out, tok, weights[tok, k][:, None] * y)
    return out


# Tolerances of the bf16 layer against dense_reference. On the path from the bf16 inputs and
# weights to the output there are six bf16 roundings (FC1 output, SiLU, gate * up, FC2 output,
# the finalized partial, the combined sum), each with relative error <= u = 2**-8; they are
# independent and of random sign, so they add in quadrature. A NumPy simulation of exactly
# these roundings (random data, hidden 256..2048, top_k 2..8) gives a relative L2 error of
# 0.0046 over all tokens, at most 0.0074 for one token, and element errors at most
# 5.6 * u * (|ref| + rms of the token's row). The bounds below leave 2-3x of margin; a lost,
# doubled, misweighted or misrouted selection is an O(1) relative error per token.
TOKEN_REL_L2 = 2.0 ** -6     # per token: ||out - ref|| <= 0.0156 ||ref||
ELEMENT_ULPS = 16            # per element: |out - ref| <= 16 u (|ref| + rms(ref row))
TOTAL_REL_L2 = 0.01          # over every token of a rank


def check_layer_output(got, want, what: str = "") -> None:
    """Raise AssertionError (with the worst token and element) unless `got` (any float
    [T, hidden], bf16 as values) is within the bf16 tolerances above of `want`."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    if got.size == 0:
        return
    assert np.isfinite(got).all(), f"{what}: non-finite output at {np.argwhere(~np.isfinite(got))[:4].tolist()}"
    err = got - want
    row_ref = np.linalg.norm(want, axis=1)
    row_err = np.linalg.norm(err, axis=1)
    total = np.linalg.norm(err) / max(np.linalg.norm(want), 1e-30)
    worst = int(np.argmax(row_err / np.maximum(row_ref, 1e-30)))
    assert total <= TOTAL_REL_L2, f"{what}: relative L2 error {total:.4g} > {TOTAL_REL_L2}"
    assert (row_err <= TOKEN_REL_L2 * row_ref + 1e-30).all(), \
        f"{what}: token {worst} relative error {row_err[worst] / max(row_ref[worst], 1e-30):.4g} > {TOKEN_REL_L2:.4g}"
    rms = np.sqrt(np.mean(want * want, axis=1, keepdims=True))
    bound = ELEMENT_ULPS * 2.0 ** -8 * (np.abs(want) + rms)
    bad = np.abs(err) > bound
    if bad.any():
        t, h = map(int, np.argwhere(bad)[0])
        raise AssertionError(f"{what}: element [{t}, {h}] = {got[t, h]:.6g}, reference {want[t, h]:.6g} "
                             f"(bound {bound[t, h]:.3g}); {int(bad.sum())} elements out of bounds")


def max_relative_error(got, want) -> float:
    """max |got - want| / max |want|: the one-number summary the examples print."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)) if want.size else 0.0
