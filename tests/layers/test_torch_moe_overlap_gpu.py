"""Two-batch overlap in the PyTorch MoE layer (ep_a2a/layers/torch_overlap.py) on in-process
ranks of one GPU: the overlapped step (TBO order of the halves) equals the sequential one bit
for bit, with random token counts per rank and micro-batch, eagerly and from CUDA graphs
replayed in a shuffled order with fresh inputs, both protocols; both within the float64
oracle's bf16 bounds; and the benchmark's overlapped mode end to end. The seed is in every
failure message."""
import random

import numpy as np
import pytest
from common import fresh_rng

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

# ep, experts, top_k, hidden, intermediate, T^
SHAPE = (4, 16, 4, 256, 128, 24)


def _cuda(graphs=False):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    dev = torch.device("cuda", 0)
    if graphs:
        from ep_a2a.layers.torch import grouped_mm_support
        fn, reason = grouped_mm_support(dev)
        if fn is None:
            pytest.skip(f"the graphed layer needs torch's grouped GEMM: {reason}")
    return dev


def _build(protocol, gemm, dev):
    import ep_a2a
    from ep_a2a.layers.torch import payload_specs
    from ep_a2a.layers.torch_overlap import TwoBatchMoe
    ep, E, top_k, H, I, tmax = SHAPE
    w1 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).to(torch.bfloat16)
    group = ep_a2a.LocalGroup([0] * ep)
    opts = dict(max_tokens_per_rank=tmax, top_k=top_k, num_experts=E, payloads=payload_specs(H, top_k),
                combine_hidden_size=H, protocol=protocol, timeout_s=20.0, validate_expert_ids=False)
    a2as = [ep_a2a.MoeAlltoAll(group, **opts) for _ in range(2)]
    tb = TwoBatchMoe(*a2as, w1, w2, gemm=gemm)
    return group, a2as, tb, (w1, w2)


def _close(group, a2as, tb):
    torch.cuda.synchronize()
    tb.close()
    for a in a2as:
        a.close()
    group.close()


def _inputs(rng, sizes, dev):
    """Per micro-batch and rank: hidden states and logits of `sizes` tokens (empty tensors)."""
    _, E, _, H, _, _ = SHAPE
    return {m: ([torch.empty(t, H, dtype=torch.bfloat16, device=dev) for t in sizes[m]],
                [torch.empty(t, E, dtype=torch.float32, device=dev) for t in sizes[m]]) for m in "AB"}


def _fill(rng, ins):
    """Fresh values in place: bf16 hidden states, logits whose top-k has no ties."""
    from ep_a2a.testing.layer_oracle import distinct_logits
    for xs, lgs in ins.values():
        for x, lg in zip(xs, lgs):
            x.copy_(torch.from_numpy(rng.standard_normal(tuple(x.shape), dtype=np.float32)).to(torch.bfloat16))
            lg.copy_(torch.from_numpy(distinct_logits(rng, lg.shape[0], lg.shape[1])))
    torch.cuda.synchronize()


def _poison(tb):
    for layer in tb.layers:
        layer.half_output.view(torch.int16).fill_(-1)  # NaN: a step that writes nothing shows
        layer.buffers[0].view(torch.int16).fill_(-1)
    torch.cuda.synchronize()


def _step(tb, ins, order):
    _poison(tb)
    outs_a, outs_b = tb.step(*ins["A"], *ins["B"], SHAPE[5], order=order)
    return [o.clone() for o in outs_a + outs_b]


def _sizes(rng):
    ep, tmax = SHAPE[0], SHAPE[5]
    sizes = {m: [int(rng.integers(0, tmax + 1)) for _ in range(ep)] for m in "AB"}
    sizes["A"][0], sizes["B"][-1] = tmax, 0  # a full rank and an empty one
    return sizes


def _equal(got, want, msg):
    for i, (g, w) in enumerate(zip(got, want)):
        micro, rank = "AB"[i // SHAPE[0]], i % SHAPE[0]
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{msg}: micro-batch {micro} rank {rank} differs"


def _check_oracle(tb, ins, outs, weights, msg):
    """Every output within the bf16 bounds of the float64 layer (the routing each layer chose)."""
    from ep_a2a.layers.torch import dense_reference_torch
    from ep_a2a.testing.layer_oracle import check_layer_output
    ep = SHAPE[0]
    for m, layers in (("A", tb.layers_a), ("B", tb.layers_b)):
        xs = ins[m][0]
        ids = torch.cat([layer.routing[0] for layer in layers]).long()
        w = torch.cat([layer.routing[1] for layer in layers])
        want = dense_reference_torch(torch.cat(xs), ids, w, *weights).cpu().numpy()
        start = 0
        for r in range(ep):
            T = xs[r].shape[0]
            got = outs["AB".index(m) * ep + r].float().cpu().numpy()
            check_layer_output(got, want[start:start + T], f"{msg} micro-batch {m} rank {r} ({T} tokens)")
            start += T


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
@pytest.mark.parametrize("gemm", ["auto", "loop"])
def test_overlapped_step_equals_the_sequential_one_eagerly(protocol, gemm):
    dev = _cuda()
    rng, seed = fresh_rng()
    torch.manual_seed(int(rng.integers(2 ** 31)))
    group, a2as, tb, weights = _build(protocol, gemm, dev)
    try:
        for step in range(3):
            sizes = _sizes(rng)
            ins = _inputs(rng, sizes, dev)
            _fill(rng, ins)
            msg = f"{seed} {protocol} {tb.layers_a[0].gemm} step {step} sizes {sizes}"
            seq = _step(tb, ins, "sequential")
            _check_oracle(tb, ins, seq, weights, msg)
            over = _step(tb, ins, "overlapped")
            _equal(over, seq, f"{msg} overlapped vs sequential")
            # any legal interleaving: both sends first, then both receives
            both = [("A", "dispatch_send"), ("B", "dispatch_send"), ("A", "dispatch_recv"), ("B", "dispatch_recv"),
                    ("A", "experts"), ("B", "experts"), ("A", "combine_send"), ("B", "combine_send"),
                    ("A", "combine_recv"), ("B", "combine_recv")]
            _equal(_step(tb, ins, both), seq, f"{msg} sends-first vs sequential")
    finally:
        _close(group, a2as, tb)


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_graphed_overlapped_step_equals_the_eager_sequential_one(protocol):
    """Graphs of both orders (random sizes per rank, fixed per graph), replayed in a shuffled
    order, each replay on fresh inputs against an eager sequential step on the same inputs."""
    dev = _cuda(graphs=True)
    rng, seed = fresh_rng()
    torch.manual_seed(int(rng.integers(2 ** 31)))
    group, a2as, tb, weights = _build(protocol, "grouped", dev)
    graphs = {}
    try:
        sizes = _sizes(rng)
        ins = _inputs(rng, sizes, dev)
        _fill(rng, ins)
        for order in ("overlapped", "sequential"):  # eager first: every view of T^ exists before capture
            _step(tb, ins, order)
        torch.cuda.synchronize()
        for order in ("overlapped", "sequential"):
            graphs[order] = g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="global"):
                tb.step(*ins["A"], *ins["B"], SHAPE[5], order=order)
            torch.cuda.synchronize()
        replays = ["overlapped"] * 4 + ["sequential"] * 2
        random.Random(seed).shuffle(replays)
        for i, order in enumerate(replays):
            _fill(rng, ins)
            want = _step(tb, ins, "sequential")
            _poison(tb)
            graphs[order].replay()
            torch.cuda.synchronize()
            got = [layer.half_output[:x.shape[0]] for layers, xs in ((tb.layers_a, ins["A"][0]), (tb.layers_b, ins["B"][0]))
                   for layer, x in zip(layers, xs)]
            msg = f"{seed} {protocol} replay {i} of {replays} sizes {sizes}"
            _equal(got, want, f"{msg}: {order} graph vs eager sequential")
            if i == 0:
                _check_oracle(tb, ins, want, weights, msg)
    finally:
        graphs.clear()
        _close(group, a2as, tb)


def test_overlap_benchmark_runs_end_to_end(tmp_path):
    """`python -m ep_a2a.bench_layer --graph --overlap` on a small shape: rows for both
    protocols and every size, step times, the graph equal to the eager sequential step."""
    import json
    import subprocess
    import sys
    _cuda(graphs=True)
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "ep_a2a.bench_layer", "--graph", "--overlap", "--ranks", "4", "--hidden", "512",
           "--intermediate", "256", "--experts", "16", "--top-k", "4", "--tokens", "1,8", "--replays", "5",
           "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert sorted((r["protocol"], r["tokens_per_rank"]) for r in doc["rows"]) == \
        [("fence", 1), ("fence", 8), ("sentinel", 1), ("sentinel", 8)]
    for row in doc["rows"]:
        assert row["graph_overlapped_equals_eager_sequential"], row
        assert row["eager_overlapped_equals_sequential"], row
        for name in ("overlapped", "sequential", "fused", "gemm_floor"):
            assert row[name]["step_us"] > 0, (name, row[name])
    assert p.stdout.strip().splitlines()[0].split()[:2] == ["protocol", "T"], p.stdout
