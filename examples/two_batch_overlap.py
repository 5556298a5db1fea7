"""Two-batch overlap in the PyTorch MoE layer: N expert-parallel ranks in this process on GPU 0,
two micro-batches per step.

    python examples/two_batch_overlap.py [--ranks 8] [--tokens 32]

Two micro-batches in flight are two all-to-alls of one group. TwoBatchMoe holds both
micro-batches' layers of every rank (sharing the experts' weights) and runs a step with
dispatch and combine split into send and receive halves, in the two-batch-overlap order:
B's dispatch is in flight while A's experts run, A's combine while B's dispatch is received.
The example checks the overlapped step against the sequential one (A's whole step, then B's)
bit for bit, eagerly and replayed from a CUDA graph (engines replay graphs), with a random
number of tokens on each rank. Exits 1 on a mismatch, 2 or 3 (one line) when something is
missing. Timings: python -m ep_a2a.bench_layer --graph --overlap.
"""
import argparse
import random

from preflight import require_torch_cuda

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--ranks", type=int, default=8)
ap.add_argument("--tokens", type=int, default=32, help="most tokens per rank and micro-batch (T^)")
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--intermediate", type=int, default=512)
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--top-k", type=int, default=4)
ap.add_argument("--protocol", choices=("fence", "sentinel"), default="fence")
args = ap.parse_args()
torch = require_torch_cuda()

import ep_a2a  # noqa: E402
from ep_a2a.layers.torch import grouped_mm_support, payload_specs  # noqa: E402
from ep_a2a.layers.torch_overlap import TwoBatchMoe  # noqa: E402

N, T, H, I, E, K = args.ranks, args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
dev = torch.device("cuda", 0)
g = torch.Generator(device=dev).manual_seed(torch.seed() >> 1)
w_gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
w_down = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).to(torch.bfloat16)
# each micro-batch: a random number of tokens on each rank (0 to T^), its own inputs
sizes = {m: [random.randint(0, T) for _ in range(N)] for m in "AB"}
xs = {m: [torch.empty(t, H, dtype=torch.bfloat16, device=dev) for t in sizes[m]] for m in "AB"}
logits = {m: [torch.empty(t, E, device=dev) for t in sizes[m]] for m in "AB"}


def fresh_inputs():
    for m in "AB":
        for x, lg in zip(xs[m], logits[m]):
            x.copy_(torch.randn(x.shape, device=dev, generator=g))
            lg.copy_(torch.randn(lg.shape, device=dev, generator=g))


def step(order):
    """Both micro-batches on every rank; returns a copy of every output (A's ranks, then B's)."""
    outs_a, outs_b = tb.step(xs["A"], logits["A"], xs["B"], logits["B"], T, order=order)
    return [o.clone() for o in outs_a + outs_b]


def same_bits(xs_, ys_):
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(xs_, ys_))


options = dict(max_tokens_per_rank=T, top_k=K, num_experts=E, payloads=payload_specs(H, K), combine_hidden_size=H,
               combine_dtype="bfloat16", protocol=args.protocol, validate_expert_ids=False)
graphed = grouped_mm_support(dev)[0] is not None  # (the loop GEMM reads counts on the host: no graph)
with ep_a2a.LocalGroup([0] * N) as group, \
        ep_a2a.MoeAlltoAll(group, **options) as a2a_a, ep_a2a.MoeAlltoAll(group, **options) as a2a_b, \
        TwoBatchMoe(a2a_a, a2a_b, w_gate_up, w_down) as tb:
    fresh_inputs()
    eager_equal = same_bits(step("overlapped"), step("sequential"))

    graph_equal = None
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the overlapped step, captured once
            graph_outs = tb.step(xs["A"], logits["A"], xs["B"], logits["B"], T)
        fresh_inputs()
        want = step("sequential")
        graph.replay()
        torch.cuda.synchronize()
        graph_equal = same_bits(graph_outs[0] + graph_outs[1], want)
        del graph

ok = eager_equal and graph_equal is not False
print(f"two_batch_overlap: {N} ranks, {args.protocol}, micro-batch A {sizes['A']} and B {sizes['B']} tokens per rank: "
      f"overlapped == sequential bit for bit: eager {eager_equal}, CUDA graph "
      f"{graph_equal if graphed else 'not run (no grouped GEMM here)'}")
if not ok:
    raise SystemExit(1)
