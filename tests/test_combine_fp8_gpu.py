"""FP8 (e4m3, per-128 scales) combine: bitwise equal to the NumPy model of its quantization,
and within its stated bound of the exact combine."""
import numpy as np
import pytest

from test_fence_gpu import make, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cdtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("ep,top_k", [(1, 2), (3, 6), (8, 8), (8, 22)])
def test_fp8_combine_bitwise_against_the_model(cdtype, ep, top_k):
    rng = np.random.default_rng()
    group, a2a = make(ep, top_k=top_k, hidden=384, cdtype=cdtype, combine_quant="fp8", max_tokens=64)
    with group, a2a:
        for T in (1, 7, 64):
            run(a2a, rng, [T] * ep, T, exact=False, route="zipf")
        run(a2a, rng, list(rng.integers(0, 40, ep)), 40, exact=False, zero_copy=False)


def test_fp8_combine_graph_replay_and_large_batch():
    rng = np.random.default_rng()
    group, a2a = make(8, top_k=8, hidden=7168, combine_quant="fp8", max_tokens=512)
    with group, a2a:
        run(a2a, rng, [512] * 8, 512, exact=False, route="uniform")
        run(a2a, rng, [3, 0, 512, 17, 1, 0, 100, 9], 512, exact=False)


def test_fp8_combine_error_within_bound_of_the_exact_combine():
    """The stated bound, on the GPU's own output: every combined value is within the sum, over
    its partial results, of their 128-block amax / 16, plus the output's bf16 rounding."""
    from ep_a2a.check import run_step
    from ep_a2a import reference as ref
    seed = int(np.random.default_rng().integers(2 ** 31))
    group, a2a = make(4, top_k=4, hidden=256, combine_quant="fp8", max_tokens=32)
    with group, a2a:
        rep = run_step(a2a, np.random.default_rng(seed), [32] * 4, 32, exact=False)
    assert not rep.mismatches, rep.mismatches[:3]
    exact = ref.combine(rep.partials, [rep.records[s] for s in range(4)], "float32", in_dtype="bfloat16")
    for s in range(4):
        got = ref.to_float32(np.asarray(rep.outputs[s]).view(np.uint16), "bfloat16")
        bound = np.zeros_like(exact[s])
        for i, row in enumerate(rep.records[s]):
            for t, slot in row:
                if t >= 0:
                    x = ref.to_float32(rep.partials[t][s, slot], "bfloat16").reshape(-1, 128)
                    bound[i] += np.repeat(np.abs(x).max(axis=1), 128) / 16
        bound += np.abs(exact[s]) * 2.0 ** -8 + 1e-6
        d = np.abs(got - exact[s])
        assert (d <= bound).all(), f"seed {seed}: rank {s}: max excess {(d - bound).max()}"
        assert (bound > 0).any()


def test_fp8_combine_argument_rules():
    import ep_a2a
    with pytest.raises(ValueError, match="combine_quant"):
        make(2, hidden=200, combine_quant="fp8")
    with pytest.raises(ValueError, match="combine_quant"):
        make(2, hidden=256, combine_quant="fp8", protocol="sentinel")
    with pytest.raises(ValueError, match="combine_quant"):
        make(2, hidden=256, combine_quant="int4")
    assert ep_a2a  # the module imports


def test_fp8_combine_into_an_out_aligned_only_to_its_elements():
    """The reduction's element-wise store path (an `out` 2 bytes past a 16-byte boundary)
    writes exactly what its 16-byte path writes for the same step."""
    from ep_a2a.check import random_payload, routing
    from ep_a2a.driver.memory import copy_from_numpy, empty, from_numpy, to_numpy
    from ep_a2a.reference import from_float32
    rng = np.random.default_rng()
    ep, T, H, top_k = 4, 9, 256, 4
    group, a2a = make(ep, top_k=top_k, hidden=H, combine_quant="fp8", max_tokens=16)
    with group, a2a:
        ins, parts, odd = [], [], []
        for r in a2a.ranks:
            ids = routing("uniform", rng, T, top_k, a2a.num_experts, ep, r.rank)
            ins.append((from_numpy(ids, r.device, "int32"),
                        [from_numpy(random_payload(rng, sp, T), r.device, sp.dtype) for sp in a2a.payload_specs]))
            parts.append(from_float32(rng.standard_normal((ep, T, H)).astype(np.float32), "bfloat16"))
            buf = empty((T * H + 8,), "bfloat16", r.device)
            odd.append(buf.view(2, (T, H)))
            assert odd[-1].ptr % 16 == 2
        got = []
        for step in range(2):  # the same inputs twice: the internal (aligned) output, then `odd`
            for r, p in zip(a2a.ranks, parts):  # (before any launch: a host copy may block)
                copy_from_numpy(r.combine_input(T), p)
            for r, (ids, pays) in zip(a2a.ranks, ins):
                r.dispatch(ids, pays, T)
            outs = [r.combine(r.combine_input(T), T, out=None if step == 0 else o) for r, o in zip(a2a.ranks, odd)]
            a2a.synchronize()
            got.append([to_numpy(o).copy() for o in outs])
        for s in range(ep):
            assert got[0][s].tobytes() == got[1][s].tobytes(), f"rank {s}"
