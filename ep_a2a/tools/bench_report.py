"""The benchmark's results: the commit measured, the cross-process reduction of the rank
processes' numbers, the crossover between the protocols, and the JSON / table / plot report
(python -m ep_a2a.bench; bench.py measures)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from . import result_paths

QUANT_NAMES = {"fp8": ", FP8 combine", "fp8-epilogue": ", FP8 combine of epilogue-quantized partials"}


def commit() -> str:
    """The short commit id of the code measured: $EP_A2A_COMMIT, else git's HEAD, else "unknown"."""
    if os.environ.get("EP_A2A_COMMIT"):  # the GPU machine gets a copy of the tree without .git
        return os.environ["EP_A2A_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def torch_device_fields(torch, dev) -> dict:
    """The head of a torch benchmark's result: the GPU, the torch version, the date and commit."""
    import datetime
    props = torch.cuda.get_device_properties(dev)
    return dict(device=props.name, compute_capability=list(torch.cuda.get_device_capability(dev)),
                sm_count=props.multi_processor_count, torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=commit())


def gather(bootstrap, values) -> np.ndarray:
    """float64 [processes, len(values)]: every process's `values` in rank order (one row
    without a bootstrap). Raw float64 bytes over the bootstrap, never pickle."""
    mine = np.asarray(values, np.float64).reshape(-1)
    if bootstrap is None:
        return mine[None]
    parts = [np.frombuffer(b, np.float64) for b in bootstrap.allgather(mine.tobytes())]
    if any(p.shape != mine.shape for p in parts):
        raise ValueError(f"gather: ranks passed {[p.size for p in parts]} values; all must pass {mine.size}")
    return np.stack(parts)


def result_file(result: dict, args) -> str:
    """The default file stem of a sweep (result_paths' convention): benchmark, device (n x GPU
    over several GPUs), ranks or rank processes, profile, then what varies within a profile."""
    inproc = result["mode"] == "inproc"
    dev = result_paths.device_slug(result["device"], 1 if inproc else result.get("gpus", 1))
    ranks = f"{result['ep_size']}ranks" if inproc else f"{result['ep_size']}procs"
    fmt = None if args.format == "bf16" else args.format
    return result_paths.result_name("alltoall", dev, ranks, args.profile, fmt, args.protocol.replace(",", "-"),
                                    args.combine_quant)


def report(result: dict, args) -> str:
    """Write the JSON (and plot), print the table; returns the JSON path."""
    out = result_paths.write_json(result_paths.output_path(args.out, result_file(result, args)), result)
    table(result)
    if args.plot:
        plot(result, args.plot)
    print(f"wrote {out}", flush=True)
    return str(out)


def crossover(rows):
    """Largest T at which SENTINEL's round trip beats FENCE's (None unless both were swept)."""
    by = {(r["protocol"], r["tokens_per_rank"]): r["round_trip_us"] for r in rows}
    Ts = sorted({t for p, t in by if p == "sentinel" and ("fence", t) in by})
    best = None
    for t in Ts:
        if by[("sentinel", t)] < by[("fence", t)]:
            best = t
        else:
            break
    return best


def setup(res) -> str:
    """How the ranks were laid out, in words (the table and plot headers)."""
    if res.get("mode", "inproc") == "inproc":
        return f"{res['config']['ranks']} in-process ranks"
    return f"{res['procs']} rank processes on {res['gpus']} GPU(s)"


def table(res) -> None:
    print(f"{res['device']}, {setup(res)}, {res['config']['profile']}, "
          f"{res['config']['format']}{QUANT_NAMES.get(res['config'].get('combine_quant'), '')}, "
          f"{res['config']['routing']} routing, commit {res['commit']}")
    if res.get("shared_gpu"):
        print(f"shared_gpu: {res['procs']} processes time-slice {res['gpus']} GPU(s): cross-process waits cost "
              "milliseconds, so these times test the path and are NOT performance")
    rounds = res.get("graph_rounds")
    print("per round: " + (f"(t({rounds[1]}) - t({rounds[0]})) / {rounds[0]} rounds (graph launch excluded)" if rounds
                           else f"t / {res['config'].get('rounds')} rounds (graph launch included)")
          + "; split: g = dispatch-only graph, ts = device timestamps; %bf = bytes floor µs / phase µs;"
          + " bf turn = both byte floors in turn, per round")
    print(f"{'proto':>8} {'T':>5} {'rt µs':>8} {'empty':>6} {'x':>5} {'barrier':>7} {'disp µs':>8} {'':>2} {'comb µs':>8} "
          f"{'%bf d':>5} {'%bf c':>5} {'bf d µs':>8} {'bf c µs':>8} {'bf turn':>8} {'disp TB/s':>9} {'copy TB/s':>9} {'%copy':>6} "
          f"{'peer TB/s':>9}")

    def f(v, spec):
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0].lstrip("<>^"))

    def pct(v):
        return None if v is None else 100 * v
    for r in res["rows"]:
        how = {"dispatch-only graph": "g", "device timestamps": "ts"}.get(r.get("split_method"), "")
        print(f"{r['protocol']:>8} {r['tokens_per_rank']:>5} {r['round_trip_us']:>8.1f} {r['floor_round_trip_us']:>6.1f} "
              f"{f(r.get('round_trip_over_floor'), '>5.2f')} {f(r.get('barrier_floor_round_trip_us'), '>7.1f')} "
              f"{f(r.get('dispatch_us'), '>8.1f')} {how:>2} {f(r.get('combine_us'), '>8.1f')} "
              f"{f(pct(r.get('dispatch_of_bytes_floor')), '>5.0f')} {f(pct(r.get('combine_of_bytes_floor')), '>5.0f')} "
              f"{f(r.get('bytes_floor_dispatch_us'), '>8.1f')} {f(r.get('bytes_floor_combine_us'), '>8.1f')} "
              f"{f(r.get('bytes_floor_in_turn_us'), '>8.1f')} {f(r.get('dispatch_tbps'), '>9.2f')} {f(r.get('copy_floor_tbps'), '>9.2f')} "
              f"{f(pct(r.get('dispatch_over_copy_bw')), '>5.0f')}% {f(r.get('peer_copy_floor_tbps'), '>9.2f')}")
    stamped = [r for r in res["rows"] if r.get("stamped_round_trip_us") is not None]
    if stamped:
        print("device timestamps (stamp kernels' cost included): " + ", ".join(
            f"{r['protocol']} T={r['tokens_per_rank']} {r['stamped_dispatch_us']:.1f}/{r['stamped_combine_us']:.1f}"
            for r in stamped) + f" µs (timer step >= {min(r['globaltimer_smallest_step_ns'] for r in stamped)} ns)")
    if res.get("peer_copy_floor_reason"):
        print(f"peer copy floor: none ({res['peer_copy_floor_reason']})")
    print(f"measured crossover: SENTINEL faster up to {res['measured_sentinel_max_tokens']} tokens per rank")
    for h in res["host_overhead"]:
        print(f"host overhead, T={h['tokens_per_rank']}: {h['host_us_per_rank_step']:.1f} µs per rank per "
              f"eager dispatch+combine = Python {h['python_us_per_rank_step']:.1f} + launches "
              f"(two bare launches: {h['two_bare_launches_us']:.1f} µs)")
    for h in res.get("torch_host_overhead") or []:  # rows of ep_a2a.tools.bench_torch: printed as they come
        print("torch host overhead: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in h.items()))


def plot(res, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for proto in dict.fromkeys(r["protocol"] for r in res["rows"]):
        rows = [r for r in res["rows"] if r["protocol"] == proto]
        T = [r["tokens_per_rank"] for r in rows]
        ax.plot(T, [r["round_trip_us"] for r in rows], marker="o", label=f"{proto} round trip")
    rows = [r for r in res["rows"] if r["protocol"] == res["rows"][0]["protocol"]]
    ax.plot([r["tokens_per_rank"] for r in rows], [r["floor_round_trip_us"] for r in rows], linestyle="--",
            label="empty-kernel floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("µs")
    ax.set_title(f"{res['device']}: {setup(res)}, {res['config']['profile']}"
                 + (" (shared GPU: not performance)" if res.get("shared_gpu") else ""))
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
