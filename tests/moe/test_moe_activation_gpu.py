"""moe.activation, the gated SiLU between FC1 and FC2, through its torch op: bitwise equal to
torch's eager F.silu(gate) * up on the rows below the index's device total, rows past it left
as poisoned, at every vector width; under CUDA graph replays with another total each time; and
torch.library.opcheck of the op. Fresh random inputs every run; the seed is in every message."""
import numpy as np
import pytest
from common import POISON, fresh_rng, torch_cuda

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _index(dev, ep, top_k, tmax, num_experts, rank):
    from ep_a2a.driver.device import get_device
    from ep_a2a.moe import ExpertIndex
    from ep_a2a.ops.torch_views import TorchIndex
    return TorchIndex(ExpertIndex(get_device(dev.index), num_experts=num_experts, ep_size=ep, rank=rank,
                                  max_tokens_per_rank=tmax, top_k=top_k), "bfloat16")


def _routing(rng, ep, tmax, top_k, num_experts, dev, local_share):
    """ids int32 / weights fp32 [ep, T^, top_k] as dispatch leaves them: a share `local_share`
    of the selections rank 0's experts (0 .. num_experts // ep - 1, all its own), the others
    drawn over every expert, 5% of those -1; local_share 1: all local; None: all -1."""
    shape = (ep, tmax, top_k)
    if local_share is None:
        ids = np.full(shape, -1, np.int32)
    else:
        other = np.where(rng.random(shape) < 0.05, -1, rng.integers(0, num_experts, shape))
        ids = np.where(rng.random(shape) < local_share, rng.integers(0, num_experts // ep, shape), other)
        ids = ids.astype(np.int32)
    w = rng.random(shape, dtype=np.float32)
    return torch.from_numpy(ids).to(dev), torch.from_numpy(w).to(dev)


def _fc1_out(rng, rows, inter, dtype, dev):
    """[rows, 2 * I]: half the rows normals at a scale per row (what a GEMM gives), half any
    finite bits (tiny, subnormal and huge values: expf(-x) under- and overflows)."""
    g = torch.Generator(device=dev).manual_seed(int(rng.integers(2 ** 62)))  # (drawn on the GPU: fast)
    scale = torch.from_numpy(rng.choice(np.float32([0.25, 1, 4, 16]), (rows, 1))).to(dev)
    h = (torch.randn(rows, 2 * inter, generator=g, device=dev) * scale).to(dtype)
    bits = torch.randint(-2 ** 15, 2 ** 15, (rows, 2 * inter), generator=g, device=dev, dtype=torch.int32).to(torch.int16)
    exp_bits = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
    finite = (bits & exp_bits) != exp_bits
    bits = torch.where(finite, bits, bits ^ exp_bits)  # all-ones exponent (inf / NaN) made finite
    odd = torch.from_numpy(rng.random(rows) < 0.5).to(dev)
    return torch.where(odd[:, None], bits.view(dtype), h).contiguous()


def _want(h, inter):
    import torch.nn.functional as F
    return torch.mul(F.silu(h[:, :inter]), h[:, inter:])  # the layer's eager composition


def _check(out, want, total, msg):
    got, ref = out.view(torch.int16), want.view(torch.int16)
    bad = (got[:total] != ref[:total]).any(dim=1).nonzero()
    assert bad.numel() == 0, (f"{msg}: {bad.numel()} of {total} rows differ from torch's F.silu(gate) * up, first "
                              f"row {int(bad[0])}: got {out[int(bad[0])][:8].tolist()} want {want[int(bad[0])][:8].tolist()}")
    assert bool((got[total:] == POISON).all()), f"{msg}: rows past the total ({total}) were written"


# (ep, top_k, T^, I): I = 1024 / 2048 the small and DeepSeek-V3-like profiles (16-byte vectors);
# I = 12, 6, 3: 8-, 4- and 2-byte vectors; T^ = 1 / 4 decode; the largest size several waves.
CASES = [(1, 1, 1, 8), (8, 8, 1, 1024), (8, 8, 4, 1024), (8, 8, 16, 2048), (3, 22, 7, 12), (2, 4, 33, 6),
         (2, 2, 5, 3), (8, 8, 128, 1024), (4, 8, 96, 2048)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("ep,top_k,tmax,inter", CASES)
def test_activation_bitwise_equals_torch_eager(ep, top_k, tmax, inter, dtype):
    from ep_a2a.ops import torch as ep_ops
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    dt = getattr(torch, dtype)
    num_experts = 4 * ep + 1
    ix = _index(dev, ep, top_k, tmax, num_experts, 0)
    cap = ep * tmax * top_k
    try:
        # every selection local (total = capacity), usual shares, none (total 0)
        for share, how in ((1.0, "eager"), (0.5, "eager"), (0.1, "dispatcher"), (None, "eager")):
            ids, w = _routing(rng, ep, tmax, top_k, num_experts, dev, share)
            ep_ops.build_index(ix, ids, w)
            h = _fc1_out(rng, cap + 2, inter, dt, dev)  # more rows than the capacity is allowed
            out = torch.full((cap + 3, inter), POISON, dtype=torch.int16, device=dev).view(dt)
            if how == "eager":
                ep_ops.activation(ix, h, out)
            else:
                ep_ops.OPS["activation"](ix.handle, ix.offsets, h, out, -1)
            total = int(ix.offsets[-1])
            if share == 1.0 or share is None:
                assert total == (cap if share else 0), f"{seed}: share={share}, total {total} of {cap}"
            _check(out, _want(h, inter), total, f"{seed} {dtype} ep={ep} top_k={top_k} T^={tmax} I={inter} "
                                                f"share={share} {how}")
    finally:
        torch.cuda.synchronize()
        ix.release()
        ix.index.close()


def test_activation_follows_the_device_total_under_graph_replays():
    """build_index + activation captured once (T^ = 16, 8 ranks' slots, top-8); every replay
    with new routing has another total, and computes exactly those rows."""
    from ep_a2a.ops import torch as ep_ops
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    ep, top_k, tmax, inter, E = 8, 8, 16, 1024, 64
    cap = ep * tmax * top_k
    ix = _index(dev, ep, top_k, tmax, E, 0)
    ids = torch.empty(ep, tmax, top_k, dtype=torch.int32, device=dev)
    w = torch.empty(ep, tmax, top_k, dtype=torch.float32, device=dev)
    h = torch.empty(cap, 2 * inter, dtype=torch.bfloat16, device=dev)
    out = torch.empty(cap, inter, dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream(dev)
    try:
        def step():
            ep_ops.build_index(ix, ids, w)
            ep_ops.activation(ix, h, out)

        def fresh(share):
            i, ww = _routing(rng, ep, tmax, top_k, E, dev, share)
            ids.copy_(i)
            w.copy_(ww)
            h.copy_(_fc1_out(rng, cap, inter, torch.bfloat16, dev))
            out.view(torch.int16).fill_(POISON)

        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            fresh(0.5)
            step()  # eager first, as before any capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s, capture_error_mode="global"):
            step()
        totals = []
        for share in (0.9, None, 0.2, 1.0, 0.5):
            fresh(share)
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            total = int(ix.offsets[-1])
            totals.append(total)
            _check(out, _want(h, inter), total, f"{seed} graph replay share={share}")
        assert len(set(totals)) > 2, f"{seed}: the replays' totals {totals} hardly vary"
    finally:
        torch.cuda.synchronize()
        ix.release()
        ix.index.close()


def test_opcheck_of_the_activation_op():
    from ep_a2a.ops import torch as ep_ops
    dev = torch_cuda(torch)
    rng, seed = fresh_rng()
    ep, top_k, tmax, inter = 2, 4, 8, 64
    ix = _index(dev, ep, top_k, tmax, 9, 1)
    try:
        ids, w = _routing(rng, ep, tmax, top_k, 9, dev, 0.5)
        ep_ops.build_index(ix, ids, w)
        h = _fc1_out(rng, ep * tmax * top_k, inter, torch.bfloat16, dev)
        out = torch.empty(ep * tmax * top_k, inter, dtype=torch.bfloat16, device=dev)
        torch.library.opcheck(ep_ops.OPS["activation"], (ix.handle, ix.offsets, h, out),
                              test_utils=("test_schema", "test_faketensor"))
    finally:
        torch.cuda.synchronize()
        ix.release()
        ix.index.close()
