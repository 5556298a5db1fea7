"""python -m ep_a2a.bench: dispatch/combine latency and bandwidth beside their floors.

Method (paper Appendix B, adapted): each process captures the dispatch and combine
launches of its ranks into CUDA graphs (rank 0's stream forks to the other ranks' streams
once at the start and joins them once at the end); events sit outside the graphs; we take
the median over `--replays` replays and the maximum over ranks.

Per-round time: every measurement captures two graphs, of R = `--rounds` rounds and of 2R,
replays them alternately and reports (t(2R) - t(R)) / R. What both lengths share cancels:
the graph launch (a few µs, which divided by R would otherwise land in every per-round
figure), the fork and join of the streams and, in procs mode, the skew of the host barrier
every replay starts after (tens of µs, all of it in the first round). Rows state the two
lengths (`graph_rounds`) and the intercept (`round_trip_graph_overhead_us` = 2 t(R) - t(2R)).
Every floor below is timed in the same two-length way.

Dispatch and combine: for FENCE, dispatch is a dispatch-only graph and combine = round trip
- dispatch (combine cannot be replayed alone: it would not wait for its peers). SENTINEL's
dispatch cannot be replayed alone either (it reuses its landing slots only after combine),
so with --stamps, for every protocol a third graph of R round trips carries a one-thread
timestamp kernel (kernels/floors.cu, ep_timestamp) on each rank's stream before the first
dispatch and after every dispatch and combine; each stamp reads %globaltimer once the
kernel before it has completed. On each rank, dispatch = stamp after dispatch - stamp before it (the end of the
previous combine), combine = stamp after combine - stamp after dispatch; round 0 left out,
means over rounds, replays and ranks (`stamped_*`). The round trip measured without stamps
is then divided in that proportion (SENTINEL's `dispatch_us` / `combine_us`, `split_method`
"device timestamps"); FENCE keeps its dispatch-only graph ("dispatch-only graph") and shows
the stamped split beside it as a check of the method. Without --stamps (the default: the
stamps cost a few µs of their own) SENTINEL rows give the round trip only.

What the graph is not: a MoE step. Dispatch and combine run back to back, and the partial
results combine reads are written once, before the graphs (the step's expert compute writes
them just before its combine). So where all ranks' bytes outgrow the L2 (one GPU,
deepseek-v3: from 16-32 tokens per rank), each dispatch's pushes evict the partial results
and the combine figure includes their misses, which a step would not pay: on the H200,
marking the pushes evict-first took 0.4-0.8 µs off the 16-token and 1.6-2.1 off the 32-token
combine, nothing off dispatch (bench/results/ab-cache-hints-cold-paths-1f5c414). The byte
floors' buffers, replayed alone, stay in L2 at such sizes.

Floors, measured in the same run:
  * latency: the same graphs with every kernel replaced by an empty kernel of the same
    launch shape (`floor_round_trip_us`, `floor_dispatch_us`, `floor_combine_us`);
  * bytes (`bytes_floor_*`): kernels that move exactly the bytes each phase moves, one per
    rank on its stream, no synchronization: dispatch reads each token's row (payloads and
    ids) once and writes it to its k targets (k = the distinct target ranks of its
    selection, as the routing gives); combine reads k partial rows (bf16, or FP8 values and
    scales) and writes one output row. Each phase is reported against its own floor as
    `dispatch_of_bytes_floor` = floor µs / phase µs (1.0: at the floor). The floors write
    and read this GPU's memory: the figure for ranks on one GPU; across GPUs it is the HBM
    part only. With --combine-quant fp8, combine's own quantize pass is not in its floor.
    The two floors also run in turn, a scatter then a gather per round
    (`bytes_floor_in_turn_us`, `round_trip_of_bytes_floor_in_turn`): the round trip's bytes
    as its graph moves them, the gather paying for the rows the scatter left dirty in L2
    (every floor buffer is distinct, as the protocols' are), which neither floor replayed
    alone pays;
  * a device-to-device copy of the bytes dispatch writes (`copy_floor_tbps`, read + write
    counted; the 1:1 copy floor `dispatch_over_copy_bw` compares against) and, when the
    ranks span several GPUs, a copy of the same bytes out of a peer GPU's mapped workspace
    (NVLink, bytes counted once).
Beside the empty-kernel floor, in-process runs also time a barrier floor: two cross-rank
flag rounds per round trip (release fence, a flag to every rank, acquire polls), the
synchronization each protocol phase holds, with no data; it shows how much of the gap to
the empty-kernel floor is crossing ranks at all (launch skew included) and how much is
the protocols' own work. It does not replace the empty-kernel floor.

Host overhead: eager dispatch + combine host time per rank (`host_overhead`); with torch
importable and ep_a2a.tools.bench_torch present, also with torch tensors and streams
(`torch_host_overhead`).

Two modes:
  --mode inproc (default): `--ranks` ranks in this process on `--device`; one graph spans
    every rank, so its time is already the maximum over ranks.
  --mode procs: one process per visible GPU (or `--procs N`, round-robin over the GPUs),
    each a ProcessGroup rank met over a UnixSocketBootstrap, as a deployment runs. Every
    rank captures its own graphs; before each replay all ranks meet at a host barrier,
    whose release skew the two graph lengths cancel (see above).
    Per-rank medians travel to every rank over the bootstrap; rows take their maximum.
    Processes sharing a GPU time-slice it (without MPS), so their cross-process waits
    cost milliseconds: such runs say `shared_gpu: true` and test the path, not its speed.
"""
from __future__ import annotations

import datetime
import math
import sys

import numpy as np

from ..driver.errors import CudaError
from ..layout import Q8_BLOCK
from ..testing import hooks
from .bench_floors import ByteFloors, Stamps
from .bench_method import (bare_launches, eager_step, host_time_us, interleaved_medians, per_round, ratio, split_round_trip,
                           stamp_split)
from .bench_report import commit, crossover, gather

PROFILES = {
    "deepseek-v3": dict(hidden=7168, top_k=8, num_experts=256),
    "deepseek-v4.1-flash": dict(hidden=5120, top_k=6, num_experts=384),
    "kimi-k3": dict(hidden=3584, top_k=16, num_experts=896),
}
MODES = ("inproc", "procs", "halves")  # halves: in-process ranks, the overlap halves (bench_halves.py)
ONE_GPU = "every rank is on one GPU: no NVLink path between ranks to measure"
PER_ROUND = ("(t(2R) - t(R)) / R: the median replay times of graphs of R and 2R rounds (R = config.rounds), "
             "so the graph launch, the stream fork/join and a host barrier's skew (procs mode) cancel")
STAMPS_MEASURE = ("stamped_*: on each rank's stream, a one-thread kernel stores %globaltimer once the kernel before "
                  "it has completed; dispatch = stamp after dispatch - stamp before it (end of the previous combine), "
                  "combine = stamp after combine - stamp after dispatch, round 0 left out, means over rounds, "
                  "replays and ranks; the stamp kernels' own cost is inside these. SENTINEL's dispatch_us / combine_us "
                  "are round_trip_us divided in the stamped proportion")
# Host figures: each measure taken this many times, in turn with the others (bench_method.interleaved_medians)
HOST_REPEATS = 5


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

    def inputs(self, T: int):
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
                q = self.combine_input(ar, T)
                codes = self.rng.integers(0, 256, q.values.shape, dtype=np.uint8)
                codes[(codes & 0x7F) == 0x7F] -= 1  # 0x7F / 0xFF are NaN: 0x7E / 0xFE (+-448) instead
                copy_from_numpy(q.values, codes)
                copy_from_numpy(q.scales, self.rng.uniform(2.0 ** -10, 2.0 ** -6, q.scales.shape).astype(np.float32))
            else:
                copy_from_numpy(self.combine_input(ar, T), from_float32(
                    self.rng.standard_normal((self.ep, T, self.hidden)).astype(np.float32), "bfloat16"))
        return ins, ids

    def combine_input(self, r, T: int):
        """The combine input of rank r: its bf16 partial results, or (--combine-quant
        fp8-epilogue) the FP8 ones an epilogue wrote, so combine skips its quantize pass."""
        return r.combine_input(T, fp8=self.epilogue_fp8)

    def _graph(self, body, streams=None, rounds=None, before=None):
        """`rounds` (default --rounds) calls of body captured into one graph on this
        process's first stream, the other streams forked from it once at the start (then
        `before()`, if given) and joined once at the end."""
        from ..driver.stream import Event, Graph
        streams = self.streams if streams is None else streams
        s0 = streams[0]
        Graph.begin(s0)
        if len(streams) > 1:
            fork = Event(self.dev).record(s0)
            for s in streams[1:]:
                fork.wait_on(s)
        if before is not None:
            before()
        for _ in range(self.args.rounds if rounds is None else rounds):
            body()
        for s in streams[1:]:
            Event(self.dev).record(s).wait_on(s0)
        return Graph.end(s0)

    def _replay(self, graph) -> float:
        """µs of one replay on this process, after the ranks' host barrier (events outside the graph)."""
        s0 = self.streams[0]
        self.meet()  # rank processes replay together; their previous replays have all ended
        self.ev0.record(s0)
        graph.launch(s0)
        self.ev1.record(s0)
        try:
            self.ev1.synchronize()
        except CudaError as e:  # a kernel trapped: say why (its rank's record), not only that it did
            for r in self.a2a.ranks:
                r.raise_recorded(e)
            raise
        return self.ev0.elapsed_ms(self.ev1) * 1e3

    def _time(self, graphs) -> list:
        """Median µs of each graph's replays on this process, the graphs replayed in turn
        (a drift of the clocks or of the host touches every graph alike)."""
        for g in graphs:  # warm-up
            g.launch(self.streams[0])
        self.group.ranks[0].stream.synchronize()  # (streams[0] is its handle)
        times = [[] for _ in graphs]
        for _ in range(self.args.replays):
            for g, t in zip(graphs, times):
                t.append(self._replay(g))
        return [float(np.median(t)) for t in times]

    def _time_rounds(self, body, streams=None) -> tuple:
        """(µs per round, µs outside the rounds) of `body`: graphs of R and 2R rounds
        (R = --rounds), per round (t(2R) - t(R)) / R (bench_method.per_round)."""
        R = self.args.rounds
        gs = []
        try:
            for n in (R, 2 * R):
                gs.append(self._graph(body, streams, n))
            return per_round(*self._time(gs), R)
        finally:
            for g in gs:
                g.close()

    def time_body(self, body, streams=None) -> float:
        """µs per round of `body` (two graph lengths, see _time_rounds)."""
        return self._time_rounds(body, streams)[0]

    def _stamped(self, ins, T: int) -> dict:
        """The round trip split by device timestamps (bench_method.stamp_split): one graph
        of --rounds round trips with a stamp on every rank's stream before the first
        dispatch and after each dispatch and combine, replayed --replays times."""
        R, ranks = self.args.rounds, self.a2a.ranks
        # Stamps launch without PDL: a PDL stamp would sit resident, waiting for its phase, in
        # a GPU that the ranks' grids fill exactly (every rank's kernels must be co-resident),
        # and the last block of a peer's dispatch then found no room (deadlock at 128 tokens).
        st = Stamps(self.group.ranks, 2 * R + 1, pdl=False)
        n = len(ranks)

        def body():
            for i, ((x_ids, pays), r) in enumerate(zip(ins, ranks)):
                r.dispatch(x_ids, pays, T)
                st.mark(i)
            for i, r in enumerate(ranks):
                r.combine(self.combine_input(r, T), T)
                st.mark(i)
        g = None
        try:
            g = self._graph(body, before=lambda: [st.mark(i) for i in range(n)])
            self._replay(g)  # warm-up (the first replay uploads the graph)
            out = []
            for _ in range(self.args.replays):
                st.poison()
                self._replay(g)
                self.group.ranks[0].stream.synchronize()
                out.append(st.read())
            return stamp_split(np.stack(out))
        finally:
            if g is not None:
                g.close()
            st.close()

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
        us = self.time_body(body)
        if to_numpy(self._flag_mem)[-1]:
            raise RuntimeError("barrier floor: a rank's flag never arrived (ep_flag_round gave up)")
        return us

    def _copy_floor(self, nbytes: int) -> float:
        """µs of one device-to-device copy of `nbytes` on this process's first GPU."""
        from ..driver.memory import copy_dtod_async
        from ..interop.arrays import empty
        src, dst = empty((nbytes,), "uint8", self.dev), empty((nbytes,), "uint8", self.dev)
        s0 = self.streams[0]
        return self.time_body(lambda: copy_dtod_async(dst.ptr, src.ptr, nbytes, s0), self.streams[:1])

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
        return self.time_body(body, [s for _, _, s in jobs]), float(n * len(jobs))

    def measure(self, T: int) -> dict:
        from ..testing.reference import expert_owner, targets_of
        a = self.a2a
        ins, ids = self.inputs(T)
        ranks = a.ranks

        def dispatch_all():
            for (x_ids, pays), r in zip(ins, ranks):
                r.dispatch(x_ids, pays, T)
                hooks.abandon_dispatch(r)  # dispatch-only graph: the host phase check is not the point

        def roundtrip():
            for (x_ids, pays), r in zip(ins, ranks):
                r.dispatch(x_ids, pays, T)
            for r in ranks:
                r.combine(self.combine_input(r, T), T)

        def empty_like(rt: bool):
            def body():
                for r in ranks:
                    hooks.launch_empty(r, grid=hooks.last_grids(r)[0])
                if rt:
                    for r in ranks:
                        hooks.launch_empty(r, grid=hooks.last_grids(r)[1])
            return body

        self.meet()  # every rank has its inputs before anyone waits on a peer
        roundtrip()  # eager once: sets the grids, checks nothing hangs
        a.synchronize()
        # SENTINEL reuses its landing slots only after combine: dispatch alone cannot be
        # replayed, so its split comes from device timestamps only
        split = ranks[0].last_protocol == "fence"
        m = {}  # name -> this process's figure; reduced over processes below
        m["rt"], m["rt_overhead"] = self._time_rounds(roundtrip)
        m["empty_rt"], m["empty_d"] = self.time_body(empty_like(True)), self.time_body(empty_like(False))
        stamped = self._stamped(ins, T) if self.args.stamps else None
        nan = float("nan")
        m["st_d"], m["st_c"], m["st_step"] = ((stamped["dispatch_us"], stamped["combine_us"], stamped["smallest_step_ns"])
                                              if stamped else (nan, nan, nan))
        if split:
            m["d"] = self.time_body(dispatch_all)
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

        # byte floors: exactly those bytes, per phase, for this process's ranks
        floors = ByteFloors(self.group.ranks, targets, per_token, pulled, self.hidden * 2, pdl=not self.args.no_pdl)
        try:
            m["bf_d"], m["bf_c"] = self.time_body(floors.dispatch), self.time_body(floors.combine)
            m["bf_turn"] = self.time_body(floors.round_trip)
        finally:
            floors.close()
        # the 1:1 copy floor: this process copies the bytes its ranks' dispatches write
        nbytes = max(sum(sends[r.rank] for r in self.group.ranks) * per_token, 1 << 20)
        m["copy"], m["nbytes"] = self._copy_floor(nbytes), nbytes
        m["peer"], m["peer_bytes"] = self._peer_copy_floor(nbytes) if self.gpus > 1 else (math.nan, 0.0)
        # times: max over processes; bytes copied: sum; the stamped split: mean (its share is
        # what matters); the timer's step: smallest
        names = list(m)
        g = self.gather([m[k] for k in names])
        how = dict(nbytes=np.sum, peer_bytes=np.sum, st_d=np.mean, st_c=np.mean, st_step=np.min)
        w = {k: float(how.get(k, np.max)(g[:, i])) for i, k in enumerate(names)}
        rt, ert, ed = w["rt"], w["empty_rt"], w["empty_d"]
        copy_tbps = ratio(2 * w["nbytes"], w["copy"], 1e-6)
        peer_tbps = None if self.gpus == 1 else ratio(w["peer_bytes"], w["peer"], 1e-6)
        st_rt = w["st_d"] + w["st_c"] if stamped else None
        d = w["d"] if split else split_round_trip(rt, w["st_d"], w["st_c"])[0] if stamped else None
        comb = None if d is None else rt - d
        disp_tbps = ratio(written + read, d, 1e-6)
        bf_rt = w["bf_d"] + w["bf_c"]  # the sum of the two phases' floors, each replayed alone
        logical = T * min(self.ep, self.top_k)  # selections' rows one token sends (perfect routing: all distinct)
        return dict(
            tokens_per_rank=T, resolved_protocol=ranks[0].last_protocol, graph_rounds=[self.args.rounds, 2 * self.args.rounds],
            round_trip_us=rt, round_trip_graph_overhead_us=w["rt_overhead"],
            floor_round_trip_us=ert, round_trip_over_floor=ratio(rt, ert),
            dispatch_bytes_written=written, dispatch_bytes_read=read, bytes_crossing_gpus=remote * per_token,
            # what combine reads (one partial per copy: bf16, or FP8 e4m3 values + a scale per
            # 128, 52% of bf16's) and writes; what of it comes from other ranks
            combine_bytes_read=combine_bytes, combine_bytes_written=T * self.ep * self.hidden * 2,
            combine_bytes_crossing_gpus=remote * pulled,
            copy_floor_tbps=copy_tbps, peer_copy_floor_tbps=peer_tbps,
            round_trip_tbps=ratio(written + read + combine_traffic, rt, 1e-6),
            barrier_floor_round_trip_us=barrier_us, round_trip_over_barrier_floor=ratio(rt, barrier_us),
            split_method="dispatch-only graph" if split else "device timestamps" if stamped else None,
            dispatch_us=d, combine_us=comb, floor_dispatch_us=ed, floor_combine_us=ert - ed,
            dispatch_over_floor=ratio(d, ed), dispatch_tbps=disp_tbps, combine_tbps=ratio(combine_traffic, comb, 1e-6),
            dispatch_over_copy_bw=ratio(disp_tbps, copy_tbps),
            logical_dispatch_gbps=ratio(logical * (per_token - 4 * self.top_k), d, 1e-3),
            logical_combine_gbps=ratio(logical * self.hidden * 2, comb, 1e-3),
            bytes_floor_dispatch_us=w["bf_d"], bytes_floor_combine_us=w["bf_c"], bytes_floor_round_trip_us=bf_rt,
            bytes_floor_dispatch_tbps=ratio(written + read, w["bf_d"], 1e-6),
            bytes_floor_combine_tbps=ratio(combine_traffic, w["bf_c"], 1e-6),
            dispatch_of_bytes_floor=ratio(w["bf_d"], d), combine_of_bytes_floor=ratio(w["bf_c"], comb),
            round_trip_of_bytes_floor=ratio(bf_rt, rt),
            bytes_floor_in_turn_us=w["bf_turn"], round_trip_of_bytes_floor_in_turn=ratio(w["bf_turn"], rt),
            stamped_dispatch_us=w["st_d"] if stamped else None, stamped_combine_us=w["st_c"] if stamped else None,
            stamped_round_trip_us=st_rt, stamped_dispatch_share=ratio(w["st_d"], st_rt) if stamped else None,
            stamp_rounds_used=stamped["rounds_used"] if stamped else None,
            stamp_samples=stamped["samples"] if stamped else None,
            globaltimer_smallest_step_ns=int(w["st_step"]) if stamped else None)

    def host_overhead(self, T: int, iters: int = None) -> dict:
        """µs of host time per rank per eager dispatch+combine (arguments reused, no sync);
        the maximum over rank processes. Beside it, from the same host: everything but the
        launches (the same calls inside testing.hooks.dry_run(), which skips the launches: the
        checks, parameter updates, any context bind) and two bare launches of the
        prepacked empty kernel (what the driver and its Python bindings cost without us)."""
        from ..testing.hooks import dry_run
        a, ranks = self.a2a, self.a2a.ranks
        iters = iters or (20 if self.shared_gpu else 200)  # time-sliced steps cost ms each
        ins, _ = self.inputs(T)
        cin = [self.combine_input(r, T) for r in ranks]

        def step():
            eager_step(ranks, ins, cin, T)

        def per_rank_us(body) -> float:
            self.meet()
            return host_time_us(body, iters, 1, a.synchronize) / len(ranks)

        def python_us() -> float:
            # the Python part: every check and parameter update, the launches skipped (the device
            # epochs do not move, and the host's step state stays paired: nothing to undo)
            with dry_run():
                return per_rank_us(step)

        # (taken in turn, HOST_REPEATS times each, in the same order in every rank process)
        med, _ = interleaved_medians(dict(host=lambda: per_rank_us(step),
                                          bare=lambda: per_rank_us(lambda: bare_launches(ranks)), py=python_us),
                                     HOST_REPEATS)
        g = self.gather([med["host"], med["bare"], med["py"]]).max(axis=0)
        return dict(tokens_per_rank=T, host_us_per_rank_step=float(g[0]), two_bare_launches_us=float(g[1]),
                    python_us_per_rank_step=float(g[2]), repeats=HOST_REPEATS)

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
    host_Ts = sorted({1, min(128, b.a2a.max_tokens_per_rank)})
    host = [b.host_overhead(T) for T in host_Ts]
    torch_host = torch_host_rows(b, host_Ts)
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
        method=__doc__, per_round_method=PER_ROUND, graph_rounds=[args.rounds, 2 * args.rounds],
        stamps_measure=STAMPS_MEASURE, rows=rows, host_overhead=host, torch_host_overhead=torch_host,
        measured_sentinel_max_tokens=crossover(rows))


def torch_host_rows(b: Bench, Ts) -> list:
    """ep_a2a.tools.bench_torch.torch_host_overhead(b, T) for each T where torch imports and
    that module exists (written apart from this one), else None. Every rank process
    decides alike: they share the interpreter's packages."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        from .bench_torch import torch_host_overhead
    except ImportError:
        return None
    return [torch_host_overhead(b, T) for T in Ts]
