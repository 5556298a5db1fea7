"""The halves' torch ops on in-process ranks (one torch stream each): an identity 'MoE' (each
dispatched row copied into the combine input) between dispatch_recv and combine_send, two
micro-batches (two all-to-alls) with their halves interleaved, outputs bitwise against the
reference; and the same step captured per half into torch CUDA graphs and replayed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_ops_gpu import _close, _cuda, _draw, _identity_want, _make  # noqa: E402

pytestmark = pytest.mark.gpu

ORDER = [("A", "dispatch_send"), ("B", "dispatch_send"), ("A", "dispatch_recv"), ("B", "dispatch_recv"),
         ("A", "combine_send"), ("B", "combine_send"), ("A", "combine_recv"), ("B", "combine_recv")]


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_halves_ops_of_two_micro_batches_match_the_reference(protocol):
    from ep_a2a.ops import torch as ops
    dev = _cuda()
    rng = np.random.default_rng()
    ep, T = 4, 8
    group, a = _make(ep, protocol=protocol)
    import ep_a2a
    b = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=a.max_tokens_per_rank, top_k=a.top_k,
                           num_experts=a.num_experts, payloads=a.payload_specs, combine_hidden_size=a.combine_hidden_size,
                           protocol=protocol, timeout_s=20.0)
    binds = {"A": [ops.bind(r) for r in a.ranks], "B": [ops.bind(r) for r in b.ranks]}
    streams = [torch.cuda.Stream() for _ in range(ep)]
    try:
        for step in range(3):
            inputs, outs, views = {}, {}, {}
            for name in "AB":
                for s in range(ep):
                    ids, x, w = _draw(rng, a, T)
                    inputs[name, s] = (ids, x, torch.from_numpy(ids).to(dev),
                                       [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(dev),
                                        torch.from_numpy(w).to(dev)])
            torch.cuda.synchronize()
            for name, op in ORDER:
                for s in range(ep):
                    tr = binds[name][s]
                    with torch.cuda.stream(streams[s]):
                        if op == "dispatch_send":
                            ops.dispatch_send(tr, inputs[name, s][2], inputs[name, s][3], T)
                        elif op == "dispatch_recv":
                            views[name, s] = ops.dispatch_recv(tr, T)
                            ops.combine_input(tr, T).copy_(views[name, s][1][0])  # the identity MoE
                        elif op == "combine_send":
                            outs[name, s] = ops.combine_send(tr, ops.combine_input(tr, T), T)
                        else:
                            ops.combine_recv(tr, outs[name, s])
            torch.cuda.synchronize()
            for name in "AB":
                for s in range(ep):
                    ids, x = inputs[name, s][:2]
                    got = outs[name, s].view(torch.int16).cpu().numpy()
                    want = _identity_want(ids, x, a).view(np.int16)
                    assert np.array_equal(got, want), f"step {step} micro-batch {name} rank {s}"
    finally:
        for bs in binds.values():
            for tr in bs:
                tr.release()
        b.close()
        _close(group, a)
