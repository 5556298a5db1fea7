"""`python -m ep_a2a.bench_layer --graph`: the MoE layer of every in-process rank captured in CUDA
graphs and replayed, against the all-gather baseline (bench_layer_baseline.py) and the
GEMM-only floor, all under graphs, in one run (the paper's Table 4 and Table 5, one GPU).

One graph for all ranks per batch size: the capture stream forks to the rank streams, the
step runs in run_phases' order (every rank's router, a gate, every rank's dispatch, the
compute of every rank, a gate, every rank's combine) and joins back. The gates are edges of
the graph, not kernels: no rank's spinning dispatch or combine can hold SMs that a peer's
router or GEMMs need before its own dispatch or combine, as in the eager step; and every
rank's dispatch node becomes ready at once, so all of them are resident together (their
grids are capped for that).

Per-step time: graphs of R and 2R steps, replayed in turn (events outside the graphs),
(t(2R) - t(R)) / R from the medians (bench_method.per_round): the graph launch and the
fork / join cancel. spread_us: the interquartile range of the same difference taken replay
pair by replay pair.

Stages: a one-step graph captured while torch.profiler (CUPTI) runs, replayed back to back;
the kernel records are cut into replays and classified by name (bench_layer_stages.py), after
every size's step times (replays timed after a profile ran slower in the same process). No
event, barrier or timestamp kernel between the stages. A stage spans from the first rank's
first kernel of it to the last rank's last kernel of it; stages may overlap, so they add up
to more than the layer.

Floors in the same run: the GEMM-only time (the same grouped GEMMs on the rows our layer
gathered, with its expert offsets), and the weight-read floor: the bytes of the experts the
routing touches over the HBM rate of a device-to-device copy measured here (read + write).
Host: the eager layer's host time to issue one step, per rank, and its split by phase.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from .bench_layer_profiles import add_torch_layers, torch_layer_run
from .bench_layer_baseline import AllGatherBaseline, GemmFloor
from .bench_report import torch_device_fields
from .bench_method import per_round

ROUTINGS = {"perfect": ("perfect", 0.0), "zipf0": ("zipf", 0.0), "zipf1": ("zipf", 1.0), "zipf1.25": ("zipf", 1.25)}


# -- inputs ----------------------------------------------------------------------------------------
def routing_ids(rng, routing: str, ep: int, T: int, top_k: int, num_experts: int) -> list:
    """int32 [T, top_k] expert ids per rank: 'perfect' (a token's k selections on consecutive
    ranks, even over their experts) or 'zipf<alpha>' (k distinct experts per token, popularity
    ~ i^-alpha over one random order of the experts shared by all ranks)."""
    from ..testing.formats import routing as draw
    kind, alpha = ROUTINGS[routing]
    if kind == "perfect":
        return [draw("perfect", rng, T, top_k, num_experts, ep, s) for s in range(ep)]
    ids = draw("zipf", rng, ep * T, top_k, num_experts, ep, alpha=alpha) if alpha > 0 else \
        draw("uniform", rng, ep * T, top_k, num_experts, ep)
    return [ids[s * T:(s + 1) * T] for s in range(ep)]


def logits_for(rng, ids: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 router logits whose top-k (descending) is exactly `ids`: noise in [0, 1), the
    selected experts well above it and apart from each other (the router stays in the step)."""
    T, k = ids.shape
    lg = rng.random((T, num_experts), dtype=np.float32)
    rows = np.arange(T)[:, None]
    lg[rows, ids] = (4.0 + np.arange(k, 0, -1, dtype=np.float32) * 0.5)[None, :]
    return lg


def load_stats(ids_per_rank, ep: int, T: int, top_k: int, num_experts: int, hidden: int, inter: int) -> dict:
    """Load imbalance (busiest rank's token-expert pairs over T * top_k, the paper's Table 5),
    the experts the step touches and their bf16 weight bytes."""
    from ..moe import local_experts
    ids = np.concatenate(ids_per_rank).reshape(-1)
    ids = ids[ids >= 0]
    pairs = [int(((ids >= f) & (ids < f + n)).sum()) for f, n in (local_experts(num_experts, ep, r) for r in range(ep))]
    touched = int(np.unique(ids).size)
    return dict(load_imbalance=max(pairs) / (T * top_k), pairs_per_rank=pairs, experts_touched=touched,
                weight_bytes_read=touched * 3 * hidden * inter * 2)


# -- graphs ----------------------------------------------------------------------------------------
def capture(torch, step, n: int, pool=None):
    """n calls of step() captured into one graph (torch.cuda.graph, global capture mode: an
    allocation outside the graph's pool, a free or a synchronization in any thread fails it)."""
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g, pool=pool, capture_error_mode="global"):
        for _ in range(n):
            step()
    torch.cuda.synchronize()
    return g


def time_pair(torch, g_short, g_long, rounds: int, replays: int) -> dict:
    """µs per step from graphs of `rounds` and 2 * rounds steps, replayed in turn."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for g in (g_short, g_long):  # warm-up (the first replay uploads the graph)
        g.replay()
    torch.cuda.synchronize()
    ts = ([], [])
    for _ in range(replays):
        for g, t in zip((g_short, g_long), ts):
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            t.append(e0.elapsed_time(e1) * 1e3)
    step, overhead = per_round(statistics.median(ts[0]), statistics.median(ts[1]), rounds)
    pairs = sorted((b - a) / rounds for a, b in zip(*ts))
    q1, q3 = np.percentile(pairs, [25, 75]) if len(pairs) > 1 else (pairs[0], pairs[0])
    return dict(step_us=step, graph_overhead_us=overhead, spread_us=float(q3 - q1),
                replay_us=[statistics.median(ts[0]), statistics.median(ts[1])])


def profile_stages(torch, step, replays: int, parse) -> dict:
    """parse(trace events, replays, skip=1) of one warm-up and `replays` back-to-back replays
    of a one-step graph captured while the profiler runs (so CUPTI is up before the graph
    exists). A failure (no CUPTI, records that do not split) is reported, not raised: the
    step times stand without it."""
    from torch.profiler import ProfilerActivity, profile
    from .bench_layer_stages import trace_events
    g = None
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g = capture(torch, step, 1)
            g.replay()              # warm-up: the first replay uploads the graph
            torch.cuda.synchronize()
            for _ in range(replays):
                g.replay()
            torch.cuda.synchronize()
        return parse(trace_events(prof), replays + 1, skip=1)
    except Exception as e:  # noqa: BLE001  (reported in the JSON and on stderr)
        print(f"WARNING: stage profile failed: {type(e).__name__}: {e}", file=sys.stderr)
        return dict(error=f"{type(e).__name__}: {e}")
    finally:
        del g
        torch.cuda.synchronize()


def copy_rate_tbps(torch, dev, nbytes: int = 1 << 30, replays: int = 10) -> float:
    """HBM rate of a device-to-device copy (bytes read + written per second, TB/s), two graph
    lengths as the steps."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    gs = [capture(torch, lambda: dst.copy_(src), n) for n in (1, 2)]
    t = time_pair(torch, gs[0], gs[1], 1, replays)["step_us"]
    del gs, src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (t * 1e-6) / 1e12


# -- the run ---------------------------------------------------------------------------------------
def eager_host_us(torch, run, iters: int) -> float:
    """Median host µs to issue one eager step (the device drained between steps)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return float(statistics.median(times))


def eager_host_phases_us(torch, layers, xs, logits, T: int, iters: int) -> dict:
    """Median host µs per rank of each phase of an eager step (run_phases, timed at its
    `between` marks; prepare includes the router, the gates are in dispatch and combine):
    where the eager layer's host time goes."""
    from ..layers.base import run_phases
    names = ("prepare", "dispatch", "compute", "combine")
    samples = {k: [] for k in names}
    for _ in range(iters):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        run_phases(layers, xs, logits, T, between=lambda stage: t.append(time.perf_counter()))
        t.append(time.perf_counter())
        for layer in layers:
            torch.cuda.current_stream(layer.device).wait_stream(layer.stream)
        for k, a, b in zip(names, t, t[1:]):
            samples[k].append((b - a) * 1e6 / len(layers))
    torch.cuda.synchronize()
    return {k: float(statistics.median(v)) for k, v in samples.items()}


def run(args, profiles: dict) -> dict:
    import torch
    import ep_a2a
    from ..layers.torch import moe_forward_all_ranks, payload_specs
    from ..testing.layer_oracle import max_relative_error
    from .bench_layer_stages import baseline_stage_times, floor_stage_times, ours_stage_times
    (H, I, E, top_k, ep), dev, seed, rng, say, w1, w2 = torch_layer_run(args, profiles, "")
    rate = copy_rate_tbps(torch, dev)
    say(f"device-to-device copy: {rate:.2f} TB/s (read + write)")
    rows = []
    protocol = args.protocol or "fence"
    R = args.rounds
    with ep_a2a.LocalGroup([args.device] * ep) as group:
        a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max(args.tokens), top_k=top_k, num_experts=E,
                                 payloads=payload_specs(H, top_k), combine_hidden_size=H, protocol=protocol,
                                 validate_expert_ids=False, on_timeout="abort")
        layers = []
        try:
            # (--graph: parse_args lets only auto, grouped or fused through)
            add_torch_layers(layers, a2a, w1, w2, gemm=args.gemm, compute_graphs=args.compute_graphs)
            if layers[0].gemm != "grouped":  # (the loop GEMM reads counts on the host: not capturable)
                raise RuntimeError(f"--graph needs torch's grouped GEMM: {layers[0].gemm_reason}")
            floor = GemmFloor(layers)
            shape, fills = (H, I, E, top_k, ep), {}
            # every size is timed before any stage is profiled: once CUPTI has run in the process,
            # the replays it leaves behind run slower
            for T in args.tokens:
                rows += _one_size(torch, args, T, layers, floor, rng, shape, say, moe_forward_all_ranks,
                                  max_relative_error, fills)
            if args.stage_replays:
                for T in args.tokens:
                    _stages_of_size(torch, args, T, layers, floor, rng, shape, say, moe_forward_all_ranks,
                                    [row for row in rows if row["tokens_per_rank"] == T], fills,
                                    (ours_stage_times, baseline_stage_times, floor_stage_times))
            for row in rows:
                derive_figures(row, rate)
            fused, torch_gemm = layers[0].fused_max_rows, f"torch's {layers[0].gemm} ({layers[0].gemm_reason})"
            gemm = (f"{args.gemm}: ep_a2a's expert kernels up to {fused} rows per expert (ep_size * T^), else "
                    f"{torch_gemm}" if fused else f"{args.gemm}: {torch_gemm} at every size")
        finally:
            torch.cuda.synchronize()
            for layer in layers:
                layer.close()
            a2a.close()
    return dict(**torch_device_fields(torch, dev),
                config=dict(profile=args.profile, hidden=H, intermediate=I, experts=E, top_k=top_k, ranks=ep,
                            device=args.device, tokens=args.tokens, routing=args.routing, rounds=R,
                            replays=args.replays, stage_replays=args.stage_replays, protocol=protocol, seed=seed,
                            compute_graphs=args.compute_graphs,
                            gemm=gemm, dtype="bf16 weights and activations, fp32 accumulation"),
                copy_tbps=rate, method=__doc__, rows=rows)


def _one_size(torch, args, T, layers, floor, rng, shape, say, forward, rel_err, fills) -> list:
    """Every routing at T tokens per rank: one set of graphs per size, refilled per routing;
    the routings drawn go to fills[(T, routing)] (the stages replay them)."""
    H, I, E, top_k, ep = shape
    R = args.rounds
    xs, logits, base, steps = _size_inputs(torch, T, layers, floor, shape, forward)
    out_rows = []
    graphs = {}
    try:
        for routing in args.routing:  # eager steps: correctness, host cost, the floor's offsets
            ids = fills[(T, routing)] = routing_ids(rng, routing, ep, T, top_k, E)
            _refill(torch, rng, xs, logits, ids, E, layers[0].device, H)
            ours = [o.clone() for o in steps["ours"]()]
            theirs = [o.clone() for o in steps["baseline"]()]
            torch.cuda.synchronize()
            diff = max(rel_err(a.float().cpu().numpy(), b.float().cpu().numpy()) for a, b in zip(ours, theirs))
            host = eager_host_us(torch, steps["ours"], args.host_iters)
            phases = eager_host_phases_us(torch, layers, xs, logits, T, args.host_iters)
            out_rows.append(dict(tokens_per_rank=T, routing=routing, max_rel_diff_vs_baseline=diff,
                                 eager_host_us_per_rank=host / ep, eager_host_phases_us_per_rank=phases,
                                 **load_stats(ids, ep, T, top_k, E, H, I)))
        pool = torch.cuda.graph_pool_handle()
        for name, step in steps.items():
            graphs[name] = [capture(torch, step, n, pool) for n in (R, 2 * R)]
        for row in out_rows:
            _refill(torch, rng, xs, logits, fills[(T, row["routing"])], E, layers[0].device, H)
            # the graph replays the eager step: the same fresh inputs through both, bitwise
            eager = [o.clone() for o in forward(layers, xs, logits, T)]
            graphs["ours"][0].replay()
            torch.cuda.synchronize()
            row["graph_equals_eager"] = all(torch.equal(a.view(torch.int16), layer.output.view(torch.int16))
                                            for a, layer in zip(eager, layers))
            floor.set_offsets()
            for name, (gs, gl) in graphs.items():
                row[name] = time_pair(torch, gs, gl, R, args.replays)
            _summary_line(say, row)
    finally:
        graphs.clear()
        torch.cuda.synchronize()
        steps.clear()  # (the baseline's buffers go with it)
        del base
        torch.cuda.empty_cache()
    return out_rows


def _stages_of_size(torch, args, T, layers, floor, rng, shape, say, forward, rows, fills, parsers) -> None:
    """The stages of each row at T tokens per rank, from profiled replays of its routing."""
    H, E = shape[0], shape[2]
    xs, logits, base, steps = _size_inputs(torch, T, layers, floor, shape, forward)
    try:
        for row in rows:
            _refill(torch, rng, xs, logits, fills[(T, row["routing"])], E, layers[0].device, H)
            steps["ours"]()
            torch.cuda.synchronize()
            floor.set_offsets()
            for (name, step), parse in zip(steps.items(), parsers):
                row[name]["stages"] = profile_stages(torch, step, args.stage_replays, parse)
            _stage_line(say, row)
    finally:
        torch.cuda.synchronize()
        steps.clear()
        del base
        torch.cuda.empty_cache()


def _size_inputs(torch, T, layers, floor, shape, forward) -> tuple:
    """(xs, logits, the baseline, the steps ours / baseline / gemm_floor) at T tokens per rank."""
    H, E, dev = shape[0], shape[2], layers[0].device
    xs = [torch.empty(T, H, dtype=torch.bfloat16, device=dev) for _ in layers]
    logits = [torch.empty(T, E, dtype=torch.float32, device=dev) for _ in layers]
    base = AllGatherBaseline(layers, T)
    steps = {"ours": lambda: forward(layers, xs, logits, T), "baseline": lambda: base.step(xs, logits),
             "gemm_floor": lambda: floor.step(T)}
    return xs, logits, base, steps


def _refill(torch, rng, xs, logits, ids, E, dev, H) -> None:
    """Fresh hidden states, logits routing to `ids`."""
    for x, lg, i in zip(xs, logits, ids):
        x.copy_(torch.randn(x.shape[0], H, device=dev).to(torch.bfloat16))
        lg.copy_(torch.from_numpy(logits_for(rng, i, E)))
    torch.cuda.synchronize()


def derive_figures(row: dict, rate_tbps: float) -> None:
    """The row's speedup, weight-read floor, glue share and ratios to its floors."""
    o, b, f = row["ours"], row["baseline"], row["gemm_floor"]
    row["speedup_vs_baseline"] = b["step_us"] / o["step_us"] if o["step_us"] > 0 else None
    row["weight_read_floor_us"] = row["weight_bytes_read"] / (rate_tbps * 1e12) * 1e6
    st = o.get("stages", {}).get("mean_us")
    if st:
        compute = st.get("compute", 0.0)
        row["glue_share"] = (st["index"] + st["gather"] + st["finalize"]) / o["step_us"] if o["step_us"] > 0 else None
        if "glue_busy" in st:
            row["glue_busy_share"] = st["glue_busy"] / o["step_us"] if o["step_us"] > 0 else None
        row["a2a_round_trip_us"] = st["dispatch"] + st["combine"]
        row["layer_over_a2a_plus_gemm_floor"] = o["step_us"] / (row["a2a_round_trip_us"] + f["step_us"]) \
            if row["a2a_round_trip_us"] + f["step_us"] > 0 else None
        row["compute_stage_us"] = compute


def _summary_line(say, row) -> None:
    o, b, f = row["ours"], row["baseline"], row["gemm_floor"]
    say(f"T={row['tokens_per_rank']:5d} {row['routing']:8s} ours {o['step_us']:9.1f} ±{o['spread_us']:.1f} µs   "
        f"baseline {b['step_us']:9.1f} ±{b['spread_us']:.1f}   GEMM floor {f['step_us']:8.1f}   "
        f"x{b['step_us'] / o['step_us']:.2f}   imbalance {row['load_imbalance']:.2f}   "
        f"eager host {row['eager_host_us_per_rank']:.0f} µs/rank ("
        + "/".join(f"{v:.0f}" for v in row["eager_host_phases_us_per_rank"].values())
        + f" prepare/dispatch/compute/combine)   graph==eager {row['graph_equals_eager']}")


def _stage_line(say, row) -> None:
    st = row["ours"]["stages"].get("mean_us")
    if st:
        say("    ours stages µs: " + "  ".join(f"{k} {v:.1f}" for k, v in st.items()))
    bt = row["baseline"]["stages"].get("mean_us")
    if bt:
        say("    baseline stages µs: " + "  ".join(f"{k} {v:.1f}" for k, v in bt.items()))
