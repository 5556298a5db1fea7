"""The PyTorch MoE layer (ep_a2a/layers/torch.py) on in-process ranks of one GPU, against the dense
float64 reference of the same layer over every token and expert (NumPy), within the bf16
tolerances stated in testing.layer_oracle (TOKEN_REL_L2, ELEMENT_ULPS, TOTAL_REL_L2: six bf16 roundings
on the path, 2-3x margin over a simulation of them). Fresh random inputs every run; the seed
is in every failure message."""
import numpy as np
import pytest
from common import fresh_rng, layer_token_counts

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

# ep, experts, top_k, hidden, intermediate, max_tokens_per_rank
CASES = [
    (1, 8, 2, 256, 128, 32),
    (2, 16, 4, 512, 256, 64),
    (4, 8, 2, 256, 64, 48),
    (4, 20, 4, 512, 128, 40),
    (4, 9, 4, 256, 128, 24),   # uneven split: rank 0 owns 3 experts, the others 2
]


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch.device("cuda", 0)


def _build(ep, E, top_k, H, I, tmax, protocol, gemm, rng, dev, combine_quant=None):
    import ep_a2a
    from ep_a2a.moe import local_experts
    from ep_a2a.layers.torch import TorchMoeLayer, bf16_from_bits, payload_specs
    from ep_a2a.testing.layer_oracle import random_weights
    w1_bits, w2_bits = random_weights(rng, E, H, I)
    group = ep_a2a.LocalGroup([0] * ep)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=top_k, num_experts=E,
                             payloads=payload_specs(H, top_k), combine_hidden_size=H, combine_dtype="bfloat16",
                             protocol=protocol, timeout_s=20.0, combine_quant=combine_quant)
    w1, w2 = bf16_from_bits(w1_bits, dev), bf16_from_bits(w2_bits, dev)
    layers = []
    for r in a2a.ranks:
        first, n = local_experts(E, ep, r.rank)
        layers.append(TorchMoeLayer(r, w1[first:first + n], w2[first:first + n], gemm=gemm))
    return group, a2a, layers, (w1_bits, w2_bits)


def _poison(layers):
    """NaN (0xFFFF) into every buffer a step writes before it is read: a skipped write shows."""
    for layer in layers:
        for t in (layer._out, layer._xg, layer._act) + ((layer._h, layer._y) if layer.gemm == "loop" else ()):
            t.view(torch.int16).fill_(-1)
    torch.cuda.synchronize()


def _run_and_check(layers, weights_bits, xs_bits, routers, ref_routing, dev, msg):
    from ep_a2a.testing.reference import to_float32
    from ep_a2a.layers.torch import bf16_from_bits, bits_from_bf16, moe_forward_all_ranks
    from ep_a2a.testing.layer_oracle import check_layer_output, dense_reference
    ep = len(layers)
    xs = [bf16_from_bits(x, dev) for x in xs_bits]
    _poison(layers)
    outs = moe_forward_all_ranks(layers, xs, routers)
    torch.cuda.synchronize()
    ids = np.concatenate([r[0] for r in ref_routing])
    w = np.concatenate([r[1] for r in ref_routing])
    want = dense_reference(np.concatenate(xs_bits), ids, w, *weights_bits)
    start = 0
    for r in range(ep):
        T = xs_bits[r].shape[0]
        got = to_float32(bits_from_bf16(outs[r]), "bfloat16")
        check_layer_output(got, want[start:start + T], f"{msg} rank {r} ({layers[r].gemm} GEMM, {T} tokens)")
        start += T
    return want


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
@pytest.mark.parametrize("ep,E,top_k,H,I,tmax", CASES)
def test_layer_matches_dense_reference(ep, E, top_k, H, I, tmax, protocol):
    from ep_a2a.testing.reference import from_float32
    from ep_a2a.testing.layer_oracle import distinct_logits, route_reference
    dev = _cuda()
    rng, seed = fresh_rng()
    group, a2a, layers, wbits = _build(ep, E, top_k, H, I, tmax, protocol, "auto", rng, dev)
    try:
        for step in range(3):
            tokens = layer_token_counts(rng, ep, tmax, step)
            msg = f"{seed} {protocol} step {step} tokens={tokens}"
            xs_bits = [from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16") for T in tokens]
            logits = [distinct_logits(rng, T, E) for T in tokens]
            ref_routing = [route_reference(lg, top_k) for lg in logits]
            _run_and_check(layers, wbits, xs_bits, [torch.from_numpy(lg).to(dev) for lg in logits], ref_routing, dev, msg)
            for r, layer in enumerate(layers):  # the router itself
                ids, w = (t.cpu().numpy() for t in layer.routing)
                assert np.array_equal(ids, ref_routing[r][0]), f"{msg} rank {r}: router ids"
                np.testing.assert_allclose(w, ref_routing[r][1], rtol=1e-5, atol=1e-7, err_msg=f"{msg} rank {r}: router weights")
    finally:
        for layer in layers:
            layer.close()
        a2a.close()
        group.close()


@pytest.mark.parametrize("gemm", ["loop", "auto", "fused"])
def test_given_routing_with_repeats_and_empty_selections(gemm):
    """Routing handed in as (ids, weights): repeated experts in a token, -1 (no expert),
    unnormalized weights; the per-expert loop, the grouped GEMM (auto at T^ 32) and the expert
    kernels at every size (fused: dozens of rows per expert, several passes)."""
    from ep_a2a.testing.reference import from_float32
    dev = _cuda()
    rng, seed = fresh_rng()
    ep, E, top_k, H, I, tmax = 4, 12, 4, 256, 128, 32
    group, a2a, layers, wbits = _build(ep, E, top_k, H, I, tmax, "fence", gemm, rng, dev)
    try:
        for step in range(2):
            tokens = layer_token_counts(rng, ep, tmax, step)
            xs_bits = [from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16") for T in tokens]
            ref_routing, routers = [], []
            for T in tokens:
                ids = rng.integers(0, E, (T, top_k)).astype(np.int32)
                ids[:, 1] = ids[:, 0]  # a repeat in every token
                ids = np.where(rng.random((T, top_k)) < 0.15, -1, ids).astype(np.int32)
                w = rng.uniform(0.1, 1.0, (T, top_k)).astype(np.float32)
                ref_routing.append((ids, w))
                routers.append((torch.from_numpy(ids).to(dev), torch.from_numpy(w).to(dev)))
            _run_and_check(layers, wbits, xs_bits, routers, ref_routing, dev, f"{seed} gemm={gemm} step {step} tokens={tokens}")
    finally:
        for layer in layers:
            layer.close()
        a2a.close()
        group.close()


def test_grouped_layer_activation_is_torchs_on_the_rows_received():
    """The grouped path's fused activation inside the layer: after a step, each rank's
    activation buffer holds bitwise torch's F.silu(gate) * up of FC1 recomputed on the rows it
    gathered, for the rows its index placed (offsets[-1]); the rows past them keep the poison
    (nothing computes padding)."""
    import torch.nn.functional as F
    from ep_a2a.layers.torch import bf16_from_bits, grouped_mm_support, moe_forward_all_ranks
    from ep_a2a.testing.layer_oracle import distinct_logits
    from ep_a2a.testing.reference import from_float32
    dev = _cuda()
    if grouped_mm_support(dev)[0] is None:
        pytest.skip(f"no grouped GEMM: {grouped_mm_support(dev)[1]}")
    rng, seed = fresh_rng()
    ep, E, top_k, H, I, tmax = 4, 16, 4, 256, 128, 24
    group, a2a, layers, _ = _build(ep, E, top_k, H, I, tmax, "fence", "grouped", rng, dev)
    try:
        for step in range(3):
            tokens = layer_token_counts(rng, ep, tmax, step)
            xs = [bf16_from_bits(from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16"), dev)
                  for T in tokens]
            logits = [torch.from_numpy(distinct_logits(rng, T, E)).to(dev) for T in tokens]
            _poison(layers)
            moe_forward_all_ranks(layers, xs, logits)
            torch.cuda.synchronize()
            for r, layer in enumerate(layers):
                msg = f"{seed} step {step} tokens={tokens} rank {r}"
                cap, total = layer.index.capacity, int(layer._offsets[-1])
                h = layer.fc1(layer._xg[:cap], layer._offs)
                want = (F.silu(h[:, :I]) * h[:, I:]).view(torch.int16)
                got = layer._act[:cap].view(torch.int16)
                assert torch.equal(got[:total], want[:total]), f"{msg}: activation differs from torch's"
                assert bool((got[total:] == -1).all()), f"{msg}: rows past the total ({total}) were written"
    finally:
        for layer in layers:
            layer.close()
        a2a.close()
        group.close()


def test_layer_with_fp8_combine_close_to_the_bf16_layer():
    """combine_quant="fp8": finalize writes e4m3 partials (a scale per 128 values) into the
    workspace and combine pulls those. The same weights, inputs and routing through a layer
    with the bf16 combine and one with FP8: every token within 2**-3 relative L2 of the bf16
    output (e4m3 keeps 3 mantissa bits: about 2**-5 on normal data), and not all equal (the
    FP8 path ran)."""
    from ep_a2a.testing.reference import from_float32, to_float32
    from ep_a2a.layers.torch import bf16_from_bits, bits_from_bf16, moe_forward_all_ranks
    from ep_a2a.testing.layer_oracle import distinct_logits
    dev = _cuda()
    rng, seed = fresh_rng()
    ep, E, top_k, H, I, tmax = 4, 16, 4, 256, 128, 32
    wseed = int(rng.integers(2 ** 31))
    tokens = [tmax, 5, 0, 17]
    xs_bits = [from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16") for T in tokens]
    logits = [distinct_logits(rng, T, E) for T in tokens]
    outs = {}
    for quant in (None, "fp8"):
        group, a2a, layers, _ = _build(ep, E, top_k, H, I, tmax, "fence", "auto", np.random.default_rng(wseed), dev,
                                       combine_quant=quant)
        try:
            for layer in layers:
                assert layer._fp8 == (quant == "fp8")
            got = moe_forward_all_ranks(layers, [bf16_from_bits(x, dev) for x in xs_bits],
                                        [torch.from_numpy(lg).to(dev) for lg in logits])
            torch.cuda.synchronize()
            outs[quant] = [to_float32(bits_from_bf16(o), "bfloat16") for o in got]
        finally:
            for layer in layers:
                layer.close()
            a2a.close()
            group.close()
    differ = False
    for r, (a, b) in enumerate(zip(outs[None], outs["fp8"])):
        assert np.isfinite(b).all(), f"{seed} rank {r}: FP8 output not finite"
        err = np.linalg.norm(b - a, axis=1)
        ref = np.linalg.norm(a, axis=1)
        assert (err <= 2.0 ** -3 * ref + 1e-30).all(), f"{seed} rank {r}: relative error {(err / np.maximum(ref, 1e-30)).max():.3g}"
        differ |= bool((a != b).any())
    assert differ, f"{seed}: the FP8 layer returned the bf16 layer's bits (FP8 combine did not run?)"


def test_torch_dense_reference_agrees_with_numpy():
    from ep_a2a.testing.reference import from_float32
    from ep_a2a.layers.torch import bf16_from_bits, dense_reference_torch
    from ep_a2a.testing.layer_oracle import dense_reference, distinct_logits, random_weights, route_reference
    dev = _cuda()
    rng, seed = fresh_rng()
    N, E, top_k, H, I = 50, 8, 3, 128, 64
    w1, w2 = random_weights(rng, E, H, I)
    x = from_float32(rng.standard_normal((N, H)).astype(np.float32), "bfloat16")
    ids, w = route_reference(distinct_logits(rng, N, E), top_k)
    want = dense_reference(x, ids, w, w1, w2)
    got = dense_reference_torch(bf16_from_bits(x, dev), torch.from_numpy(ids).to(dev).long(), torch.from_numpy(w).to(dev),
                                bf16_from_bits(w1, dev), bf16_from_bits(w2, dev)).cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max(), err_msg=seed)


def test_grouped_gemm_used_on_hopper():
    """torch's grouped GEMM is expected on sm_90+; this says why when the layer falls back."""
    from ep_a2a.layers.torch import grouped_mm_support
    dev = _cuda()
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("grouped_mm's bf16 kernels need sm_90+")
    fn, reason = grouped_mm_support(dev)
    assert fn is not None, f"torch {torch.__version__}: {reason} (the layer falls back to the per-expert loop)"


def test_offsets_read_in_place_on_hopper():
    """grouped_mm takes the index's offsets[1:] (4 bytes past a 16-byte boundary) as they are,
    with the bits of aligned offsets: the layer then copies nothing before FC1."""
    from ep_a2a.layers.torch import grouped_mm_support, grouped_mm_takes_offset_views
    dev = _cuda()
    if grouped_mm_support(dev)[0] is None:
        pytest.skip(f"no grouped GEMM: {grouped_mm_support(dev)[1]}")
    assert grouped_mm_takes_offset_views(dev), f"torch {torch.__version__}: grouped_mm refused an offsets view"


@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_router_is_the_fused_kernel(renormalize):
    """TorchMoeLayer.route runs ep_a2a's router (one kernel) and gives torch.topk's ids and
    torch.softmax's weights (within the router test's bound) on logits without ties; non-
    contiguous logits take torch's path with the same result; the FC1 offsets are read in place."""
    import ep_a2a
    from ep_a2a.layers.torch import TorchMoeLayer, payload_specs
    from ep_a2a.testing.layer_oracle import distinct_logits
    dev = _cuda()
    rng, seed = fresh_rng()
    E, top_k, H, I, tmax = 64, 8, 128, 64, 32
    group = ep_a2a.LocalGroup([0])
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=top_k, num_experts=E,
                             payloads=payload_specs(H, top_k), combine_hidden_size=H, combine_dtype="bfloat16")
    w1 = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16, device=dev)
    w2 = torch.zeros(E, H, I, dtype=torch.bfloat16, device=dev)
    layer = TorchMoeLayer(a2a.ranks[0], w1, w2, renormalize=renormalize)
    try:
        assert layer.route_reason is None, layer.route_reason
        if layer.gemm == "grouped":
            assert layer.buffers[2] is layer._ends, "the grouped GEMMs should read the offsets in place"
        for T in (1, 4, tmax):
            lg = torch.from_numpy(distinct_logits(rng, T, E)).to(dev)
            ids, w = layer.route(lg)
            assert ids.data_ptr() == layer._route_ids.data_ptr(), "the fused router writes the layer's buffers"
            top, want_ids = torch.topk(lg, top_k, dim=-1)
            want_w = torch.softmax(top, -1) if renormalize else torch.softmax(lg, -1).gather(1, want_ids)
            torch.cuda.synchronize()
            assert torch.equal(ids, want_ids.int()), f"{seed} T={T}"
            ulps = (w.view(torch.int32).long() - want_w.view(torch.int32).long()).abs().max()
            assert int(ulps) <= 2, f"{seed} T={T}: weights {int(ulps)} ulp from torch's"
            if T > 1:  # (non-contiguous logits: torch's path)
                ids_t, w_t = layer.route(lg.t().contiguous().t())
                assert ids_t.data_ptr() != layer._route_ids.data_ptr() and torch.equal(ids_t, want_ids.int()), seed
    finally:
        layer.close()
        a2a.close()
        group.close()
