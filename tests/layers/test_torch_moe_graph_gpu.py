"""The PyTorch MoE layer of every in-process rank captured in one CUDA graph per batch size (as
`python -m ep_a2a.bench_layer --graph` does): replays in a shuffled order, each with fresh
inputs, bitwise equal to an eager step on the same inputs; and in the small profile (8 ranks)
the graphed layer and the graphed all-gather baseline within the float64 oracle's bounds.
Fresh random inputs every run; the seed is in every failure message."""
import random

import numpy as np
import pytest
from common import fresh_rng

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from ep_a2a.layers.torch import grouped_mm_support
    dev = torch.device("cuda", 0)
    fn, reason = grouped_mm_support(dev)
    if fn is None:
        pytest.skip(f"the graphed layer needs torch's grouped GEMM: {reason}")
    return dev


def _build(ep, E, top_k, H, I, tmax, protocol, dev):
    import ep_a2a
    from ep_a2a.layers.torch import TorchMoeLayer, payload_specs
    from ep_a2a.moe import local_experts
    w1 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).to(torch.bfloat16)
    group = ep_a2a.LocalGroup([0] * ep)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=top_k, num_experts=E,
                             payloads=payload_specs(H, top_k), combine_hidden_size=H, protocol=protocol,
                             timeout_s=20.0, validate_expert_ids=False)
    layers = []
    for r in a2a.ranks:
        first, n = local_experts(E, ep, r.rank)
        layers.append(TorchMoeLayer(r, w1[first:first + n], w2[first:first + n], gemm="grouped"))
    return group, a2a, layers, (w1, w2)


def _close(group, a2a, layers):
    torch.cuda.synchronize()
    for layer in layers:
        layer.close()
    a2a.close()
    group.close()


def _fill(rng, xs, logits, routing, E, top_k):
    """Fresh hidden states and logits that route as `routing` (the benchmark's inputs)."""
    from ep_a2a.tools.bench_layer_graphs import logits_for, routing_ids
    ep, T = len(xs), xs[0].shape[0]
    ids = routing_ids(rng, routing, ep, T, top_k, E)
    lgs = [logits_for(rng, i, E) for i in ids]
    for x, lg, l_np in zip(xs, logits, lgs):
        x.copy_(torch.from_numpy(rng.standard_normal(x.shape, dtype=np.float32)).to(torch.bfloat16))
        lg.copy_(torch.from_numpy(l_np))
    torch.cuda.synchronize()
    return lgs


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_graphs_per_size_replayed_shuffled_equal_the_eager_layer(protocol):
    from ep_a2a.layers.torch import moe_forward_all_ranks
    dev = _cuda()
    rng, seed = fresh_rng()
    torch.manual_seed(int(rng.integers(2 ** 31)))
    ep, E, top_k, H, I, sizes = 4, 16, 4, 256, 128, [1, 5, 32]
    group, a2a, layers, _ = _build(ep, E, top_k, H, I, max(sizes), protocol, dev)
    ins = {T: ([torch.empty(T, H, dtype=torch.bfloat16, device=dev) for _ in layers],
               [torch.empty(T, E, dtype=torch.float32, device=dev) for _ in layers]) for T in sizes}
    graphs = {}
    try:
        for T in sizes:  # one eager step per size first: the views of each T^ exist before capture
            _fill(rng, *ins[T], "perfect", E, top_k)
            moe_forward_all_ranks(layers, *ins[T], T)
        torch.cuda.synchronize()
        for T in sizes:
            graphs[T] = g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="global"):
                moe_forward_all_ranks(layers, *ins[T], T)
            torch.cuda.synchronize()
        order = [(T, r) for T in sizes for r in ("perfect", "zipf0", "zipf1.25")]
        random.Random(seed).shuffle(order)
        for i, (T, routing) in enumerate(order):
            _fill(rng, *ins[T], routing, E, top_k)
            want = [o.clone() for o in moe_forward_all_ranks(layers, *ins[T], T)]
            torch.cuda.synchronize()
            for layer in layers:
                layer._out.view(torch.int16).fill_(-1)   # poison: a replay that writes nothing shows
                layer._xg.view(torch.int16).fill_(-1)
            torch.cuda.synchronize()
            graphs[T].replay()
            torch.cuda.synchronize()
            for r, (w, layer) in enumerate(zip(want, layers)):
                got = layer._out[:T]
                assert torch.equal(got.view(torch.int16), w.view(torch.int16)), \
                    f"{seed} {protocol} replay {i} of {order}: T={T} {routing} rank {r} differs from the eager step"
                assert torch.isfinite(w.float()).all(), f"{seed}: eager output not finite"
    finally:
        graphs.clear()
        _close(group, a2a, layers)


def test_small_profile_graphs_and_baseline_within_the_oracle():
    """8 ranks, hidden 2048, intermediate 1024, 64 experts, top-8, T = 1 / 16 / 128: our graphed
    layer and the graphed all-gather baseline against the float64 dense reference (on the GPU),
    within testing.layer_oracle's bf16 bounds; the GEMM-only floor's graph replays."""
    from ep_a2a.layers.torch import dense_reference_torch, moe_forward_all_ranks
    from ep_a2a.testing.layer_oracle import check_layer_output, route_reference
    from ep_a2a.tools.bench_layer_baseline import AllGatherBaseline, GemmFloor
    dev = _cuda()
    rng, seed = fresh_rng()
    torch.manual_seed(int(rng.integers(2 ** 31)))
    ep, E, top_k, H, I, sizes = 8, 64, 8, 2048, 1024, [1, 16, 128]
    group, a2a, layers, (w1, w2) = _build(ep, E, top_k, H, I, max(sizes), "fence", dev)
    floor = GemmFloor(layers)
    try:
        for T in sizes:
            xs = [torch.empty(T, H, dtype=torch.bfloat16, device=dev) for _ in layers]
            logits = [torch.empty(T, E, dtype=torch.float32, device=dev) for _ in layers]
            base = AllGatherBaseline(layers, T)
            _fill(rng, xs, logits, "perfect", E, top_k)
            moe_forward_all_ranks(layers, xs, logits, T)
            base.step(xs, logits)
            floor.set_offsets()
            torch.cuda.synchronize()
            g_ours, g_base, g_floor = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_ours, capture_error_mode="global"):
                moe_forward_all_ranks(layers, xs, logits, T)
            with torch.cuda.graph(g_base, capture_error_mode="global"):
                base_out = base.step(xs, logits)
            with torch.cuda.graph(g_floor, capture_error_mode="global"):
                floor.step(T)
            for routing in ("perfect", "zipf1.25"):
                lgs = _fill(rng, xs, logits, routing, E, top_k)
                g_ours.replay()
                g_base.replay()
                g_floor.replay()
                torch.cuda.synchronize()
                routes = [route_reference(lg, top_k) for lg in lgs]
                ids = torch.from_numpy(np.concatenate([r[0] for r in routes])).to(dev).long()
                w = torch.from_numpy(np.concatenate([r[1] for r in routes])).to(dev)
                want = dense_reference_torch(torch.cat(xs), ids, w, w1, w2).cpu().numpy()
                for r, layer in enumerate(layers):
                    rows = want[r * T:(r + 1) * T]
                    msg = f"{seed} T={T} {routing} rank {r}"
                    check_layer_output(layer._out[:T].float().cpu().numpy(), rows, f"{msg} ours (graph)")
                    check_layer_output(base_out[r].float().cpu().numpy(), rows, f"{msg} baseline (graph)")
            del g_ours, g_base, g_floor, base
            torch.cuda.synchronize()
    finally:
        _close(group, a2a, layers)


def test_graphed_benchmark_runs_end_to_end(tmp_path):
    """The --graph command on a small shape, stages included: every row has step times, stages
    without an error, the graph equal to the eager step, and the table printed last."""
    import json
    import subprocess
    import sys
    _cuda()
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "ep_a2a.bench_layer", "--graph", "--ranks", "4", "--hidden", "512", "--intermediate",
           "256", "--experts", "16", "--top-k", "4", "--tokens", "1,8", "--routing", "perfect,zipf1",
           "--replays", "5", "--stage-replays", "3", "--host-iters", "3", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 4
    for row in doc["rows"]:
        assert row["graph_equals_eager"], row
        for name in ("ours", "baseline", "gemm_floor"):
            assert row[name]["step_us"] > 0 and "error" not in row[name]["stages"], (name, row[name])
        assert row["ours"]["stages"]["mean_us"]["dispatch"] > 0, row["ours"]["stages"]
    assert p.stdout.strip().splitlines()[0].split()[:2] == ["T", "routing"], p.stdout
