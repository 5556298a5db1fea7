"""The smallest complete ep_a2a step: N expert-parallel ranks in this one process, all on GPU 0
(a LocalGroup), dispatch -> simulated experts -> combine, checked against NumPy.

    python examples/quickstart_local.py [--ranks 8] [--tokens 32] [--hidden 1024]

No framework is needed: the inputs go to the GPU and the results come back through ep_a2a's own
device arrays (ep_a2a.interop.arrays). With PyTorch, JAX or CuPy pass their GPU tensors instead
(DLPack, zero copy). Prints one line and exits 0 when the combined output matches NumPy; exits 3
without a usable GPU, 1 on a mismatch.
"""
import argparse

import numpy as np

from preflight import require_gpu

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--ranks", type=int, default=8, help="in-process ranks, all on GPU 0")
ap.add_argument("--tokens", type=int, default=32, help="max tokens per rank (the workspace's size)")
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--top-k", type=int, default=4)
args = ap.parse_args()
require_gpu()

import ep_a2a  # noqa: E402  (after the GPU check: the message beats a traceback)
from ep_a2a.interop.arrays import copy_from_numpy, from_numpy, to_numpy  # noqa: E402
from ep_a2a.moe import local_experts  # noqa: E402

N, T, H, K = args.ranks, args.tokens, args.hidden, args.top_k
E = 4 * N                                   # 4 experts per rank, in contiguous blocks
rng = np.random.default_rng()

# Every rank's inputs: its tokens' expert ids (distinct per token; -1 = no expert), hidden
# states and router weights. Ranks may hold different token counts; T^ is the largest.
tokens = [int(rng.integers(1, T + 1)) for _ in range(N)]
T_hat = max(tokens)                         # every rank must pass the same T^ in a step
ids_h = [np.argsort(rng.random((t, E)), axis=1)[:, :K].astype(np.int32) for t in tokens]
for ids in ids_h:
    ids[rng.random(ids.shape) < 0.1] = -1   # some selections choose no expert
x_h = [rng.standard_normal((t, H)).astype(np.float32) for t in tokens]
w_h = [rng.random((t, K)).astype(np.float32) for t in tokens]
scale = (1.0 + np.arange(E, dtype=np.float32) % 5) / 4  # the simulated expert e: y = scale[e] * x

with ep_a2a.LocalGroup([0] * N) as group, \
        ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=T, top_k=K, num_experts=E,
                           payloads=[ep_a2a.PayloadSpec("hidden", (H,), "float32"),
                                     ep_a2a.PayloadSpec("weights", (K,), "float32")],
                           combine_hidden_size=H, combine_dtype="float32") as a2a:
    # In-process ranks spin on each other: copy every input to the GPU before the first launch
    # (a copy or free issued between two ranks' launches would wait for a kernel that waits
    # for the next rank's launch).
    ins = [(from_numpy(ids_h[r.rank], r.device), [from_numpy(x_h[r.rank], r.device), from_numpy(w_h[r.rank], r.device)])
           for r in a2a.ranks]

    # 1. dispatch, every rank before anything blocks. Each rank receives rank-major views of
    #    its workspace: ids [N, T^, K], hidden [N, T^, H], weights [N, T^, K]; region s holds
    #    the tokens rank s sent here, and every slot without a token carries expert id -1.
    views = [r.dispatch(ids, pays, runtime_max_tokens_per_rank=T_hat) for r, (ids, pays) in zip(a2a.ranks, ins)]
    a2a.synchronize()                       # every dispatch is issued: waiting is safe now

    # 2. the experts (simulated on the host): each rank writes, per received slot, the weighted
    #    sum of its own experts' outputs into combine_input(T^), a [N, T^, H] workspace view.
    received = []
    for r, (ids_v, (x_v, w_v)) in zip(a2a.ranks, views):
        ids, x, w = to_numpy(ids_v), to_numpy(x_v), to_numpy(w_v)
        first, n = local_experts(E, N, r.rank)
        mine = (ids >= first) & (ids < first + n)
        factor = np.where(mine, w * scale[np.clip(ids, 0, E - 1)], 0).sum(axis=-1)       # [N, T^]
        partial = np.where(mine.any(axis=-1)[..., None], factor[..., None] * x, 0)      # empty slots: 0
        copy_from_numpy(r.combine_input(T_hat), partial.astype(np.float32))
        received.append(int((ids >= 0).any(axis=-1).sum()))

    # 3. combine, every rank before anything blocks: each gets [its tokens, H], the sum of the
    #    partial results of every rank its tokens went to.
    outs = [r.combine(r.combine_input(T_hat), T_hat) for r in a2a.ranks]
    a2a.synchronize()
    got = [to_numpy(o) for o in outs]

# The oracle: every selection's expert output, weighted, summed per token.
worst = 0.0
for r in range(N):
    valid = ids_h[r] >= 0
    want = (np.where(valid, w_h[r] * scale[np.clip(ids_h[r], 0, E - 1)], 0).sum(axis=1))[:, None] * x_h[r]
    err = float(np.abs(got[r] - want).max() / max(np.abs(want).max(), 1e-30))
    worst = max(worst, err)
    if not np.allclose(got[r], want, rtol=1e-5, atol=1e-5 * np.abs(want).max()):
        print(f"quickstart: MISMATCH on rank {r}: max relative error {err:.2e}")
        raise SystemExit(1)
print(f"quickstart: {N} ranks on GPU 0, tokens per rank {tokens} (T^={T_hat}), received per rank {received}: "
      f"combine matches NumPy (max relative error {worst:.1e})")
