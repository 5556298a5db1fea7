"""A MoE layer in PyTorch on ep_a2a: N expert-parallel ranks in this process on GPU 0.

    PYTHONPATH=. python3 examples/torch_moe_layer.py [--ranks 4] [--tokens 64]

Prints the largest error against a dense float64 reference of the same layer (every token,
every expert) and the eager time per layer step (all ranks, median)."""
import argparse
import os
import time

import numpy as np
import torch

import ep_a2a
from ep_a2a.layers.torch import TorchMoeLayer, bf16_from_bits, bits_from_bf16, moe_forward_all_ranks, payload_specs
from ep_a2a.moe import local_experts
from ep_a2a.testing.layer_oracle import check_layer_output, dense_reference, max_relative_error, random_weights
from ep_a2a.testing.reference import from_float32, to_float32

ap = argparse.ArgumentParser()
ap.add_argument("--ranks", type=int, default=4)
ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--intermediate", type=int, default=512)
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--top-k", type=int, default=4)
args = ap.parse_args()
N, T, H, I, E, K = args.ranks, args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
seed = int.from_bytes(os.urandom(4), "little")
rng = np.random.default_rng(seed)
dev = torch.device("cuda", 0)

w1_bits, w2_bits = random_weights(rng, E, H, I)              # every expert, bf16 bits
w1, w2 = bf16_from_bits(w1_bits, dev), bf16_from_bits(w2_bits, dev)
with ep_a2a.LocalGroup([0] * N) as group, \
        ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=T, top_k=K, num_experts=E, payloads=payload_specs(H, K),
                           combine_hidden_size=H, combine_dtype="bfloat16", validate_expert_ids=False) as a2a:
    layers = []
    for r in a2a.ranks:                                       # each rank holds its own experts
        first, n = local_experts(E, N, r.rank)
        layers.append(TorchMoeLayer(r, w1[first:first + n], w2[first:first + n]))
    xs_bits = [from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16") for _ in range(N)]
    xs = [bf16_from_bits(x, dev) for x in xs_bits]
    logits = [torch.from_numpy(rng.standard_normal((T, E)).astype(np.float32)).to(dev) for _ in range(N)]

    outs = moe_forward_all_ranks(layers, xs, logits)
    torch.cuda.synchronize()
    got = np.concatenate([to_float32(bits_from_bf16(o), "bfloat16") for o in outs])
    ids = np.concatenate([layer.routing[0].cpu().numpy() for layer in layers])
    w = np.concatenate([layer.routing[1].cpu().numpy() for layer in layers])
    want = dense_reference(np.concatenate(xs_bits), ids, w, w1_bits, w2_bits)
    check_layer_output(got, want, f"seed={seed}")
    print(f"{N} ranks x {T} tokens, hidden {H}, intermediate {I}, {E} experts, top_k {K}, "
          f"{layers[0].gemm} GEMM: max |error| / max |reference| = {max_relative_error(got, want):.2e} (seed {seed})")

    times = []
    for i in range(25):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        moe_forward_all_ranks(layers, xs, logits)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(f"{torch.cuda.get_device_name(dev)}: {np.median(times[5:]) * 1e6:.0f} µs per layer step "
          f"(all {N} ranks, eager, median of {len(times) - 5})")
    for layer in layers:
        layer.close()
