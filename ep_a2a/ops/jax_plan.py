"""The launches of one jitted call, decided once at trace time (the native path: jax_ffi.py).

Everything a step of dispatch and combine decides (T^, protocol, grids, PDL triggers, each
rank's parameter block) follows from static facts under jit: shapes, the all-to-all's
options and its ranks' plans (schedule.RankPlan). So the planner (schedule.plan_step) runs
here once per trace, for the steady state of a jitted step, and the result is a list of
launches and copies per rank whose argument bytes hold stand-in addresses for XLA's buffers
(fake(k): buffer k of the call, operands first, then results). encode() turns that into the
words the native handler reads: it finds every stand-in in the argument bytes and makes it
a patch, so a call only writes the addresses XLA hands it and launches.

The steady state: a jitted step is dispatch then combine, repeated, so each is planned from
the state the other leaves. The combine of a step never lets its successor start early
(PDL) and the dispatch is launched without PDL, so every dispatch is planned after a launch
that did not trigger early, whatever ran before it (an eager step, XLA's own kernels); the
dispatch keeps its early trigger, which holds the combine to half the grid as eagerly. The first calls wait with the first
timeout (peers may still be loading) through a timeout patch.

The halves (jax_halves.py) are four calls per step, each its own XLA call whose rank-stream
kernels sit between the call's fork and join events, so no early start (PDL) ever crosses
from one call into the next: every half launches without PDL, and what XLA or another
all-to-all (the other micro-batch) runs between two halves cannot start beside them. Each
half is planned from the state its own all-to-all's previous half leaves (steady_halves):
the dispatch send after the previous step's combine receive, which never triggers early.
"""
from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import numpy as np

from ..driver.stream import native
from ..layout import A2AParams
from ..schedule import (CLUSTER_BLOCKS, COMBINE, COMBINE_RECEIVE, COMBINE_SEND, DISPATCH, DISPATCH_RECEIVE,
                        DISPATCH_SEND, Call, StepState, plan_step)

MAGIC, VERSION = 0x6570613261666669, 1   # (native/ffi/ep_a2a_ffi.cc reads the same)
LAUNCH, COPY, ABSOLUTE = 1, 2, (1 << 64) - 1
FAKE_BASE, FAKE_SHIFT, MAX_BUFFERS = 0xE000_0000_0000_0000, 40, 512  # stand-ins: far above any device address


def fake(k: int, add: int = 0) -> int:
    """The stand-in address of byte `add` of buffer k of a call (256-byte aligned: the plan's
    vector widths are those of a 16-byte aligned buffer, which the handler checks)."""
    return FAKE_BASE + (k << FAKE_SHIFT) + add


def buffer_of(value: int):
    """(buffer, byte offset) a stand-in address names, or None for any other value."""
    if not FAKE_BASE <= value < FAKE_BASE + (MAX_BUFFERS << FAKE_SHIFT):
        return None
    k = (value - FAKE_BASE) >> FAKE_SHIFT
    return k, value - fake(k)


@dataclass
class LaunchOp:
    rank: int                 # position of the rank in its GPU's group (its stream)
    function: object          # the CUfunction (handle_of makes it an address)
    grid: int
    block: int
    shared: int
    cluster: int
    pdl: bool
    args: list                # each argument's bytes, as launched, with stand-in addresses
    timeout: tuple = None     # (byte offset in args[0], first steps' value, later value)


@dataclass
class CopyOp:
    rank: int
    dst: int                  # an address or a stand-in
    src: int
    nbytes: int


@dataclass
class Group:
    """The ranks of one GPU in one call: ranks are (rank number, stream, join event, error
    record address) and share the fork event."""
    ordinal: int
    fork: int
    ranks: list
    ops: list = dataclasses.field(default_factory=list)


# -- the steady step of one rank ------------------------------------------------------------
def steady_pair(plan, tag_hi: int, protocol: str, tokens: int, runtime_max: int, sources: tuple, out: int,
                prequantized: bool) -> tuple:
    """(dispatch Step, combine Step) of a rank with this RankPlan in a jitted step: dispatch
    of `tokens` tokens from `sources` (ids first) and combine into `out`."""
    quantizing = plan.fp8_combine and not prequantized
    state = StepState(steps=plan.first_steps, triggered_early=False, tag_hi=tag_hi, quantizing_combine=quantizing)
    d = plan_step(plan, state, Call(DISPATCH, tokens, runtime_max, protocol, tuple(sources)))
    c = plan_step(plan, d.state, Call(COMBINE, tokens, runtime_max, None, (out,), prequantized))
    return d, c


def pair_params(plan, d, c) -> tuple:
    """(dispatch block, combine block) as bytes: the plan's block with each planned step's
    fields written in order, as RankPlan.apply and RankAlltoAll._run write them, in the steady
    state: the dispatch's block holds what the previous step's combine (this one) wrote, the
    combine's block what the dispatch wrote; the combine never triggers early."""
    params = A2AParams.from_buffer_copy(bytes(plan.params))
    for name, value in c.fields:
        setattr(params, name, value)
    for name, value in d.fields:
        setattr(params, name, value)
    for q, (src, vec) in enumerate(d.sources):
        params.payloads[q].src, params.payloads[q].vec = src, vec
    params.trigger_early = d.trigger_early
    dispatch = bytes(params)
    for name, value in c.fields:
        setattr(params, name, value)
    params.trigger_early = 0
    for q in range(len(d.sources)):  # (the dispatch's inputs, which combine never reads, are not its call's
        if buffer_of(params.payloads[q].src) is not None:  # buffers: a mapped address of ours stands in)
            params.payloads[q].src = plan.combine_input
    return dispatch, bytes(params)


def steady_halves(plan, tag_hi: int, protocol: str, tokens: int, runtime_max: int, sources: tuple, out: int) -> tuple:
    """(dispatch send, dispatch receive, combine send, combine receive) Steps of a rank with this
    RankPlan in a jitted step of halves, each planned from the state the one before leaves, the
    first from the state the last leaves (the steady state: a combine receive never triggers
    early, and the step count is past the first steps)."""
    state = StepState(steps=plan.first_steps, triggered_early=False, tag_hi=tag_hi, quantizing_combine=plan.fp8_combine)
    calls = (Call(DISPATCH_SEND, tokens, runtime_max, protocol, tuple(sources)), Call(DISPATCH_RECEIVE, 0, 0, None),
             Call(COMBINE_SEND, tokens, runtime_max, None, (out,)), Call(COMBINE_RECEIVE, 0, 0, None))
    steps = []
    for call in calls:
        steps.append(plan_step(plan, state, call))
        state = steps[-1].state
    return tuple(steps)


# which stand-ins each half's call holds: (the dispatch inputs, the combine output)
_HALF_BUFFERS = ((True, False), (False, False), (False, False), (False, True))


def half_params(plan, steps) -> tuple:
    """The parameter block of each of steady_halves' four Steps as bytes, as RankPlan.apply and
    RankAlltoAll._run write them in turn, the dispatch send's after the previous step's combine
    (this one's, in a jitted loop). A stand-in naming another half's call (the dispatch inputs
    outside the send, the combine output outside the combine receive: no other half reads them)
    becomes a mapped address of ours."""
    params = A2AParams.from_buffer_copy(bytes(plan.params))
    for name, value in steps[2].fields:
        setattr(params, name, value)
    n_src, blocks = len(steps[0].sources), []
    for step, (inputs, output) in zip(steps, _HALF_BUFFERS):
        for name, value in step.fields:
            setattr(params, name, value)
        for q, (src, vec) in enumerate(step.sources):
            params.payloads[q].src, params.payloads[q].vec = src, vec
        params.trigger_early = step.trigger_early
        own = A2AParams.from_buffer_copy(bytes(params))
        for q in range(0 if inputs else n_src):
            if buffer_of(own.payloads[q].src) is not None:
                own.payloads[q].src = plan.combine_input
        if not output and buffer_of(own.combine_out) is not None:
            own.combine_out = plan.combine_input
        blocks.append(bytes(own))
    return tuple(blocks)


def timeout_patch(plan) -> tuple:
    return A2AParams.timeout_ns.offset, plan.first_timeout_ns, plan.timeout_ns


def launch_shape(launch) -> tuple:
    """(block, shared bytes, pdl) of a driver.launch.Launch."""
    cfg = launch.config
    return int(cfg.blockDimX), int(cfg.sharedMemBytes), bool(launch.pdl)


def step_launch(plan, rank_pos: int, step, block_bytes: bytes, first: bool = False) -> LaunchOp:
    """The LaunchOp of a planned step. The first launch of a jitted step (first=True) goes
    without PDL: what ran before it on the stream is unknown at trace time (an eager step's
    combine may have triggered early), and after our own combine, which never does, PDL would
    change nothing."""
    block, shared, pdl = launch_shape(step.launch)
    cluster = CLUSTER_BLOCKS if step.launch is plan.cluster else 1  # (FENCE's one-cluster dispatch)
    return LaunchOp(rank_pos, step.launch.function, step.grid, block, shared, cluster, pdl and not first,
                    [block_bytes], timeout_patch(plan))


def recorded_launch(rank_pos: int, launch) -> LaunchOp:
    """A launch as testing.hooks.dry_run saw it (the MoE helpers' kernels, never clusters): its
    arguments' bytes now."""
    block, shared, pdl = launch_shape(launch)
    return LaunchOp(rank_pos, launch.function, launch.grid, block, shared, 1, pdl, [bytes(a) for a in launch.args])


def copy_launch(op: CopyOp, function, sm_count: int) -> LaunchOp:
    """op as a launch of util.cu's ep_copy_bytes (`function` on op's GPU): the handler issues a
    kernel launch in less host time than cuMemcpyDtoDAsync (under XLA's command buffers, which
    replay the call, both cost the same)."""
    grid = max(1, min(-(-op.nbytes // (256 * 16)), 4 * sm_count))
    return LaunchOp(op.rank, function, grid, 256, 0, 1, False,
                    [struct.pack("<Q", op.dst), struct.pack("<Q", op.src), struct.pack("<Q", op.nbytes)])


# -- the words the handler reads --------------------------------------------------------------
def handle_of(obj) -> int:
    """A driver handle (cuda.bindings object or int) as an integer address."""
    return obj if isinstance(obj, int) else native(obj)


def _arg_words(args) -> tuple:
    """(argument byte offsets, uint64 words): each argument starts on an 8-byte boundary."""
    blob, offsets = b"", []
    for a in args:
        offsets.append(len(blob))
        blob += a + b"\0" * (-len(a) % 8)
    return offsets, np.frombuffer(blob, np.uint64) if blob else np.zeros(0, np.uint64)


def patches(words) -> list:
    """(byte offset, buffer, byte offset in it) of every stand-in address among the words."""
    out = []
    for i, w in enumerate(words.tolist()):
        hit = buffer_of(w)
        if hit is not None:
            out.append((8 * i, hit[0], hit[1]))
    return out


def _end(value: int) -> tuple:
    hit = buffer_of(value)
    return (ABSOLUTE, value) if hit is None else hit


def encode(groups, buffers: int, first_steps: int) -> np.ndarray:
    """The plan words (native/ffi/ep_a2a_ffi.cc, parse) of a call with `buffers` operands and
    results whose GPUs run `groups`."""
    if buffers > MAX_BUFFERS:
        raise ValueError(f"a jit call of ep_a2a takes at most {MAX_BUFFERS} buffers, this one {buffers}")
    w = [MAGIC, VERSION, buffers, first_steps, len(groups)]
    for g in groups:
        w += [g.ordinal & ABSOLUTE, handle_of(g.fork) if g.fork is not None else 0, len(g.ranks)]
        for number, stream, join, record in g.ranks:
            w += [number, handle_of(stream), handle_of(join) if join is not None else 0, record]
        w.append(len(g.ops))
        for op in g.ops:
            if isinstance(op, LaunchOp):
                offsets, words = _arg_words(op.args)
                w += [LAUNCH, op.rank, handle_of(op.function), op.grid, op.block, op.shared, op.cluster, int(op.pdl),
                      len(offsets), len(words), *offsets, *words.tolist()]
                found = patches(words)
                w.append(len(found))
                for p in found:
                    w += list(p)
                w += [op.timeout[0], op.timeout[1], op.timeout[2]] if op.timeout else [ABSOLUTE, 0, 0]
            else:
                (db, da), (sb, sa) = _end(op.dst), _end(op.src)
                w += [COPY, op.rank, db, da, sb, sa, op.nbytes]
    return np.array(w, dtype=np.uint64)


def renumbered(op: LaunchOp, moves: dict) -> LaunchOp:
    """op with every stand-in address of buffer k (a key of moves) naming buffer moves[k]
    instead, the same byte in it: a launch planned for one call's buffer layout, in another's."""
    def move(arg: bytes) -> bytes:
        words = np.frombuffer(arg + b"\0" * (-len(arg) % 8), np.uint64).copy()
        for j, w in enumerate(words.tolist()):
            hit = buffer_of(w)
            if hit is not None and hit[0] in moves:
                words[j] = fake(moves[hit[0]], hit[1])
        return words.tobytes()[:len(arg)]
    return dataclasses.replace(op, args=[move(a) for a in op.args])


def recorded(rank_pos: int, run) -> list:
    """The launches `run()` makes (the MoE helpers, moe.py), as LaunchOps of rank position
    `rank_pos`, none issued (testing.hooks.dry_run: nothing else in them touches the GPU)."""
    from ..testing.hooks import dry_run
    seen = []
    with dry_run(lambda launch, stream: seen.append(recorded_launch(rank_pos, launch))):
        run()
    return seen
