"""python -m ep_a2a.bench --mode halves: the send and receive halves against the whole calls,
and the communication they leave exposed when compute runs between them (docs/overlap.md).

Per (protocol, tokens), in-process ranks on one GPU, every figure per round trip by the
bench's two-length graph method (bench.py, PER_ROUND) in the same run:
  * fused: dispatch + combine as whole calls (as --mode inproc);
  * halves: dispatch_send, dispatch_recv, combine_send, combine_recv with nothing between
    them (the cost of the split: target at most 1 µs over fused);
  * for compute C swept from 0 to --halves-max-ratio x the fused round trip: a compute
    kernel (kernels/util.cu, ep_busy: FMAs of a set length, --busy-blocks blocks of 256
    threads per rank) on every rank's stream between each send half and its receive half;
    C is those kernels timed alone, without communication (two per round, as in the step),
    and exposed = step - C, beside the bytes-in-turn floor (the bytes still move: what
    overlap hides is the waiting).
"""
from __future__ import annotations

import ctypes
import datetime

from ..layout import Q8_BLOCK
from ..testing.reference import expert_owner, targets_of
from .bench_floors import ByteFloors
from .bench_method import ratio
from .bench_report import commit

CALIBRATION_ITERS = 4096


class Busy:
    """ep_busy launches, one per rank, whose length is set per sweep point."""

    def __init__(self, group, blocks: int):
        from ..driver.memory import DeviceAllocation
        from ..driver.module import load
        dev = group.ranks[0].device
        self.sink = DeviceAllocation(dev, 4)
        self.fn, self.group, self.blocks, self.iters = load("util", dev).function("ep_busy"), group, blocks, 0

    def __call__(self, i: int) -> None:
        from ..driver.launch import launch_once
        r = self.group.ranks[i]
        launch_once(r.device, self.fn, [ctypes.c_uint64(self.sink.ptr), ctypes.c_uint32(self.iters)], self.blocks, 256,
                    r.stream.handle)

    def close(self) -> None:
        self.sink.close()


def measure(b, busy: Busy, T: int) -> dict:
    """One (protocol, T) row: fused and halves round trips, floors, the compute sweep."""
    ins, ids = b.inputs(T)
    ranks, n = b.a2a.ranks, len(b.a2a.ranks)

    def fused():
        for (x_ids, pays), r in zip(ins, ranks):
            r.dispatch(x_ids, pays, T)
        for r in ranks:
            r.combine(b.combine_input(r, T), T)

    def halves(compute: bool):
        def body():
            for (x_ids, pays), r in zip(ins, ranks):
                r.dispatch_send(x_ids, pays, T)
            for i in range(n) if compute else ():
                busy(i)
            for r in ranks:
                r.dispatch_recv()
            for r in ranks:
                r.combine_send(b.combine_input(r, T), T)
            for i in range(n) if compute else ():
                busy(i)
            for r in ranks:
                r.combine_recv()
        return body

    def compute_alone():
        for _ in range(2):
            for i in range(n):
                busy(i)

    b.meet()
    fused()
    halves(False)()
    b.a2a.synchronize()
    rt = b.time_body(fused)
    split = b.time_body(halves(False))
    # the bytes-in-turn floor of these bytes (as bench.Bench.measure)
    owner = expert_owner(b.num_experts, b.ep)
    per_token = sum(sp.bytes_per_token for sp in b.specs) + 4 * b.top_k
    targets = [[targets_of(row, owner) for row in ids[s]] for s in range(b.ep)]
    pulled = b.hidden + b.hidden // Q8_BLOCK * 4 if b.args.combine_quant else b.hidden * 2
    floors = ByteFloors(b.group.ranks, targets, per_token, pulled, b.hidden * 2, pdl=not b.args.no_pdl)
    try:
        turn = b.time_body(floors.round_trip)
    finally:
        floors.close()
    busy.iters = CALIBRATION_ITERS
    per_iter = b.time_body(compute_alone) / CALIBRATION_ITERS  # µs per iteration of two kernels in turn
    sweep = []
    for frac in b.args.halves_ratios:
        busy.iters = int(round(frac * rt / per_iter)) if frac else 0
        c = b.time_body(compute_alone) if frac else 0.0
        step = b.time_body(halves(True)) if frac else split
        sweep.append(dict(target_ratio=frac, busy_iters=busy.iters, compute_us=c, step_us=step,
                          exposed_us=step - c, exposed_minus_bytes_floor_us=step - c - turn,
                          exposed_over_fused=ratio(step - c, rt)))
    return dict(tokens_per_rank=T, resolved_protocol=ranks[0].last_protocol, fused_round_trip_us=rt,
                halves_round_trip_us=split, halves_minus_fused_us=split - rt, bytes_floor_in_turn_us=turn,
                fused_minus_bytes_floor_us=rt - turn, busy_blocks_per_rank=busy.blocks, compute_sweep=sweep)


def sweep(b) -> dict:
    """Every (protocol, tokens) row and the result document (bench.sweep's fields)."""
    from ..driver.device import driver_version
    args, dev = b.args, b.dev
    busy = Busy(b.group, args.busy_blocks or max(1, 2 * dev.sm_count // b.ep))
    rows = []
    try:
        for proto in args.protocol.split(","):
            b.a2a.use_protocol(proto)
            for T in args.tokens:
                rows.append(dict(protocol=proto, **measure(b, busy, T)))
                r = rows[-1]
                exposed = " ".join(f"{s['target_ratio']:g}x:{s['exposed_us']:.1f}" for s in r["compute_sweep"])
                b.say(f"{proto} T={T}: fused {r['fused_round_trip_us']:.1f} halves {r['halves_round_trip_us']:.1f} "
                      f"(+{r['halves_minus_fused_us']:.2f}) floor {r['bytes_floor_in_turn_us']:.1f} exposed {exposed} µs")
    finally:
        busy.close()
    return dict(device=dev.name, compute_capability=list(dev.compute_capability), sm_count=dev.sm_count,
                driver=driver_version(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                commit=commit(), mode="halves", ep_size=b.ep,
                config=dict(vars(args), ranks=b.ep, hidden=b.hidden, top_k=b.top_k, experts=b.num_experts, seed=b.seed),
                method=__doc__, rows=rows)


def summary(doc) -> str:
    """The table printed last."""
    lines = ["protocol  T     fused   halves  +split  floor   exposed at C = 1x / 2x round trip (µs)"]
    for r in doc["rows"]:
        at = {s["target_ratio"]: s["exposed_us"] for s in r["compute_sweep"]}
        lines.append(f"{r['protocol']:<9} {r['tokens_per_rank']:<5} {r['fused_round_trip_us']:7.1f} "
                     f"{r['halves_round_trip_us']:7.1f} {r['halves_minus_fused_us']:+6.2f} "
                     f"{r['bytes_floor_in_turn_us']:6.1f}  {at.get(1.0, float('nan')):6.1f} / {at.get(2.0, float('nan')):6.1f}")
    return "\n".join(lines)
