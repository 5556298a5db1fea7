"""The torch MoE ops' replays (ops/torch_views.Replays) on the GPU: a call whose tensors all
sit where that op's last call had them relaunches its last launches; every change, and every
other call that rewrote those launches, takes the full path. Each step bitwise against
moe_reference; fresh random inputs every run (the seed is in every failure message)."""
import numpy as np
import pytest
from common import fresh_rng

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
from ep_a2a.ops import torch as ops  # noqa: E402
from test_torch_ops_gpu import _close, _cuda, _draw, _make, _moe_reference, _moe_step  # noqa: E402


def test_moe_ops_replay_their_launches_only_while_nothing_moved():
    """The MoE ops relaunch their last launches where every tensor sits where it did
    (torch_views.Replays). Steps in a random order, each against moe_reference bitwise: the
    same tensors refilled in place (replayed), tensors moved, T^ changed, the index rebuilt
    and gather_rows run straight through ep_a2a.moe on the same index (rewriting the Launches
    a replay would reuse: the op's next call must not replay), the route op into the same and
    into another output. Both kinds of call must occur."""
    from ep_a2a import moe
    from ep_a2a.ops.torch_views import Replays
    from ep_a2a.testing.torch_step import host_bits, to_torch
    dev = _cuda()
    rng, seed = fresh_rng()
    group, a2a = _make(1, experts=8, max_tokens=32, validate_expert_ids=False)
    tr = ops.bind(a2a.ranks[0])
    ix = ops.expert_index(tr)
    E, k = a2a.num_experts, a2a.top_k
    counts = {"replayed": 0, "recorded": 0}
    real_replay, real_record = Replays.replay, Replays.record

    def replay(self, *args):
        done = real_replay(self, *args)
        counts["replayed"] += done
        return done

    def record(self, *args):
        counts["recorded"] += 1
        return real_record(self, *args)

    events = ["refill"] * 6 + ["move", "tmax", "straight_index", "straight_gather", "fc2_rows"]
    order = [events[i] for i in rng.permutation(len(events))]
    fc2_rows = torch.empty(32 * k, 256, dtype=torch.bfloat16, device=dev)
    scratch = torch.empty_like(fc2_rows)
    T, n = 16, 9
    tensors = None
    Replays.replay, Replays.record = replay, record
    try:
        for step, event in enumerate(["move"] + order):
            if event == "tmax":
                T = int(rng.choice([t for t in (4, 16, 32) if t != T]))
                n = int(rng.integers(1, T + 1))
            if event in ("straight_index", "straight_gather"):
                other = 32 if T != 32 else 4
                ids2, (x2, w2) = a2a.ranks[0].dispatch_views(other)
                cur = torch.cuda.current_stream(dev).cuda_stream
                idx = moe.build_index(ids2, w2, num_experts=E, ep_size=1, rank=0, out=ix.index, stream=cur)
                if event == "straight_gather":  # (back to this step's T^, the gather into another buffer)
                    ids1, (x1, w1) = a2a.ranks[0].dispatch_views(T)
                    moe.build_index(ids1, w1, num_experts=E, ep_size=1, rank=0, out=idx, stream=cur)
                    moe.gather_rows(idx, x1, scratch, stream=cur)
            if event == "fc2_rows":
                fc2_rows = torch.empty_like(fc2_rows)
            tr.prepare([T])
            ids, x, w = _draw(rng, a2a, n)
            if tensors is None or event in ("move", "tmax"):
                tensors = (to_torch(ids, dev, "int32"), to_torch(x, dev, "bfloat16"), to_torch(w, dev, "float32"))
            else:  # the same tensors, new values
                for t, a, dt in zip(tensors, (ids, x, w), ("int32", "bfloat16", "float32")):
                    t.copy_(to_torch(a, dev, dt))
            fc2_rows.fill_(float("nan"))
            got = host_bits(_moe_step(tr, ix, *tensors, T, fc2_rows))
            want = _moe_reference(ids, x, w, a2a, T)
            assert np.array_equal(got, want), f"{seed} step {step} ({event}, T^={T}): differs from moe_reference"
        logits = torch.randn(3, E, device=dev)
        for out_ids in (torch.empty(3, k, dtype=torch.int32, device=dev), None):
            for _ in range(2):
                logits.normal_()
                ids_o = out_ids if out_ids is not None else torch.empty(3, k, dtype=torch.int32, device=dev)
                w_o = torch.full((3, k), float("nan"), device=dev)
                ops.route(logits, ids_o, w_o)
                top, want_ids = torch.topk(logits, k, dim=-1)
                assert torch.equal(ids_o, want_ids.to(torch.int32)), f"{seed}: route's ids"
                assert torch.allclose(w_o, torch.softmax(top, dim=-1), rtol=1e-6, atol=0), f"{seed}: route's weights"
        assert counts["replayed"] and counts["recorded"], f"{seed}: {counts}"
    finally:
        Replays.replay, Replays.record = real_replay, real_record
        torch.cuda.synchronize()
        ix.release()
        ix.index.close()
        _close(group, a2a, [tr])
