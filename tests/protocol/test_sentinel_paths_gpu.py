"""SENTINEL's decode-batch paths (kernels/sentinel.cu) on one GPU with in-process ranks,
bitwise against the reference: a token's push shared by several blocks, landing slots of
more than one round of polls per thread, KIND_RAW16 payloads, combine outputs whose vectors
are narrower than the 16-byte groups SENTINEL polls (now split over blocks too), more
targets than one register chunk of 8, and FENCE steps right after SENTINEL ones on ranks
that received nothing from some peers (the combine flag now published at combine start)."""
import numpy as np
import pytest

from test_fence_gpu import make, run
from test_sentinel_gpu import _adversarial

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt,hidden", [("bf16", 7168), ("bf16", 16384), ("opaque", 7168), ("nvfp4", 7168),
                                        ("mxfp8", 7168)])
def test_decode_batches_large_tokens(fmt, hidden):
    # 16384 bf16 (32 KB) and the RAW16 formats take more than one round of U groups per thread
    rng = np.random.default_rng()
    group, a2a = make(8, fmt=fmt, hidden=hidden, top_k=8, max_tokens=16, protocol="sentinel")
    with group, a2a:
        for T in (1, 2, 4, 16):
            run(a2a, rng, [T] * 8, T, route="perfect" if T % 2 else "uniform", payload_fn=_adversarial)
        run(a2a, rng, [1, 0, 3, 0, 16, 2, 0, 5], 16, route="zipf", payload_fn=_adversarial)  # 0-token ranks


@pytest.mark.parametrize("offset", [2, 4, 8])
def test_combine_output_with_narrow_vectors_split_over_blocks(offset):
    # an output 2/4/8 bytes off 16-byte alignment: combine_vec < 16, groups still polled whole
    from ep_a2a.interop.arrays import empty
    from ep_a2a.interop.tensor import Tensor
    rng = np.random.default_rng()
    keep = []

    def out_fn(r, shape, dtype):
        raw = empty((shape[0] * shape[1] * 2 + 64,), "uint8", r.device)
        keep.append(raw)
        return Tensor(raw.ptr + offset, shape, dtype, device=(2, r.device.ordinal), owner=raw)

    group, a2a = make(8, hidden=7168, top_k=8, max_tokens=8, protocol="sentinel")
    with group, a2a:
        for T in (1, 3, 8):
            run(a2a, rng, [T] * 8, T, out_fn=out_fn)
        run(a2a, rng, [0, 1, 0, 8, 2, 0, 7, 1], 8, out_fn=out_fn)
    group2, a2a2 = make(3, hidden=7, top_k=3, max_tokens=8, protocol="sentinel")  # tail group of 14 bytes
    with group2, a2a2:
        for T in (1, 8):
            run(a2a2, rng, [T, 0, T], T, out_fn=out_fn)


def test_more_targets_than_one_chunk():
    # 12 ranks, top_k 12: up to 12 distinct targets, polled in two chunks of 8
    rng = np.random.default_rng()
    group, a2a = make(12, hidden=1024, top_k=12, num_experts=48, max_tokens=8, protocol="sentinel")
    with group, a2a:
        for T in (1, 5, 8):
            run(a2a, rng, [T] * 12, T, route="uniform")


def test_fence_right_after_sentinel_with_sparse_routing():
    # zipf routing leaves ranks that receive nothing from some peers: the FENCE dispatch after
    # a SENTINEL step must still wait for their combine flags (published at combine start)
    rng = np.random.default_rng()
    group, a2a = make(8, hidden=2048, top_k=2, max_tokens=16, protocol="auto", crossover_tokens=4)
    with group, a2a:
        for step in range(200):
            tmax = (1, 16, 2, 16, 4, 8)[step % 6]
            run(a2a, rng, list(rng.integers(0, tmax + 1, 8)), tmax, route="zipf", alpha=2.5)
