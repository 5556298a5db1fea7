"""`python -m ep_a2a.bench_layer --graph --overlap`: the two-micro-batch MoE layer step
(ep_a2a/layers/torch_overlap.py) of every in-process rank captured in CUDA graphs, the
overlapped order against the sequential one, per protocol and batch size.

Per size T (tokens per rank in each micro-batch) and routing, four graphed steps of the same
two micro-batches (2 T tokens per rank in all):
  overlapped: the halves in the two-batch-overlap order (TBO): B's dispatch in flight while
    A's experts run, A's combine in flight while B's dispatch is received;
  sequential: the same halves, A's whole step then B's: the same kernels, nothing overlapped;
  fused: the whole dispatch and combine (no halves), both micro-batches one after the other
    through micro-batch A's all-to-all (the layer as it runs without overlap);
  gemm_floor: the grouped GEMMs alone of both micro-batches on the rows their step gathered
    (bench_layer_baseline.GemmFloor), the compute the layer cannot go below.
saved_us = sequential - overlapped is what the order hides; vs_fused_us = fused - overlapped
is the overlap's gain over the layer without halves (it also pays the halves' extra kernel
boundary per phase). On one GPU, 8 ranks' kernels share the SMs, so the compute that could
hide a rank's waiting is mostly its peers' and the gain is small; NVLink between GPUs is
where the order pays.

Step time: graphs of R and 2R steps, replayed in turn (events outside the graphs),
(t(2R) - t(R)) / R from the medians (bench_method.per_round, as bench_layer_graphs): the
graph launch and the fork / join cancel. spread_us: the interquartile range of that
difference replay pair by replay pair. Correctness in the same run: the eager overlapped
step equals the eager sequential one bit for bit, and one replay of the overlapped graph on
fresh inputs equals an eager sequential step on them; the fused step's equality is reported.
"""
from __future__ import annotations

import argparse
import sys

from . import bench_layer
from .argtypes import check_top_k
from .bench_layer_profiles import PROFILES, torch_layer_run
from .result_paths import check_out

MODES = ("overlapped", "sequential", "fused", "gemm_floor")
DEFAULT_TOKENS = [1, 4, 16, 64, 128]


def parser() -> argparse.ArgumentParser:
    """bench_layer's options and --overlap."""
    ap = bench_layer.parser()
    ap.add_argument("--overlap", action="store_true",
                    help="the two-micro-batch step under CUDA graphs, overlapped (halves, TBO order) against "
                         "sequential and fused, per protocol (default fence and sentinel; tokens per micro-batch "
                         "default 1,4,16,64,128; tools/bench_layer_overlap.py)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if not args.overlap:
        ap.error("bench_layer_overlap runs with --overlap")
    if args.framework != "torch" or args.combine_quant or args.gemm == "loop":
        ap.error("--overlap runs the PyTorch layer with the bf16 combine and the grouped GEMM "
                 "(no --framework jax, --combine-quant or --gemm loop)")
    args.graph = True
    if args.tokens is None:
        args.tokens = list(DEFAULT_TOKENS)
    args.protocols = [args.protocol] if args.protocol else ["fence", "sentinel"]
    p = dict(PROFILES[args.profile], **{k: getattr(args, k) for k in ("experts", "top_k") if getattr(args, k)})
    check_top_k(ap, p["top_k"], p["experts"])
    check_out(ap, args.out)
    return args


def result_file(res: dict, args) -> str:
    """bench_layer's graphed name with '-overlap': moe-layer-<gpu>-<N>ranks-<profile>-torch-graph-overlap."""
    return bench_layer.result_file(res, args) + "-overlap"


def run(args) -> dict:
    import torch
    import ep_a2a
    from ..layers.torch import payload_specs
    from ..layers.torch_overlap import TwoBatchMoe
    from .bench_layer_baseline import GemmFloor
    from .bench_report import torch_device_fields
    (H, I, E, top_k, ep), dev, seed, rng, say, w1, w2 = torch_layer_run(args, PROFILES, "two micro-batches; ")
    rows = []
    for protocol in args.protocols:
        opts = dict(max_tokens_per_rank=max(args.tokens), top_k=top_k, num_experts=E, payloads=payload_specs(H, top_k),
                    combine_hidden_size=H, protocol=protocol, validate_expert_ids=False, on_timeout="abort")
        with ep_a2a.LocalGroup([args.device] * ep) as group, ep_a2a.MoeAlltoAll(group, **opts) as a2a_a, \
                ep_a2a.MoeAlltoAll(group, **opts) as a2a_b, TwoBatchMoe(a2a_a, a2a_b, w1, w2, gemm="grouped") as tb:
            try:
                floors = (GemmFloor(tb.layers_a), GemmFloor(tb.layers_b))
                for T in args.tokens:
                    for routing in args.routing:
                        row = dict(protocol=protocol, tokens_per_rank=T, routing=routing,
                                   **_one_size(torch, args, T, routing, tb, floors, rng, (H, E, top_k, ep)))
                        _derive(row)
                        rows.append(row)
                        _summary_line(say, row)
                gemm = f"{tb.layers_a[0].gemm} ({tb.layers_a[0].gemm_reason})"
            finally:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    return dict(**torch_device_fields(torch, dev),
                config=dict(profile=args.profile, hidden=H, intermediate=I, experts=E, top_k=top_k, ranks=ep,
                            device=args.device, tokens_per_micro_batch=args.tokens, micro_batches=2,
                            routing=args.routing, rounds=args.rounds, replays=args.replays, protocols=args.protocols,
                            seed=seed, gemm=gemm, dtype="bf16 weights and activations, fp32 accumulation"),
                method=__doc__, rows=rows)


def _one_size(torch, args, T, routing, tb, floors, rng, shape) -> dict:
    """One size and routing: the eager checks, then the four graphs' step times."""
    from ..layers.torch import moe_forward_all_ranks
    from .bench_layer_graphs import capture, logits_for, routing_ids, time_pair
    H, E, top_k, ep = shape
    dev = tb.layers_a[0].device
    R = args.rounds
    ins = {m: ([torch.empty(T, H, dtype=torch.bfloat16, device=dev) for _ in range(ep)],
               [torch.empty(T, E, dtype=torch.float32, device=dev) for _ in range(ep)]) for m in "AB"}
    ids = {m: routing_ids(rng, routing, ep, T, top_k, E) for m in "AB"}

    def refill():  # fresh hidden states, logits that route as `ids`
        for m, (xs, lgs) in ins.items():
            for x, lg, i in zip(xs, lgs, ids[m]):
                x.copy_(torch.randn(T, H, device=dev).to(torch.bfloat16))
                lg.copy_(torch.from_numpy(logits_for(rng, i, E)))
        torch.cuda.synchronize()

    def halves(order):
        return lambda: tb.step(*ins["A"], *ins["B"], T, order=order)

    def fused():
        moe_forward_all_ranks(tb.layers_a, *ins["A"], T)
        return moe_forward_all_ranks(tb.layers_a, *ins["B"], T)

    def copies(outs):
        return [o.clone() for part in outs for o in part]

    def same(a, b):
        return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))

    steps = {"overlapped": halves("overlapped"), "sequential": halves("sequential"), "fused": fused,
             "gemm_floor": lambda: [f.step(T) for f in floors]}
    refill()
    over = copies(steps["overlapped"]())
    fa = [o.clone() for o in moe_forward_all_ranks(tb.layers_a, *ins["A"], T)]
    fb = [o.clone() for o in moe_forward_all_ranks(tb.layers_a, *ins["B"], T)]
    seq = copies(steps["sequential"]())  # (last: the floors take these offsets)
    torch.cuda.synchronize()
    for f in floors:
        f.set_offsets()
    out = dict(eager_overlapped_equals_sequential=same(over, seq), fused_equals_sequential=same(fa + fb, seq))

    graphs = {}
    try:
        pool = torch.cuda.graph_pool_handle()
        for name, step in steps.items():
            graphs[name] = [capture(torch, step, n, pool) for n in (R, 2 * R)]
        refill()
        want = copies(steps["sequential"]())
        for layer in tb.layers:
            layer.half_output.view(torch.int16).fill_(-1)  # poison: a replay that writes nothing shows
        graphs["overlapped"][0].replay()
        torch.cuda.synchronize()
        got = [layer.half_output[:T] for layer in tb.layers]
        out["graph_overlapped_equals_eager_sequential"] = same(got, want)
        for name, (gs, gl) in graphs.items():
            out[name] = time_pair(torch, gs, gl, R, args.replays)
    finally:
        graphs.clear()
        torch.cuda.synchronize()
    return out


def _derive(row: dict) -> None:
    o, s, f = (row[m]["step_us"] for m in ("overlapped", "sequential", "fused"))
    row["saved_us"] = s - o
    row["vs_fused_us"] = f - o
    row["overlapped_over_gemm_floor"] = o / row["gemm_floor"]["step_us"] if row["gemm_floor"]["step_us"] > 0 else None


def _summary_line(say, row) -> None:
    say(f"{row['protocol']:8s} T={row['tokens_per_rank']:4d} {row['routing']:8s} "
        + "  ".join(f"{m} {row[m]['step_us']:.1f} ±{row[m]['spread_us']:.1f}" for m in MODES)
        + f"  saved {row['saved_us']:.1f}  vs fused {row['vs_fused_us']:.1f} µs  "
        f"eager== {row['eager_overlapped_equals_sequential']}  graph== {row['graph_overlapped_equals_eager_sequential']}"
        f"  fused== {row['fused_equals_sequential']}")


def table(rows) -> str:
    """The summary printed last: µs per two-micro-batch step of each mode, what the overlapped
    order saves against sequential and fused, and the bitwise checks (eager, graph)."""
    lines = [f"{'protocol':8} {'T':>4} {'routing':8} {'overlap':>8} {'sequent':>8} {'fused':>8} {'GEMM fl':>8} "
             f"{'saved':>7} {'vs fused':>8} {'==':>5}"]
    for r in rows:
        ok = r["eager_overlapped_equals_sequential"] and r["graph_overlapped_equals_eager_sequential"]
        lines.append(f"{r['protocol']:8} {r['tokens_per_rank']:>4} {r['routing']:8} {r['overlapped']['step_us']:>8.1f} "
                     f"{r['sequential']['step_us']:>8.1f} {r['fused']['step_us']:>8.1f} "
                     f"{r['gemm_floor']['step_us']:>8.1f} {r['saved_us']:>7.1f} {r['vs_fused_us']:>8.1f} "
                     f"{str(ok):>5}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """The command (ep_a2a/bench_layer.py calls it for --overlap): exits as bench_layer does."""
    from . import exits
    from .result_paths import output_path, write_json
    args = parse_args(argv)
    prog = "ep_a2a.bench_layer"
    missing = exits.require_framework_and_gpu(prog, "torch", "the layer benchmark drives it")
    if missing is not None:
        return missing
    import torch
    if not torch.cuda.is_available():
        return exits.missing(prog, f"this PyTorch ({torch.__version__}) has no CUDA device to run on")
    res = run(args)
    path = write_json(output_path(args.out, result_file(res, args)), res)
    print(f"wrote {path}", file=sys.stderr)
    print(table(res["rows"]), flush=True)
    bad = [(r["protocol"], r["tokens_per_rank"], r["routing"]) for r in res["rows"]
           if not (r["eager_overlapped_equals_sequential"] and r["graph_overlapped_equals_eager_sequential"])]
    if bad:
        print(f"ERROR: overlapped != sequential bit for bit at {bad}", file=sys.stderr)
        return exits.FAILED
    return exits.OK
