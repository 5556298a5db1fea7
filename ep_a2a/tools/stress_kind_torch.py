"""The mixed soak's torch-op step kind: one step through the registered torch ops
(ep_a2a/ops/torch.py: dispatch, combine_input, combine) on an all-to-all of their own, every
rank on a torch stream of its own, with T^, token counts, protocol setting, out= given or
made, and partial results in the workspace or staged all drawn per step; every step checked
against the reference (testing/torch_step.run_torch_step). Runs only where torch sees CUDA."""
from __future__ import annotations

from .stress import MODES, step_bytes
from .stress_kinds import Outcome, step_kind


class TorchRanks:
    def __init__(self, soak):
        import ep_a2a
        import torch
        from ..ops import torch as ops
        from ..testing.formats import payload_formats
        ep, most = soak.group.ep_size, soak.args.max_tokens
        self.a2a = ep_a2a.MoeAlltoAll(soak.group, max_tokens_per_rank=most, top_k=4, num_experts=2 * ep + 3,
                                      payloads=payload_formats(512, 4)["bf16"], combine_hidden_size=512,
                                      protocol="auto", crossover_tokens=max(1, most // 4), timeout_s=20.0)
        try:
            self.binds = [ops.bind(r) for r in self.a2a.ranks]
            self.streams = {b.rank: torch.cuda.Stream(device=b.device) for b in self.binds}
        except BaseException:
            self.a2a.close()
            raise

    def close(self) -> None:
        import torch
        torch.cuda.synchronize()
        try:
            for b in self.binds:
                b.release()
        finally:
            self.a2a.close()


@step_kind("torch", weight=1.0, needs="torch")
def torch_step(soak, rng, verify) -> Outcome:
    from ..testing.torch_step import run_torch_step
    tr = soak.resource("torch-ranks", lambda: TorchRanks(soak))
    a2a, most = tr.a2a, soak.args.max_tokens
    mode = str(rng.choice(MODES))
    a2a.use_protocol(mode)
    tmax = 1 if rng.random() < 0.1 else int(rng.integers(1, most + 1))
    tokens = [int(t) for t in rng.integers(0, tmax + 1, soak.ep_size)]
    out_given, staged = bool(rng.random() < 0.5), bool(rng.random() < 0.3)
    rep = run_torch_step(a2a, tr.binds, rng, tokens, tmax, route=str(rng.choice(["uniform", "zipf", "perfect"])),
                         streams=tr.streams, out_given=out_given, staged=staged)
    bad = [f"torch {mode} T^={tmax} tokens={tokens} out_given={out_given} staged={staged}: {m}" for m in rep.mismatches]
    if rep.combine_rows_checked != sum(tokens):
        bad.append(f"torch: combine checked {rep.combine_rows_checked} rows of {sum(tokens)}")
    db, cb = step_bytes(a2a, tokens)
    # (the torch harness compares every step: `verify` does not thin these out)
    return Outcome(f"torch/{mode}", a2a.protocol_for(tmax), True, bad, db, cb)
