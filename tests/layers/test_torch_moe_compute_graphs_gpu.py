"""TorchMoeLayer(compute_graphs=True): the compute phase of each T^ replayed from a CUDA graph of
the rank's stream after one eager step with that T^; every step bitwise equal to layers without
graphs on the same all-to-all and inputs, over T^ in a shuffled order with fresh inputs and token
counts, both protocols and FENCE with the FP8 combine (the separate finalize kernel then), the
expert kernels' sizes and the grouped GEMM's; and whole steps of the graphed layers captured by
the caller (no nested capture), replayed with fresh inputs. Fresh
random inputs every run; the seed is in every failure message."""
import numpy as np
import pytest
from common import fresh_rng, layer_token_counts

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("protocol, quant", [("fence", None), ("sentinel", None), ("fence", "fp8")])
def test_compute_graphs_equal_the_eager_layer_over_shuffled_sizes(protocol, quant):
    import ep_a2a
    from ep_a2a.layers.torch import TorchMoeLayer, grouped_mm_support, moe_forward_all_ranks, payload_specs
    from ep_a2a.moe import local_experts
    from ep_a2a.testing.layer_oracle import distinct_logits
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    dev = torch.device("cuda", 0)
    if grouped_mm_support(dev)[0] is None:
        pytest.skip("needs torch's grouped GEMM")
    rng, seed = fresh_rng()
    torch.manual_seed(int(rng.integers(2 ** 31)))
    ep, E, top_k, H, I = 4, 16, 4, 256, 128
    # auto at hidden 256: the expert kernels up to 512 rows an expert may get (4 x 2: 16-row passes;
    # 4 x 40: the wide kernels), torch's grouped GEMM past them (4 x 160)
    sizes = [2, 40, 160]
    w1 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).to(torch.bfloat16)
    with ep_a2a.LocalGroup([0] * ep) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max(sizes), top_k=top_k, num_experts=E,
                               payloads=payload_specs(H, top_k), combine_hidden_size=H, protocol=protocol,
                               timeout_s=20.0, validate_expert_ids=False, combine_quant=quant) as a2a:
        graphed, plain = [], []
        try:
            for r in a2a.ranks:
                first, n = local_experts(E, ep, r.rank)
                graphed.append(TorchMoeLayer(r, w1[first:first + n], w2[first:first + n], compute_graphs=True))
                plain.append(TorchMoeLayer(r, w1[first:first + n], w2[first:first + n]))
            assert [ep * T <= graphed[0].fused_max_rows for T in sizes] == [True, True, False]  # (both paths graphed)
            order = [int(t) for t in rng.permutation(sizes * 3)]
            for step, tmax in enumerate(order):
                tokens = layer_token_counts(rng, ep, tmax, step)
                msg = f"{seed} {protocol} {quant} step {step} T^={tmax} tokens={tokens}"
                xs = [torch.from_numpy(rng.standard_normal((T, H), dtype=np.float32)).to(dev).to(torch.bfloat16) for T in tokens]
                lg = [torch.from_numpy(distinct_logits(rng, T, E)).to(dev) for T in tokens]
                got = [o.clone() for o in moe_forward_all_ranks(graphed, xs, lg, tmax)]
                want = [o.clone() for o in moe_forward_all_ranks(plain, xs, lg, tmax)]
                torch.cuda.synchronize()
                for r, (g, w) in enumerate(zip(got, want)):
                    assert torch.equal(g.view(torch.int16), w.view(torch.int16)), \
                        f"{msg} rank {r}: {int((g != w).sum())} values differ"
            for layer in graphed:  # every size seen at least twice: each has its graph
                assert sorted(layer._graphs) == sorted(sizes), f"{seed}: graphs of {sorted(layer._graphs)}"
            # The caller's own capture of whole steps: the layer runs its pieces inside it (no nested capture).
            tmax = sizes[0]
            xs = [torch.empty(tmax, H, dtype=torch.bfloat16, device=dev) for _ in graphed]
            lg = [torch.empty(tmax, E, dtype=torch.float32, device=dev) for _ in graphed]
            whole = torch.cuda.CUDAGraph()
            with torch.cuda.graph(whole, capture_error_mode="global"):
                outs = moe_forward_all_ranks(graphed, xs, lg, tmax)
            for replay in range(2):
                for x, l in zip(xs, lg):
                    x.copy_(torch.from_numpy(rng.standard_normal(x.shape, dtype=np.float32)).to(torch.bfloat16))
                    l.copy_(torch.from_numpy(distinct_logits(rng, tmax, E)))
                for o in outs:
                    o.view(torch.int16).fill_(-1)  # poison: a replay that writes nothing shows
                whole.replay()
                want = [o.clone() for o in moe_forward_all_ranks(plain, xs, lg, tmax)]
                torch.cuda.synchronize()
                for r, (g, w) in enumerate(zip(outs, want)):
                    assert torch.equal(g.view(torch.int16), w.view(torch.int16)), \
                        f"{seed} {protocol} {quant} whole-step replay {replay} rank {r}: {int((g != w).sum())} values differ"
        finally:
            torch.cuda.synchronize()
            for layer in graphed + plain:
                layer.close()


def test_compute_graphs_refuse_the_loop_gemm():
    import ep_a2a
    from ep_a2a.layers.torch import TorchMoeLayer, payload_specs
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    dev = torch.device("cuda", 0)
    H, I, E = 256, 128, 4
    w1 = torch.zeros(E, 2 * I, H, device=dev, dtype=torch.bfloat16)
    w2 = torch.zeros(E, H, I, device=dev, dtype=torch.bfloat16)
    with ep_a2a.LocalGroup([0]) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=4, top_k=2, num_experts=E, payloads=payload_specs(H, 2),
                               combine_hidden_size=H) as a2a:
        with pytest.raises(ValueError, match="compute_graphs: not with the loop GEMM"):
            TorchMoeLayer(a2a.ranks[0], w1, w2, gemm="loop", compute_graphs=True)
