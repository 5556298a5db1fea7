"""moe.route, the fused router, through its torch op: against torch.topk + torch.softmax (the
layer's former router) on logits without ties, ids equal in order, weights within WEIGHT_ULPS;
ties, -0 / +0, -inf and NaN by the documented rule (descending; equal logits: lower expert
first; NaN above all); both renormalize modes; bf16 / fp16 logits; 1..1024 tokens, 8..1024
experts, top_k 1..32; CUDA graph replays; torch.library.opcheck. Fresh random inputs every
run; the seed is in every message."""
import numpy as np
import pytest
from common import fresh_rng

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

# Weights: torch's one-warp softmax takes the same steps (x - max, expf, per-lane sums in element
# order, a butterfly, a division), so the bits are expected equal; the bound leaves 2 ulp for a
# torch whose softmax reduces in another order (2 ulp: a few positive terms' sum, then a division).
WEIGHT_ULPS = 2
POISON = -7


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch.device("cuda", 0)


def _distinct(rng, T, E, dtype):
    """[T, E] logits of `dtype` whose values in a row all differ: a random permutation of E
    integers, times a power of two (exact in bf16 up to 256 experts), plus an offset."""
    ranks = np.argsort(rng.random((T, E)), axis=1).astype(np.float32) - np.float32(E // 2)
    scale = np.float32(2.0 ** int(rng.integers(-6, 0)))
    lg = ranks * scale + np.float32(rng.uniform(-4, 4))
    if dtype != "float32":  # offsets that bf16 / fp16 cannot hold would make ties
        lg = ranks * scale
    return torch.from_numpy(lg.astype(np.float32)).to(_cuda()).to(getattr(torch, dtype))


def _torch_route(logits, k, renormalize):
    top, ids = torch.topk(logits.float(), k, dim=-1)
    w = torch.softmax(top, dim=-1) if renormalize else torch.softmax(logits.float(), dim=-1).gather(1, ids)
    return ids.to(torch.int32), w


def _ulps(a, b):
    """Per-element distance in float32 ulps of two tensors of positive floats (0 where equal)."""
    return (a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs()


def _outputs(T, k, device):
    """The router's outputs for T tokens, poisoned: ids int32 and weights fp32 [T, k]."""
    return (torch.full((T, k), POISON, dtype=torch.int32, device=device),
            torch.full((T, k), float(POISON), dtype=torch.float32, device=device))


def _route(logits, k, renormalize, how="eager"):
    from ep_a2a.ops import torch as ep_ops
    ids, w = _outputs(logits.shape[0], k, logits.device)
    if how == "eager":
        ep_ops.route(logits, ids, w, renormalize)
    else:
        ep_ops.OPS["route"](logits, ids, w, renormalize, -1)
    return ids, w


def _check_against_torch(logits, k, renormalize, msg, how="eager"):
    ids, w = _route(logits, k, renormalize, how)
    want_ids, want_w = _torch_route(logits, k, renormalize)
    torch.cuda.synchronize()
    bad = (ids != want_ids).any(dim=1).nonzero()
    assert bad.numel() == 0, (f"{msg}: ids of {bad.numel()} rows differ from torch.topk's, first row {int(bad[0])}: "
                              f"got {ids[int(bad[0])].tolist()} want {want_ids[int(bad[0])].tolist()}")
    d = _ulps(w, want_w)
    assert int(d.max()) <= WEIGHT_ULPS, (f"{msg}: weights {int(d.max())} ulp from torch.softmax's (bound {WEIGHT_ULPS}), "
                                         f"first at {np.unravel_index(int(d.argmax()), tuple(d.shape))}")
    return int(d.max())


SIZES = [1, 2, 3, 4, 16, 100, 128, 1024]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("E", [8, 64, 256])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_route_equals_torch_topk_and_softmax(E, k, renormalize):
    dev = _cuda()
    rng, seed = fresh_rng()
    worst = 0
    for T in SIZES:
        lg = _distinct(rng, T, E, "float32")
        worst = max(worst, _check_against_torch(lg, k, renormalize, f"{seed} T={T} E={E} k={k} renorm={renormalize}"))
        # normal draws, as a router's logits look (ties are possible in principle: checked none)
        lg = torch.from_numpy(rng.standard_normal((T, E), dtype=np.float32) * np.float32(3)).to(dev)
        if bool((lg.sort(dim=1).values.diff(dim=1) != 0).all()):
            worst = max(worst, _check_against_torch(lg, k, renormalize, f"{seed} normal T={T} E={E} k={k}",
                                                    how="dispatcher" if T % 2 else "eager"))
    print(f"route E={E} k={k} renormalize={renormalize}: weights at most {worst} ulp from torch's")


@pytest.mark.parametrize("E,k", [(1, 1), (5, 3), (31, 22), (33, 4), (40, 8), (100, 32), (512, 8), (513, 8),
                                 (1000, 22), (1024, 32)])
def test_route_other_widths_and_top_k(E, k):
    """Rows that do not fill the lanes, every per-lane width up to 32 logits (1024 experts) and
    top_k up to 32."""
    rng, seed = fresh_rng()
    for T in (1, 9, 257):
        for renorm in (True, False):
            _check_against_torch(_distinct(rng, T, E, "float32"), k, renorm, f"{seed} T={T} E={E} k={k} renorm={renorm}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("E", [8, 64, 256])
def test_route_reads_half_precision_logits(dtype, E):
    """bf16 / fp16 logits: the kernel widens them to fp32 as logits.float() does."""
    rng, seed = fresh_rng()
    for T in (1, 4, 1024):
        for renorm in (True, False):
            _check_against_torch(_distinct(rng, T, E, dtype), 8, renorm, f"{seed} {dtype} T={T} E={E} renorm={renorm}")


def _rule_ids(lg: np.ndarray, k: int) -> np.ndarray:
    """The documented order: descending logit, equal logits by ascending expert, NaN above all
    (lower expert first among NaNs), -0 equal to +0."""
    T, E = lg.shape
    key = np.where(np.isnan(lg), np.inf, lg).astype(np.float64)
    nan = np.isnan(lg)
    # lexsort: last key primary. NaN first, then descending value, then ascending index.
    out = np.empty((T, k), np.int32)
    for t in range(T):
        order = np.lexsort((np.arange(E), -key[t], ~nan[t]))
        out[t] = order[:k]
    return out


@pytest.mark.parametrize("E,k", [(8, 2), (64, 8), (256, 8), (40, 22)])
def test_ties_take_the_lower_expert_first(E, k):
    """Logits from a handful of values (many ties, across lanes and within a lane's experts),
    with -0 and +0, -inf, and some rows all equal: ids by the documented rule; the weights
    still within the bound of torch.softmax over the selected logits."""
    dev = _cuda()
    rng, seed = fresh_rng()
    for T in (1, 33, 512):
        vals = np.array([-np.inf, -1.5, -0.0, 0.0, 0.25, 2.0], np.float32)
        lg = vals[rng.integers(0, len(vals), (T, E))]
        lg[:, : min(k, E)] = np.where(np.isneginf(lg[:, :k]), 0.0, lg[:, :k])  # at least k finite logits per row
        lg[rng.random(T) < 0.1] = np.float32(rng.uniform(-3, 3))  # whole rows of one value
        want = _rule_ids(lg, k)
        t = torch.from_numpy(lg).to(dev)
        for renorm in (True, False):
            ids, w = _route(t, k, renorm)
            torch.cuda.synchronize()
            got = ids.cpu().numpy()
            bad = np.nonzero((got != want).any(axis=1))[0]
            assert bad.size == 0, (f"{seed} T={T} E={E} k={k}: {bad.size} rows break the tie rule, first {bad[0]}: "
                                   f"logits {lg[bad[0]].tolist()} got {got[bad[0]].tolist()} want {want[bad[0]].tolist()}")
            sel = t.gather(1, ids.long())
            ref = torch.softmax(sel, dim=-1) if renorm else torch.softmax(t, dim=-1).gather(1, ids.long())
            d = _ulps(w, ref)
            assert int(d.max()) <= WEIGHT_ULPS, f"{seed} T={T} E={E} k={k} renorm={renorm}: weights {int(d.max())} ulp off"


def test_nan_logits_rank_first():
    """NaN ranks above every logit (as torch.topk ranks it): the ids follow the rule; the
    weights of such a row are NaN, as torch.softmax's would be."""
    dev = _cuda()
    rng, seed = fresh_rng()
    T, E, k = 64, 64, 8
    lg = _distinct(rng, T, E, "float32").cpu().numpy()
    for t in range(T):
        lg[t, rng.choice(E, int(rng.integers(0, 4)), replace=False)] = np.nan
    ids, w = _route(torch.from_numpy(lg).to(dev), k, True)
    torch.cuda.synchronize()
    assert np.array_equal(ids.cpu().numpy(), _rule_ids(lg, k)), seed
    has_nan = np.isnan(lg).any(axis=1)
    assert bool(np.isnan(w.cpu().numpy()[has_nan]).all()), seed
    assert not bool(np.isnan(w.cpu().numpy()[~has_nan]).any()), seed


def test_route_under_graph_replays():
    """route captured once into a CUDA graph on a side stream; every replay with new logits in
    the same buffer gives what an eager call gives, bitwise."""
    from ep_a2a.ops import torch as ep_ops
    dev = _cuda()
    rng, seed = fresh_rng()
    T, E, k = 128, 64, 8
    lg = torch.empty(T, E, device=dev)
    ids, w = _outputs(T, k, dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        lg.copy_(_distinct(rng, T, E, "float32"))
        ep_ops.route(lg, ids, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="global"):
        ep_ops.route(lg, ids, w)
    for rep in range(4):
        lg.copy_(_distinct(rng, T, E, "float32"))
        ids.fill_(POISON)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        want_ids, want_w = _route(lg, k, True)
        torch.cuda.synchronize()
        assert torch.equal(ids, want_ids) and torch.equal(w.view(torch.int32), want_w.view(torch.int32)), \
            f"{seed} replay {rep}"


def test_route_on_an_explicit_stream_and_argument_errors():
    from ep_a2a.ops import torch as ep_ops
    dev = _cuda()
    rng, seed = fresh_rng()
    lg = _distinct(rng, 16, 64, "float32")
    ids, w = _outputs(16, 8, dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))  # (the poison is written on the current stream)
    ep_ops.route(lg, ids, w, stream=s)
    torch.cuda.synchronize()
    want_ids, _ = _torch_route(lg, 8, True)
    assert torch.equal(ids, want_ids), seed
    with pytest.raises(ValueError, match="ids, weights: dtypes"):
        ep_ops.route(lg, ids.long(), w)
    with pytest.raises(ValueError, match="ids, weights: shapes"):
        ep_ops.route(lg, ids[:8], w[:8])
    with pytest.raises(ValueError, match="num_experts=2000"):
        ep_ops.route(torch.zeros(4, 2000, device=dev), ids[:4], w[:4])
    with pytest.raises(ValueError, match="top_k=9"):
        ep_ops.route(torch.zeros(4, 8, device=dev), torch.empty(4, 9, dtype=torch.int32, device=dev),
                     torch.empty(4, 9, device=dev))
    with pytest.raises(ValueError, match="contiguous"):
        ep_ops.route(lg.t().contiguous().t(), ids, w)


def test_opcheck_of_the_route_op():
    from ep_a2a.ops import torch as ep_ops
    dev = _cuda()
    rng, seed = fresh_rng()
    lg = _distinct(rng, 32, 64, "float32")
    ids, w = _outputs(32, 8, dev)
    torch.library.opcheck(ep_ops.OPS["route"], (lg, ids, w, True), test_utils=("test_schema", "test_faketensor"))
