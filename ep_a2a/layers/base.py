"""What the PyTorch and JAX MoE layers share, framework-free: the payloads they dispatch, the
checks every rank's layer makes of its all-to-all and the phased step of in-process ranks.
(The NumPy oracle of the whole layer is ep_a2a/testing/layer_oracle.py.)

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

from .. import PayloadSpec
from ..moe import build_index, finalize, gather_rows, local_experts
from ..moe_experts import fc2_finalizes


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
        # the expert kernels' FC2 finalizes into a bf16 combine input itself (moe_experts.expert_fc2)
        self._fc2_finalizes = fc2_finalizes(self.hidden, self._fp8)
        self._step = None
        self._gate_event = None  # run_phases' cross-rank gate (created on first use)

    def drop_step(self) -> None:
        """Forget a prepared step whose launches were never issued (a peer's prepare failed)."""
        self._step = None

    def close_gate(self) -> None:
        """Release the event the layer's steps wait on (part of close)."""
        if self._gate_event is not None:
            self._gate_event.close()
            self._gate_event = None

    def dispatch(self) -> None:
        """Phase 2: launch this rank's dispatch (no host blocking, no framework call)."""
        st = self._step
        st["views"] = self.a2a_rank.dispatch(st["ids"], [st["x"], st["w"]], st["runtime_max"], stream=self.s)

    def expert_index(self):
        """The start of phase 3, on this rank's stream: the expert index of the dispatched ids
        (into self.index)."""
        ids_v, (_, w_v) = self._step["views"]
        return build_index(ids_v, w_v, num_experts=self.num_experts, ep_size=self.ep_size, rank=self.rank,
                           stream=self.s, out=self.index)

    def index_and_gather(self, rows):
        """expert_index, then the dispatched hidden states gathered expert-major into `rows`."""
        idx = self.expert_index()
        gather_rows(idx, self._step["views"][1][0], rows, stream=self.s)
        return idx

    def finalize_partials(self, idx, fc2) -> None:
        """The end of phase 3, on this rank's stream: the experts' outputs (in the index's row
        order), weighted and summed per slot, into the combine input (FP8 where combine is)."""
        finalize(idx, fc2, self.a2a_rank.combine_input(self._step["runtime_max"], fp8=self._fp8), stream=self.s)

    def combine_into(self, out) -> None:
        """Phase 4: launch this rank's combine of that input into `out` [T, hidden] (no host
        blocking)."""
        r, runtime_max = self.a2a_rank, self._step["runtime_max"]
        r.combine(r.combine_input(runtime_max, fp8=self._fp8), runtime_max, stream=self.s, out=out)


def run_phases(layers, xs, routers, runtime_max_tokens_per_rank: int = None, between=None) -> list:
    """One MoE step of every in-process rank, phase by phase (see the module docstring).
    xs[r]: [T_r, hidden]; routers[r]: logits [T_r, num_experts] or (ids, weights); T^
    defaults to the largest T_r (at least 1). `between(stage)`, if given, runs after the
    prepare phase ("prepare"), the dispatch phase ("dispatch") and the compute phase
    ("compute") (the layer benchmarks mark their stage times there). Returns every layer's
    combine() result."""
    prepare_all([(layers, xs, routers, runtime_max_tokens_per_rank)])
    if between:
        between("prepare")
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


def prepare_all(batches) -> None:
    """Phase 1 of every layer of each (layers, xs, routers, T^ or None) in `batches`: T^
    defaults to the batch's largest T_r (at least 1). If any prepare fails (or a batch has not
    one x and one router per layer), the layers prepared already drop their step (nothing is
    launched yet) and the error propagates."""
    prepared = []
    try:
        for layers, xs, routers, runtime_max in batches:
            if not (len(layers) == len(xs) == len(routers)):
                raise ValueError(f"layers, xs, routers: need one per rank, got {len(layers)}, {len(xs)}, {len(routers)}")
            if runtime_max is None:
                runtime_max = max([1] + [int(x.shape[0]) for x in xs])
            for layer, x, router in zip(layers, xs, routers):
                layer.prepare(x, router, runtime_max)
                prepared.append(layer)
    except BaseException:
        for layer in prepared:
            layer.drop_step()
        raise


def phase_gate(layers) -> None:
    """Every rank's stream waits for the work every rank of its GPU has issued (module
    docstring), through the first such rank's stream: the others' events join there, and
    one event recorded after them fans back out (3n driver calls, not n^2)."""
    from ..driver.stream import Event
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
