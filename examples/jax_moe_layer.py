"""A MoE layer in JAX on ep_a2a: N expert-parallel ranks in this process on GPU 0.

    PYTHONPATH=. python3 examples/jax_moe_layer.py [--ranks 4] [--tokens 64] [--gemm ragged|loop]

Runs the layer jitted (one XLA program for every rank: ep_a2a's dispatch and combine run as
XLA calls on its stream) and eager; prints whether they agree bit for bit, the largest error
against a dense float64 reference of the same layer (every token, every expert) and the time
per layer step of both (all ranks, median)."""
import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for ep_a2a's workspaces

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ep_a2a  # noqa: E402
from ep_a2a.layers.jax import JaxMoeLayer, jit_forward_all_ranks, moe_forward_all_ranks, payload_specs  # noqa: E402
from ep_a2a.moe import local_experts  # noqa: E402
from ep_a2a.testing.layer_oracle import check_layer_output, dense_reference, max_relative_error, random_weights  # noqa: E402
from ep_a2a.testing.reference import from_float32  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--ranks", type=int, default=4)
ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--intermediate", type=int, default=512)
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--top-k", type=int, default=4)
ap.add_argument("--gemm", choices=("auto", "ragged", "loop"), default="auto", help="the eager layer's experts")
args = ap.parse_args()
N, T, H, I, E, K = args.ranks, args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
seed = int.from_bytes(os.urandom(4), "little")
rng = np.random.default_rng(seed)
gpu = jax.devices("gpu")[0]


def bf16(bits):
    return jax.device_put(jnp.asarray(bits.view(jnp.bfloat16)), gpu)


w1_bits, w2_bits = random_weights(rng, E, H, I)
w1, w2 = bf16(w1_bits), bf16(w2_bits)
with ep_a2a.LocalGroup([0] * N) as group, \
        ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=T, top_k=K, num_experts=E, payloads=payload_specs(H, K),
                           combine_hidden_size=H, validate_expert_ids=False) as a2a:
    layers = []
    for r in a2a.ranks:
        first, n = local_experts(E, N, r.rank)
        layers.append(JaxMoeLayer(r, w1[first:first + n], w2[first:first + n], gemm=args.gemm))
    xs_bits = [from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16") for _ in range(N)]
    xs = [bf16(x) for x in xs_bits]
    logits = [jax.device_put(jnp.asarray(rng.standard_normal((T, E)).astype(np.float32)), gpu) for _ in range(N)]

    step = jit_forward_all_ranks(layers)         # needs jax.lax.ragged_dot (the layers' gemm="ragged")
    jitted = jax.block_until_ready(step(xs, logits))
    outs = moe_forward_all_ranks(layers, xs, logits)
    same = all(np.array_equal(np.asarray(j).view(np.uint16), np.asarray(o).view(np.uint16)) for j, o in zip(jitted, outs))
    if not same and layers[0].gemm == "ragged":  # (the jitted experts are ragged_dot: "loop" rounds apart)
        raise SystemExit(f"the jitted layer differs from the eager one (seed {seed})")
    got = np.concatenate([np.asarray(o).astype(np.float32) for o in jitted])
    ids = np.concatenate([np.asarray(layer.routing[0]) for layer in layers])
    w = np.concatenate([np.asarray(layer.routing[1]) for layer in layers])
    want = dense_reference(np.concatenate(xs_bits), ids, w, w1_bits, w2_bits)
    check_layer_output(got, want, f"seed={seed}")
    print(f"{N} ranks x {T} tokens, hidden {H}, intermediate {I}, {E} experts, top_k {K}, {layers[0].gemm} experts: "
          f"jit == eager bit for bit: {same}; max |error| / max |reference| = {max_relative_error(got, want):.2e} (seed {seed})")

    for name, run in (("jit", lambda: jax.block_until_ready(step(xs, logits))),
                      ("eager", lambda: moe_forward_all_ranks(layers, xs, logits))):  # (returns once ready)
        times = []
        for i in range(25):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        print(f"{gpu.device_kind}: {np.median(times[5:]) * 1e6:.0f} µs per layer step (all {N} ranks, {name}, "
              f"median of {len(times) - 5})")
    for layer in layers:
        layer.close()
