"""tools/bench_layer_jax.py without a GPU: the random weights it draws."""
import numpy as np

from common import fresh_rng


def test_random_weights_are_bf16_with_the_layers_scales():
    import pytest
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from ep_a2a.tools.bench_layer_jax import random_weights_bf16
    rng, _ = fresh_rng()
    E, H, inter = 3, 256, 128
    w1, w2 = random_weights_bf16(rng, E, H, inter)
    assert (w1.dtype, w1.shape, w2.dtype, w2.shape) == (ml_dtypes.bfloat16, (E, 2 * inter, H), ml_dtypes.bfloat16, (E, H, inter))
    for w, scale in ((w1, H ** -0.5), (w2, inter ** -0.5)):
        x = w.astype(np.float32)
        assert abs(x.std() / scale - 1) < 0.05 and abs(x.mean()) < 0.05 * scale
        assert len({x[e].tobytes() for e in range(E)}) == E          # (each expert drawn anew)
