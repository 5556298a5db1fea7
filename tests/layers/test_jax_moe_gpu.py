"""The JAX MoE layer (ep_a2a/layers/jax.py) on in-process ranks of one GPU, against the same dense
float64 NumPy reference and bf16 tolerances as the PyTorch layer (ep_a2a/layers/torch.py)."""
import os

# JAX takes 75% of the GPU at its first use unless told otherwise; ep_a2a's workspaces and the
# other frameworks of this test process need room too. Set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from common import fresh_rng, layer_token_counts  # noqa: E402

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

CASES = [  # ep, experts, top_k, hidden, intermediate, max_tokens_per_rank
    (1, 8, 2, 256, 128, 32),
    (2, 16, 4, 512, 256, 48),
    (4, 9, 4, 256, 128, 24),
]


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend")


def _bf16(bits, dev):
    return jax.device_put(jnp.asarray(np.ascontiguousarray(bits).view(jnp.bfloat16)), dev)


@pytest.mark.parametrize("gemm", ["ragged", "loop"])
@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
@pytest.mark.parametrize("ep,E,top_k,H,I,tmax", CASES)
def test_jax_layer_matches_dense_reference(ep, E, top_k, H, I, tmax, protocol, gemm):
    import ep_a2a
    from ep_a2a.interop.arrays import copy_from_numpy
    from ep_a2a.layers.jax import JaxMoeLayer, moe_forward_all_ranks
    from ep_a2a.moe import local_experts
    from ep_a2a.testing.reference import from_float32
    from ep_a2a.layers.base import payload_specs
    from ep_a2a.testing.layer_oracle import (check_layer_output, dense_reference, distinct_logits, random_weights,
                                             route_reference)
    dev = _gpu()
    if gemm == "ragged" and not hasattr(jax.lax, "ragged_dot"):
        pytest.skip(f"jax {jax.__version__} has no lax.ragged_dot")
    rng, seed = fresh_rng()
    w1_bits, w2_bits = random_weights(rng, E, H, I)
    w1, w2 = _bf16(w1_bits, dev), _bf16(w2_bits, dev)
    group = ep_a2a.LocalGroup([0] * ep)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=top_k, num_experts=E,
                             payloads=payload_specs(H, top_k), combine_hidden_size=H, protocol=protocol, timeout_s=20.0)
    layers = []
    try:
        for r in a2a.ranks:
            first, n = local_experts(E, ep, r.rank)
            layers.append(JaxMoeLayer(r, w1[first:first + n], w2[first:first + n], gemm=gemm))
        for step in range(2):
            tokens = layer_token_counts(rng, ep, tmax, step)
            msg = f"{seed} {protocol} {gemm} step {step} tokens={tokens}"
            xs_bits = [from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16") for T in tokens]
            logits = [distinct_logits(rng, T, E) for T in tokens]
            routing = [route_reference(lg, top_k) for lg in logits]
            for layer in layers:  # poison (bf16 NaN) what the step must overwrite
                copy_from_numpy(layer._out, np.full(layer._out.nbytes, 0xFF, np.uint8))
                copy_from_numpy(layer._xg, np.full(layer._xg.nbytes, 0xFF, np.uint8))
            outs = moe_forward_all_ranks(layers, [_bf16(x, dev) for x in xs_bits],
                                         [jax.device_put(jnp.asarray(lg), dev) for lg in logits])
            want = dense_reference(np.concatenate(xs_bits), np.concatenate([r[0] for r in routing]),
                                   np.concatenate([r[1] for r in routing]), w1_bits, w2_bits)
            start = 0
            for r, (layer, out) in enumerate(zip(layers, outs)):
                T = tokens[r]
                assert out.shape == (T, H) and out.dtype == jnp.bfloat16, f"{msg} rank {r}: {out.shape} {out.dtype}"
                check_layer_output(np.asarray(out).astype(np.float32), want[start:start + T], f"{msg} rank {r}")
                ids, w = (np.asarray(t) for t in layer.routing)
                assert np.array_equal(ids, routing[r][0]), f"{msg} rank {r}: router ids"
                np.testing.assert_allclose(w, routing[r][1], rtol=1e-5, atol=1e-7, err_msg=f"{msg} rank {r}: router weights")
                start += T
    finally:
        for layer in layers:
            layer.close()
        a2a.close()
        group.close()
