"""python -m ep_a2a.bench: dispatch/combine latency and bandwidth beside their floors.

Method (paper Appendix B, adapted): each process captures the dispatch and combine
launches of its ranks into one CUDA graph, `--rounds` rounds per graph so one graph launch
(~10 µs) is amortised; events sit outside the graph; we report the median over
`--replays` replays, per round, and the maximum over ranks. Combine = round trip -
dispatch-only graph (combine cannot be replayed alone: it would not wait for its peers).
Floors measured in the same run: the same graph with every kernel replaced by an empty
kernel of the same launch shape (latency), a device-to-device copy of the bytes dispatch
writes (bandwidth, read + write counted for both) and, when the ranks span several GPUs,
a copy of the same bytes out of a peer GPU's mapped workspace (NVLink, bytes counted once).
Beside the empty-kernel floor, in-process runs also time a barrier floor: two cross-rank
flag rounds per round trip (release fence, a flag to every rank, acquire polls), the
synchronization each protocol phase holds, with no data; it shows how much of the gap to
the empty-kernel floor is crossing ranks at all (launch skew included) and how much is
the protocols' own work. It does not replace the empty-kernel floor.

Two modes:
  --mode inproc (default): `--ranks` ranks in this process on `--device`; one graph spans
    every rank (rank 0's stream forks to the others and joins back), so its time is
    already the maximum over ranks.
  --mode procs: one process per visible GPU (or `--procs N`, round-robin over the GPUs),
    each a ProcessGroup rank met over a UnixSocketBootstrap, as a deployment runs. Every
    rank captures its own graphs; before each replay all ranks meet at a host barrier,
    so the barrier's release skew (tens of µs) lands in the first round of a replay.
    Per-rank medians travel to every rank over the bootstrap; rows take their maximum.
    Processes sharing a GPU time-slice it (without MPS), so their cross-process waits
    cost milliseconds: such runs say `shared_gpu: true` and test the path, not its speed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from .layout import Q8_BLOCK

PROFILES = {
    "deepseek-v3": dict(hidden=7168, top_k=8, num_experts=256),
    "deepseek-v4.1-flash": dict(hidden=5120, top_k=6, num_experts=384),
    "kimi-k3": dict(hidden=3584, top_k=16, num_experts=896),
}
MODES = ("inproc", "procs")
ONE_GPU = "every rank is on one GPU: no NVLink path between ranks to measure"


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


class Bench:
    """The measurements, for the ranks of `group` that live in this process.

    The same code serves both modes: a LocalGroup holds every rank (one process), a
    ProcessGroup one. Every rank process runs the same sequence of calls, so the device
    waits of the protocols and the host barriers (`meet`) pair up across processes.
    """

    def __init__(self, args, group, seed: int, *, timeout_s: float = 10.0, first_timeout_s: float = 60.0):
        import ep_a2a
        from .driver.stream import Event
        self.args, self.group, self.seed = args, group, seed
        self.bootstrap = group.bootstrap
        self.ep = group.ep_size
        self.procs = 1 if self.bootstrap is None else self.bootstrap.world_size
        self.root = self.bootstrap is None or self.bootstrap.rank == 0
        self.dev = group.ranks[0].device
        # the GPU of every rank of the group, local or not
        self.rank_gpus = list(getattr(group, "pci_bus_ids", None) or [r.device.pci_bus_id for r in group.ranks])
        self.gpus = len(set(self.rank_gpus))
        # ranks of different processes on one GPU time-slice it (in-process ranks run concurrently)
        self.shared_gpu = self.procs > self.gpus
        p = PROFILES.get(args.profile, {})
        self.hidden = args.hidden or p["hidden"]
        self.top_k = args.top_k or p["top_k"]
        self.num_experts = args.experts or p["num_experts"]
        self.epilogue_fp8 = args.combine_quant == "fp8-epilogue"
        self.specs = _payloads(args.format, self.hidden, self.top_k)
        # routing of every rank is drawn from one seed in every process (all know all byte
        # counts); payload data from a stream of this process's own
        self.route_rng = np.random.default_rng(seed)
        self.rng = np.random.default_rng([seed, 1 + group.ranks[0].rank])
        # one workspace with both protocols; each sweep forces one (or lets "auto" choose)
        self.a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max(args.tokens), top_k=self.top_k,
                                      num_experts=self.num_experts, payloads=self.specs,
                                      combine_hidden_size=self.hidden,
                                      protocol="fence" if args.combine_quant else "auto",
                                      combine_quant="fp8" if args.combine_quant else None,
                                      validate_expert_ids=False, pdl=not args.no_pdl,
                                      threads_per_block=args.threads, timeout_s=timeout_s,
                                      first_timeout_s=first_timeout_s)
        self.ev0, self.ev1 = Event(self.dev, timing=True), Event(self.dev, timing=True)
        self.streams = [r.stream.handle for r in group.ranks]
        self._flag_rounds = self._barrier_kernels() if self.procs == 1 else None

    def say(self, msg: str) -> None:
        if self.root:
            print(msg, file=sys.stderr, flush=True)

    def meet(self) -> None:
        """Host barrier of the rank processes (nothing to do when one process holds every rank)."""
        if self.bootstrap is not None:
            self.bootstrap.barrier()

    def gather(self, values) -> np.ndarray:
        return gather(self.bootstrap, values)

    def _inputs(self, T: int):
        from .check import random_payload, routing
        from .interop.arrays import copy_from_numpy, from_numpy
        from .reference import from_float32
        a = self.args
        ids = [routing(a.routing, self.route_rng, T, self.top_k, self.num_experts, self.ep, s, a.alpha)
               for s in range(self.ep)]
        ins = []
        for r, ar in zip(self.group.ranks, self.a2a.ranks):
            pays = [from_numpy(random_payload(self.rng, sp, T), r.device, sp.dtype) for sp in self.specs]
            ins.append((from_numpy(ids[r.rank], r.device, "int32"), pays))
            if self.epilogue_fp8:  # what a quantizing MoE epilogue leaves (moe.finalize into fp8=True)
                # random finite e4m3 bytes and scales: quantizing normals in NumPy took minutes at
                # 4096 tokens (session 4 run 6 timed out), and the timing does not depend on values
                q = self._combine_input(ar, T)
                codes = self.rng.integers(0, 256, q.values.shape, dtype=np.uint8)
                codes[(codes & 0x7F) == 0x7F] -= 1  # 0x7F / 0xFF are NaN: 0x7E / 0xFE (+-448) instead
                copy_from_numpy(q.values, codes)
                copy_from_numpy(q.scales, self.rng.uniform(2.0 ** -10, 2.0 ** -6, q.scales.shape).astype(np.float32))
            else:
                copy_from_numpy(self._combine_input(ar, T), from_float32(
                    self.rng.standard_normal((self.ep, T, self.hidden)).astype(np.float32), "bfloat16"))
        return ins, ids

    def _combine_input(self, r, T: int):
        """The combine input of rank r: its bf16 partial results, or (--combine-quant
        fp8-epilogue) the FP8 ones an epilogue wrote, so combine skips its quantize pass."""
        return r.combine_input(T, fp8=self.epilogue_fp8)

    def _graph(self, body, streams=None):
        """`--rounds` calls of body captured into one graph on this process's first stream."""
        from .driver.stream import Event, Graph
        streams = self.streams if streams is None else streams
        s0 = streams[0]
        Graph.begin(s0)
        if len(streams) > 1:
            fork = Event(self.dev).record(s0)
            for s in streams[1:]:
                fork.wait_on(s)
        for _ in range(self.args.rounds):
            body()
        for s in streams[1:]:
            Event(self.dev).record(s).wait_on(s0)
        return Graph.end(s0)

    def _time(self, graph) -> float:
        """Median µs of one graph replay on this process (events outside the graph)."""
        s0 = self.streams[0]
        graph.launch(s0)  # warm-up
        self.group.ranks[0].stream.synchronize()  # (s0 is its handle)
        times = []
        for _ in range(self.args.replays):
            self.meet()  # rank processes replay together; their previous replays have all ended
            self.ev0.record(s0)
            graph.launch(s0)
            self.ev1.record(s0)
            self.ev1.synchronize()
            times.append(self.ev0.elapsed_ms(self.ev1) * 1e3)
        return float(np.median(times))

    def _time_body(self, body, streams=None) -> float:
        """Median µs per round of `body` (captured --rounds times, replayed --replays times)."""
        g = self._graph(body, streams)
        try:
            return self._time(g) / self.args.rounds
        finally:
            g.close()

    def _barrier_kernels(self):
        """In-process ranks: one ep_flag_round launch per rank (one block, the protocol
        kernels' block size), over a flag matrix and step counters of this GPU's memory."""
        import ctypes
        from .driver.launch import Launch
        from .interop.arrays import from_numpy
        from .driver.module import load
        self._flag_mem = from_numpy(np.zeros(self.ep * self.ep + self.ep + 1, np.uint32), self.dev)
        flags, state = self._flag_mem.ptr, self._flag_mem.ptr + 4 * self.ep * self.ep
        fn = load("util", self.dev).function("ep_flag_round")
        return [Launch(self.dev, fn, [ctypes.c_uint64(flags), ctypes.c_uint64(state), ctypes.c_int(self.ep),
                                      ctypes.c_int(r.rank)], 1, self.args.threads, pdl=not self.args.no_pdl)
                for r in self.group.ranks]

    def _barrier_floor(self) -> float:
        """µs of two flag rounds over every rank (one per phase, as dispatch and combine
        each hold one), captured and replayed like the protocols: what crossing ranks
        costs before any token moves."""
        from .interop.arrays import to_numpy

        def body():
            for _ in range(2):
                for k, s in zip(self._flag_rounds, self.streams):
                    k(s)
        us = self._time_body(body)
        if to_numpy(self._flag_mem)[-1]:
            raise RuntimeError("barrier floor: a rank's flag never arrived (ep_flag_round gave up)")
        return us

    def _copy_floor(self, nbytes: int) -> float:
        """µs of one device-to-device copy of `nbytes` on this process's first GPU."""
        from cuda.bindings import driver as _drv
        from .driver.errors import call
        from .interop.arrays import empty
        src, dst = empty((nbytes,), "uint8", self.dev), empty((nbytes,), "uint8", self.dev)
        s0 = self.streams[0]
        return self._time_body(lambda: call(_drv.cuMemcpyDtoDAsync, dst.ptr, src.ptr, nbytes, s0), self.streams[:1])

    def _peer_copy_floor(self, nbytes: int):
        """(µs, bytes) of every local rank copying `nbytes` (at most a workspace) out of the
        mapped workspace of the next rank on another GPU, i.e. over NVLink."""
        from cuda.bindings import driver as _drv
        from .driver.errors import call
        from .interop.arrays import empty
        n = min(nbytes, self.a2a.workspace_bytes_per_rank)
        jobs = []
        for i, r in enumerate(self.group.ranks):
            others = ((r.rank + k) % self.ep for k in range(1, self.ep))
            q = next(q for q in others if self.rank_gpus[q] != self.rank_gpus[r.rank])
            jobs.append((empty((n,), "uint8", r.device), self.a2a.workspace.peers(i)[q], r.stream.handle))

        def body():
            for dst, src, s in jobs:
                call(_drv.cuMemcpyDtoDAsync, dst.ptr, src, n, s)
        return self._time_body(body, [s for _, _, s in jobs]), float(n * len(jobs))

    def measure(self, T: int) -> dict:
        from .reference import expert_owner, targets_of
        a = self.a2a
        ins, ids = self._inputs(T)
        ranks = a.ranks

        def dispatch_all():
            for (x_ids, pays), r in zip(ins, ranks):
                r.dispatch(x_ids, pays, T)
                r._dispatched_tmax = None  # dispatch-only graph: the host phase check is not the point

        def roundtrip():
            for (x_ids, pays), r in zip(ins, ranks):
                r.dispatch(x_ids, pays, T)
            for r in ranks:
                r.combine(self._combine_input(r, T), T)

        def empty_like(rt: bool):
            def body():
                for r in ranks:
                    r.launch_empty(grid=r.last_grids[0])
                if rt:
                    for r in ranks:
                        r.launch_empty(grid=r.last_grids[1])
            return body

        self.meet()  # every rank has its inputs before anyone waits on a peer
        roundtrip()  # eager once: sets the grids, checks nothing hangs
        a.synchronize()
        # SENTINEL reuses its landing slots only after combine: dispatch alone cannot be
        # replayed, so its dispatch/combine split is not measured (round trip only)
        split = ranks[0].last_protocol == "fence"
        bodies = [roundtrip, empty_like(True)] + ([dispatch_all, empty_like(False)] if split else [])
        t = [self._time_body(b) for b in bodies]
        barrier_us = self._barrier_floor() if self._flag_rounds else None

        # bytes: what dispatch writes (one copy per distinct target) and reads (once per token)
        owner = expert_owner(self.num_experts, self.ep)
        per_token = sum(sp.bytes_per_token for sp in self.specs) + 4 * self.top_k
        targets = [[targets_of(row, owner) for row in ids[s]] for s in range(self.ep)]
        sends = [sum(map(len, targets[s])) for s in range(self.ep)]
        remote = sum(1 for s in range(self.ep) for t in targets[s] for q in t if q != s)
        written = sum(sends) * per_token
        read = T * self.ep * per_token
        # each partial read once (FP8: e4m3 values + an fp32 scale per 128), plus outputs written
        pulled = self.hidden + self.hidden // Q8_BLOCK * 4 if self.args.combine_quant else self.hidden * 2
        combine_bytes = sum(sends) * pulled
        combine_traffic = combine_bytes + T * self.ep * self.hidden * 2

        # bandwidth floors: this process copies the bytes its ranks' dispatches write
        nbytes = max(sum(sends[r.rank] for r in self.group.ranks) * per_token, 1 << 20)
        copy_us = self._copy_floor(nbytes)
        peer_us, peer_bytes = self._peer_copy_floor(nbytes) if self.gpus > 1 else (math.nan, 0.0)
        # max over ranks of the times, sum over processes of the bytes copied
        g = self.gather(t + [copy_us, nbytes, peer_us, peer_bytes])
        k = len(t)
        worst, total = g.max(axis=0), g.sum(axis=0)
        rt, ert = (float(x) for x in worst[:2])
        copy_tbps = float(2 * total[k + 1] / worst[k] / 1e6)
        peer_tbps = None if self.gpus == 1 else float(total[k + 3] / worst[k + 2] / 1e6)
        row = dict(tokens_per_rank=T, resolved_protocol=ranks[0].last_protocol, round_trip_us=rt,
                   floor_round_trip_us=ert, round_trip_over_floor=rt / ert,
                   dispatch_bytes_written=written, dispatch_bytes_read=read, bytes_crossing_gpus=remote * per_token,
                   # what combine pulls back from other ranks: one partial per remote copy (bf16
                   # combine; FP8: e4m3 values + a scale per 128, 52% of bf16's)
                   combine_bytes_crossing_gpus=remote * pulled,
                   copy_floor_tbps=copy_tbps, peer_copy_floor_tbps=peer_tbps,
                   round_trip_tbps=(written + read + combine_traffic) / rt / 1e6,
                   barrier_floor_round_trip_us=barrier_us,
                   round_trip_over_barrier_floor=None if barrier_us is None else rt / barrier_us,
                   dispatch_us=None, combine_us=None)
        if split:
            d, ed = (float(x) for x in worst[2:4])
            comb = rt - d
            disp_tbps = (written + read) / d / 1e6
            row.update(dispatch_us=d, combine_us=comb, floor_dispatch_us=ed, floor_combine_us=ert - ed,
                       dispatch_over_floor=d / ed, dispatch_tbps=disp_tbps,
                       combine_tbps=combine_traffic / max(comb, 1e-9) / 1e6, dispatch_over_copy_bw=disp_tbps / copy_tbps,
                       logical_dispatch_gbps=T * min(self.ep, self.top_k) * (per_token - 4 * self.top_k) / d / 1e3,
                       logical_combine_gbps=T * min(self.ep, self.top_k) * self.hidden * 2 / max(comb, 1e-9) / 1e3)
        return row

    def host_overhead(self, T: int, iters: int = None) -> dict:
        """µs of host time per rank per eager dispatch+combine (arguments reused, no sync);
        the maximum over rank processes. Beside it, from the same host: everything but the
        launches (the same calls with Launch.__call__ patched out for the measurement: the
        checks, parameter updates, any context bind) and two bare launches of the
        prepacked empty kernel (what the driver and cuda-bindings cost without us)."""
        from .driver import launch as _launch
        a, ranks = self.a2a, self.a2a.ranks
        iters = iters or (20 if self.shared_gpu else 200)  # time-sliced steps cost ms each
        ins, _ = self._inputs(T)
        cin = [self._combine_input(r, T) for r in ranks]

        def step():
            for (x_ids, pays), r in zip(ins, ranks):
                r.dispatch(x_ids, pays, T)
            for c, r in zip(cin, ranks):
                r.combine(c, T)

        def bare():
            for r in ranks:
                r.launch_empty()
                r.launch_empty()

        def per_rank_us(body) -> float:
            self.meet()
            body()
            a.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                body()
            t1 = time.perf_counter()
            a.synchronize()
            return (t1 - t0) / iters / len(ranks) * 1e6

        host, bare_us = per_rank_us(step), per_rank_us(bare)
        # the Python part: every check and parameter update, the launches skipped (the device
        # epochs do not move, and the host's step state stays paired: nothing to undo)
        real_call = _launch.Launch.__call__
        _launch.Launch.__call__ = lambda self, stream: None
        try:
            py = per_rank_us(step)
        finally:
            _launch.Launch.__call__ = real_call
        g = self.gather([host, bare_us, py]).max(axis=0)
        return dict(tokens_per_rank=T, host_us_per_rank_step=float(g[0]), two_bare_launches_us=float(g[1]),
                    python_us_per_rank_step=float(g[2]))

    def close(self) -> None:
        if self._flag_rounds:
            self._flag_mem.owner.close()
        self.a2a.close()
        self.ev0.close()
        self.ev1.close()


def sweep(b: Bench) -> dict:
    """Every (protocol, tokens) row, the host overhead, and the result document."""
    from cuda.bindings import driver as _drv
    args = b.args
    plan = [(p, T) for p in args.protocol.split(",") for T in args.tokens if p != "sentinel" or T <= args.sentinel_max]
    rows = []
    for i, (proto, T) in enumerate(plan, 1):
        b.a2a.protocol = proto
        rows.append(dict(protocol=proto, **b.measure(T)))
        b.say(f"[{i}/{len(plan)}] {proto} T={T}: round trip {rows[-1]['round_trip_us']:.1f} µs")
    b.a2a.protocol = "auto"
    host = [b.host_overhead(T) for T in sorted({1, min(128, b.a2a.max_tokens_per_rank)})]
    if args.profile_host:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.runcall(b.host_overhead, 1, 500)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    dev = b.dev
    return dict(
        device=dev.name, compute_capability=list(dev.compute_capability), sm_count=dev.sm_count,
        driver=_drv.cuDriverGetVersion()[1], date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        commit=_commit(), mode=args.mode, ep_size=b.ep, procs=b.procs, gpus=b.gpus, shared_gpu=b.shared_gpu,
        peer_copy_floor_reason=ONE_GPU if b.gpus == 1 else None,
        config=dict(vars(args), ranks=b.ep, hidden=b.hidden, top_k=b.top_k, experts=b.num_experts, seed=b.seed,
                    payload_bytes_per_token=[s.bytes_per_token for s in b.specs]),
        workspace_bytes_per_rank=b.a2a.workspace_bytes_per_rank,
        expert_major_bytes_per_rank=b.a2a.layout.expert_major_bytes(-(-b.num_experts // b.ep)),
        method=__doc__, rows=rows, host_overhead=host, measured_sentinel_max_tokens=_crossover(rows))


def report(result: dict, args) -> str:
    """Write the JSON (and plot), print the table; returns the JSON path."""
    unit = "ranks" if result["mode"] == "inproc" else "procs"
    out = args.out or os.path.join("bench", "results", f"{result['device'].replace(' ', '_')}-{args.profile}-"
                                   f"{args.format}-{result['ep_size']}{unit}-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    _table(result)
    if args.plot:
        _plot(result, args.plot)
    print(f"wrote {out}", flush=True)
    return out


def _bounded_int(lo: int, hi: int = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}, got {v}")
        return v
    parse.__name__ = "int"
    return parse


def _token_list(s: str) -> list:
    try:
        v = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {s!r}") from None
    if min(v) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {s!r}")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (argparse exits with status 2 and a message on an error)."""
    from .alltoall import PROTOCOLS
    from .layout import MAX_RANKS
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="inproc", choices=MODES,
                    help="inproc: --ranks ranks in this process on one GPU; procs: one rank process per GPU")
    ap.add_argument("--procs", type=_bounded_int(2, MAX_RANKS),
                    help="--mode procs: rank processes (default: one per visible GPU; more than the GPUs share "
                         "them round-robin, time-sliced: a correctness run, not performance)")
    ap.add_argument("--profile", default="deepseek-v3", choices=list(PROFILES) + ["custom"])
    ap.add_argument("--hidden", type=_bounded_int(1))
    ap.add_argument("--top-k", type=_bounded_int(1))
    ap.add_argument("--experts", type=_bounded_int(1))
    ap.add_argument("--ranks", type=_bounded_int(1, MAX_RANKS), help="--mode inproc: ranks on --device (default 8)")
    ap.add_argument("--device", type=_bounded_int(0), help="--mode inproc: the GPU (default 0)")
    ap.add_argument("--tokens", type=_token_list, default=[2 ** i for i in range(13)])
    ap.add_argument("--routing", default="perfect", choices=["perfect", "uniform", "zipf"])
    ap.add_argument("--alpha", type=float, default=1.2)
    ap.add_argument("--format", default="bf16", choices=["bf16", "mxfp8", "nvfp4"])
    ap.add_argument("--protocol", default="fence,sentinel,auto", help="comma list of fence, sentinel, auto")
    ap.add_argument("--sentinel-max", type=_bounded_int(0), default=4096,
                    help="sweep SENTINEL only up to this many tokens")
    ap.add_argument("--rounds", type=_bounded_int(1), default=20)
    ap.add_argument("--replays", type=_bounded_int(1), default=30)
    ap.add_argument("--combine-quant", choices=["fp8", "fp8-epilogue"], default=None,
                    help="FP8 (e4m3, per-128 scales) combine, FENCE only. fp8: combine quantizes the bf16 "
                         "partial results itself; fp8-epilogue: the MoE epilogue wrote them as FP8 "
                         "(combine_input(T^, fp8=True), as moe.finalize can), so combine only pulls and reduces")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--threads", type=int, default=256, help="threads per block of the protocol kernels")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/<device>-<date>.json)")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    ap.add_argument("--profile-host", action="store_true", help="print where the eager host time goes (cProfile)")
    args = ap.parse_args(argv)
    if args.profile == "custom" and not (args.hidden and args.top_k and args.experts):
        ap.error("--profile custom needs --hidden, --top-k and --experts")
    bad = [p for p in args.protocol.split(",") if p not in PROTOCOLS]
    if bad:
        ap.error(f"--protocol: {bad} not among {', '.join(PROTOCOLS)}")
    if args.combine_quant and set(args.protocol.split(",")) != {"fence"}:
        ap.error(f"--combine-quant {args.combine_quant} needs --protocol fence")
    if args.threads % 32 or not 96 <= args.threads <= 512:
        ap.error(f"--threads must be a multiple of 32 in 96..512, got {args.threads}")
    if args.mode == "procs":
        for flag, v in (("--ranks", args.ranks), ("--device", args.device), ("--profile-host", args.profile_host or None)):
            if v is not None:
                ap.error(f"{flag} is for --mode inproc (--mode procs runs one rank per process on the visible GPUs: "
                         "choose them with CUDA_VISIBLE_DEVICES, their number with --procs)")
    else:
        if args.procs is not None:
            ap.error("--procs needs --mode procs")
        args.ranks = 8 if args.ranks is None else args.ranks
        args.device = 0 if args.device is None else args.device
    return args


_QUANT_NAMES = {"fp8": ", FP8 combine", "fp8-epilogue": ", FP8 combine of epilogue-quantized partials"}


def main(argv=None) -> int:
    import secrets
    args = parse_args(argv)
    from .driver import device
    if not device.available():
        print("no CUDA GPU here: nothing to benchmark", file=sys.stderr)
        return 1
    if args.mode == "procs":
        from .bench_procs import run
        return run(args)
    import ep_a2a
    with ep_a2a.LocalGroup([args.device] * args.ranks) as group:
        b = Bench(args, group, secrets.randbits(63))
        try:
            report(sweep(b), args)
        finally:
            b.close()
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


def _setup(res) -> str:
    """How the ranks were laid out, in words (the table and plot headers)."""
    if res.get("mode", "inproc") == "inproc":
        return f"{res['config']['ranks']} in-process ranks"
    return f"{res['procs']} rank processes on {res['gpus']} GPU(s)"


def _table(res) -> None:
    print(f"{res['device']}, {_setup(res)}, {res['config']['profile']}, "
          f"{res['config']['format']}{_QUANT_NAMES.get(res['config'].get('combine_quant'), '')}, "
          f"{res['config']['routing']} routing, commit {res['commit']}")
    if res.get("shared_gpu"):
        print(f"shared_gpu: {res['procs']} processes time-slice {res['gpus']} GPU(s): cross-process waits cost "
              "milliseconds, so these times test the path and are NOT performance")
    print(f"{'proto':>8} {'T':>5} {'rt µs':>8} {'floor':>7} {'x':>5} {'barrier':>7} {'disp µs':>8} {'floor':>7} {'comb µs':>8} "
          f"{'disp TB/s':>9} {'copy TB/s':>9} {'%copy':>6} {'peer TB/s':>9}")
    def f(v, spec):
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0].lstrip("<>^"))
    for r in res["rows"]:
        pct = None if r.get("dispatch_over_copy_bw") is None else 100 * r["dispatch_over_copy_bw"]
        print(f"{r['protocol']:>8} {r['tokens_per_rank']:>5} {r['round_trip_us']:>8.1f} {r['floor_round_trip_us']:>7.1f} "
              f"{r['round_trip_over_floor']:>5.2f} {f(r.get('barrier_floor_round_trip_us'), '>7.1f')} {f(r['dispatch_us'], '>8.1f')} {f(r.get('floor_dispatch_us'), '>7.1f')} "
              f"{f(r['combine_us'], '>8.1f')} {f(r.get('dispatch_tbps'), '>9.2f')} {r['copy_floor_tbps']:>9.2f} "
              f"{f(pct, '>5.0f')}% {f(r.get('peer_copy_floor_tbps'), '>9.2f')}")
    if res.get("peer_copy_floor_reason"):
        print(f"peer copy floor: none ({res['peer_copy_floor_reason']})")
    print(f"measured crossover: SENTINEL faster up to {res['measured_sentinel_max_tokens']} tokens per rank")
    for h in res["host_overhead"]:
        print(f"host overhead, T={h['tokens_per_rank']}: {h['host_us_per_rank_step']:.1f} µs per rank per "
              f"eager dispatch+combine = Python {h['python_us_per_rank_step']:.1f} + launches "
              f"(two bare launches: {h['two_bare_launches_us']:.1f} µs)")


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
    ax.set_title(f"{res['device']}: {_setup(res)}, {res['config']['profile']}"
                 + (" (shared GPU: not performance)" if res.get("shared_gpu") else ""))
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
