"""python -m ep_a2a.tools.bench_torch: host time of eager dispatch + combine through the torch ops.

The same measurement as Bench.host_overhead (µs of host time per rank per eager dispatch +
combine, arguments reused, no synchronization inside the timed loop, in-process ranks; each
figure the median of several loops, taken in turn with the others), with torch tensors on
torch streams through ep_a2a.ops.torch, beside the ep_a2a-Tensor path and two bare launches
timed in the same run:

  torch_ops_us            ops.dispatch + ops.combine (out=None: a new torch tensor each
                          step), the same torch tensors every step: what an engine pays
                          (eager calls run the implementations without the dispatcher)
  torch_ops_out_us        the same with combine's out= given (a tensor per rank kept by the
                          caller): what an engine that keeps its output buffer pays
  torch_ops_moved_us      the same as torch_ops_us with the inputs alternating between two
                          sets of tensors, so every call sees new addresses (the
                          all-to-all's full checks)
  torch_dispatcher_us     the same as torch_ops_us through the torch dispatcher
                          (ops.EAGER_DIRECT = False), as torch.ops.ep_a2a.* calls pay
  stream_switch_us        torch.cuda.set_stream to each rank's stream (in-process ranks
                          need one stream each; a rank alone in its process does not pay
                          it), included in the four above and also given alone
  ep_a2a_tensors_us       RankAlltoAll.dispatch/combine with ep_a2a Tensors (fast path)
  core_torch_tensors_us   RankAlltoAll.dispatch/combine with the same torch tensors every
                          step (the combine input as torch's view of the workspace), torch's
                          current stream set to each rank's as in torch_ops_us: the repeat
                          fast path reads their geometry through torch (fastpath.py)
  core_torch_waits_us     the same with torch's current stream another torch stream per
                          rank: each call then orders it before the rank's stream (an
                          event record and a wait per rank and phase), as DLPack does
  two_bare_launches_us    two launches of the prepacked empty kernel per rank
  torch_ops_copies        times an op was handed a copy of its own view during this run (0)
"""
from __future__ import annotations

import argparse
import sys

from . import exits
from .argtypes import check_top_k, int_in, int_list, positive_int
from .bench_method import bare_launches, eager_step, host_time_us, interleaved_medians
from .result_paths import OUT_HELP, check_out, device_slug, output_path, result_name, write_json


def _torch_inputs(b, T: int, torch):
    """Per rank: (ids int32 [T, top_k], [payloads]) as torch tensors, random."""
    from ..testing.formats import routing
    from ..interop.torch_tensor import torch_dtype
    a = b.a2a
    out = []
    for r in a.ranks:
        dev = torch.device("cuda", r.device.ordinal)
        ids = torch.from_numpy(routing("perfect", b.route_rng, T, a.top_k, a.num_experts, a.ep_size, r.rank)).to(dev)
        pays = []
        for s in a.payload_specs:
            raw = torch.randint(0, 256, (T, s.bytes_per_token), dtype=torch.uint8, device=dev)
            if s.dtype in ("bfloat16", "float16", "float32"):  # finite values (NaN bits are SENTINEL-escaped)
                raw = torch.randn(T, *s.shape, device=dev).to(torch_dtype(s.dtype)).view(torch.uint8).reshape(T, -1)
            pays.append(raw.view(torch_dtype(s.dtype)).reshape(T, *s.shape))
        out.append((ids.to(torch.int32).contiguous(), pays))
    return out


def torch_host_overhead(b, T: int, iters: int = None, repeats: int = 5) -> dict:
    """µs of host time per rank per eager dispatch + combine through the torch ops (module
    docstring), at T tokens per rank (T^ = T): each figure the median of `repeats` timed loops
    of `iters` steps, the figures taken in turn (bench_method.interleaved_medians). b: an
    ep_a2a.tools.bench.Bench, or anything with its `a2a` (in-process ranks) and `route_rng`."""
    import torch
    from ..interop.arrays import from_numpy
    from ..ops import torch as ops
    a, ranks = b.a2a, b.a2a.ranks
    iters = iters or 200
    fp8 = a.combine_quant == "fp8" and getattr(b, "epilogue_fp8", False)
    streams = [torch.cuda.ExternalStream(r.default_stream, device=torch.device("cuda", r.device.ordinal)) for r in ranks]
    binds = [ops.bind(r) for r in ranks]
    sets = [_torch_inputs(b, T, torch), _torch_inputs(b, T, torch)]
    for tr in binds:  # finite partial results (bytes below 0x78: no NaN in bf16, e4m3 or fp32)
        tr.prepare([T])
        cin = ops.combine_input(tr, T, fp8=fp8)
        for t in (cin if fp8 else (cin,)):
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, dtype=torch.uint8))
    torch.cuda.synchronize()
    keep = torch.cuda.current_stream()
    outs = [torch.empty((T, tr.hidden), dtype=tr.combine_dtype, device=tr.device) for tr in binds]

    def ops_step(inputs, out_given=False):
        for (ids, pays), tr, st in zip(inputs, binds, streams):
            torch.cuda.set_stream(st)
            ops.dispatch(tr, ids, pays, T)
        for tr, st, out in zip(binds, streams, outs):
            torch.cuda.set_stream(st)
            ops.combine(tr, ops.combine_input(tr, T, fp8=fp8), T, out=out if out_given else None)
        torch.cuda.set_stream(keep)

    def moved_step(i):
        ops_step(sets[i & 1])

    other = [torch.cuda.Stream(device=torch.device("cuda", r.device.ordinal)) for r in ranks]

    def core_torch_step(currents):  # (the core calls with torch tensors: no binding, no slots)
        for (ids, pays), r, st in zip(sets[0], ranks, currents):
            torch.cuda.set_stream(st)
            r.dispatch(ids, pays, T)
        for part, r, st in zip(tparts, ranks, currents):
            torch.cuda.set_stream(st)
            r.combine(part, T)
        torch.cuda.set_stream(keep)

    def dispatcher_step():
        direct, ops.EAGER_DIRECT = ops.EAGER_DIRECT, False
        try:
            ops_step(sets[0])
        finally:
            ops.EAGER_DIRECT = direct

    def switch_only():
        for st in streams:
            torch.cuda.set_stream(st)
        for st in streams:
            torch.cuda.set_stream(st)
        torch.cuda.set_stream(keep)

    def host(t, itemsize):  # a torch tensor's bytes on the host, as unsigned ints of its element size
        return t.contiguous().view(torch.uint8).cpu().numpy().view(f"u{itemsize}").reshape(t.shape)
    ins = [(from_numpy(ids.cpu().numpy(), r.device, "int32"),
            [from_numpy(host(p, p.element_size()), r.device, s.dtype) for p, s in zip(pays, a.payload_specs)])
           for (ids, pays), r in zip(sets[0], ranks)]
    cins = [r.combine_input(T, fp8=fp8) for r in ranks]
    tparts = [cin if fp8 else ops.combine_input(tr, T) for tr, cin in zip(binds, cins)]  # (torch views of the same)

    def settle():
        a.synchronize()
        torch.cuda.synchronize()

    def per_rank_us(body, indexed=False) -> float:
        # (8 calls first: past the first steps' longer timeouts, the fast path applies from the 6th)
        return host_time_us(body, iters, 8, settle, indexed) / len(ranks)

    copies_before = ops.copies()  # (the count is the process's: other callers' copies are not this run's)
    med, samples = interleaved_medians(dict(
        torch_ops_us=lambda: per_rank_us(lambda: ops_step(sets[0])),
        torch_ops_out_us=lambda: per_rank_us(lambda: ops_step(sets[0], out_given=True)),
        torch_ops_moved_us=lambda: per_rank_us(moved_step, indexed=True),
        torch_dispatcher_us=lambda: per_rank_us(dispatcher_step),
        stream_switch_us=lambda: per_rank_us(switch_only),
        ep_a2a_tensors_us=lambda: per_rank_us(lambda: eager_step(ranks, ins, cins, T)),
        core_torch_tensors_us=lambda: per_rank_us(lambda: core_torch_step(streams)),
        core_torch_waits_us=lambda: per_rank_us(lambda: core_torch_step(other)),
        two_bare_launches_us=lambda: per_rank_us(lambda: bare_launches(ranks))), repeats)
    res = dict(tokens_per_rank=T, ranks=len(ranks), iters=iters, repeats=repeats, **med, samples=samples)
    res["torch_ops_copies"] = ops.copies() - copies_before
    return res


DEEPSEEK_V3 = dict(hidden=7168, top_k=8, experts=256)   # (tools/bench.py's profile; not imported: bench imports us)

EPILOG = f"""examples:
  python -m ep_a2a.tools.bench_torch --tokens 1,128
      8 in-process ranks on GPU 0, deepseek-v3 shapes, FENCE

The JSON goes to bench/results/torch-host-<gpu>-<N>ranks-<shapes>-<protocol>.json in the
checkout, or to --out.
{exits.EPILOG}"""


def parser() -> argparse.ArgumentParser:
    """The command line's options, each with its help."""
    from ..layout import MAX_RANKS, MAX_TOP_K
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.tools.bench_torch", description=__doc__.split("\n")[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int_in(1, MAX_RANKS), default=8, help="in-process ranks on GPU 0 (default 8)")
    ap.add_argument("--tokens", type=int_list(1), default=[1, 128],
                    help="tokens per rank, comma-separated (default 1,128)")
    ap.add_argument("--iters", type=positive_int, default=200, help="steps per timed loop (default 200)")
    ap.add_argument("--hidden", type=positive_int, default=DEEPSEEK_V3["hidden"],
                    help=f"hidden size (default {DEEPSEEK_V3['hidden']}, deepseek-v3's)")
    ap.add_argument("--top-k", type=int_in(1, MAX_TOP_K), default=DEEPSEEK_V3["top_k"],
                    help=f"experts per token (default {DEEPSEEK_V3['top_k']})")
    ap.add_argument("--experts", type=positive_int, default=DEEPSEEK_V3["experts"],
                    help=f"number of experts (default {DEEPSEEK_V3['experts']})")
    ap.add_argument("--protocol", default="fence", choices=["fence", "sentinel", "auto"],
                    help="the all-to-all's protocol (default fence)")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    check_top_k(ap, args.top_k, args.experts)
    check_out(ap, args.out)
    return args


def main(argv=None) -> int:
    """The standalone table: its own all-to-all (bench's layout: payloads of the bf16 format,
    validation off, PDL on), deepseek-v3 shapes unless told otherwise."""
    import datetime
    import secrets
    import types
    import numpy as np
    args = parse_args(argv)
    prog = "ep_a2a.tools.bench_torch"
    missing = exits.require_framework_and_gpu(prog, "torch", "this benchmark times the torch ops")
    if missing is not None:
        return missing
    import ep_a2a
    from ..testing.formats import payload_formats
    from .bench_report import commit
    tokens = args.tokens
    seed = secrets.randbits(63)
    rows = []
    with ep_a2a.LocalGroup([0] * args.ranks) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max(tokens), top_k=args.top_k, num_experts=args.experts,
                               payloads=payload_formats(args.hidden, args.top_k)["bf16"],
                               combine_hidden_size=args.hidden, protocol=args.protocol,
                               validate_expert_ids=False) as a2a:
        gpu = group.ranks[0].device.name
        b = types.SimpleNamespace(a2a=a2a, route_rng=np.random.default_rng(seed))
        for T in tokens:
            rows.append(torch_host_overhead(b, T, args.iters))
    keys = [k for k in rows[0] if k.endswith("_us")]
    print("tokens  " + "  ".join(f"{k[:-3]:>20s}" for k in keys))
    for row in rows:
        print(f"{row['tokens_per_rank']:6d}  " + "  ".join(f"{row[k]:20.1f}" for k in keys))
    print("torch_ops_copies per T: " + ", ".join(f"{row['tokens_per_rank']}: {row['torch_ops_copies']}" for row in rows))
    print("core_torch_tensors / torch_ops per T: " + ", ".join(
        f"{row['tokens_per_rank']}: {row['core_torch_tensors_us'] / row['torch_ops_us']:.2f}x" for row in rows))
    import torch
    doc = dict(method=__doc__, device=gpu, torch=torch.__version__, commit=commit(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), ranks=args.ranks,
               hidden=args.hidden, top_k=args.top_k, experts=args.experts, protocol=args.protocol, seed=seed, rows=rows)
    shapes = dict(hidden=args.hidden, top_k=args.top_k, experts=args.experts)
    shapes = "deepseek-v3" if shapes == DEEPSEEK_V3 else "-".join(f"{k.replace('_', '')}{v}" for k, v in shapes.items())
    name = result_name("torch-host", device_slug(gpu), f"{args.ranks}ranks", shapes, args.protocol)
    print(f"wrote {write_json(output_path(args.out, name), doc)}")
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
