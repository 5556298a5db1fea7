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

import datetime
import math
import sys
import time

import numpy as np

from ..layout import Q8_BLOCK
from .bench_report import commit, crossover, gather

PROFILES = {
    "deepseek-v3": dict(hidden=7168, top_k=8, num_experts=256),
    "deepseek-v4.1-flash": dict(hidden=5120, top_k=6, num_experts=384),
    "kimi-k3": dict(hidden=3584, top_k=16, num_experts=896),
}
MODES = ("inproc", "procs")
ONE_GPU = "every rank is on one GPU: no NVLink path between ranks to measure"


def _payloads(fmt: str, hidden: int, top_k: int):
    from ..testing.formats import payload_formats
    return payload_formats(hidden, top_k)[fmt]


class Bench:
    """The measurements, for the ranks of `group` that live in this process.

    The same code serves both modes: a LocalGroup holds every rank (one process), a
    ProcessGroup one. Every rank process runs the same sequence of calls, so the device
    waits of the protocols and the host barriers (`meet`) pair up across processes.
    """

    def __init__(self, args, group, seed: int, *, timeout_s: float = 10.0, first_timeout_s: float = 60.0):
        import ep_a2a
        from ..driver.stream import Event
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
        from ..testing.formats import random_payload, routing
        from ..interop.arrays import copy_from_numpy, from_numpy
        from ..testing.reference import from_float32
        a = self.args
        ids = [routing(a.routing, self.route_rng, T, self.top_k, self.num_experts, self.ep, s, a.alpha)
               for s in range(self.ep)]
        ins = []
        for r, ar in zip(self.group.ranks, self.a2a.ranks):
            pays = [from_numpy(random_payload(self.rng, sp, T), r.device, sp.dtype) for sp in self.specs]
            ins.append((from_numpy(ids[r.rank], r.device, "int32"), pays))
            if self.epilogue_fp8:  # what a quantizing MoE epilogue leaves (moe.finalize into fp8=True)
                # random finite e4m3 bytes and scales: quantizing normals in NumPy takes minutes at
                # 4096 tokens, and the timing does not depend on the values
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
        from ..driver.stream import Event, Graph
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
        from ..driver.launch import Launch
        from ..interop.arrays import from_numpy
        from ..driver.module import load
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
        from ..interop.arrays import to_numpy

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
        from ..driver.memory import copy_dtod_async
        from ..interop.arrays import empty
        src, dst = empty((nbytes,), "uint8", self.dev), empty((nbytes,), "uint8", self.dev)
        s0 = self.streams[0]
        return self._time_body(lambda: copy_dtod_async(dst.ptr, src.ptr, nbytes, s0), self.streams[:1])

    def _peer_copy_floor(self, nbytes: int):
        """(µs, bytes) of every local rank copying `nbytes` (at most a workspace) out of the
        mapped workspace of the next rank on another GPU, i.e. over NVLink."""
        from ..driver.memory import copy_dtod_async
        from ..interop.arrays import empty
        n = min(nbytes, self.a2a.workspace_bytes_per_rank)
        jobs = []
        for i, r in enumerate(self.group.ranks):
            others = ((r.rank + k) % self.ep for k in range(1, self.ep))
            q = next(q for q in others if self.rank_gpus[q] != self.rank_gpus[r.rank])
            jobs.append((empty((n,), "uint8", r.device), self.a2a.workspace.peers(i)[q], r.stream.handle))

        def body():
            for dst, src, s in jobs:
                copy_dtod_async(dst.ptr, src, n, s)
        return self._time_body(body, [s for _, _, s in jobs]), float(n * len(jobs))

    def measure(self, T: int) -> dict:
        from ..testing.reference import expert_owner, targets_of
        a = self.a2a
        ins, ids = self._inputs(T)
        ranks = a.ranks

        def dispatch_all():
            for (x_ids, pays), r in zip(ins, ranks):
                r.dispatch(x_ids, pays, T)
                r.abandon_dispatch()  # dispatch-only graph: the host phase check is not the point

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
        launches (the same calls inside driver.launch.dry_run(), which skips the launches: the
        checks, parameter updates, any context bind) and two bare launches of the
        prepacked empty kernel (what the driver and its Python bindings cost without us)."""
        from ..driver.launch import dry_run
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
        with dry_run():
            py = per_rank_us(step)
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
    from ..driver.device import driver_version
    args = b.args
    plan = [(p, T) for p in args.protocol.split(",") for T in args.tokens if p != "sentinel" or T <= args.sentinel_max]
    rows = []
    for i, (proto, T) in enumerate(plan, 1):
        b.a2a.use_protocol(proto)
        rows.append(dict(protocol=proto, **b.measure(T)))
        b.say(f"[{i}/{len(plan)}] {proto} T={T}: round trip {rows[-1]['round_trip_us']:.1f} µs")
    b.a2a.use_protocol(b.a2a.built_protocol)  # back to what it was built with ("auto" unless FP8 combine)
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
        driver=driver_version(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        commit=commit(), mode=args.mode, ep_size=b.ep, procs=b.procs, gpus=b.gpus, shared_gpu=b.shared_gpu,
        peer_copy_floor_reason=ONE_GPU if b.gpus == 1 else None,
        config=dict(vars(args), ranks=b.ep, hidden=b.hidden, top_k=b.top_k, experts=b.num_experts, seed=b.seed,
                    payload_bytes_per_token=[s.bytes_per_token for s in b.specs]),
        workspace_bytes_per_rank=b.a2a.workspace_bytes_per_rank,
        expert_major_bytes_per_rank=b.a2a.layout.expert_major_bytes(-(-b.num_experts // b.ep)),
        method=__doc__, rows=rows, host_overhead=host, measured_sentinel_max_tokens=crossover(rows))
