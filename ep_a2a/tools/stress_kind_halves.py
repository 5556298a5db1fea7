"""The mixed soak's halves step kind: two micro-batches in flight on two all-to-alls of the
soak's group, through the send and receive halves (ep_a2a/halves.py), in an order engines use
(both sends first, two-batch overlap) or a random legal interleaving, the ranks issued in a
random order, each micro-batch with its own T^ and token counts, protocol fence, sentinel or
auto per step; checked against the reference (testing/halves_step.py)."""
from __future__ import annotations

import random

from .stress import MODES, step_bytes
from .stress_kinds import Outcome, step_kind


def _pair(soak):
    import numpy as np

    def make():
        import ep_a2a
        from ..testing.formats import payload_formats
        ep, most = soak.group.ep_size, soak.args.max_tokens
        hidden = int(np.random.default_rng([soak.seed, 1 << 42]).choice((96, 256, 1024)))
        made = []
        try:
            for _ in "AB":
                made.append(ep_a2a.MoeAlltoAll(soak.group, max_tokens_per_rank=most, top_k=4, num_experts=2 * ep + 5,
                                               payloads=payload_formats(hidden, 4)["bf16"], combine_hidden_size=hidden,
                                               protocol="auto", crossover_tokens=max(1, most // 4), timeout_s=20.0,
                                               validate_expert_ids=False))
        except BaseException:
            for a in made:
                a.close()
            raise
        return made

    def close(made):
        for a in made:
            a.close()
    return soak.resource("halves-alltoalls", make, close)


@step_kind("halves", weight=1.0)
def halves_step(soak, rng, verify) -> Outcome:
    from ..testing.halves_step import BOTH_SENDS_FIRST, TBO, Micro, interleaving, run_two
    a, b = _pair(soak)
    most, ep = soak.args.max_tokens, soak.ep_size
    mode = str(rng.choice(MODES))
    rnd = random.Random(int(rng.integers(1 << 30)))
    order = (BOTH_SENDS_FIRST, TBO, None)[int(rng.integers(3))] or interleaving(rnd)
    m = {}
    for name, x in (("A", a), ("B", b)):
        x.use_protocol(mode)
        m[name] = Micro(x, rng, 1 if rng.random() < 0.1 else int(rng.integers(1, most + 1)))
    run_two(m, order, rnd.sample(range(ep), ep))
    a.synchronize()
    bad = []
    if verify:
        for name in "AB":
            bad += [f"halves/{mode} {name} T^={m[name].tmax} tokens={m[name].tokens} order={order}: {x}"
                    for x in m[name].mismatches()]
    db = sum(step_bytes(x, m[n].tokens)[0] for n, x in (("A", a), ("B", b)))
    cb = sum(step_bytes(x, m[n].tokens)[1] for n, x in (("A", a), ("B", b)))
    return Outcome(f"halves/{mode}", a.protocol_for(m["A"].tmax), verify, bad, db, cb)
