"""moe_experts.expert_fc1 / expert_fc2, the experts' GEMMs at decode and small-batch sizes,
through their torch ops: FC1 reads each row where dispatch left it (the index's rows) and
applies the gated SiLU; both against a float64 oracle at every rows-per-expert count (one pass
of 16 rows and several), with the kernels each size takes and with the wide ones forced, rows
past the device total left as poisoned; graph replays with another routing each time bitwise
equal to eager calls; bad arguments refused before any launch. Fresh random inputs every run;
the seed is in every message."""
import numpy as np
import pytest
from common import POISON, fresh_rng, torch_cuda

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _index(dev, ep, top_k, tmax, num_experts):
    from ep_a2a.driver.device import get_device
    from ep_a2a.moe import ExpertIndex
    from ep_a2a.ops.torch_views import TorchIndex
    return TorchIndex(ExpertIndex(get_device(dev.index), num_experts=num_experts, ep_size=ep, rank=0,
                                  max_tokens_per_rank=tmax, top_k=top_k), "bfloat16")


def _routing(rng, ep, tmax, top_k, num_experts, local_share, dev):
    """ids / weights [ep, T^, top_k] as dispatch leaves them: a share of the selections on rank
    0's experts (repeats allowed: a caller's ids may repeat one), the rest anywhere or -1."""
    shape = (ep, tmax, top_k)
    other = np.where(rng.random(shape) < 0.1, -1, rng.integers(0, num_experts, shape))
    ids = np.where(rng.random(shape) < local_share, rng.integers(0, num_experts // ep, shape), other).astype(np.int32)
    return torch.from_numpy(ids).to(dev), torch.from_numpy(rng.random(shape, dtype=np.float32)).to(dev)


def _tensors(rng, dev, slots, L, H, I, cap):
    g = torch.Generator(device=dev).manual_seed(int(rng.integers(2 ** 62)))
    src = torch.randn(slots, H, generator=g, device=dev).to(torch.bfloat16)
    w1 = (torch.randn(L, 2 * I, H, generator=g, device=dev) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(L, H, I, generator=g, device=dev) / I ** 0.5).to(torch.bfloat16)
    act = torch.full((cap, I), POISON, dtype=torch.int16, device=dev).view(torch.bfloat16)
    y = torch.full((cap, H), POISON, dtype=torch.int16, device=dev).view(torch.bfloat16)
    return src, w1, w2, act, y


def _oracle(ix, src, w1, w2, act):
    """float64 act and y for the rows of the last build (y from the kernel's own bf16 act)."""
    offs = torch.from_dlpack(ix.index.offsets).cpu().numpy()
    total = int(offs[-1])
    rows = torch.from_dlpack(ix.index.rows).cpu().numpy()[:total]
    x = src.double().cpu().numpy()[rows]
    a1, a2, ours = w1.double().cpu().numpy(), w2.double().cpu().numpy(), act[:total].double().cpu().numpy()
    inter = a1.shape[1] // 2
    act_ref, y_ref = np.zeros((total, inter)), np.zeros((total, a2.shape[1]))
    for e in range(len(offs) - 1):
        a, b = offs[e], offs[e + 1]
        h = x[a:b] @ a1[e].T
        act_ref[a:b] = h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]
        y_ref[a:b] = ours[a:b] @ a2[e].T
    return total, act_ref, y_ref


def _close(got, want, what, msg):
    scale = max(1e-6, float(np.abs(want).max()))
    err = float(np.abs(got - want).max()) / scale
    assert err <= 2 ** -6, f"{msg}: {what} differs from the float64 oracle by {err:.3g} of its largest value"


@pytest.mark.parametrize("H,I", [(64, 64), (256, 128), (2048, 1024)])
@pytest.mark.parametrize("ep,top_k,tmax,local_share", [(1, 1, 1, 1.0), (8, 8, 1, 0.2), (8, 8, 2, 1.0),
                                                       (3, 4, 5, 0.5), (4, 8, 16, 0.7), (2, 2, 3, 0.0),
                                                       (8, 8, 4, 1.0), (8, 4, 8, 0.6), (8, 8, 32, 0.9)])
@pytest.mark.parametrize("wide", [False, True])  # the kernels each size takes, or the wide ones forced
def test_expert_gemms_match_float64(H, I, ep, top_k, tmax, local_share, wide, monkeypatch):
    from ep_a2a import moe_experts
    from ep_a2a.ops import torch as ep_ops
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    E = 4 * ep
    msg = f"{seed} H={H} I={I} ep={ep} top_k={top_k} T^={tmax} local={local_share} wide={wide}"
    if wide:
        monkeypatch.setattr(moe_experts, "WIDE_FROM_ROWS", moe_experts.EXPERT_PASS_ROWS)
    ix = _index(dev, ep, top_k, tmax, E)
    try:
        ids, w = _routing(rng, ep, tmax, top_k, E, local_share, dev)
        ep_ops.build_index(ix, ids, w)
        src, w1, w2, act, y = _tensors(rng, dev, ep * tmax, E // ep, H, I, ix.index.capacity)
        ep_ops.expert_fc1(ix, src, w1, act)
        ep_ops.expert_fc2(ix, act, w2, y)
        if wide and ep * tmax > moe_experts.EXPERT_PASS_ROWS and H % moe_experts.WIDE_FC2_COLS == 0:
            ran = ix.index.last_issued[0].function
            assert ran is ix.index.expert_function("moe_expert_fc2_wide_bf16"), f"{msg}: not the wide kernel"
        torch.cuda.synchronize()
        total, act_ref, y_ref = _oracle(ix, src, w1, w2, act)
        for t, name in ((act, "act"), (y, "y")):
            past = t[total:].view(torch.int16)
            assert bool((past == POISON).all()), f"{msg}: {name} rows past the total {total} were written"
        if total:
            _close(act[:total].double().cpu().numpy(), act_ref, "act", msg)
            _close(y[:total].double().cpu().numpy(), y_ref, "y", msg)
    finally:
        ix.index.close()


def _poisoned_slots(dev, ep, tmax, H):
    return torch.full((ep, tmax, H), POISON, dtype=torch.int16, device=dev).view(torch.bfloat16)


@pytest.mark.parametrize("H,I", [(64, 64), (2048, 1024)])
@pytest.mark.parametrize("ep,top_k,tmax,local_share", [(1, 1, 1, 1.0), (8, 8, 1, 0.3), (8, 8, 2, 1.0),
                                                       (3, 4, 5, 0.5), (8, 8, 6, 0.8), (2, 2, 3, 0.0), (8, 8, 24, 0.9)])
@pytest.mark.parametrize("wide", [False, True])  # the kernels each size takes, or the wide ones forced
def test_fc2_with_finalize_gives_the_bits_of_fc2_then_finalize(H, I, ep, top_k, tmax, local_share, wide,
                                                               monkeypatch):
    """expert_fc2(finalize_into=...) (each column tile's last block sums the tile) against
    expert_fc2 then finalize, both from poisoned outputs: the same bits in FC2's rows and in
    every slot; three calls with new routing each (the tiles' counts start at zero each time)."""
    from ep_a2a import moe_experts
    from ep_a2a.ops import torch as ep_ops
    if wide:
        monkeypatch.setattr(moe_experts, "WIDE_FROM_ROWS", moe_experts.EXPERT_PASS_ROWS)
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    E = 4 * ep
    ix = _index(dev, ep, top_k, tmax, E)
    try:
        for call in range(3):
            msg = f"{seed} H={H} I={I} ep={ep} top_k={top_k} T^={tmax} local={local_share} wide={wide} call {call}"
            ids, w = _routing(rng, ep, tmax, top_k, E, local_share, dev)
            ep_ops.build_index(ix, ids, w)
            src, w1, w2, act, y = _tensors(rng, dev, ep * tmax, E // ep, H, I, ix.index.capacity)
            ep_ops.expert_fc1(ix, src, w1, act)
            y2, fin, ref = y.clone(), _poisoned_slots(dev, ep, tmax, H), _poisoned_slots(dev, ep, tmax, H)
            ep_ops.expert_fc2(ix, act, w2, y)
            ep_ops.finalize(ix, y, ref)
            ep_ops.expert_fc2(ix, act, w2, y2, finalize_into=fin)
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), f"{msg}: FC2's rows differ"
            assert torch.equal(fin.view(torch.int16), ref.view(torch.int16)), f"{msg}: the finalized slots differ"
    finally:
        ix.index.close()


def test_fc2_relaunched_by_the_op_finalizes_after_other_calls_of_the_other_kernel():
    """The torch op relaunches its last launch where its tensors and T^ are as they were: FC2 with
    the finalize at T^ = 1 (the 16-row kernel), FC2 alone at T^ = 8 (the _m64 kernel), then the
    first call again: it still finalizes (each FC2 kernel keeps its own finalize arguments)."""
    from ep_a2a.ops import torch as ep_ops
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    ep, top_k, H, I, E = 8, 8, 64, 64, 32
    ix = _index(dev, ep, top_k, 8, E)
    try:
        src, w1, w2, act, y = _tensors(rng, dev, ep * 8, E // ep, H, I, ix.index.capacity)
        ids1, w_1 = _routing(rng, ep, 1, top_k, E, 0.5, dev)
        ids8, w_8 = _routing(rng, ep, 8, top_k, E, 0.5, dev)
        x1, fin, ref = src[:ep].contiguous(), _poisoned_slots(dev, ep, 1, H), _poisoned_slots(dev, ep, 1, H)

        def at_one():
            ep_ops.build_index(ix, ids1, w_1)
            ep_ops.expert_fc1(ix, x1, w1, act)
            ep_ops.expert_fc2(ix, act, w2, y, finalize_into=fin)
        at_one()
        ep_ops.build_index(ix, ids8, w_8)
        ep_ops.expert_fc1(ix, src, w1, act)
        ep_ops.expert_fc2(ix, act, w2, y)
        fin.copy_(_poisoned_slots(dev, ep, 1, H))
        at_one()
        ep_ops.finalize(ix, y, ref)
        torch.cuda.synchronize()
        assert torch.equal(fin.view(torch.int16), ref.view(torch.int16)), f"{seed}: the relaunched FC2 did not finalize"
    finally:
        ix.index.close()


@pytest.mark.parametrize("fin", [False, True])  # FC2 alone, or with the finalize
@pytest.mark.parametrize("tmax", [2, 8, 24])  # the kernels of 16-row passes, of up to 64, the wide ones
def test_graph_replays_equal_eager_calls(tmax, fin):
    """build_index + expert_fc1 + expert_fc2 (+ its finalize) captured once, replayed with new
    routing and inputs each time (another total per replay): bitwise what eager calls give."""
    from ep_a2a.ops import torch as ep_ops
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    ep, top_k, H, I, E = 8, 8, 256, 128, 64
    ix = _index(dev, ep, top_k, tmax, E)
    try:
        ids, w = _routing(rng, ep, tmax, top_k, E, 0.5, dev)
        src, w1, w2, act, y = _tensors(rng, dev, ep * tmax, E // ep, H, I, ix.index.capacity)
        slots = _poisoned_slots(dev, ep, tmax, H)

        def step():
            ep_ops.build_index(ix, ids, w)
            ep_ops.expert_fc1(ix, src, w1, act)
            ep_ops.expert_fc2(ix, act, w2, y, finalize_into=slots if fin else None)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for rep in range(4):
            new_ids, new_w = _routing(rng, ep, tmax, top_k, E, float(rng.uniform(0, 1)), dev)
            ids.copy_(new_ids)
            w.copy_(new_w)
            src.copy_(torch.randn(ep * tmax, H, device=dev).to(torch.bfloat16))
            g.replay()
            torch.cuda.synchronize()
            total = int(torch.from_dlpack(ix.index.offsets)[-1])
            got_act, got_y, got_slots = act[:total].clone(), y[:total].clone(), slots.clone()
            step()
            torch.cuda.synchronize()
            assert torch.equal(got_act.view(torch.int16), act[:total].view(torch.int16)), f"{seed} replay {rep}: act"
            assert torch.equal(got_y.view(torch.int16), y[:total].view(torch.int16)), f"{seed} replay {rep}: y"
            assert torch.equal(got_slots.view(torch.int16), slots.view(torch.int16)), f"{seed} replay {rep}: slots"
    finally:
        ix.index.close()


@pytest.mark.parametrize("H,I", [(256, 128), (2048, 1024)])
def test_passes_of_64_rows_give_the_bits_of_passes_of_16(H, I, monkeypatch):
    """The _m64 kernels (what a call takes where an expert may hold 17 to WIDE_FROM_ROWS rows) and
    the 16-row kernels, forced on the same build: the same bits in every row (a row's sums do not
    depend on the pass that held it), rows past the total untouched by both."""
    from ep_a2a import moe_experts
    from ep_a2a.ops import torch as ep_ops
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    ep, top_k, tmax, E = 8, 8, 6, 32
    ix = _index(dev, ep, top_k, tmax, E)
    try:
        ids, w = _routing(rng, ep, tmax, top_k, E, 0.8, dev)  # 4 local experts: about 80 rows each
        ep_ops.build_index(ix, ids, w)
        src, w1, w2, act, y = _tensors(rng, dev, ep * tmax, E // ep, H, I, ix.index.capacity)
        got = {}
        for kernel, pass_rows in (("_m64", 0), ("", 1 << 30)):
            monkeypatch.setattr(moe_experts, "EXPERT_PASS_ROWS", pass_rows)
            a, o = act.clone(), y.clone()  # (other tensors: full calls, not the ops' replays)
            ep_ops.expert_fc1(ix, src, w1, a)
            ep_ops.expert_fc2(ix, a, w2, o)
            ran = ix.index.last_issued[0].function
            assert ran is ix.index.expert_function(f"moe_expert_fc2{kernel}_bf16"), f"{seed}: not the {kernel} kernel"
            got[kernel] = (a, o)
        torch.cuda.synchronize()
        total = int(torch.from_dlpack(ix.index.offsets)[-1])
        counts = torch.from_dlpack(ix.index.counts).cpu().tolist()
        assert max(counts) > 32, f"{seed}: the routing gave no expert more than 32 rows: {counts}"
        for i, name in enumerate(("act", "y")):
            a, b = got["_m64"][i].view(torch.int16), got[""][i].view(torch.int16)
            assert torch.equal(a, b), f"{seed} H={H} I={I} counts={counts}: {name} differs between the kernels"
            assert bool((a[total:] == POISON).all()), f"{seed}: {name} rows past the total {total} were written"
    finally:
        ix.index.close()


def test_bad_arguments_are_refused_before_any_launch():
    from ep_a2a import moe, moe_experts
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    ep, top_k, tmax, H, I, E = 2, 2, 4, 128, 64, 8
    ix = _index(dev, ep, top_k, tmax, E)
    try:
        ids, w = _routing(rng, ep, tmax, top_k, E, 1.0, dev)
        moe.build_index(ids, w, num_experts=E, ep_size=ep, rank=0, out=ix.index,
                        stream=torch.cuda.current_stream(dev).cuda_stream)
        src, w1, w2, act, y = _tensors(rng, dev, ep * tmax, E // ep, H, I, ix.index.capacity)
        i = ix.index
        with pytest.raises(TypeError, match="src"):
            moe_experts.expert_fc1(i, src.half(), w1, act)
        with pytest.raises(ValueError, match="w_gate_up"):
            moe_experts.expert_fc1(i, src, w1[:, :I], act)
        with pytest.raises(ValueError, match="out"):
            moe_experts.expert_fc1(i, src, w1, act[:3])
        with pytest.raises(ValueError, match="hidden=96"):
            moe_experts.expert_fc1(i, src[:, :96].contiguous(), w1[:, :, :96].contiguous(), act)
        with pytest.raises(ValueError, match="w_down"):
            moe_experts.expert_fc2(i, act, w2.transpose(1, 2).contiguous(), y)
        cap = i.capacity
        shifted = torch.zeros((cap + 1) * H, dtype=torch.bfloat16, device=dev)[4:4 + cap * H].view(cap, H)
        with pytest.raises(ValueError, match="16-byte"):
            moe_experts.expert_fc2(i, act, w2, shifted)
        slots = _poisoned_slots(dev, ep, tmax, H)
        with pytest.raises(ValueError, match="finalize_into"):
            moe_experts.expert_fc2(i, act, w2, y, finalize_into=slots[:, :, :64])
        with pytest.raises(TypeError, match="finalize_into"):
            moe_experts.expert_fc2(i, act, w2, y, finalize_into=slots.float())
        torch.cuda.synchronize()
        for t, name in ((act, "act"), (y, "y"), (slots, "finalize_into")):
            assert bool((t.view(torch.int16) == POISON).all()), f"{seed}: {name} written by a refused call"
    finally:
        ix.index.close()
