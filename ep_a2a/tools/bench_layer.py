"""python -m ep_a2a.bench_layer: the PyTorch MoE layer (ep_a2a/layers/torch.py) on in-process ranks
of one GPU, as the paper's Table 4 (layer time and its dispatch / compute / combine stages),
against the layer a PyTorch user would write without ep_a2a on the same ranks and streams.

With --graph (tools/bench_layer_graphs.py, its docstring says how): the whole step of every
rank captured in CUDA graphs, per-step times from graph replays, stages from profiler kernel
records, against an all-gather baseline and the GEMM-only floor also under graphs. What
follows describes the eager run (no --graph).

Baseline ("all-gather"): every rank routes its tokens, copies every rank's tokens, ids and
weights into one batch (torch.cat: the all-gather), runs its local experts over the tokens that
selected them (nonzero + index_select, FC1, SiLU(gate) * up, FC2, weighted index_add_ in fp32),
then sums the rows of its own tokens over every rank's output (the reduce-scatter) into bf16.
Ranks wait for each other where the collectives would (events between the rank streams).

Method: eager PyTorch, no CUDA graphs: every step launches every rank's work from Python (ours
through moe_forward_all_ranks' phases). CUDA events on a timer stream that forks to every rank
stream and joins them back. Per token count, --iters steps after --warmup, median of each:
  layer: events only at the start and the end of the step;
  stages: the same step with a join of every rank stream (and a fork after it) at each stage
    boundary, an event at each join: dispatch (router + dispatch; baseline: router +
    all-gather), compute, combine (baseline: reduce-scatter). Joins stop a stage from
    overlapping the next, so the stages add up to a little more than the layer.
  host: wall time to issue one step (eager launches from Python bound small batches).
Routing: random logits through the router (uniform over experts). The GPU is named; the
result goes to bench/results/ as JSON (device, date, commit, config) or to --out.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ..layers.base import phase_gate, run_phases
from . import exits
from .argtypes import check_top_k, choice_list, int_in, int_list, nonnegative_int, positive_int
from .bench_layer_profiles import PROFILES, add_torch_layers, expert_weights, layer_shape, run_seed
from .bench_report import commit, torch_device_fields
from .result_paths import OUT_HELP, check_out, device_slug, output_path, result_name, write_json

ROUTINGS = ("perfect", "zipf0", "zipf1", "zipf1.25")  # (bench_layer_graphs.ROUTINGS: what each means)


def _fork(torch, ts, streams):
    ev = torch.cuda.Event()
    ev.record(ts)
    for s in streams:
        s.wait_event(ev)


def _join(torch, ts, streams):
    for s in streams:
        ev = torch.cuda.Event()
        ev.record(s)
        ts.wait_event(ev)


class Baseline:
    """The all-gather / local experts / reduce-scatter layer, one instance for all ranks."""

    def __init__(self, layers):
        self.layers = layers

    def route(self, layer, logits):
        import torch
        top, ids = torch.topk(logits, layer.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def step(self, xs, logits, between=None):
        """One step; `between(stage)` is called after the dispatch-like and compute stages."""
        import torch
        import torch.nn.functional as F
        layers = self.layers
        routes = []
        for layer, lg in zip(layers, logits):
            with torch.cuda.stream(layer.stream):
                routes.append(self.route(layer, lg))
        phase_gate(layers)  # the all-gather needs every rank's tokens and routing
        gathered = []
        for layer in layers:
            with torch.cuda.stream(layer.stream):
                gathered.append((torch.cat(xs), torch.cat([r[0] for r in routes]), torch.cat([r[1] for r in routes])))
        if between:
            between("dispatch")
        outs = []
        for layer, (x_all, ids_all, w_all) in zip(layers, gathered):
            with torch.cuda.stream(layer.stream):
                out = torch.zeros(x_all.shape[0], x_all.shape[1], dtype=torch.float32, device=x_all.device)
                I = layer.inter
                for e in range(layer.num_local):
                    tok, k = (ids_all == layer.first_expert + e).nonzero(as_tuple=True)  # host sync
                    if tok.numel() == 0:
                        continue
                    h = x_all.index_select(0, tok) @ layer.w_gate_up[e].t()
                    y = (F.silu(h[:, :I]) * h[:, I:]) @ layer.w_down[e].t()
                    out.index_add_(0, tok, y.float() * w_all[tok, k].unsqueeze(1))
                outs.append(out)
        if between:
            between("compute")
        phase_gate(layers)  # the reduce-scatter needs every rank's partial sums
        results, start = [], 0
        for layer, x in zip(layers, xs):
            T = x.shape[0]
            with torch.cuda.stream(layer.stream):
                acc = outs[0][start:start + T].clone()
                for o in outs[1:]:
                    acc += o[start:start + T]
                results.append(acc.to(torch.bfloat16))
            start += T
        return results


def _measure(torch, run, streams, iters: int, warmup: int) -> dict:
    """Median µs of the whole step, of each stage (with joins), and host µs to issue a step."""
    ts = torch.cuda.Stream()
    for _ in range(warmup):
        _fork(torch, ts, streams)
        run(None)
        _join(torch, ts, streams)
    torch.cuda.synchronize()
    layer, host, stages = [], [], {"dispatch": [], "compute": [], "combine": []}
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(ts)
        _fork(torch, ts, streams)
        t0 = time.perf_counter()
        run(None)
        host.append((time.perf_counter() - t0) * 1e6)
        _join(torch, ts, streams)
        e1.record(ts)
        e1.synchronize()
        layer.append(e0.elapsed_time(e1) * 1e3)
    for _ in range(iters):
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        marks = iter(evs[1:3])

        def between(stage):
            if stage == "prepare":  # (its device work is the router's: inside the dispatch stage here)
                return
            _join(torch, ts, streams)
            next(marks).record(ts)
            _fork(torch, ts, streams)

        evs[0].record(ts)
        _fork(torch, ts, streams)
        run(between)
        _join(torch, ts, streams)
        evs[3].record(ts)
        evs[3].synchronize()
        for name, (a, b) in zip(stages, zip(evs, evs[1:])):
            stages[name].append(a.elapsed_time(b) * 1e3)
    return dict(layer_us=float(np.median(layer)), host_issue_us=float(np.median(host)),
                **{f"{k}_us": float(np.median(v)) for k, v in stages.items()},
                staged_layer_us=float(np.median([sum(x) for x in zip(*stages.values())])))


def run(args) -> dict:
    import torch
    import ep_a2a
    from ..layers.torch import moe_forward_all_ranks, payload_specs
    from ..testing.layer_oracle import max_relative_error
    H, I, E, top_k, ep = layer_shape(args, PROFILES)
    dev = torch.device("cuda", args.device)
    seed = run_seed(args)
    torch.manual_seed(seed)
    print(f"seed {seed}; {torch.cuda.get_device_name(dev)}; {ep} ranks; hidden {H}, intermediate {I}, "
          f"{E} experts, top_k {top_k}", file=sys.stderr)
    w1, w2 = expert_weights(E, H, I, dev)
    rows = []
    protocol = "fence" if args.combine_quant else args.protocol  # (FP8 combine is FENCE only)
    with ep_a2a.LocalGroup([args.device] * ep) as group:
        a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max(args.tokens), top_k=top_k, num_experts=E,
                                 payloads=payload_specs(H, top_k), combine_hidden_size=H,
                                 protocol=protocol, combine_quant=args.combine_quant, validate_expert_ids=False,
                                 on_timeout="abort")  # a stuck wait reports who was missing, the run ends cleanly
        layers = []
        try:
            add_torch_layers(layers, a2a, w1, w2, gemm=args.gemm, compute_graphs=args.compute_graphs)
            streams = [layer.stream for layer in layers]
            base = Baseline(layers)
            for T in args.tokens:
                xs = [torch.randn(T, H, device=dev).to(torch.bfloat16) for _ in range(ep)]
                logits = [torch.randn(T, E, device=dev) for _ in range(ep)]
                torch.cuda.synchronize()
                ours = [o.clone() for o in moe_forward_all_ranks(layers, xs, logits)]  # (clones wait for the combines)
                theirs = base.step(xs, logits)
                torch.cuda.synchronize()
                diff = max(max_relative_error(a.float().cpu().numpy(), b.float().cpu().numpy()) for a, b in zip(ours, theirs))
                if diff > 0.05:
                    print(f"WARNING: T={T}: ours and the baseline differ by {diff:.3g} (relative to the largest output)",
                          file=sys.stderr)
                row = dict(tokens_per_rank=T, max_rel_diff_vs_baseline=diff,
                           ours=_measure(torch, lambda b: run_phases(layers, xs, logits, T, between=b), streams,
                                         args.iters, args.warmup),
                           baseline=_measure(torch, lambda b: base.step(xs, logits, b), streams, args.iters, args.warmup))
                row["speedup"] = row["baseline"]["layer_us"] / row["ours"]["layer_us"]
                rows.append(row)
                o, b = row["ours"], row["baseline"]
                print(f"T={T:5d}  ours {o['layer_us']:9.1f} µs ({o['dispatch_us']:.1f} / {o['compute_us']:.1f} / "
                      f"{o['combine_us']:.1f}; host {o['host_issue_us']:.0f})   baseline {b['layer_us']:9.1f} µs "
                      f"({b['dispatch_us']:.1f} / {b['compute_us']:.1f} / {b['combine_us']:.1f}; host "
                      f"{b['host_issue_us']:.0f})   x{row['speedup']:.2f}", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
            gemm = f"{layers[0].gemm} ({layers[0].gemm_reason})"
        finally:
            for layer in layers:
                layer.close()
            a2a.close()
    return dict(**torch_device_fields(torch, dev),
                config=dict(profile=args.profile, hidden=H, intermediate=I, experts=E, top_k=top_k, ranks=ep,
                            device=args.device, tokens=args.tokens, iters=args.iters,
                            protocol=protocol, combine_quant=args.combine_quant, compute_graphs=args.compute_graphs,
                            warmup=args.warmup, seed=seed, gemm=gemm, routing="random logits, softmax top-k renormalized",
                            dtype="bf16 weights and activations, fp32 accumulation"),
                method=__doc__, rows=rows)


EPILOG = f"""examples:
  python -m ep_a2a.bench_layer --tokens 1,16,128
      the small profile, 8 in-process ranks on GPU 0, PyTorch, eager
  python -m ep_a2a.bench_layer --graph --tokens 1,16,128 --routing perfect,zipf1.25
      the layer captured in CUDA graphs, with stages, against the graphed all-gather baseline
  python -m ep_a2a.bench_layer --framework jax --profile deepseek-v3-like --ranks 4

The JSON goes to bench/results/moe-layer-<gpu>-<N>ranks-<profile>-<framework>[-fp8].json in
the checkout, or to --out.
{exits.EPILOG}"""


def parser() -> argparse.ArgumentParser:
    """The command line's options, each with its help."""
    from ..layout import MAX_RANKS, MAX_TOP_K
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.bench_layer", description=__doc__.split("\n\n")[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int_in(1, MAX_RANKS), default=8, help="in-process ranks on --device (default 8)")
    ap.add_argument("--device", type=nonnegative_int, default=0, help="the GPU ordinal (default 0)")
    ap.add_argument("--tokens", type=int_list(1), default=None,
                    help="tokens per rank, comma-separated (default 1,16,128,1024; --graph: 1,4,16,64,128,1024)")
    ap.add_argument("--graph", action="store_true",
                    help="capture every rank's whole step in CUDA graphs: step times from replays, stages from "
                         "profiler kernel records, against the graphed all-gather baseline and the GEMM floor")
    ap.add_argument("--routing", type=choice_list(tuple(ROUTINGS)), default=["perfect"],
                    help=f"--graph: routings, comma-separated among {', '.join(ROUTINGS)} (zipf<alpha>: "
                         "the paper's Table 5; default perfect)")
    ap.add_argument("--rounds", type=positive_int, default=2,
                    help="--graph: steps R of the shorter graph (the other has 2R; default 2)")
    ap.add_argument("--replays", type=positive_int, default=20, help="--graph: timed replays per graph (default 20)")
    ap.add_argument("--stage-replays", dest="stage_replays", type=nonnegative_int, default=10,
                    help="--graph, --framework jax: profiled back-to-back replays (jax: jitted steps) for the "
                         "stages (0: no stages; default 10)")
    ap.add_argument("--host-iters", dest="host_iters", type=positive_int, default=10,
                    help="--graph: eager steps timed for the host cost (default 10)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="small",
                    help="layer shapes: " + "; ".join(f"{k}: hidden {v['hidden']}, intermediate {v['intermediate']}, "
                                                      f"{v['experts']} experts, top_k {v['top_k']}"
                                                      for k, v in PROFILES.items()) + " (default small)")
    ap.add_argument("--hidden", type=positive_int, help="hidden size (overrides the profile's)")
    ap.add_argument("--intermediate", type=positive_int, help="experts' intermediate size (overrides the profile's)")
    ap.add_argument("--experts", type=positive_int, help="number of experts (overrides the profile's)")
    ap.add_argument("--top-k", dest="top_k", type=int_in(1, MAX_TOP_K), help="experts per token (overrides the profile's)")
    ap.add_argument("--protocol", choices=("fence", "sentinel", "auto"), default=None,
                    help="the all-to-all's protocol (default auto: SENTINEL for small batches, FENCE above; "
                         "fence with --combine-quant)")
    ap.add_argument("--gemm", choices=("auto",) + tuple(dict.fromkeys(GEMMS["torch"] + GEMMS["jax"])), default="auto",
                    help="the experts' GEMMs: PyTorch one grouped GEMM or a loop over experts; JAX (ours and the "
                         "baseline alike) a batched GEMM over rows padded per expert or jax.lax.ragged_dot; fused: "
                         "ep_a2a's expert kernels (the JAX baseline then runs auto's); auto (default): "
                         "ep_a2a's expert kernels at decode sizes, else grouped (torch) / layers.jax.expert_gemm")
    ap.add_argument("--compute-graphs", dest="compute_graphs", action="store_true",
                    help="torch: each layer replays its compute phase from a CUDA graph per T^ in eager steps "
                         "(TorchMoeLayer(compute_graphs=True)); --graph captures whole steps either way")
    ap.add_argument("--combine-quant", choices=("fp8",), default=None,
                    help="FP8 combine (FENCE): finalize writes e4m3 partials, combine pulls those")
    ap.add_argument("--iters", type=positive_int, default=20, help="timed steps per token count (default 20)")
    ap.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--seed", type=nonnegative_int, help="seed of the weights and inputs (default: drawn and printed)")
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--framework", choices=("torch", "jax"), default="torch",
                    help="torch (default): the PyTorch layer, eager, against an all-gather layer; jax: the JAX layer "
                         "jitted against the eager one and a jitted all-gather (tools/bench_layer_jax.py)")
    return ap


GEMMS = {"torch": ("grouped", "loop", "fused"), "jax": ("padded", "ragged", "fused")}  # the experts' GEMMs of each framework


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    p = dict(PROFILES[args.profile], **{k: getattr(args, k) for k in ("experts", "top_k") if getattr(args, k)})
    if args.combine_quant and args.protocol not in (None, "fence"):
        ap.error(f"--combine-quant {args.combine_quant} needs --protocol fence, got {args.protocol}")
    if args.gemm not in ("auto",) + GEMMS[args.framework]:
        ap.error(f"--gemm {args.gemm}: --framework {args.framework} takes auto or one of {GEMMS[args.framework]}")
    if args.graph and (args.framework != "torch" or args.combine_quant or args.gemm == "loop"):
        ap.error("--graph runs the PyTorch layer with the bf16 combine and capturable expert GEMMs "
                 "(no --framework jax, --combine-quant or --gemm loop)")
    if args.compute_graphs and (args.framework != "torch" or args.gemm == "loop"):
        ap.error("--compute-graphs: the PyTorch layer's, with capturable expert GEMMs (no --framework jax or --gemm loop)")
    if args.tokens is None:
        args.tokens = [1, 4, 16, 64, 128, 1024] if args.graph else [1, 16, 128, 1024]
    if args.protocol is None:  # (FENCE: the faster protocol on one GPU at every size)
        args.protocol = "fence" if args.combine_quant or args.graph else "auto"
    check_top_k(ap, p["top_k"], p["experts"])
    check_out(ap, args.out)
    return args


def result_file(res: dict, args) -> str:
    """The default file stem: benchmark, GPU, ranks, profile (and what overrides it), framework, FP8."""
    overrides = [f"{k.replace('_', '')}{getattr(args, k)}" for k in ("hidden", "intermediate", "experts", "top_k")
                 if getattr(args, k) is not None]
    return result_name("moe-layer", device_slug(res["device"]), f"{args.ranks}ranks", args.profile, *overrides,
                       args.framework, args.combine_quant, "graph" if args.graph else None,
                       "compute-graphs" if args.compute_graphs else None)


def main(argv=None) -> int:
    args = parse_args(argv)
    prog = "ep_a2a.bench_layer"
    missing = exits.require_framework_and_gpu(prog, args.framework, "the layer benchmark drives it")
    if missing is not None:
        return missing
    if args.framework == "jax":
        from .bench_layer_jax import run as run_jax
        res = run_jax(args, PROFILES, commit)
    else:
        import torch
        if not torch.cuda.is_available():
            return exits.missing(prog, f"this PyTorch ({torch.__version__}) has no CUDA device to run on")
        if args.graph:
            from .bench_layer_graphs import run as run_graph
            res = run_graph(args, PROFILES)
        else:
            res = run(args)
    path = write_json(output_path(args.out, result_file(res, args)), res)
    print(f"wrote {path}", file=sys.stderr)
    if args.graph:
        from .bench_layer_report import table
        print(table(res["rows"]), flush=True)
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
