"""The command line of `python -m ep_a2a.bench`: its arguments, checked, and main (in-process
ranks here, one rank per process through bench_procs)."""
from __future__ import annotations

import argparse
import sys

from . import bench
from .bench_report import no_gpu, report


def _bounded_int(lo: int, hi: int = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}, got {v}")
        return v
    parse.__name__ = "int"
    return parse


def _token_list(s: str) -> list:
    try:
        v = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {s!r}") from None
    if min(v) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {s!r}")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (argparse exits with status 2 and a message on an error)."""
    from ..config import PROTOCOLS
    from ..layout import MAX_RANKS
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.bench", description=bench.__doc__.split("\n")[0])
    ap.add_argument("--mode", default="inproc", choices=bench.MODES,
                    help="inproc: --ranks ranks in this process on one GPU; procs: one rank process per GPU")
    ap.add_argument("--procs", type=_bounded_int(2, MAX_RANKS),
                    help="--mode procs: rank processes (default: one per visible GPU; more than the GPUs share "
                         "them round-robin, time-sliced: a correctness run, not performance)")
    ap.add_argument("--profile", default="deepseek-v3", choices=list(bench.PROFILES) + ["custom"])
    ap.add_argument("--hidden", type=_bounded_int(1))
    ap.add_argument("--top-k", type=_bounded_int(1))
    ap.add_argument("--experts", type=_bounded_int(1))
    ap.add_argument("--ranks", type=_bounded_int(1, MAX_RANKS), help="--mode inproc: ranks on --device (default 8)")
    ap.add_argument("--device", type=_bounded_int(0), help="--mode inproc: the GPU (default 0)")
    ap.add_argument("--tokens", type=_token_list, default=[2 ** i for i in range(13)])
    ap.add_argument("--routing", default="perfect", choices=["perfect", "uniform", "zipf"])
    ap.add_argument("--alpha", type=float, default=1.2)
    ap.add_argument("--format", default="bf16", choices=["bf16", "mxfp8", "nvfp4"])
    ap.add_argument("--protocol", default="fence,sentinel,auto", help="comma list of fence, sentinel, auto")
    ap.add_argument("--sentinel-max", type=_bounded_int(0), default=4096,
                    help="sweep SENTINEL only up to this many tokens")
    ap.add_argument("--rounds", type=_bounded_int(1), default=20,
                    help="R: every figure replays graphs of R and 2R rounds and reports (t(2R) - t(R)) / R, "
                         "so the graph launch and the host barrier's skew drop out")
    ap.add_argument("--replays", type=_bounded_int(1), default=30)
    ap.add_argument("--combine-quant", choices=["fp8", "fp8-epilogue"], default=None,
                    help="FP8 (e4m3, per-128 scales) combine, FENCE only. fp8: combine quantizes the bf16 "
                         "partial results itself; fp8-epilogue: the MoE epilogue wrote them as FP8 "
                         "(combine_input(T^, fp8=True), as moe.finalize can), so combine only pulls and reduces")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--stamps", action="store_true",
                    help="also time a graph with device timestamps between the phases (SENTINEL's dispatch / "
                         "combine split, and FENCE's as a check); off by default: on the H200 with 8 in-process "
                         "ranks that graph hung (a timeout's launch failure) at FENCE 128 and SENTINEL 16 tokens per "
                         "rank, where every rank's grid is its whole share of the GPU (cause not found yet), while 1 "
                         "and 4 tokens ran; such sizes now take no stamped graph and say why (stamps_refused)")
    ap.add_argument("--threads", type=int, default=256, help="threads per block of the protocol kernels")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/<device>-<date>.json)")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    ap.add_argument("--profile-host", action="store_true", help="print where the eager host time goes (cProfile)")
    args = ap.parse_args(argv)
    if args.profile == "custom" and not (args.hidden and args.top_k and args.experts):
        ap.error("--profile custom needs --hidden, --top-k and --experts")
    bad = [p for p in args.protocol.split(",") if p not in PROTOCOLS]
    if bad:
        ap.error(f"--protocol: {bad} not among {', '.join(PROTOCOLS)}")
    if args.combine_quant and set(args.protocol.split(",")) != {"fence"}:
        ap.error(f"--combine-quant {args.combine_quant} needs --protocol fence")
    if args.threads % 32 or not 96 <= args.threads <= 512:
        ap.error(f"--threads must be a multiple of 32 in 96..512, got {args.threads}")
    if args.mode == "procs":
        for flag, v in (("--ranks", args.ranks), ("--device", args.device), ("--profile-host", args.profile_host or None)):
            if v is not None:
                ap.error(f"{flag} is for --mode inproc (--mode procs runs one rank per process on the visible GPUs: "
                         "choose them with CUDA_VISIBLE_DEVICES, their number with --procs)")
    else:
        if args.procs is not None:
            ap.error("--procs needs --mode procs")
        args.ranks = 8 if args.ranks is None else args.ranks
        args.device = 0 if args.device is None else args.device
    return args


def main(argv=None) -> int:
    import secrets
    args = parse_args(argv)
    if no_gpu():
        return 1
    if args.mode == "procs":
        from .bench_procs import run
        return run(args)
    import ep_a2a
    with ep_a2a.LocalGroup([args.device] * args.ranks) as group:
        b = bench.Bench(args, group, secrets.randbits(63))
        try:
            report(bench.sweep(b), args)
        finally:
            b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
