"""The layer benchmarks' shapes: the profiles, the command line's overrides of them, the seed."""
from __future__ import annotations

import os

PROFILES = {
    "small": dict(hidden=2048, intermediate=1024, experts=64, top_k=8),
    "deepseek-v3-like": dict(hidden=7168, intermediate=2048, experts=256, top_k=8),
}


def layer_shape(args, profiles: dict) -> tuple:
    """(hidden, intermediate, experts, top_k, ranks): the profile's, with the command line's
    overrides."""
    p = dict(profiles[args.profile])
    for k in ("hidden", "intermediate", "experts", "top_k"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    return p["hidden"], p["intermediate"], p["experts"], p["top_k"], args.ranks


def run_seed(args) -> int:
    """--seed, or a fresh one (printed by the caller, so a run reproduces)."""
    return args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")


def torch_layer_run(args, profiles: dict, what: str):
    """What a graphed torch layer benchmark sets up first: (shape, device, seed, rng, say, w1,
    w2), the random weights of every expert (w_gate_up bf16 [E, 2I, H], w_down bf16 [E, H, I])
    on --device, after saying the run's seed and shape (`what`: the benchmark's own words)."""
    import sys
    import numpy as np
    import torch
    H, I, E, top_k, ep = shape = layer_shape(args, profiles)
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    seed = run_seed(args)
    torch.manual_seed(seed)

    def say(message):
        print(message, file=sys.stderr, flush=True)
    say(f"seed {seed}; {torch.cuda.get_device_name(dev)}; {ep} ranks; hidden {H}, intermediate {I}, {E} experts, "
        f"top_k {top_k}; {what}graphs of {args.rounds} and {2 * args.rounds} steps, {args.replays} replays")
    return (shape, dev, seed, np.random.default_rng(seed), say) + expert_weights(E, H, I, dev)


def expert_weights(E: int, H: int, I: int, dev) -> tuple:
    """(w1, w2): random bf16 weights of every expert on torch device `dev` (w_gate_up [E, 2I, H],
    w_down [E, H, I]), scaled by 1/sqrt(fan-in) so activations keep their size; from torch's
    generator (seeded by the caller where a run must reproduce)."""
    import torch
    w1 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).to(torch.bfloat16)
    return w1, w2


def add_torch_layers(layers: list, a2a, w1, w2, **options) -> None:
    """Append to `layers` a TorchMoeLayer per rank of a2a over its local experts' slices of every
    expert's weights (w1 [E, 2I, H], w2 [E, H, I]); options: TorchMoeLayer's (gemm=,
    compute_graphs=). One by one, so that the caller's cleanup closes those made before a failure."""
    from ..layers.torch import TorchMoeLayer
    from ..moe import local_experts
    for r in a2a.ranks:
        first, n = local_experts(a2a.num_experts, a2a.ep_size, r.rank)
        layers.append(TorchMoeLayer(r, w1[first:first + n], w2[first:first + n], **options))
