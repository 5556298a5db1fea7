"""python -m ep_a2a.tools.bench_layer_host: where the eager PyTorch MoE layer's host time goes.

Builds the layer of every in-process rank on one GPU (small profile, 8 ranks by default) and,
per token count: the host µs to issue one eager step of all ranks (moe_forward_all_ranks,
median of --iters, the GPU drained before each), per rank; then the host µs per call of one
rank's pieces, each called --calls times in a row on its own outputs (the launches repeat
the same work): the route, build_index, gather_rows, activation and finalize ops, torch's
grouped GEMM (FC1, FC2), ep_a2a's expert kernels (expert_fc1, expert_fc2 alone and with its
finalize: what --gemm auto runs at decode sizes instead of gather, FC1, activation, FC2 and
finalize), one kernel launch alone
(Launch.__call__: the cuLaunchKernelEx of cuda.bindings), a stream switch through the layer's
OnStream and through torch.cuda.stream.
Dispatch and combine are left out: alone they would wait for peers. --cprofile DIR also
writes a cProfile of --iters eager steps per token count (top functions by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

from . import exits
from .argtypes import int_in, int_list, nonnegative_int, positive_int
from .bench_layer_graphs import eager_host_us
from .bench_layer_profiles import PROFILES, add_torch_layers, expert_weights
from .bench_report import torch_device_fields
from .result_paths import OUT_HELP, check_out, device_slug, output_path, result_name, write_json

MAX_RANKS = 8


def _pieces(torch, layer, logits, T: int, calls: int, reps: int) -> dict:
    """Host µs per call of rank `layer`'s pieces, after a whole step has left its buffers set."""
    ops = layer._ops
    ids_v, (x_v, w_v) = layer.tr.dispatch_views(T)
    cap = layer.index.capacity
    xg, act = layer._xg[:cap], layer._act[:cap]
    ci = ops.combine_input(layer.tr, T)
    with layer._on, torch.no_grad():
        ops.build_index(layer.tix, ids_v, w_v)
        ops.gather_rows(layer.tix, x_v, layer._xg)
        launch = layer.index.last_issued[0]  # the gather's
        h = layer.fc1(xg, layer._offs)
        y = layer.fc2(act, layer._offs)
        s = layer.s

        def torch_stream():
            with torch.cuda.stream(layer.stream):
                pass

        def on_stream():
            with layer._on:
                pass
        pieces = {"route": lambda: layer.route(logits), "build_index": lambda: ops.build_index(layer.tix, ids_v, w_v),
                  "gather_rows": lambda: ops.gather_rows(layer.tix, x_v, layer._xg),
                  "fc1": lambda: layer.fc1(xg, layer._offs), "activation": lambda: ops.activation(layer.tix, h, act),
                  "fc2": lambda: layer.fc2(act, layer._offs), "finalize": lambda: ops.finalize(layer.tix, y, ci),
                  "expert_fc1": lambda: ops.expert_fc1(layer.tix, x_v, layer.w_gate_up, layer._act),
                  "expert_fc2": lambda: ops.expert_fc2(layer.tix, layer._act, layer.w_down, layer._xg),
                  "expert_fc2 + finalize": lambda: ops.expert_fc2(layer.tix, layer._act, layer.w_down, layer._xg,
                                                                  finalize_into=ci),
                  "launch alone": lambda: launch(s), "OnStream": on_stream, "torch.cuda.stream": torch_stream}
        return {k: eager_host_us(torch, lambda f=f: [f() for _ in range(calls)], reps) / calls for k, f in pieces.items()}


def run(args) -> dict:
    import torch
    import ep_a2a
    from ..layers.torch import moe_forward_all_ranks, payload_specs
    p = PROFILES[args.profile]
    H, I, E, K, ep = p["hidden"], p["intermediate"], p["experts"], p["top_k"], args.ranks
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    w1, w2 = expert_weights(E, H, I, dev)
    rows = []
    with ep_a2a.LocalGroup([args.device] * ep) as group:
        a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max(args.tokens), top_k=K, num_experts=E,
                                 payloads=payload_specs(H, K), combine_hidden_size=H, protocol="fence",
                                 validate_expert_ids=False, on_timeout="abort")
        layers = []
        try:
            add_torch_layers(layers, a2a, w1, w2, gemm=args.gemm, compute_graphs=args.compute_graphs)
            for T in args.tokens:
                xs = [torch.randn(T, H, device=dev).to(torch.bfloat16) for _ in layers]
                logits = [torch.randn(T, E, device=dev) for _ in layers]

                def step():
                    moe_forward_all_ranks(layers, xs, logits, T)
                for _ in range(5):
                    step()
                host = eager_host_us(torch, step, args.iters)
                pieces = _pieces(torch, layers[0], logits[0], T, args.calls, 30)
                rows.append(dict(tokens_per_rank=T, step_host_us=host, step_host_us_per_rank=host / ep,
                                 pieces_us_per_call=pieces))
                print(f"T={T:5d}  step {host:7.0f} µs = {host / ep:6.1f} µs/rank;  " +
                      "  ".join(f"{k} {v:.1f}" for k, v in pieces.items()), flush=True)
                if args.cprofile:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(args.iters):
                        step()
                    prof.disable()
                    torch.cuda.synchronize()
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
                    os.makedirs(args.cprofile, exist_ok=True)
                    with open(f"{args.cprofile}/layer-host-T{T}.txt", "w") as f:
                        f.write(text.getvalue())
        finally:
            torch.cuda.synchronize()
            for layer in layers:
                layer.close()
            a2a.close()
    return dict(**torch_device_fields(torch, dev),
                config=dict(profile=args.profile, hidden=H, intermediate=I, experts=E, top_k=K, ranks=ep,
                            tokens=args.tokens, iters=args.iters, calls=args.calls, gemm=args.gemm,
                            compute_graphs=args.compute_graphs,
                            fused_max_rows=layers[0].fused_max_rows if layers else None),
                method=__doc__, rows=rows)


EPILOG = f"""example:
  python -m ep_a2a.tools.bench_layer_host --tokens 1,16,128 --cprofile /tmp
      the small profile, 8 in-process ranks on GPU 0, with a cProfile per token count

The JSON goes to bench/results/layer-host-<gpu>-<N>ranks-<profile>.json in the checkout, or to --out.
{exits.EPILOG}"""


def parser() -> argparse.ArgumentParser:
    """The command line's options, each with its help."""
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.tools.bench_layer_host", description=__doc__.split("\n\n")[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="small", help="layer shapes (default small)")
    ap.add_argument("--ranks", type=int_in(1, MAX_RANKS), default=8, help="in-process ranks (default 8)")
    ap.add_argument("--device", type=nonnegative_int, default=0, help="the GPU ordinal (default 0)")
    ap.add_argument("--tokens", type=int_list(1), default=[1, 16, 128], help="tokens per rank (default 1,16,128)")
    ap.add_argument("--gemm", choices=("auto", "grouped", "fused"), default="auto",
                    help="the layer's expert GEMMs (default auto: ep_a2a's expert kernels at decode sizes)")
    ap.add_argument("--compute-graphs", action="store_true",
                    help="the layers replay their compute phase from a graph per T^ (TorchMoeLayer(compute_graphs=True))")
    ap.add_argument("--iters", type=positive_int, default=100, help="eager steps timed per token count (default 100)")
    ap.add_argument("--calls", type=positive_int, default=20, help="calls in a row per piece timing (default 20)")
    ap.add_argument("--cprofile", default=None, help="a folder for a cProfile of the eager steps per token count")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    check_out(ap, args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prog = "ep_a2a.tools.bench_layer_host"
    missing = exits.require_framework_and_gpu(prog, "torch", "the layer it times is PyTorch's")
    if missing is not None:
        return missing
    import torch
    if not torch.cuda.is_available():
        return exits.missing(prog, f"this PyTorch ({torch.__version__}) has no CUDA device to run on")
    doc = run(args)
    path = write_json(output_path(args.out, result_name("layer-host", device_slug(doc["device"]),
                                                        f"{args.ranks}ranks", args.profile)), doc)
    print(f"wrote {path}", file=sys.stderr)
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
