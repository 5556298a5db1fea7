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


@pytest.mark.parametrize("cdtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("ep,top_k", [(1, 2), (3, 6), (8, 8), (8, 22)])
def test_fp8_combine_of_an_input_the_epilogue_quantized(cdtype, ep, top_k):
    """combine_input(T^, fp8=True) written by the MoE side: combine skips its quantize pass
    and delivers the same bits as when it quantizes itself; mixed with quantizing steps."""
    rng = np.random.default_rng()
    group, a2a = make(ep, top_k=top_k, hidden=384, cdtype=cdtype, combine_quant="fp8", max_tokens=64)
    with group, a2a:
        from ep_a2a.testing.harness import run_step
        for T, pre in ((1, True), (7, False), (64, True), (33, True), (64, False), (5, True)):
            rep = run_step(a2a, rng, [T] * ep, max(T, 8), exact=False, route="zipf", prequantize=pre)
            assert not rep.mismatches, (T, pre, rep.mismatches[:3])


def test_fp8_combine_input_rules():
    """An Fp8Partial is only this rank's own views for this T^; a plain all-to-all has none."""
    from ep_a2a.alltoall import Fp8Partial
    from ep_a2a.testing.harness import run_step
    rng = np.random.default_rng()
    group, a2a = make(2, top_k=2, hidden=256, combine_quant="fp8", max_tokens=16)
    with group, a2a:
        r0, r1 = a2a.ranks
        run_step(a2a, rng, [4, 4], 8)
        from ep_a2a.interop.arrays import from_numpy
        # (inputs first: in-process ranks spin on each other, so nothing blocks between launches)
        ins = [(from_numpy(np.zeros((2, 2), np.int32), r.device, "int32"),
                [_zeros(sp, 2, r.device) for sp in a2a.payload_specs]) for r in a2a.ranks]
        for r, (ids, pays) in zip(a2a.ranks, ins):
            r.dispatch(ids, pays, 8)
        bad = [r1.combine_input(8, fp8=True),                                     # another rank's views
               r0.combine_input(4, fp8=True),                                     # another T^
               Fp8Partial(r0.combine_input(8, fp8=True).values, r0.combine_input(8, fp8=True).scales, "float16")]
        for part in bad:
            with pytest.raises(ValueError, match="partial"):
                r0.combine(part, 8)
        for r in a2a.ranks:
            r.combine(r.combine_input(8, fp8=True), 8)
        a2a.synchronize()
    group, plain = make(2, top_k=2, hidden=256, max_tokens=16)
    with group, plain:
        with pytest.raises(ValueError, match="fp8"):
            plain.ranks[0].combine_input(8, fp8=True)


def _zeros(spec, rows, device):
    from ep_a2a.interop.arrays import copy_from_numpy, empty
    t = empty((rows,) + tuple(spec.shape), spec.dtype, device)
    copy_from_numpy(t, np.zeros(t.nbytes, np.uint8))
    return t


def test_fp8_combine_graph_replay_and_large_batch():
    rng = np.random.default_rng()
    group, a2a = make(8, top_k=8, hidden=7168, combine_quant="fp8", max_tokens=512)
    with group, a2a:
        run(a2a, rng, [512] * 8, 512, exact=False, route="uniform")
        run(a2a, rng, [3, 0, 512, 17, 1, 0, 100, 9], 512, exact=False)


def test_fp8_combine_error_within_bound_of_the_exact_combine():
    """The stated bound, on the GPU's own output: every combined value is within the sum, over
    its partial results, of their 128-block amax / 16, plus the output's bf16 rounding."""
    from ep_a2a.testing.harness import run_step
    from ep_a2a.testing import reference as ref
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
    """The reduction's element-wise store path: an `out` 2 bytes past a 16-byte boundary gets
    the model's bytes (bitwise), and the words around it are untouched."""
    from ep_a2a.testing.harness import run_step
    from ep_a2a.interop.arrays import copy_from_numpy, empty, to_numpy
    rng = np.random.default_rng()
    ep, T, H = 4, 9, 256
    group, a2a = make(ep, top_k=4, hidden=H, combine_quant="fp8", max_tokens=16)
    bufs = []

    def odd_out(r, shape, dtype):
        buf = empty((T * H + 16,), dtype, r.device)
        copy_from_numpy(buf, np.full(buf.nbytes, 0xA5, np.uint8))  # guard words around `out`
        bufs.append(buf)
        out = buf.view(2, shape)
        assert out.ptr % 16 == 2
        return out

    with group, a2a:
        for _ in range(2):
            bufs.clear()
            rep = run_step(a2a, rng, [T] * ep, T, exact=False, out_fn=odd_out)
            assert not rep.mismatches, rep.mismatches[:3]
            for buf in bufs:
                raw = to_numpy(buf).view(np.uint8)
                assert (raw[:2] == 0xA5).all() and (raw[2 + T * H * 2:] == 0xA5).all()
