"""The mixed soak's CUDA-graph step kind: on one all-to-all built with protocol "auto" (its
crossover inside the token range, so both protocols have graphs), a graph per rank and T^ of
the whole step (testing/graph_step.py), captured the first time that T^ is drawn, after one
eager step with the same buffers; later steps replay a T^ drawn at random, or run an eager
harness step on the same all-to-all with any protocol setting in between, so replays follow
eager steps of either protocol and of other T^ in random order (the decisions that cross
steps live on the device)."""
from __future__ import annotations

from .stress import MODES
from .stress_kinds import Outcome, step_kind

GRAPH_HIDDEN = 256
GRAPH_TOP_K = 4


def graph_sizes(most: int) -> list:
    """The T^ that get graphs: powers of 4 and a few odd ones, up to max_tokens_per_rank."""
    return sorted({t for t in (1, 3, 4, 16, 37, 64, 128, 256, most) if t <= most})


class GraphSet:
    """The all-to-all of the graph kind and its captured steps, per T^."""

    def __init__(self, soak):
        import ep_a2a
        from ..testing.formats import payload_formats
        most, ep = soak.args.max_tokens, soak.ep_size
        sizes = graph_sizes(most)
        self.crossover = sizes[len(sizes) // 2] if len(sizes) > 1 else 1
        self.a2a = ep_a2a.MoeAlltoAll(soak.group, max_tokens_per_rank=most, top_k=GRAPH_TOP_K,
                                      num_experts=3 * ep + 1, payloads=payload_formats(GRAPH_HIDDEN, GRAPH_TOP_K)["bf16"],
                                      combine_hidden_size=GRAPH_HIDDEN, combine_dtype="bfloat16", protocol="auto",
                                      crossover_tokens=self.crossover, validate_expert_ids=False, timeout_s=20.0)
        self.sizes = sizes
        self.steps = {}   # T^ -> [RankGraphStep per rank]

    def captured(self, rng, runtime_max: int) -> tuple:
        """(the steps of T^, the mismatches of the eager step run before a first capture)."""
        from ..testing import graph_step as gs
        got = self.steps.get(runtime_max)
        if got is not None:
            return got, []
        a2a = self.a2a
        a2a.use_protocol("auto")
        steps = [gs.RankGraphStep(a2a, r, int(rng.integers(0, runtime_max + 1)), runtime_max) for r in a2a.ranks]
        drawn = [st.fill(rng) for st in steps]
        gs.issue_eager(steps)
        a2a.synchronize()
        bad = gs.check(steps, drawn, f"graph/eager-before-capture T^={runtime_max}")
        try:
            for st in steps:
                st.capture()
        except BaseException:
            for st in steps:
                st.close()
            raise
        self.steps[runtime_max] = steps
        return steps, bad

    def close(self) -> None:
        try:
            for steps in self.steps.values():
                for st in steps:
                    st.close()
            self.steps.clear()
        finally:
            self.a2a.close()


@step_kind("graph", weight=2.0)
def graph_step(soak, rng, verify) -> Outcome:
    from ..testing import graph_step as gs
    from ..testing.harness import run_step
    from .stress import step_bytes
    gset = soak.resource("graphs", lambda: GraphSet(soak))
    a2a = gset.a2a
    bad = []
    if not gset.steps:  # the first step captures every T^ (no graph is made after the warm-up)
        for size in gset.sizes:
            bad += gset.captured(rng, size)[1]
    if rng.random() < 0.3:  # an eager step on the graphs' all-to-all, any protocol setting
        mode = str(rng.choice(MODES))
        a2a.use_protocol(mode)
        tmax = int(rng.integers(1, soak.args.max_tokens + 1))
        tokens = [int(t) for t in rng.integers(0, tmax + 1, soak.ep_size)]
        rep = run_step(a2a, rng, tokens, tmax, route=str(rng.choice(["uniform", "zipf", "perfect"])), verify=verify)
        db, cb = step_bytes(a2a, tokens)
        bad += [f"graph/eager {mode} T^={tmax} tokens={tokens}: {m}" for m in rep.mismatches]
        a2a.use_protocol("auto")
        return Outcome(f"graph/eager/{mode}", a2a.protocol_for(tmax) if mode == "auto" else mode, verify, bad, db, cb)
    tmax = int(rng.choice(gset.sizes))
    steps, more = gset.captured(rng, tmax)
    bad += more
    route = str(rng.choice(["uniform", "zipf"]))
    drawn = [st.fill(rng, route, invalid_fraction=float(rng.choice([0.0, 0.1]))) for st in steps]
    gs.replay(steps)
    a2a.synchronize()
    if verify:
        bad += gs.check(steps, drawn, f"graph/replay T^={tmax}")
    tokens = [st.tokens for st in steps]
    db, cb = step_bytes(a2a, tokens)
    return Outcome(f"graph/replay/T^={tmax}", a2a.protocol_for(tmax), verify, bad, db, cb)
