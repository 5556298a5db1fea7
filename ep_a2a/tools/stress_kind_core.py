"""The mixed soak's eager step kinds on the core calls (RankAlltoAll.dispatch / combine),
each through the harness the tests use (testing/harness.run_step):

  eager   a random configuration of the plain soak (stress.py): payload format, combine dtype,
          protocol "fence", "sentinel" or "auto" (around a crossover inside the token range),
          T^, token counts with idle and full ranks, routing, invalid ids, zero-copy or staged
  fp8     the FP8 combine (FENCE), combine quantizing or an epilogue's FP8 input
  active  an all-to-all whose active ranks shrink step by step (set_active_ranks), rebuilt
          with every rank once two are left: inactive ranks have no tokens and are not run,
          and selections of their experts are dropped as the reference drops them
"""
from __future__ import annotations

from .stress import COMBINE_DTYPES, HIDDEN, TOP_K, build_alltoalls, draw_step, step_bytes
from .stress_kinds import Outcome, step_kind


def _alltoalls(soak) -> dict:
    """The plain soak's all-to-alls (one per format and combine dtype, and the FP8 ones),
    shapes drawn from the seed."""
    import numpy as np

    def make():
        built = {}
        try:
            return build_alltoalls(soak.group, soak.args, np.random.default_rng([soak.seed, 1 << 40]), built)
        except BaseException:
            for a in built.values():
                a.close()
            raise

    def close(built):
        for a in built.values():
            a.close()
    return soak.resource("plain-alltoalls", make, close)


def _run(a2a, rng, d, verify, label, prequantize=False) -> tuple:
    """(Outcome, the harness's StepReport) of one harness step."""
    from ..testing.harness import run_step
    proto = a2a.protocol_for(d["tmax"])
    rep = run_step(a2a, rng, d["tokens"], d["tmax"], route=d["route"], exact=d["exact"], zero_copy=d["zero_copy"],
                   verify=verify, alpha=d["alpha"], invalid_fraction=d["invalid"], prequantize=prequantize)
    mism = list(rep.mismatches)
    if verify and rep.combine_rows_checked != sum(d["tokens"]):
        mism.append(f"combine checked {rep.combine_rows_checked} rows of {sum(d['tokens'])}")
    db, cb = step_bytes(a2a, d["tokens"])
    if mism:
        mism = [f"{label} T^={d['tmax']} tokens={d['tokens']} route={d['route']}: {m}" for m in mism]
    return Outcome(label, proto, verify, mism, db, cb), rep


@step_kind("eager", weight=3.0)
def eager_step(soak, rng, verify) -> Outcome:
    a2as = {k: a for k, a in _alltoalls(soak).items() if not a.combine_quant}
    d = draw_step(rng, a2as, soak.args.max_tokens, soak.ep_size)
    a2a = a2as[d["key"]]
    a2a.use_protocol(d["mode"])
    return _run(a2a, rng, d, verify, f"eager/{'/'.join(d['key'])}/{d['mode']}")[0]


@step_kind("fp8", weight=1.0)
def fp8_step(soak, rng, verify) -> Outcome:
    a2as = {k: a for k, a in _alltoalls(soak).items() if a.combine_quant == "fp8"}
    d = draw_step(rng, a2as, soak.args.max_tokens, soak.ep_size)
    pre = d["prequantize"]
    return _run(a2as[d["key"]], rng, d, verify, f"fp8/{d['key'][1]}" + ("/epilogue" if pre else ""), prequantize=pre)[0]


ACTIVE_KEY = "active-alltoall"
DROPPED_KEY = "active-dropped"   # selections each rank of it dropped by the reference, since its build


def active_num_experts(ep: int, top_k: int) -> int:
    """Experts of the active-rank kind's all-to-all: an uneven split over the ranks (2 ep + 1),
    and at least top_k + 1, so that every top_k of TOP_K is valid with few ranks too."""
    return max(2 * ep + 1, top_k + 1)


@step_kind("active", weight=1.0)
def active_step(soak, rng, verify) -> Outcome:
    from ..testing import reference as ref
    from ..testing.formats import payload_formats
    import numpy as np
    ep, most = soak.ep_size, soak.args.max_tokens
    # shapes from the seed, the same at every rebuild: a rebuilt workspace takes the bytes the
    # closed one gave back, so device memory is comparable across the soak's samples
    shapes = np.random.default_rng([soak.seed, 1 << 41])
    hidden, top_k, cdt = int(shapes.choice(HIDDEN)), int(shapes.choice(TOP_K)), str(shapes.choice(COMBINE_DTYPES))

    def make():
        import ep_a2a
        crossover = int(rng.integers(1, most)) if most > 1 else 1
        return ep_a2a.MoeAlltoAll(soak.group, max_tokens_per_rank=most, top_k=top_k, num_experts=active_num_experts(ep, top_k),
                                  payloads=payload_formats(hidden, top_k)["bf16"], combine_hidden_size=hidden,
                                  combine_dtype=cdt, protocol="auto", crossover_tokens=crossover, timeout_s=20.0)
    a2a = soak.resource(ACTIVE_KEY, make)
    active = list(a2a.active_ranks)
    if ep > 2 and rng.random() < 0.3:
        if len(active) <= 2:  # ranks only leave: start again with all of them (a new all-to-all)
            soak.drop(ACTIVE_KEY)
            soak.drop(DROPPED_KEY)
            a2a = soak.resource(ACTIVE_KEY, make)
        else:
            active.remove(int(rng.choice(active)))
            a2a.set_active_ranks(active)
    active = list(a2a.active_ranks)
    d = draw_step(rng, {"x": a2a}, most, ep)
    d["tokens"] = [t if s in active else 0 for s, t in enumerate(d["tokens"])]
    a2a.use_protocol(d["mode"])
    out, rep = _run(a2a, rng, d, verify, f"active/{len(active)}of{ep}/{d['mode']}")
    # each rank's count of dropped selections (cumulative since the build) against the reference's
    want = soak.resource(DROPPED_KEY, lambda: [0] * ep, lambda _: None)
    for s in active:
        want[s] += ref.dropped_selections([rep.expert_ids[s]], a2a.num_experts, ep, active)
    if verify:
        got = [a2a.ranks[s].dropped_selections() for s in active]
        if got != [want[s] for s in active]:
            out.mismatches.append(f"{out.label}: dropped selections {got} of ranks {active}, reference {[want[s] for s in active]}")
    return out
