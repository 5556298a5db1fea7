"""SENTINEL (and protocol="auto") on one GPU with in-process ranks, against the reference."""
import numpy as np
import pytest

from test_fence_gpu import make, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ep", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("top_k", [1, 6, 8, 22])
def test_sizes_and_top_k(ep, top_k):
    rng = np.random.default_rng()
    group, a2a = make(ep, top_k=top_k, num_experts=max(4 * ep, top_k), protocol="sentinel")
    with group, a2a:
        for T in (0, 1, 7, 128):
            run(a2a, rng, [T] * ep, max(T, 1), route="zipf" if T % 2 else "uniform", invalid_fraction=0.05)
        run(a2a, rng, list(rng.integers(0, 100, ep)), 100)


def _adversarial(rng, spec, T):
    """Random data with a third of its 32-bit words set to sentinel-like patterns: all-ones
    (0xFFFF bf16 halves, 0xFF fp8 bytes, -1 int32, 0xFFFFFFFF fp32) and the id sentinel."""
    from ep_a2a.testing.formats import random_payload
    x = random_payload(rng, spec, T)
    raw = np.ascontiguousarray(x).view(np.uint8).reshape(T, spec.bytes_per_token).copy()
    n = raw.shape[1] // 4 * 4
    if n:
        words = raw[:, :n].copy().view(np.uint32)
        pick = rng.random(words.shape)
        words[pick < 0.25] = 0xFFFFFFFF
        words[(pick >= 0.25) & (pick < 0.33)] = 0x88888888
        raw[:, :n] = words.view(np.uint8)
    raw[:, n:] = 0xFF
    return raw.view(x.dtype).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4", "opaque"])
@pytest.mark.parametrize("hidden", [512, 7])
def test_adversarial_payloads_follow_the_documented_rule(fmt, hidden):
    # run_step checks each received byte against reference.sentinel_escape: NaN words of
    # float formats become the format's canonical NaN, everything else arrives exactly
    rng = np.random.default_rng()
    group, a2a = make(4, fmt=fmt, hidden=hidden, top_k=4, max_tokens=32, protocol="sentinel")
    with group, a2a:
        for _ in range(3):
            run(a2a, rng, [32, 5, 0, 31], 32, payload_fn=_adversarial)


def test_fence_and_sentinel_give_identical_combine():
    """Same inputs through both protocols, with an identity 'MoE' (each rank copies the hidden
    states it received into its combine input), so the partial results depend on the token,
    not on the slot (FENCE and SENTINEL place tokens in different slots): bitwise equal."""
    from test_fence_gpu import identity_step
    seed = int(np.random.default_rng().integers(1 << 31))
    outs = {}
    for proto in ("fence", "sentinel"):
        group, a2a = make(8, hidden=1024, protocol=proto, validate_expert_ids=False)
        with group, a2a:
            outs[proto] = identity_step(a2a, np.random.default_rng(seed), [20, 0, 7, 64, 1, 33, 12, 5], 64)
    for s in range(8):
        assert np.array_equal(outs["fence"][s].view(np.uint8), outs["sentinel"][s].view(np.uint8))


def test_auto_switches_protocol_step_to_step_1000_steps():
    rng = np.random.default_rng()
    group, a2a = make(4, hidden=64, max_tokens=32, top_k=4, protocol="auto", crossover_tokens=12)
    seen = set()
    with group, a2a:
        for step in range(1000):
            tmax = int(rng.integers(1, 33))
            seen.add(a2a.protocol_for(tmax))
            run(a2a, rng, list(rng.integers(0, tmax + 1, 4)), tmax, route=("uniform", "zipf", "perfect")[step % 3],
                verify=step % 10 == 0)
    assert seen == {"fence", "sentinel"}


def test_4096_tokens_per_rank():
    rng = np.random.default_rng()
    group, a2a = make(8, hidden=512, max_tokens=4096, protocol="sentinel")
    with group, a2a:
        run(a2a, rng, [4096] * 8, 4096, route="perfect")
