"""The layer a strong PyTorch user writes without ep_a2a, capturable in a CUDA graph: all-gather,
the same grouped GEMMs over the tokens each rank's experts selected, weighted reduce,
reduce-scatter. Ranks stay apart as real ranks would: each rank's work on its own stream, its
collectives as copies between ranks' buffers (the all-gather copies every rank's tokens and
routing into a buffer of its own; the reduce-scatter reads every rank's partial sums of its
tokens), no GEMM merged across ranks. Events between the rank streams stand where the
collectives would synchronize.

Without a host synchronization a rank cannot know how many selections its experts got, so
the expert-major rows are sized for all of them (ep_size * T * top_k): the gather, the
activation and the weighting touch that many rows; the grouped GEMMs compute only the rows
of each expert (device offsets), as in our layer, whose gather and finalize read the count
on the device. The per-expert-loop baseline of the eager benchmark (tools/bench_layer.py)
stays there, labelled; it synchronizes the host and cannot be captured.
"""
from __future__ import annotations


def fork(torch, streams) -> None:
    """Every stream waits for the current stream (the capture stream under capture)."""
    cur = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(cur)


def join(torch, streams) -> None:
    """The current stream waits for every stream."""
    cur = torch.cuda.current_stream()
    for s in streams:
        cur.wait_stream(s)


def gate(torch, streams) -> None:
    """Every stream waits for what every stream has issued (a collective's synchronization):
    the others join the first, and the first fans back out."""
    hub = streams[0]
    for s in streams[1:]:
        hub.wait_stream(s)
    for s in streams[1:]:
        s.wait_stream(hub)


class AllGatherBaseline:
    """The baseline for the ranks of `layers` (TorchMoeLayers: their streams, local experts,
    weights and grouped GEMM) at T tokens on every rank. Buffers read by other ranks are
    allocated here, once; step() allocates only what one rank's stream uses alone."""

    def __init__(self, layers, T: int):
        import torch
        L0 = layers[0]
        if L0.gemm != "grouped":
            raise RuntimeError(f"the graphed baseline needs torch's grouped GEMM: {L0.gemm_reason}")
        self.layers, self.T = layers, T
        self.streams = [layer.stream for layer in layers]
        ep, H, k, dev = len(layers), L0.hidden, L0.top_k, L0.device
        n = ep * T * k
        f32, i64, bf = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int64, device=dev), \
            dict(dtype=torch.bfloat16, device=dev)
        self.top = [torch.empty(T, k, **f32) for _ in layers]           # router outputs (read by peers)
        self.ids = [torch.empty(T, k, **i64) for _ in layers]
        self.x_all = [torch.empty(ep * T, H, **bf) for _ in layers]     # all-gather destinations
        self.top_all = [torch.empty(ep * T, k, **f32) for _ in layers]
        self.ids_all = [torch.empty(ep * T, k, **i64) for _ in layers]
        self.part = torch.empty(ep, ep * T + 1, H, **f32)               # partial sums; row ep*T: non-local rows
        self.sum = [torch.empty(T, H, **f32) for _ in layers]
        self.out = [torch.empty(T, H, **bf) for _ in layers]
        self.dump = ep * T
        self.token_of = torch.arange(n, **i64) // k                     # selection -> token row
        self.local_of, self.bounds = [], []
        for layer in layers:  # expert id -> local expert, or num_local for another rank's expert
            e = torch.arange(layer.num_experts, **i64) - layer.first_expert
            self.local_of.append(torch.where((e >= 0) & (e < layer.num_local), e, layer.num_local))
            self.bounds.append(torch.arange(1, layer.num_local + 1, **i64))
        torch.cuda.synchronize(dev)

    def step(self, xs, logits) -> list:
        """One step of every rank: bf16 [T, hidden] per rank (this object's buffers), ready on
        the current stream."""
        import torch
        import torch.nn.functional as F
        layers, T, S = self.layers, self.T, self.streams
        ep = len(layers)
        fork(torch, S)
        with torch.no_grad():
            for r, layer in enumerate(layers):
                with torch.cuda.stream(S[r]):
                    torch.topk(logits[r], layer.top_k, dim=-1, out=(self.top[r], self.ids[r]))
            gate(torch, S)  # the all-gather: every rank's tokens and routing are ready
            for r in range(ep):
                with torch.cuda.stream(S[r]):
                    for s in range(ep):
                        self.x_all[r][s * T:(s + 1) * T].copy_(xs[s])
                        self.top_all[r][s * T:(s + 1) * T].copy_(self.top[s])
                        self.ids_all[r][s * T:(s + 1) * T].copy_(self.ids[s])
            for r, layer in enumerate(layers):
                with torch.cuda.stream(S[r]):
                    self._experts(torch, F, r, layer)
            gate(torch, S)  # the reduce-scatter: every rank's partial sums are ready
            for r in range(ep):
                with torch.cuda.stream(S[r]):
                    torch.sum(self.part[:, r * T:(r + 1) * T], 0, out=self.sum[r])
                    self.out[r].copy_(self.sum[r])
        join(torch, S)
        return self.out

    def _experts(self, torch, F, r: int, layer) -> None:
        """Rank r's local experts over the gathered tokens that selected them, weighted and
        summed per token into its partial sums."""
        I, L = layer.inter, layer.num_local
        w = torch.softmax(self.top_all[r], dim=-1).flatten()
        key = torch.take(self.local_of[r], self.ids_all[r].flatten())   # local expert, or L
        key, order = torch.sort(key, stable=True)                      # expert-major, token order inside
        offs = torch.searchsorted(key, self.bounds[r], out_int32=True)  # end row of each local expert
        tok = torch.take(self.token_of, order)
        xg = self.x_all[r].index_select(0, tok)
        h = layer.fc1(xg, offs)
        gate_, up = h[:, :I], h[:, I:]
        F.silu(gate_, inplace=True)
        y = layer.fc2(torch.mul(gate_, up), offs)
        yw = torch.mul(y, torch.take(w, order).unsqueeze(1))            # fp32 (rows past the last expert: garbage)
        dest = torch.where(key < L, tok, self.dump)                    # ... summed into the dump row
        part = self.part[r]
        part.zero_()
        part.index_add_(0, dest, yw)


class GemmFloor:
    """The same grouped GEMMs on pre-gathered rows: FC1 over each rank's gathered rows and FC2
    over its activations, with the expert offsets of the routing (set_offsets), nothing else:
    the layer's compute floor."""

    def __init__(self, layers):
        import torch
        self.layers = layers
        self.streams = [layer.stream for layer in layers]
        self.offs = [torch.empty_like(layer.buffers[2]) for layer in layers]

    def set_offsets(self) -> None:
        """Take each layer's offsets of its last step (outside any capture)."""
        for o, layer in zip(self.offs, self.layers):
            o.copy_(layer.buffers[2])

    def step(self, T: int) -> None:
        import torch
        fork(torch, self.streams)
        with torch.no_grad():
            for layer, s, offs in zip(self.layers, self.streams, self.offs):
                cap = layer.ep_size * T * layer.top_k
                rows, act, _ = layer.buffers
                with torch.cuda.stream(s):
                    layer.fc1(rows[:cap], offs)
                    layer.fc2(act[:cap], offs)
        join(torch, self.streams)
