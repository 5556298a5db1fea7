"""A MoE layer in PyTorch on ep_a2a: N expert-parallel ranks in this process on GPU 0.

    python examples/torch_moe_layer.py [--ranks 4] [--tokens 64]

Each rank holds its block of the experts (ep_a2a.layers.torch.TorchMoeLayer: router -> dispatch
-> grouped GEMMs -> finalize -> combine); moe_forward_all_ranks runs one step of every rank in
phases, so that no rank's spinning kernels wait for a peer held up by the host. Prints the
largest error against a float64 dense reference of the same layer (every token through every
expert it chose, no all-to-all) and the eager time per step (all ranks, median); exits 1 if the
output is outside the bf16 bounds, 2 or 3 (one line) when something is missing.
"""
import argparse
import time

from preflight import require_torch_cuda

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--ranks", type=int, default=4)
ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--intermediate", type=int, default=512)
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--top-k", type=int, default=4)
ap.add_argument("--steps", type=int, default=25, help="timed steps (the first 5 are warm-up)")
args = ap.parse_args()
torch = require_torch_cuda()

import numpy as np  # noqa: E402
import ep_a2a  # noqa: E402
from ep_a2a.layers.torch import TorchMoeLayer, dense_reference_torch, moe_forward_all_ranks, payload_specs  # noqa: E402
from ep_a2a.moe import local_experts  # noqa: E402

N, T, H, I, E, K = args.ranks, args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
dev = torch.device("cuda", 0)
g = torch.Generator(device=dev).manual_seed(torch.seed() >> 1)
# every expert's weights (nn.Linear layout, unit-variance projections); each rank keeps its block
w_gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
w_down = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).to(torch.bfloat16)
xs = [torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16) for _ in range(N)]
logits = [torch.randn(T, E, device=dev, generator=g) for _ in range(N)]

with ep_a2a.LocalGroup([0] * N) as group, \
        ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=T, top_k=K, num_experts=E, payloads=payload_specs(H, K),
                           combine_hidden_size=H, combine_dtype="bfloat16", validate_expert_ids=False) as a2a:
    layers = []
    for r in a2a.ranks:
        first, n = local_experts(E, N, r.rank)
        layers.append(TorchMoeLayer(r, w_gate_up[first:first + n], w_down[first:first + n]))
    outs = moe_forward_all_ranks(layers, xs, logits)
    got = torch.cat(outs).float()
    ids = torch.cat([layer.routing[0] for layer in layers])      # the routers' choices, to replay densely
    w = torch.cat([layer.routing[1] for layer in layers])
    want = dense_reference_torch(torch.cat(xs), ids, w, w_gate_up, w_down)

    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        moe_forward_all_ranks(layers, xs, logits)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    gemm = layers[0].gemm
    for layer in layers:
        layer.close()

# The oracle check (bf16 bounds derived in ep_a2a/testing/layer_oracle.py).
from ep_a2a.testing.layer_oracle import check_layer_output, max_relative_error  # noqa: E402

got_h, want_h = got.cpu().numpy(), want.cpu().numpy()
try:
    check_layer_output(got_h, want_h, "torch MoE layer")
except AssertionError as e:
    print(f"torch_moe_layer: MISMATCH: {e}")
    raise SystemExit(1)
print(f"torch_moe_layer: {N} ranks x {T} tokens, hidden {H}, intermediate {I}, {E} experts, top_k {K}, {gemm} GEMM: "
      f"max |error| / max |reference| = {max_relative_error(got_h, want_h):.2e}; "
      f"{torch.cuda.get_device_name(dev)}: {np.median(times[5:] or times) * 1e6:.0f} us per layer step "
      f"(all {N} ranks, eager, median of {len(times[5:] or times)})")
