"""The command line of `python -m ep_a2a.bench`: its arguments, checked, and main (in-process
ranks here, one rank per process through bench_procs)."""
from __future__ import annotations

import argparse
import sys

from . import bench, bench_halves, exits, result_paths
from .argtypes import check_top_k, int_in, int_list, nonnegative_int, positive_float, positive_int
from .bench_report import report
from .result_paths import OUT_HELP, check_out

EPILOG = f"""examples:
  python -m ep_a2a.bench --tokens 1,16,128 --protocol fence
      8 in-process ranks on GPU 0, deepseek-v3 shapes, FENCE only, three batch sizes
  python -m ep_a2a.bench --mode procs --profile kimi-k3
      one rank process per visible GPU
  python -m ep_a2a.bench --mode halves --tokens 1,16,64,128 --protocol fence,sentinel
      the send/receive halves against the whole calls, and with compute between them

The JSON goes to bench/results/alltoall-<gpu>-<N>ranks-<profile>[-<format>]-<protocols>.json
(<N>procs and <n>x<gpu> in procs mode) in the checkout, or to --out.
{exits.EPILOG}"""


def parser() -> argparse.ArgumentParser:
    """The command line's options, each with its help."""
    from ..config import PROTOCOLS
    from ..layout import MAX_RANKS, MAX_TOP_K
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.bench", description=bench.__doc__.split("\n")[0], epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="inproc", choices=bench.MODES,
                    help="inproc: --ranks ranks in this process on one GPU; procs: one rank process per GPU "
                         "(default inproc)")
    ap.add_argument("--procs", type=int_in(2, MAX_RANKS),
                    help="--mode procs: rank processes (default: one per visible GPU; more than the GPUs share "
                         "them round-robin, time-sliced: a correctness run, not performance)")
    ap.add_argument("--profile", default="deepseek-v3", choices=list(bench.PROFILES) + ["custom"],
                    help="model shapes (hidden size, top_k, experts); custom takes all three from "
                         "--hidden, --top-k, --experts (default deepseek-v3)")
    ap.add_argument("--hidden", type=positive_int, help="hidden size (overrides the profile's)")
    ap.add_argument("--top-k", type=int_in(1, MAX_TOP_K), help="experts per token (overrides the profile's)")
    ap.add_argument("--experts", type=positive_int, help="number of experts (overrides the profile's)")
    ap.add_argument("--ranks", type=int_in(1, MAX_RANKS), help="--mode inproc: ranks on --device (default 8)")
    ap.add_argument("--device", type=nonnegative_int, help="--mode inproc: the GPU ordinal (default 0)")
    ap.add_argument("--tokens", type=int_list(1), default=[2 ** i for i in range(13)],
                    help="tokens per rank to sweep, comma-separated (default 1,2,4,...,4096)")
    ap.add_argument("--routing", default="perfect", choices=["perfect", "uniform", "zipf"],
                    help="how tokens pick experts: perfect (every token reaches min(top_k, ranks) ranks, "
                         "balanced), uniform, or zipf with --alpha (default perfect)")
    ap.add_argument("--alpha", type=positive_float, default=1.2, help="--routing zipf: the exponent (default 1.2)")
    ap.add_argument("--format", default="bf16", choices=["bf16", "mxfp8", "nvfp4"],
                    help="the dispatched activations' format (default bf16)")
    ap.add_argument("--protocol", default="fence,sentinel,auto",
                    help=f"comma list of {', '.join(PROTOCOLS)}, each swept in turn (default fence,sentinel,auto)")
    ap.add_argument("--sentinel-max", type=nonnegative_int, default=4096,
                    help="sweep SENTINEL only up to this many tokens (default 4096)")
    ap.add_argument("--rounds", type=positive_int, default=20,
                    help="R: every figure replays graphs of R and 2R rounds and reports (t(2R) - t(R)) / R, "
                         "so the graph launch and the host barrier's skew drop out (default 20)")
    ap.add_argument("--replays", type=positive_int, default=30,
                    help="graph replays per figure; the median is reported (default 30)")
    ap.add_argument("--combine-quant", choices=["fp8", "fp8-epilogue"], default=None,
                    help="FP8 (e4m3, per-128 scales) combine, FENCE only. fp8: combine quantizes the bf16 "
                         "partial results itself; fp8-epilogue: the MoE epilogue wrote them as FP8 "
                         "(combine_input(T^, fp8=True), as moe.finalize can), so combine only pulls and reduces")
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    ap.add_argument("--stamps", action="store_true",
                    help="also time a graph with a one-warp timestamp kernel between the phases on every rank's "
                         "stream (SENTINEL's dispatch / combine split, and FENCE's as a check)")
    ap.add_argument("--threads", type=int_in(96, 512), default=256,
                    help="threads per block of the protocol kernels, a multiple of 32 in 96..512 (default 256)")
    ap.add_argument("--halves-ratios", type=lambda v: [float(x) for x in v.split(",")],
                    default=[0.0, 0.25, 0.5, 1.0, 1.5, 2.0],
                    help="--mode halves: compute between the halves, as multiples of the fused round trip")
    ap.add_argument("--busy-blocks", type=positive_int, default=None,
                    help="--mode halves: blocks of 256 threads of each rank's compute kernel (default 2 x SMs / ranks)")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    ap.add_argument("--plot", default=None, help="also draw the round trips against the floors into this PNG "
                                                  "(needs matplotlib; default: no plot)")
    ap.add_argument("--profile-host", action="store_true", help="print where the eager host time goes (cProfile)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (argparse exits with status 2 and a message on an error)."""
    from ..config import PROTOCOLS
    ap = parser()
    args = ap.parse_args(argv)
    if args.profile == "custom" and not (args.hidden and args.top_k and args.experts):
        ap.error("--profile custom needs --hidden, --top-k and --experts")
    bad = [p for p in args.protocol.split(",") if p not in PROTOCOLS]
    if bad:
        ap.error(f"--protocol: {bad} not among {', '.join(PROTOCOLS)}")
    if args.combine_quant and set(args.protocol.split(",")) != {"fence"}:
        ap.error(f"--combine-quant {args.combine_quant} needs --protocol fence")
    if args.threads % 32:
        ap.error(f"--threads must be a multiple of 32 in 96..512, got {args.threads}")
    p = bench.PROFILES.get(args.profile, {})
    top_k, experts = args.top_k or p.get("top_k"), args.experts or p.get("num_experts")
    check_top_k(ap, top_k, experts)
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
    check_out(ap, args.out)
    return args


def main(argv=None) -> int:
    import secrets
    args = parse_args(argv)
    missing = exits.require_gpu("ep_a2a.bench")
    if missing is not None:
        return missing
    if args.mode == "procs":
        from .bench_procs import run
        return run(args)
    import ep_a2a
    with ep_a2a.LocalGroup([args.device] * args.ranks) as group:
        b = bench.Bench(args, group, secrets.randbits(63))
        try:
            if args.mode == "halves":
                halves_report(bench_halves.sweep(b), args)
            else:
                report(bench.sweep(b), args)
        finally:
            b.close()
    return exits.OK


def halves_report(doc: dict, args) -> None:
    """Write the halves sweep's JSON (bench/results/alltoall-halves-... or --out), print its table."""
    name = result_paths.result_name("alltoall-halves", result_paths.device_slug(doc["device"]), f"{doc['ep_size']}ranks",
                                    args.profile, args.protocol.replace(",", "-"), args.combine_quant)
    out = result_paths.write_json(result_paths.output_path(args.out, name), doc)
    print(bench_halves.summary(doc))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
