"""python -m ep_a2a.bench: dispatch/combine latency and bandwidth beside their floors.

Method (paper Appendix B, adapted to one process): the dispatch and combine launches of
every rank are captured into one CUDA graph (rank 0's stream forks to the others and joins
back), `--rounds` rounds per graph so one graph launch (~10 µs) is amortised; events sit
outside the graph; we report the median over `--replays` replays, per round. A graph
spans every rank, so its time is the max over ranks. Combine = round trip - dispatch-only
graph (combine cannot be replayed alone: it would not wait for its peers).
Floors measured in the same run: the same graph with every kernel replaced by an empty
kernel of the same launch shape (latency), and a device-to-device copy of the bytes
dispatch writes (bandwidth, read + write counted for both).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

PROFILES = {
    "deepseek-v3": dict(hidden=7168, top_k=8, num_experts=256),
    "deepseek-v4.1-flash": dict(hidden=5120, top_k=6, num_experts=384),
    "kimi-k3": dict(hidden=3584, top_k=16, num_experts=896),
}


def _commit() -> str:
    if os.environ.get("EP_A2A_COMMIT"):  # the GPU machine gets a copy of the tree without .git
        return os.environ["EP_A2A_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _payloads(fmt: str, hidden: int, top_k: int):
    from .check import payload_formats
    return payload_formats(hidden, top_k)[fmt]


class Bench:
    def __init__(self, args):
        import ep_a2a
        from .driver.stream import Event
        self.args = args
        self.group = ep_a2a.LocalGroup([args.device] * args.ranks)
        self.dev = self.group.ranks[0].device
        p = PROFILES.get(args.profile, {})
        self.hidden = args.hidden or p["hidden"]
        self.top_k = args.top_k or p["top_k"]
        self.num_experts = args.experts or p["num_experts"]
        self.specs = _payloads(args.format, self.hidden, self.top_k)
        # one workspace with both protocols; each sweep forces one (or lets "auto" choose)
        self.a2a = ep_a2a.MoeAlltoAll(self.group, max_tokens_per_rank=max(args.tokens), top_k=self.top_k,
                                      num_experts=self.num_experts, payloads=self.specs,
                                      combine_hidden_size=self.hidden, protocol="auto",
                                      validate_expert_ids=False, pdl=not args.no_pdl,
                                      threads_per_block=args.threads)
        self.ev0, self.ev1 = Event(self.dev, timing=True), Event(self.dev, timing=True)
        self.streams = [r.stream.handle for r in self.group.ranks]

    def _inputs(self, T: int, rng):
        from .check import random_payload, routing
        from .driver.memory import copy_from_numpy, from_numpy
        from .reference import from_float32
        ins = []
        for s, r in enumerate(self.group.ranks):
            ids = routing(self.args.routing, rng, T, self.top_k, self.num_experts, self.args.ranks, s, self.args.alpha)
            pays = [from_numpy(random_payload(rng, sp, T), r.device, sp.dtype) for sp in self.specs]
            ins.append((from_numpy(ids, r.device, "int32"), pays, ids))
            copy_from_numpy(self.a2a.ranks[s].combine_input(T),
                            from_float32(rng.standard_normal((self.args.ranks, T, self.hidden)).astype(np.float32), "bfloat16"))
        return ins

    def _graph(self, body, rounds: int):
        from .driver.stream import Event, Graph
        s0 = self.streams[0]
        Graph.begin(s0)
        fork = Event(self.dev).record(s0)
        for s in self.streams[1:]:
            fork.wait_on(s)
        for _ in range(rounds):
            body()
        for s in self.streams[1:]:
            Event(self.dev).record(s).wait_on(s0)
        return Graph.end(s0)

    def _time(self, graph, replays: int) -> float:
        """Median µs of one graph replay (events outside the graph)."""
        s0 = self.streams[0]
        graph.launch(s0)  # warm-up
        times = []
        for _ in range(replays):
            self.ev0.record(s0)
            graph.launch(s0)
            self.ev1.record(s0)
            self.ev1.synchronize()
            times.append(self.ev0.elapsed_ms(self.ev1) * 1e3)
        return float(np.median(times))

    def measure(self, T: int, rng) -> dict:
        from cuda.bindings import driver as _drv
        from .driver.errors import call
        from .driver.memory import empty
        a, R = self.a2a, self.args.rounds
        ins = self._inputs(T, rng)
        ranks = a.ranks

        def dispatch_all():
            for s, r in enumerate(ranks):
                r.dispatch(ins[s][0], ins[s][1], T)
                r._dispatched_tmax = None  # dispatch-only graph: the host phase check is not the point

        def roundtrip():
            for s, r in enumerate(ranks):
                r.dispatch(ins[s][0], ins[s][1], T)
            for r in ranks:
                r.combine(r.combine_input(T), T)

        def empty_like(rt: bool):
            def body():
                for r in ranks:
                    r.launch_empty(grid=r.last_grids[0])
                if rt:
                    for r in ranks:
                        r.launch_empty(grid=r.last_grids[1])
            return body

        roundtrip()  # eager once: sets the grids, checks nothing hangs
        a.synchronize()
        # SENTINEL reuses its landing slots only after combine: dispatch alone cannot be
        # replayed, so its dispatch/combine split is not measured (round trip only)
        split = ranks[0].last_protocol == "fence"
        graphs = [self._graph(roundtrip, R), self._graph(empty_like(True), R)]
        if split:
            graphs += [self._graph(dispatch_all, R), self._graph(empty_like(False), R)]
        t = [self._time(g, self.args.replays) / R for g in graphs]
        for g in graphs:
            g.close()
        rt, ert = t[:2]
        d, ed = t[2:] if split else (None, None)

        # bytes: what dispatch writes (one copy per distinct target) and reads (once per token)
        from .reference import expert_owner, targets_of
        owner = expert_owner(self.num_experts, self.args.ranks)
        per_token = sum(sp.bytes_per_token for sp in self.specs) + 4 * self.top_k
        sends = sum(len(targets_of(row, owner)) for _, _, ids in ins for row in ids)
        remote = sum(sum(1 for t in targets_of(row, owner) if t != s) for s, (_, _, ids) in enumerate(ins) for row in ids)
        written = sends * per_token
        read = T * self.args.ranks * per_token
        combine_bytes = sends * self.hidden * 2  # each partial read once, plus outputs written
        combine_traffic = combine_bytes + T * self.args.ranks * self.hidden * 2

        # bandwidth floor: a device copy of the bytes dispatch writes
        nbytes = max(written, 1 << 20)
        src, dst = empty((nbytes,), "uint8", self.dev), empty((nbytes,), "uint8", self.dev)
        s0 = self.streams[0]
        from .driver.stream import Graph
        Graph.begin(s0)
        for _ in range(R):
            call(_drv.cuMemcpyDtoDAsync, dst.ptr, src.ptr, nbytes, s0)
        g_copy = Graph.end(s0)
        copy_us = self._time(g_copy, self.args.replays) / R
        g_copy.close()
        del src, dst
        copy_tbps = 2 * nbytes / copy_us / 1e6
        row = dict(tokens_per_rank=T, resolved_protocol=ranks[0].last_protocol, round_trip_us=rt,
                   floor_round_trip_us=ert, round_trip_over_floor=rt / ert,
                   dispatch_bytes_written=written, dispatch_bytes_read=read, bytes_crossing_gpus=remote * per_token,
                   copy_floor_tbps=copy_tbps, round_trip_tbps=(written + read + combine_traffic) / rt / 1e6,
                   dispatch_us=None, combine_us=None)
        if split:
            comb = rt - d
            disp_tbps = (written + read) / d / 1e6
            row.update(dispatch_us=d, combine_us=comb, floor_dispatch_us=ed, floor_combine_us=ert - ed,
                       dispatch_over_floor=d / ed, dispatch_tbps=disp_tbps,
                       combine_tbps=combine_traffic / max(comb, 1e-9) / 1e6, dispatch_over_copy_bw=disp_tbps / copy_tbps,
                       logical_dispatch_gbps=T * min(self.args.ranks, self.top_k) * (per_token - 4 * self.top_k) / d / 1e3,
                       logical_combine_gbps=T * min(self.args.ranks, self.top_k) * self.hidden * 2 / max(comb, 1e-9) / 1e3)
        return row

    def host_overhead(self, T: int, rng, iters: int = 200) -> dict:
        """µs of host time per rank per eager dispatch+combine (arguments reused, no sync)."""
        a, ranks = self.a2a, self.a2a.ranks
        ins = self._inputs(T, rng)
        cin = [r.combine_input(T) for r in ranks]

        def step():
            for s, r in enumerate(ranks):
                r.dispatch(ins[s][0], ins[s][1], T)
            for s, r in enumerate(ranks):
                r.combine(cin[s], T)

        step()
        a.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        t1 = time.perf_counter()
        a.synchronize()
        # what two bare launches (cuLaunchKernelEx of the prepacked empty kernel) cost
        t2 = time.perf_counter()
        for _ in range(iters):
            for r in ranks:
                r.launch_empty()
                r.launch_empty()
        t3 = time.perf_counter()
        a.synchronize()
        return dict(tokens_per_rank=T, host_us_per_rank_step=(t1 - t0) / iters / len(ranks) * 1e6,
                    two_bare_launches_us=(t3 - t2) / iters / len(ranks) * 1e6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="deepseek-v3", choices=list(PROFILES) + ["custom"])
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--ranks", type=int, default=8, help="in-process ranks on --device")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2 ** i for i in range(13)])
    ap.add_argument("--routing", default="perfect", choices=["perfect", "uniform", "zipf"])
    ap.add_argument("--alpha", type=float, default=1.2)
    ap.add_argument("--format", default="bf16", choices=["bf16", "mxfp8", "nvfp4"])
    ap.add_argument("--protocol", default="fence,sentinel,auto", help="comma list of fence, sentinel, auto")
    ap.add_argument("--sentinel-max", type=int, default=4096, help="sweep SENTINEL only up to this many tokens")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--threads", type=int, default=256, help="threads per block of the protocol kernels")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/<device>-<date>.json)")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    ap.add_argument("--profile-host", action="store_true", help="print where the eager host time goes (cProfile)")
    args = ap.parse_args(argv)
    if args.profile == "custom" and not (args.hidden and args.top_k and args.experts):
        ap.error("--profile custom needs --hidden, --top-k and --experts")

    from .driver import device
    if not device.available():
        print("no CUDA GPU here: nothing to benchmark", file=sys.stderr)
        return 1
    b = Bench(args)
    rng = np.random.default_rng()
    rows = []
    protocols = args.protocol.split(",")
    n = sum(len([t for t in args.tokens if p != "sentinel" or t <= args.sentinel_max]) for p in protocols)
    for proto in protocols:
        b.a2a.protocol = proto
        for T in [t for t in args.tokens if proto != "sentinel" or t <= args.sentinel_max]:
            rows.append(dict(protocol=proto, **b.measure(T, rng)))
            r = rows[-1]
            print(f"[{len(rows)}/{n}] {proto} T={T}: round trip {r['round_trip_us']:.1f} µs", file=sys.stderr, flush=True)
    b.a2a.protocol = "auto"
    crossover = _crossover(rows)
    host = [b.host_overhead(T, rng) for T in (1, 128)]
    if args.profile_host:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.runcall(b.host_overhead, 1, rng, 500)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    from cuda.bindings import driver as _drv
    dev = b.dev
    result = dict(
        device=dev.name, compute_capability=list(dev.compute_capability), sm_count=dev.sm_count,
        driver=_drv.cuDriverGetVersion()[1], date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        commit=_commit(), config=dict(vars(args), hidden=b.hidden, top_k=b.top_k, experts=b.num_experts,
                                      payload_bytes_per_token=[s.bytes_per_token for s in b.specs]),
        workspace_bytes_per_rank=b.a2a.workspace_bytes_per_rank,
        expert_major_bytes_per_rank=b.a2a.layout.expert_major_bytes(-(-b.num_experts // args.ranks)),
        method=__doc__, rows=rows, host_overhead=host, measured_sentinel_max_tokens=crossover)
    out = args.out or os.path.join("bench", "results", f"{dev.name.replace(' ', '_')}-{args.profile}-{args.format}-"
                                   f"{args.ranks}ranks-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    _table(result)
    if args.plot:
        _plot(result, args.plot)
    print(f"wrote {out}")
    return 0


def _crossover(rows):
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


def _table(res) -> None:
    print(f"{res['device']}, {res['config']['ranks']} in-process ranks, {res['config']['profile']}, "
          f"{res['config']['format']}, {res['config']['routing']} routing, commit {res['commit']}")
    print(f"{'proto':>8} {'T':>5} {'rt µs':>8} {'floor':>7} {'x':>5} {'disp µs':>8} {'floor':>7} {'comb µs':>8} "
          f"{'disp TB/s':>9} {'copy TB/s':>9} {'%copy':>6}")
    def f(v, spec):
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0].lstrip("<>^"))
    for r in res["rows"]:
        pct = None if r.get("dispatch_over_copy_bw") is None else 100 * r["dispatch_over_copy_bw"]
        print(f"{r['protocol']:>8} {r['tokens_per_rank']:>5} {r['round_trip_us']:>8.1f} {r['floor_round_trip_us']:>7.1f} "
              f"{r['round_trip_over_floor']:>5.2f} {f(r['dispatch_us'], '>8.1f')} {f(r.get('floor_dispatch_us'), '>7.1f')} "
              f"{f(r['combine_us'], '>8.1f')} {f(r.get('dispatch_tbps'), '>9.2f')} {r['copy_floor_tbps']:>9.2f} "
              f"{f(pct, '>5.0f')}%")
    print(f"measured crossover: SENTINEL faster up to {res['measured_sentinel_max_tokens']} tokens per rank")
    for h in res["host_overhead"]:
        print(f"host overhead, T={h['tokens_per_rank']}: {h['host_us_per_rank_step']:.1f} µs per rank per "
              f"eager dispatch+combine (two bare launches: {h['two_bare_launches_us']:.1f} µs)")


def _plot(res, path: str) -> None:
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
    ax.set_title(f"{res['device']}: {res['config']['ranks']} in-process ranks, {res['config']['profile']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
