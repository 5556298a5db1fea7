"""python -m ep_a2a: a dispatch/combine demo on the GPUs present (the NumPy reference without one)."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _reference_demo(ep: int, tokens: int, hidden: int, top_k: int, experts: int, rng) -> None:
    from .testing import reference as ref
    from .testing.formats import routing
    ids = [routing("uniform", rng, tokens, top_k, experts, ep, s) for s in range(ep)]
    x = [[rng.standard_normal((tokens, hidden)).astype(np.float32)] for _ in range(ep)]
    received, records = ref.dispatch(ids, x, ep, experts, tokens)
    # stand-in MoE: every target returns its copy of the token; combine then sums the copies
    partial = [r["payloads"][0] for r in received]
    out = ref.combine(partial, records, "float32")
    n_targets = [np.array([[len(ref.targets_of(row, ref.expert_owner(experts, ep)))] for row in ids[s]]) for s in range(ep)]
    err = max(float(np.abs(out[s] - x[s][0] * n_targets[s]).max()) for s in range(ep))
    print(f"reference: {ep} ranks x {tokens} tokens, top_k={top_k}, {experts} experts; "
          f"received per rank {[int(r['counts'].sum()) for r in received]}; combine max error {err:.2e}")


EPILOG = """examples:
  python -m ep_a2a                        one rank per GPU (4 ranks on a single GPU), 128 tokens each
  python -m ep_a2a --ranks 8 --tokens 16  8 in-process ranks, 16 tokens each
  python -m ep_a2a --info                 the build: cubins, toolkit, the native JAX library

Without a CUDA GPU or driver the demo runs the NumPy reference model of dispatch and combine
instead and exits 0 (the other tools exit 3 there).
exit status: 0 every step matched the reference (or the NumPy fallback ran); 1 a mismatch;
2 a bad command line"""


def parser() -> argparse.ArgumentParser:
    """The command line's options, each with its help."""
    from .layout import MAX_RANKS, MAX_TOP_K
    from .tools.argtypes import int_in, positive_int
    ap = argparse.ArgumentParser(prog="python -m ep_a2a", epilog=EPILOG,
                                 description="A dispatch/combine demo on the GPUs present, every step checked against\n"
                                             "the NumPy reference model (the model alone without a GPU).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int_in(1, MAX_RANKS), default=None,
                    help="in-process ranks, spread round-robin over the GPUs (default: one per GPU, 4 on one GPU)")
    ap.add_argument("--tokens", type=int_in(1, 2 ** 23 - 1), default=128, help="tokens per rank (default 128)")
    ap.add_argument("--hidden", type=positive_int, default=7168, help="hidden size of the tokens (default 7168)")
    ap.add_argument("--top-k", type=int_in(1, MAX_TOP_K), default=8, help="experts per token (default 8)")
    ap.add_argument("--experts", type=positive_int, default=256, help="number of experts (default 256)")
    ap.add_argument("--steps", type=positive_int, default=5, help="dispatch/combine steps on the GPU (default 5)")
    ap.add_argument("--info", action="store_true",
                    help="print what this installation holds (cubins, the native JAX library and the jaxlib it was "
                         "built for) and exit")
    return ap


def info() -> None:
    """--info: the package, its cubins and the native JAX library (ops/jax_ffi.py)."""
    import json
    from pathlib import Path

    import ep_a2a
    from .ops import jax_ffi
    cubins = Path(ep_a2a.__file__).resolve().parent / "cubins"
    try:
        m = json.loads((cubins / "manifest.json").read_text())
        built = f"nvcc {m.get('nvcc')}, sm_{', sm_'.join(map(str, m.get('archs', [])))}"
    except (OSError, ValueError):
        built = "no manifest.json (run `make cubins`)"
    print(f"ep_a2a {ep_a2a.__version__} at {cubins.parent}")
    print(f"cubins: {len(list(cubins.glob('*.cubin')))} ({built})")
    print(jax_ffi.info_line())


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    from .tools.argtypes import check_top_k
    check_top_k(ap, args.top_k, args.experts)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.info:
        info()
        return 0
    rng = np.random.default_rng()

    from .driver import device
    n = device.device_count()
    if n == 0:
        print("no CUDA GPU on this machine (no driver or no device): running the NumPy reference model instead")
        _reference_demo(args.ranks or 4, args.tokens, args.hidden, args.top_k, args.experts, rng)
        return 0
    import ep_a2a
    from .testing.formats import payload_formats
    from .testing.harness import run_step
    devices = list(range(n)) if args.ranks is None and n > 1 else [0] * (args.ranks or 4)
    if args.ranks and n > 1:
        devices = [i % n for i in range(args.ranks)]
    with ep_a2a.LocalGroup(devices) as group:
        with ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=args.tokens, top_k=args.top_k, num_experts=args.experts,
                                payloads=payload_formats(args.hidden, args.top_k)["bf16"],
                                combine_hidden_size=args.hidden) as a2a:
            d = group.ranks[0].device
            print(f"{len(devices)} ranks on {d.name} x{len(set(devices))} (devices {devices}), "
                  f"workspace {a2a.workspace_bytes_per_rank / 2**20:.0f} MiB per rank")
            bad = 0
            for step in range(args.steps):
                t0 = time.perf_counter()
                rep = run_step(a2a, rng, [args.tokens] * len(devices), args.tokens, route="uniform")
                bad += len(rep.mismatches)
                print(f"step {step}: dispatched and combined {sum(rep.tokens)} tokens, "
                      f"{rep.dispatch_bytes_checked / 2**20:.1f} MiB checked against the reference, "
                      f"{len(rep.mismatches)} mismatches ({(time.perf_counter() - t0) * 1e3:.0f} ms incl. checks)")
    print("OK" if bad == 0 else f"FAILED: {bad} mismatches")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
