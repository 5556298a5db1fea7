"""A MoE layer in JAX on ep_a2a: N expert-parallel ranks in this process on GPU 0.

    python examples/jax_moe_layer.py [--ranks 4] [--tokens 64] [--gemm auto|padded|ragged|loop]

Each rank holds its block of the experts (ep_a2a.layers.jax.JaxMoeLayer). The layer runs jitted
(one XLA program drives every rank: ep_a2a's dispatch and combine are XLA calls on its stream)
and eager; prints whether the two agree bit for bit, the largest error against a float64 dense
reference of the same layer (every token through every expert it chose, no all-to-all) and the
time per step of both (all ranks, median). Exits 1 on a mismatch, 2 or 3 (one line) when
something is missing.
"""
import argparse
import time

from preflight import require_jax_gpu

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--ranks", type=int, default=4)
ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--intermediate", type=int, default=512)
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--top-k", type=int, default=4)
ap.add_argument("--gemm", choices=("auto", "padded", "ragged", "loop"), default="auto", help="the eager layer's experts")
ap.add_argument("--steps", type=int, default=25, help="timed steps of each mode (the first 5 are warm-up)")
args = ap.parse_args()
jax, gpus = require_jax_gpu()

import os  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import ep_a2a  # noqa: E402
from ep_a2a.layers.jax import JaxMoeLayer, expert_gemm, jit_forward_all_ranks, moe_forward_all_ranks, payload_specs  # noqa: E402
from ep_a2a.moe import local_experts  # noqa: E402

N, T, H, I, E, K = args.ranks, args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
gpu = gpus[0]
key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
k1, k2, k3, k4 = jax.random.split(key, 4)
# every expert's weights (nn.Linear layout, unit-variance projections); each rank keeps its block
w_gate_up = jax.device_put((jax.random.normal(k1, (E, 2 * I, H)) / H ** 0.5).astype(jnp.bfloat16), gpu)
w_down = jax.device_put((jax.random.normal(k2, (E, H, I)) / I ** 0.5).astype(jnp.bfloat16), gpu)
xs = [jax.device_put(x.astype(jnp.bfloat16), gpu) for x in jax.random.normal(k3, (N, T, H))]
logits = [jax.device_put(x, gpu) for x in jax.random.normal(k4, (N, T, E))]

with ep_a2a.LocalGroup([0] * N) as group, \
        ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=T, top_k=K, num_experts=E, payloads=payload_specs(H, K),
                           combine_hidden_size=H, validate_expert_ids=False) as a2a:
    layers = []
    for r in a2a.ranks:
        first, n = local_experts(E, N, r.rank)
        layers.append(JaxMoeLayer(r, w_gate_up[first:first + n], w_down[first:first + n], gemm=args.gemm))
    step = jit_forward_all_ranks(layers)
    jitted = jax.block_until_ready(step(xs, logits))
    eager = moe_forward_all_ranks(layers, xs, logits)
    same = all(np.array_equal(np.asarray(j).view(np.uint16), np.asarray(o).view(np.uint16)) for j, o in zip(jitted, eager))
    ids = np.concatenate([np.asarray(layer.routing[0]) for layer in layers])   # the routers' choices
    w = np.concatenate([np.asarray(layer.routing[1]) for layer in layers])
    gemm = expert_gemm(layers[0].gemm, T)   # the experts this T^ ran (auto: by size)

    times = {}
    for name, run in (("jit", lambda: jax.block_until_ready(step(xs, logits))),
                      ("eager", lambda: moe_forward_all_ranks(layers, xs, logits))):  # (returns once ready)
        t = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            run()
            t.append(time.perf_counter() - t0)
        times[name] = np.median(t[5:] or t) * 1e6
    for layer in layers:
        layer.close()

# The oracle check (a float64 dense layer and the bf16 bounds of ep_a2a/testing/layer_oracle.py).
from ep_a2a.testing.layer_oracle import check_layer_output, dense_reference, max_relative_error  # noqa: E402

bits = lambda a: np.asarray(a).view(np.uint16)  # noqa: E731  (bf16 as its bits, the oracle's input)
got = np.concatenate([np.asarray(o).astype(np.float32) for o in jitted])
want = dense_reference(np.concatenate([bits(x) for x in xs]), ids, w, bits(w_gate_up), bits(w_down))
if not same and gemm != "loop":   # (jit and eager run the same expert function; "loop" rounds apart)
    print("jax_moe_layer: MISMATCH: the jitted layer differs from the eager one")
    raise SystemExit(1)
try:
    check_layer_output(got, want, "jitted JAX MoE layer")
except AssertionError as e:
    print(f"jax_moe_layer: MISMATCH: {e}")
    raise SystemExit(1)
print(f"jax_moe_layer: {N} ranks x {T} tokens, hidden {H}, intermediate {I}, {E} experts, top_k {K}, {gemm} experts: "
      f"jit == eager bit for bit: {same}; max |error| / max |reference| = {max_relative_error(got, want):.2e}; "
      f"{gpu.device_kind}: jit {times['jit']:.0f} us, eager {times['eager']:.0f} us per layer step (all {N} ranks, median)")
