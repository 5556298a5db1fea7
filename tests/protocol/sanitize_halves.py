"""A short run of every halves kernel for compute-sanitizer (memcheck, racecheck, synccheck):
two in-process ranks on GPU 0, two micro-batches (two all-to-alls) per protocol, FENCE with
and without FP8 combine, a few steps each, checked against the NumPy reference.

    PYTHONPATH=. compute-sanitizer --tool memcheck python tests/protocol/sanitize_halves.py

Every half is issued for all ranks before the next half of any rank (A.send, B.send, A.recv,
B.recv, as engines order them), so the run also completes where the tool serializes kernels:
a receive half never waits for a send half queued behind it.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import test_halves_gpu as halves_test  # noqa: E402

ORDER = [("A", "dispatch_send"), ("B", "dispatch_send"), ("A", "dispatch_recv"), ("B", "dispatch_recv"),
         ("A", "combine_send"), ("B", "combine_send"), ("A", "combine_recv"), ("B", "combine_recv")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    halves_test.EP = args.ranks
    rng = np.random.default_rng()
    done = 0
    for protocol, quant in (("fence", None), ("fence", "fp8"), ("sentinel", None)):
        group, a = halves_test._make(protocol, quant, timeout_s=120.0, first_timeout_s=120.0)
        _, b = halves_test._make(protocol, quant, group=group, timeout_s=120.0, first_timeout_s=120.0)
        with group, a, b:
            for step in range(args.steps):
                m = {"A": halves_test.Micro(a, rng, 4), "B": halves_test.Micro(b, rng, 2)}
                for name, op in ORDER:
                    for s in range(args.ranks):
                        m[name].half(op, s)
                a.synchronize()
                for name in "AB":
                    m[name].check(f"{protocol} fp8={bool(quant)} step {step} micro-batch {name}")
                done += 1
    print(f"sanitize_halves: {done} steps of two micro-batches matched the reference", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
