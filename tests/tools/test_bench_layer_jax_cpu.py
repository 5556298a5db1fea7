"""tools/bench_layer_jax.py without a GPU: the random weights it draws."""
import numpy as np

from common import fresh_rng


def test_random_weights_are_bf16_with_the_layers_scales():
    import pytest
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from ep_a2a.tools.bench_layer_jax import random_expert_weights
    rng, _ = fresh_rng()
    E, H, inter = 3, 256, 128
    key = jax.random.key(int(rng.integers(1 << 31)))
    w1, w2 = random_expert_weights(key, E, H, inter, jax.devices("cpu")[0])
    assert (w1.dtype, w1.shape, w2.dtype, w2.shape) == (jnp.bfloat16, (E, 2 * inter, H), jnp.bfloat16, (E, H, inter))
    for w, scale in ((w1, H ** -0.5), (w2, inter ** -0.5)):
        x = np.asarray(w.astype(jnp.float32))
        assert abs(x.std() / scale - 1) < 0.05 and abs(x.mean()) < 0.05 * scale
        assert len({x[e].tobytes() for e in range(E)}) == E          # (each expert drawn anew)
    other = random_expert_weights(jax.random.fold_in(key, 1), E, H, inter, jax.devices("cpu")[0])[0]
    assert not np.array_equal(np.asarray(other.astype(jnp.float32)), np.asarray(w1.astype(jnp.float32)))  # another rank's


def test_the_jitted_steps_stages_from_kernel_records():
    """Records as CUPTI gives them for two jitted steps of 2 ranks (each step one graph launch:
    one correlation id): routers, dispatch, index and the counts' copies, the expert kernels,
    combine; the second step's stage spans, the counts' copy counted with the index."""
    from ep_a2a.tools.bench_layer_jax import JAX_STAGE_MAP
    from ep_a2a.tools.bench_layer_stages import OURS_GROUPS, OURS_STAGES, stage_times
    step = [("moe_route_f32_2", "kernel", 0, 3), ("moe_route_f32_2", "kernel", 1, 4), ("fence_dispatch", "kernel", 6, 14),
            ("fence_dispatch", "kernel", 6, 15), ("moe_index_fused", "kernel", 15, 18), ("moe_index_fused", "kernel", 16, 18),
            ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 18, 20), ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 18, 21),
            ("moe_expert_fc1_bf16", "kernel", 22, 60), ("moe_expert_fc1_bf16", "kernel", 23, 70),
            ("moe_expert_fc2_bf16", "kernel", 61, 100), ("moe_expert_fc2_bf16", "kernel", 71, 110),
            ("fence_combine_bf16", "kernel", 101, 120), ("fence_combine_bf16", "kernel", 111, 121)]
    events = [dict(ph="X", name=n, cat=c, ts=t0 + 1000 * k, dur=t1 - t0, args=dict(stream=7, correlation=40 + k))
              for k in range(2) for n, c, t0, t1 in step]
    st = stage_times(events, 2, JAX_STAGE_MAP, OURS_STAGES, groups=OURS_GROUPS, skip=1)
    got = st["mean_us"]
    assert st["replays"] == 1 and st["records_per_replay"] == len(step)
    assert (got["router"], got["dispatch"], got["index"], got["fc1"], got["fc2"], got["combine"]) == (4, 9, 6, 48, 49, 20)
    assert got["gather"] == got["finalize"] == got["activation"] == 0 and got["layer"] == 121
