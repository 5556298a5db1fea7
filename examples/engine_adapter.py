"""An engine-free sketch of ep_a2a behind a prepare/finalize backend (the shape of vLLM's
modular-kernel prepare/finalize classes; docs/engines.md maps it onto vLLM, SGLang,
TensorRT-LLM, DeepEP and pplx-kernels), run on real ep_a2a with N in-process ranks on GPU 0.

    python examples/engine_adapter.py [--ranks 8] [--tokens 32] [--hidden 2048]

OneSidedPrepareFinalize wraps one rank (in an engine: the one rank of its process):
  prepare(a1, topk_weights, topk_ids)  dispatch; returns the received tokens in the layout
      of the TensorRT-LLM-style "rank-major" backends: [ep_size * T^, hidden] rows, ids and
      weights [ep_size * T^, top_k], rows without a token carrying expert id -1
  expert_output(T^)                    where the experts write their weighted per-row sum
                                       (the combine input in the workspace: no copy)
  finalize(output, fused_expert_output) combine into `output` [tokens, hidden], in place
The experts here are a stand-in (expert e: y = scale[e] * x), written in PyTorch; the result
is checked against the same sum computed without any all-to-all. Nothing from vLLM or any
other engine is imported or was run. Exits 0 on a match, 1 on a mismatch, 2 or 3 (one line)
when something is missing.
"""
import argparse

from preflight import require_torch_cuda

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--ranks", type=int, default=8, help="in-process ranks, all on GPU 0")
ap.add_argument("--tokens", type=int, default=32, help="max tokens per rank")
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--top-k", type=int, default=8)
args = ap.parse_args()
torch = require_torch_cuda()

import ep_a2a  # noqa: E402
from ep_a2a.moe import local_experts  # noqa: E402
from ep_a2a.ops import torch as ep_ops  # noqa: E402


class OneSidedPrepareFinalize:
    """One rank's dispatch/combine in the shape of a prepare/finalize backend.

    The properties an engine asks such a backend for, with ep_a2a's answers: the activation
    format is rank-major slots (not expert-major batches), top-k ids are int32, at most
    max_tokens_per_rank tokens per rank per step, ep_size dispatchers, and finalize's output
    is the complete sum over every rank the token went to (no reduction left to the caller).
    """

    topk_indices_dtype = torch.int32

    def __init__(self, rank_a2a):
        self.tr = ep_ops.bind(rank_a2a)         # ep_a2a's torch ops on torch's current stream
        a = rank_a2a.a2a
        self.ep_size, self.top_k, self.hidden = a.ep_size, a.top_k, a.combine_hidden_size
        self.max_num_tokens_per_rank = a.max_tokens_per_rank
        self.num_dispatchers = a.ep_size
        self.T_hat = None

    def prepare(self, a1, topk_weights, topk_ids, runtime_max_tokens_per_rank: int):
        """Dispatch. T^ (the largest token count of any rank this step, the same on every rank)
        is what an engine knows from its batch metadata (e.g. all ranks' token counts)."""
        self.T_hat = T_hat = runtime_max_tokens_per_rank
        ids, (x, w) = ep_ops.dispatch(self.tr, topk_ids, [a1, topk_weights], T_hat)
        rows = self.ep_size * T_hat
        # (views of the workspace, valid until the next prepare; no copies)
        return x.view(rows, self.hidden), None, ids.view(rows, self.top_k), w.view(rows, self.top_k)

    def expert_output(self):
        """[ep_size * T^, hidden] in the workspace: the experts' weighted sum per received row."""
        return ep_ops.combine_input(self.tr, self.T_hat).view(-1, self.hidden)

    def finalize(self, output, fused_expert_output):
        """Combine into `output` [local tokens, hidden], in place. fused_expert_output: the
        experts' [ep_size * T^, hidden] (expert_output() itself: zero copy; any other tensor is
        staged into the workspace first)."""
        part = fused_expert_output.view(self.ep_size, self.T_hat, self.hidden)
        ep_ops.combine(self.tr, part, self.T_hat, out=output)


def stand_in_experts(x, ids, w, first, n_local, scale, out):
    """Expert e computes scale[e] * x; each row gets the router-weighted sum of this rank's
    experts among its selections (rows with no local expert, and empty slots, get 0)."""
    own = (ids >= first) & (ids < first + n_local)
    factor = torch.where(own, w * scale[ids.clamp(min=0).long()], 0).sum(dim=-1, keepdim=True)
    out.copy_(torch.where(own.any(dim=-1, keepdim=True), factor * x.float(), 0).to(out.dtype))


N, T, H, K = args.ranks, args.tokens, args.hidden, args.top_k
E = 4 * N
dev = torch.device("cuda", 0)
g = torch.Generator(device=dev).manual_seed(torch.seed() >> 1)
scale = (1.0 + torch.arange(E, device=dev) % 5) / 4
with ep_a2a.LocalGroup([0] * N) as group, \
        ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=T, top_k=K, num_experts=E,
                           payloads=[ep_a2a.PayloadSpec("hidden", (H,), "bfloat16"),
                                     ep_a2a.PayloadSpec("weights", (K,), "float32")],
                           combine_hidden_size=H, combine_dtype="bfloat16") as a2a:
    backends = [OneSidedPrepareFinalize(r) for r in a2a.ranks]
    streams = [torch.cuda.Stream(dev) for _ in a2a.ranks]  # in-process ranks must run concurrently

    # The batch (an engine's router output), every tensor made before the first dispatch.
    tokens = torch.randint(1, T + 1, (N,), device=dev, generator=g).tolist()
    T_hat = max(tokens)
    ids = [torch.rand(t, E, device=dev, generator=g).argsort(dim=1)[:, :K].to(torch.int32) for t in tokens]
    xs = [torch.randn(t, H, device=dev, generator=g).to(torch.bfloat16) for t in tokens]
    ws = [torch.rand(t, K, device=dev, generator=g) for t in tokens]
    outs = [torch.empty(t, H, device=dev, dtype=torch.bfloat16) for t in tokens]
    torch.cuda.synchronize()   # (a rank's dispatch spins on its peers: nothing of theirs may still be queued)

    # prepare on every rank before anything blocks (in an engine: each process calls its own)
    got = []
    for b, s, x, w, i in zip(backends, streams, xs, ws, ids):
        with torch.cuda.stream(s):
            got.append(b.prepare(x, w, i, T_hat))
    for b, s, (rx, _, rids, rw), r in zip(backends, streams, got, a2a.ranks):
        with torch.cuda.stream(s):
            first, n_local = local_experts(E, N, r.rank)
            stand_in_experts(rx, rids, rw, first, n_local, scale, b.expert_output())
    torch.cuda.synchronize()   # every rank's experts are done before any combine spins
    for b, s, out in zip(backends, streams, outs):
        with torch.cuda.stream(s):
            b.finalize(out, b.expert_output())
    torch.cuda.synchronize()

worst = 0.0
for r in range(N):  # the oracle: the same weighted sum, computed without any all-to-all
    want = torch.where(ids[r] >= 0, ws[r] * scale[ids[r].clamp(min=0).long()], 0).sum(dim=1, keepdim=True) * xs[r].float()
    err = ((outs[r].float() - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-30)).max().item()
    worst = max(worst, err)
if worst > 2 ** -6:   # bf16: the partial sums and the output are rounded to 8 significant bits
    print(f"engine_adapter: MISMATCH: a token's relative error is {worst:.2e}")
    raise SystemExit(1)
print(f"engine_adapter: prepare/finalize over {N} ranks on GPU 0, tokens per rank {tokens} (T^={T_hat}): "
      f"every rank's output matches the reference (max relative error per token {worst:.1e})")
