"""python -m ep_a2a.bench_layer --framework jax: the JAX MoE layer (ep_a2a/layers/jax.py) on
in-process ranks of one GPU, jitted (moe_forward_traced: one XLA program for every rank, our
dispatch and combine as XLA calls on its stream) against the same layer eager
(moe_forward_all_ranks) and against a jitted all-gather baseline a JAX user would write
without ep_a2a: every rank's tokens, ids and weights concatenated (the all-gather), each rank's
local experts over the selections of all tokens (sorted by expert; XLA's expert function of
--gemm: padded_ffn with at most one row per token and expert, or jax.lax.ragged_dot, "auto"
choosing between them as our layer does when it does not take ep_a2a's expert kernels, which
a layer without ep_a2a has not; the router weight applied in fp32 and scattered back per
token), the ranks' outputs summed and each rank's own rows sliced out (the reduce-scatter).
Each row names the expert function our layer ran (`gemm`).

Method: wall time of a whole step on the host, from the call to the results being ready
(jax.block_until_ready; the eager layer synchronizes itself), median over --iters after
--warmup, per token count. Stages (--stage-replays > 0, where torch is installed): after every
size is timed, the jitted steps of each size replayed back to back under torch.profiler, whose
CUPTI kernel records give each stage's span as the graphed torch benchmark's do. The jitted
step's device time: a program of CHAIN + 1 steps (each
step's outputs the next one's hidden states) minus a program of one, over CHAIN (the host
issues step i+1 while step i runs, so it hides behind the GPU as long as it is the faster);
host = jit - device. jax_call: a jitted call of the same arguments and results doing one
elementwise op per rank (JAX's own dispatch and synchronization, which jit includes and no
handler of ours can remove). issue / jax_issue: the time until the jitted call (resp. that
elementwise call) returns, before any wait: the host thread's own cost of a step, the rest of
jit being the GPU's and the wait's. handler_runs_per_call: how often our FFI handler ran per
timed jitted call (each call, or only when XLA's command buffer records it); node_updates_per_call:
the kernel nodes of the handler's own graphs it re-set per call (where XLA's buffers moved).
The step's routing (random logits, the same every step of a size) selects
experts whose bf16 weights it must read (load_stats: experts_touched, weight_bytes_read), in at
least weight_read_floor_us at the copy rate of a jitted elementwise pass over 1 GiB in the
same run (bytes read + written per second), the experts' floor at small sizes.
Pipelined: --iters steps issued back to back (each step's outputs the
next one's hidden states) and waited for once, per step: what a serving loop that does not
wait between steps sees, the larger of the host's and the device's time per step; the
baseline is timed the same way. Routing: random logits through the router. Prints one line per token
count and returns the rows (bench_layer.py writes the JSON)."""
from __future__ import annotations

import datetime
import os
import sys
import time

import numpy as np

from ..ops.jax_bench import issue_us
from .bench_layer_graphs import load_stats
from .bench_layer_profiles import layer_shape, run_seed
from .bench_layer_stages import OURS_MAP


def all_gather_step(layers, gemm: str):
    """The jitted all-gather baseline over these layers: f(xs, logits) -> one output per rank.
    gemm: the layers' gemm ("auto", "padded" or "ragged"), resolved per T^ as theirs (expert_gemm);
    for "fused" (ep_a2a's expert kernels, which a layer without ep_a2a has not) as "auto"."""
    import jax
    import jax.numpy as jnp
    from ..layers.jax import expert_gemm, traced_functions
    fns = traced_functions()
    router = fns["router"]

    def experts(p, rows, counts, tokens):  # a token selects an expert at most once
        if expert_gemm("auto" if gemm == "fused" else gemm, tokens // len(layers)) == "padded":
            return fns["padded_ffn"](rows, counts, p["w1t"], p["w2t"], tokens)
        return fns["ragged_ffn"](rows, counts, p["w1t"], p["w2t"])

    def step(params, xs, logits):
        routes = [router(lg, layer.top_k, layer.renormalize) for layer, lg in zip(layers, logits)]
        x = jnp.concatenate(xs)                                  # the all-gather
        ids = jnp.concatenate([r[0] for r in routes])
        w = jnp.concatenate([r[1] for r in routes])
        n, k = ids.shape
        total = jnp.zeros((n, x.shape[1]), jnp.float32)
        for layer, p in zip(layers, params):                     # each rank's local experts
            local = ids.reshape(-1) - layer.first_expert
            mine = (local >= 0) & (local < layer.num_local)
            key = jnp.where(mine, local, layer.num_local)
            order = jnp.argsort(key, stable=True)
            counts = jnp.bincount(key, length=layer.num_local + 1)[:layer.num_local].astype(jnp.int32)
            rows = x[order // k]
            y = experts(p, rows, counts, n)
            wt = jnp.where(mine, w.reshape(-1), 0.0)[order]
            total = total.at[order // k].add(y.astype(jnp.float32) * wt[:, None])   # the reduce-scatter's sum
        outs, start = [], 0
        for xr in xs:
            outs.append(total[start:start + xr.shape[0]].astype(jnp.bfloat16))
            start += xr.shape[0]
        return outs
    params, jitted = [{k: layer.params[k] for k in ("w1t", "w2t")} for layer in layers], jax.jit(step)
    return lambda xs, logits: jitted(params, xs, logits)


CHAIN = 4
JAX_STAGE_MAP = dict(OURS_MAP, memcpy="index")  # (dispatch_to_experts copies the counts after its index)


def calls_path() -> str:
    """How the jitted step's dispatch and combine run: the native FFI library or Python callbacks."""
    from ..ops import jax_ffi
    reason = jax_ffi.why()
    if reason is not None:
        return f"python callbacks ({reason})"
    h = jax_ffi.handler_settings()
    return (f"native ({'the handler XLA may capture' if h['xla_may_capture'] else 'the handler XLA never captures'}, "
            f"{'its own graph' if h['own_graphs'] else 'kernel by kernel'} where uncaptured)")


def chained_steps(layers, runtime_max: int, steps: int):
    """jax.jit of `steps` layer steps of every rank, each step's outputs the next one's inputs."""
    import jax
    from ..layers.jax import moe_forward_traced, traced_params

    def run(params, xs, logits):
        for _ in range(steps):
            xs = moe_forward_traced(layers, xs, logits, runtime_max, params)
        return xs
    params, jitted = traced_params(layers, runtime_max), jax.jit(run)
    return lambda xs, logits: jitted(params, xs, logits)


def _median_us(fn, iters: int, warmup: int) -> float:
    import jax
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def random_expert_weights(key, n: int, H: int, I: int, device) -> tuple:
    """n experts' bf16 weights drawn on `device` (jax.random under `key`): w_gate_up [n, 2I, H] ~
    N(0, 1/H), w_down [n, H, I] ~ N(0, 1/I). Drawn rank by rank on the GPU: the DeepSeek-V3-like
    profile's 22.5 GB of weights are neither drawn by one host core nor held by the host."""
    import jax
    import jax.numpy as jnp
    k1, k2 = jax.random.split(key)

    def draw(k, shape, scale):
        with jax.default_device(device):
            return (jax.random.normal(k, shape, jnp.float32) * np.float32(scale)).astype(jnp.bfloat16)
    return draw(k1, (n, 2 * I, H), H ** -0.5), draw(k2, (n, H, I), I ** -0.5)


def copy_rate_tbps(gpu, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """HBM rate of an elementwise pass over nbytes (bytes read + written per second, TB/s): a
    jitted program of two passes (a barrier keeps XLA from fusing them) minus one of one pass,
    medians of iters calls, so the call's own cost cancels: the floor's rate in the same run."""
    import jax
    import jax.numpy as jnp
    x = jax.device_put(jnp.zeros(nbytes // 4, jnp.float32), gpu)
    one = jax.jit(lambda a: a + 1.0)
    two = jax.jit(lambda a: jax.lax.optimization_barrier(a + 1.0) + 1.0)
    us = _median_us(lambda: two(x), iters, 2) - _median_us(lambda: one(x), iters, 2)
    del x
    return 2 * nbytes / (us * 1e-6) / 1e12


def stage_profile(fn, xs, logits, replays: int):
    """Stage times (bench_layer_stages: a stage spans from its first kernel on any rank to its
    last) of replays + 1 jitted steps issued back to back, the first left out, from the CUPTI
    records of torch.profiler, which sees every kernel of the process, XLA's and ours; a
    dict with the reason where torch is absent or the records do not split into steps."""
    import jax
    from .bench_layer_stages import OURS_GROUPS, OURS_STAGES, stage_times, trace_events
    try:
        import torch
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001  (no torch, or no CUDA in it: no profile, the rest stands)
        return dict(error=f"no kernel records: {e}")
    ys = jax.block_until_ready(fn(xs, logits))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays + 1):
            ys = fn(ys, logits)
        jax.block_until_ready(ys)
    events = trace_events(prof)
    try:
        return stage_times(events, replays + 1, JAX_STAGE_MAP, OURS_STAGES, groups=OURS_GROUPS, skip=1)
    except ValueError as e:
        return dict(error=str(e))


def _pipelined_us(fn, xs, logits, iters: int, warmup: int) -> float:
    import jax
    ys = xs
    for _ in range(warmup):
        ys = fn(ys, logits)
    jax.block_until_ready(ys)
    t0 = time.perf_counter()
    for _ in range(iters):
        ys = fn(ys, logits)
    jax.block_until_ready(ys)
    return (time.perf_counter() - t0) / iters * 1e6


def run(args, profiles: dict, commit) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    import ep_a2a
    from ..layers.jax import JaxMoeLayer, jax_device, jit_forward_all_ranks, moe_forward_all_ranks, payload_specs
    from ..moe import local_experts
    from ..testing.layer_oracle import max_relative_error
    H, I, E, top_k, ep = layer_shape(args, profiles)
    seed = run_seed(args)
    rng = np.random.default_rng(seed)
    gpu = jax_device(args.device)
    put = lambda a: jax.device_put(jnp.asarray(a), gpu)  # noqa: E731
    key = jax.random.key(seed)
    rate = copy_rate_tbps(gpu)
    print(f"seed {seed}; {gpu.device_kind}; jax {jax.__version__}; {ep} ranks; hidden {H}, intermediate {I}, "
          f"{E} experts, top_k {top_k}; copy rate {rate:.2f} TB/s (read + write)", file=sys.stderr)
    protocol = "fence" if args.combine_quant else args.protocol
    rows, profiled = [], []
    with ep_a2a.LocalGroup([args.device] * ep) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max(args.tokens), top_k=top_k, num_experts=E,
                               payloads=payload_specs(H, top_k), combine_hidden_size=H, protocol=protocol,
                               combine_quant=args.combine_quant, validate_expert_ids=False, on_timeout="abort") as a2a:
        layers = []
        try:
            for r in a2a.ranks:
                w1, w2 = random_expert_weights(jax.random.fold_in(key, r.rank), local_experts(E, ep, r.rank)[1], H, I, gpu)
                layers.append(JaxMoeLayer(r, w1, w2, gemm=args.gemm))  # (the baseline reads the layers' weights)
                del w1, w2
            base = all_gather_step(layers, args.gemm)
            trivial = jax.jit(lambda xs, logits: [(x.astype(jnp.float32) * 1.0001).astype(x.dtype) for x in xs])
            for T in args.tokens:
                xs = [put(rng.standard_normal((T, H)).astype(np.float32)).astype(jnp.bfloat16) for _ in range(ep)]
                logits = [put(rng.standard_normal((T, E)).astype(np.float32)) for _ in range(ep)]
                jitted = jit_forward_all_ranks(layers, T)
                many = chained_steps(layers, T, CHAIN + 1)
                ours = [np.asarray(o) for o in jax.block_until_ready(jitted(xs, logits))]
                eager = [np.asarray(o) for o in moe_forward_all_ranks(layers, xs, logits, T)]
                theirs = [np.asarray(o) for o in jax.block_until_ready(base(xs, logits))]
                same = all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(ours, eager))
                load = load_stats([np.asarray(layer.routing[0]) for layer in layers], ep, T, top_k, E, H, I)
                diff = max(max_relative_error(a.astype(np.float32), b.astype(np.float32)) for a, b in zip(ours, theirs))
                runs, updates = layers[0].native_calls(), layers[0].native_calls(updates=True)
                row = dict(tokens_per_rank=T, gemm=layers[0].expert_gemm(T), jit_equals_eager_bitwise=same,
                           max_rel_diff_vs_baseline=diff, **load,
                           weight_read_floor_us=load["weight_bytes_read"] / (rate * 1e12) * 1e6,
                           jit_us=_median_us(lambda: jitted(xs, logits), args.iters, args.warmup),
                           handler_runs_per_call=(layers[0].native_calls() - runs) / (args.iters + args.warmup),
                           node_updates_per_call=(layers[0].native_calls(updates=True) - updates) / (args.iters + args.warmup),
                           eager_us=_median_us(lambda: moe_forward_all_ranks(layers, xs, logits, T), args.iters, args.warmup),
                           baseline_us=_median_us(lambda: base(xs, logits), args.iters, args.warmup))
                row["device_us"] = (_median_us(lambda: many(xs, logits), args.iters, args.warmup) - row["jit_us"]) / CHAIN
                row["host_us"] = row["jit_us"] - row["device_us"]
                row["jax_call_us"] = _median_us(lambda: trivial(xs, logits), args.iters, args.warmup)
                row["issue_us"] = issue_us(lambda: jitted(xs, logits), args.iters, args.warmup)
                row["jax_issue_us"] = issue_us(lambda: trivial(xs, logits), args.iters, args.warmup)
                row["pipelined_us"] = _pipelined_us(jitted, xs, logits, args.iters, args.warmup)
                row["baseline_pipelined_us"] = _pipelined_us(base, xs, logits, args.iters, args.warmup)
                rows.append(row)
                profiled.append((row, jitted, xs, logits))
                print(f"T={T:5d} {row['gemm']:6s} jit {row['jit_us']:9.1f} µs   eager {row['eager_us']:9.1f} µs   all-gather (jit) "
                      f"{row['baseline_us']:9.1f} µs   x{row['baseline_us'] / row['jit_us']:.2f} vs baseline, "
                      f"x{row['eager_us'] / row['jit_us']:.2f} vs eager; device {row['device_us']:.1f} µs "
                      f"(jit/device x{row['jit_us'] / row['device_us']:.2f}; JAX's own call {row['jax_call_us']:.1f}; returns after "
                      f"{row['issue_us']:.1f}, JAX's own {row['jax_issue_us']:.1f}; handler runs per call "
                      f"{row['handler_runs_per_call']:.2f}); pipelined {row['pipelined_us']:.1f} µs "
                      f"(/device x{row['pipelined_us'] / row['device_us']:.2f}; baseline {row['baseline_pipelined_us']:.1f}); "
                      f"weight-read floor {row['weight_read_floor_us']:.1f} µs ({load['experts_touched']} experts); "
                      f"jit == eager bitwise: {same}; "
                      f"vs baseline {diff:.2g}", file=sys.stderr, flush=True)
            # stages after every timing: steps run slower once CUPTI has run in the process
            for row, jitted, xs, logits in profiled if args.stage_replays else ():
                row["stages"] = stage_profile(jitted, xs, logits, args.stage_replays)
                means = row["stages"].get("mean_us", row["stages"])
                print(f"T={row['tokens_per_rank']:5d} stages (µs, mean span): "
                      + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in means.items()),
                      file=sys.stderr, flush=True)
        finally:
            for layer in layers:
                layer.close()
    return dict(device=gpu.device_kind, jax=jax.__version__, framework="jax",
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=commit(),
                config=dict(profile=args.profile, hidden=H, intermediate=I, experts=E, top_k=top_k, ranks=ep,
                            device=args.device, tokens=args.tokens, iters=args.iters, warmup=args.warmup, seed=seed,
                            protocol=protocol, combine_quant=args.combine_quant, gemm=args.gemm,
                            calls=calls_path(), xla_flags=os.environ.get("XLA_FLAGS", ""), copy_rate_tbps=rate,
                            stage_replays=args.stage_replays),
                method=__doc__, rows=rows)
