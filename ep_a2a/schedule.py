"""Launch shapes, protocol choice and the step planner: pure functions, testable without a GPU.

Which protocol a step uses, how many blocks each phase launches, how combine splits a token
over blocks, and when a launch lets its successor start early (PDL) are the rules of
Schedule. plan_step applies them: from a rank's fixed plan (RankPlan), the state the device
sees (StepState) and one phase call (Call) to what that launch needs (Step: its kernel,
grid, trigger, splits and the parameter-block fields it writes) and the state after it.
Dispatch, combine and a rejected step all plan here; the repeat fast path is a memo over
plan_step's inputs (RankAlltoAll._run). A phase is an (operation, part) pair: a whole
dispatch or combine today; a send or receive half of one is another part of the same
operation, planned by the same rules (plan_half; the SM rule of halves is Schedule.receive_grid).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import HalvesOrderError
from .layout import PRELOAD_GROUPS, TAG_REJECT, ids_per_load

# protocol="auto" uses SENTINEL while runtime_max_tokens_per_rank is at most this, FENCE
# above (bench/results/ holds the sweeps it comes from). With 8 ranks sharing one GPU a
# system-scope fence is cheap, while SENTINEL's landing copy, per-word checks and resets cost
# memory traffic that all ranks share, so FENCE wins at every size there; NVLink-connected
# GPUs may favour SENTINEL at small batches (the paper does). Overridden per all-to-all by
# crossover_tokens=, or for the process by $EP_A2A_SENTINEL_MAX_TOKENS (config.py).
SENTINEL_MAX_TOKENS_H200 = 0


def protocol_for(setting: str, runtime_max_tokens_per_rank: int, crossover_tokens: int) -> str:
    """The protocol of a step with this T^ (the same on every rank: T^ is shared)."""
    if setting != "auto":
        return setting
    return "sentinel" if runtime_max_tokens_per_rank <= crossover_tokens else "fence"


def vector_bytes(nbytes: int, *addresses: int) -> int:
    """The widest vector (16, 8, 4, 2, 1 bytes) that divides the size and every address:
    the lowest set bit of all of them together, at most 16."""
    x = nbytes
    for a in addresses:
        x |= a
    return min(16, x & -x) if x else 16


def push_groups(bytes_per_token, threads: int) -> int:
    """Schedule.push_groups of payloads of these sizes (ids first) and blocks of `threads`."""
    if any(n % 16 for n in bytes_per_token):
        return 0
    n = sum(bytes_per_token) // 16
    return n if n <= PRELOAD_GROUPS * threads else 0


MIN_SPLIT_GROUPS = 32  # (512 bytes: fewer per block and the block's own fixed costs dominate)
MAX_DISPATCH_SPLITS = 8
# A split dispatch at T^ of at most CLUSTER_TOKENS runs as one cluster of CLUSTER_BLOCKS
# (the portable cluster size): its blocks meet at the cluster barrier instead of electing
# the last one (kernels/fence.cu, publish_counts). That pays at one token only: at two it
# broke even and at four it lost (bench/results), so only T^ = 1 forms a cluster.
CLUSTER_BLOCKS, CLUSTER_TOKENS = 8, 1
GPC_SMS = 16  # SMs per GPC that clusters_fit assumes at least (Hopper and Blackwell data-center GPUs: 16-18)


@dataclass(frozen=True)
class Schedule:
    """The fixed sizes of one rank's launches; its methods are the rules."""
    ep_size: int
    top_k: int
    threads: int
    combine_hidden_size: int
    combine_bytes: int
    fp8_combine: bool
    pdl: bool
    max_grid: int        # this rank's share of its GPU: every co-resident rank's blocks must fit
    push_groups: int = 0  # FENCE: 16-byte groups of one token's payloads (ids included) when every
    #                       payload is a whole number of them and a block loads them in one round,
    #                       else 0 (A2AParams.push_groups: 0 too where an input is not 16-byte aligned)
    clusters: bool = False  # FENCE: small split dispatches may run as one cluster (clusters_fit)

    def clusters_fit(self, blocks_per_sm: int, sm_count: int, ranks_on_device: int) -> bool:
        """Whether a one-cluster dispatch always finds room on a GPU whose ranks spin on each
        other: a cluster needs its blocks within one GPC, while the block budget (max_grid)
        counts slots anywhere. What can be resident and waiting on a rank's pending cluster at
        T^ <= CLUSTER_TOKENS is every rank's dispatch of that step (one cluster, or the blocks
        that sanitize its ids) and one PDL successor each, which is that step's combine
        (capped at CLUSTER_BLOCKS there: combine_want) or, in dispatch-only replays, the next
        dispatch alike; the next one cannot launch before its dispatch is done, and earlier
        steps' kernels finish without waiting on this one. Room is then guaranteed both if the
        blocks of a cluster may share an SM (the free slots outnumber CLUSTER_BLOCKS - 1 per
        GPC, GPCs counted as one per 8 SMs: none has fewer) and if they need SMs of their own
        (the SMs the held blocks can fill leave some GPC CLUSTER_BLOCKS SMs with a free slot,
        GPCs counted as one per GPC_SMS). Work on other streams, which waits on nothing of
        ours, can only delay a cluster."""
        held = ranks_on_device * 2 * max(CLUSTER_BLOCKS, self.dispatch_want(0, CLUSTER_TOKENS, "fence"))
        shared = blocks_per_sm * sm_count - held > (sm_count // 8) * (CLUSTER_BLOCKS - 1)
        apart = held // blocks_per_sm < sm_count - (CLUSTER_BLOCKS - 1) * max(1, sm_count // GPC_SMS)
        return shared and apart

    def dispatch_splits(self, T: int, runtime_max: int, vectors) -> int:
        """FENCE: blocks that share one token's pushes, since a small batch's token pushed from
        one SM takes most of the dispatch. Every block of a split token counts the earlier
        tokens' selections itself (kernels/fence.cu, earlier_selections), so splits stay where
        their ids fit one warp-wide load (beyond it the recount costs more than the split
        gains). Within half the share (PDL's early trigger), at least MIN_SPLIT_GROUPS groups
        per block, at most MAX_DISPATCH_SPLITS; only tokens whose payloads (`vectors`: each
        one's vector bytes, ids first) all move in 16-byte vectors."""
        if not (self.push_groups and T and all(v == 16 for v in vectors)) or (T - 1) * self.top_k > ids_per_load(self.top_k):
            return 1
        half = max(1, self.max_grid // 2)
        n = max(1, min(half // T, self.push_groups // MIN_SPLIT_GROUPS, MAX_DISPATCH_SPLITS))
        return CLUSTER_BLOCKS // T if self._clustered(runtime_max) and CLUSTER_BLOCKS // T <= n else n

    def _clustered(self, runtime_max: int) -> bool:
        return self.clusters and runtime_max <= CLUSTER_TOKENS

    def dispatch_cluster(self, T: int, runtime_max: int, splits: int, grid: int) -> int:
        """Blocks of the one cluster a FENCE dispatch's grid forms, or 0 (not clustered)."""
        return grid if self._clustered(runtime_max) and splits > 1 and grid == T * splits == CLUSTER_BLOCKS else 0

    def loaded_groups(self, vectors) -> int:
        """A2AParams.push_groups of a dispatch whose inputs move in vectors of these bytes (ids
        first): push_groups when every one moves in 16-byte vectors, else 0."""
        return self.push_groups if all(v == 16 for v in vectors) else 0

    def dispatch_want(self, T: int, runtime_max: int, proto: str, splits: int = 1) -> int:
        """Blocks a dispatch would use: a block per token, or per part of one (splits; FENCE:
        at least enough to sanitize the received ids in one pass; SENTINEL: one per (source,
        slot) to receive)."""
        if proto == "fence":
            return max(T * splits, -(-self.ep_size * runtime_max * self.top_k // (self.threads * 8)))
        return self.ep_size * runtime_max

    def combine_want(self, T: int, runtime_max: int, proto: str, vec: int, quantize: bool = True) -> tuple:
        """(blocks, splits) of a combine of T tokens whose output takes vectors of `vec` bytes.

        Small batches spread each token over `splits` blocks until a thread issues one round
        of loads. SENTINEL polls and reduces 16-byte groups whatever the output's vectors, and
        pushes every received slot (a block each, or parts of one). At small batches its
        pushing and reducing blocks are apart (the reducers poll at once) while the grid
        stays within half the share (PDL's early trigger); either way the grid has one block
        more than its work, which publishes the combine flag (kernels/sentinel.cu: its
        system-scope fence stays off every working block's path). The FP8 quantize pass
        spreads its 128-value blocks over the whole grid, which this sizes by the slots too
        (quantize=False: the epilogue quantized, combine_input(T^, fp8=True))."""
        if proto == "sentinel":
            units = -(-self.combine_bytes // 16)
            splits = max(1, min(self.max_grid // max(T, 1), -(-units // self.threads)))
            slots = self.ep_size * runtime_max
            apart = slots + T * splits + 1  # pushing and reducing blocks apart (sentinel.cu), if it fits half
            return (apart if apart <= max(1, self.max_grid // 2) else max(T * splits, slots) + 1), splits
        units = self.combine_hidden_size // 8 if self.fp8_combine else self.combine_bytes // vec
        splits = max(1, min(self.max_grid // max(T, 1), -(-units // self.threads)))
        slots = self.fp8_combine and quantize
        blocks = max(T * splits, self.ep_size * runtime_max if slots else 0)
        return (min(blocks, CLUSTER_BLOCKS) if self._clustered(runtime_max) else blocks), splits  # (Schedule.clusters_fit)

    def combine_push_blocks(self, T: int, runtime_max: int, splits: int, grid: int) -> int:
        """SENTINEL combine: blocks [0, n) push the received slots (A2AParams.combine_push_blocks).
        The grid's last block publishes the combine flag (combine_want gave it one more); when
        the blocks before it hold every received slot beside the T * splits reducers, the
        pushers are those spare blocks and the reducers follow them (n < grid); otherwise every
        block pushes and then reduces (n = grid)."""
        spare = grid - 1 - T * splits
        return spare if spare >= self.ep_size * runtime_max else grid

    def send_push_blocks(self, grid: int) -> int:
        """SENTINEL combine's send half: every block but the publishing last one pushes (one
        block alone does both)."""
        return max(1, grid - 1)

    def grid(self, want: int, successor_want: int, prev_early: bool, successor_fills: bool = False) -> tuple:
        """(blocks, trigger early) of the next launch, given whether the previous one triggered
        early: whether it may let its successor launch at once (PDL).

        Every rank sharing the GPU spins on the others, so all their blocks must be resident:
        a rank's grid is capped at its share of the GPU (max_grid). An early trigger puts the
        successor's blocks beside ours, so it is allowed only for grids of at most half that
        share, and a launch that follows an early trigger is itself held to half.

        A launch held to half only for that reason triggers early only when its successor
        (predicted: the other phase at the same sizes, `successor_want`) would fit in half
        anyway. Otherwise it triggers late and its successor gets the whole share: an early
        trigger there would hold the successor to half, and it the next, so one small step
        would leave every later large step at half the grid.

        A successor that fills its grid with throughput work (successor_fills: a combine that
        runs its own FP8 quantize pass) gets the same rule even after an unheld launch: half
        the grid slows that pass more than the early start gains, while a bf16 combine gains.
        """
        half = max(1, self.max_grid // 2)
        held = prev_early and want > half
        grid = max(1, min(half if prev_early else self.max_grid, want))
        early = self.pdl and grid <= half and (not (held or successor_fills) or successor_want <= half)
        return grid, bool(early)


    def receive_grid(self, want: int) -> int:
        """Blocks of a receive half: at most half this rank's share (docs/design.md, the SM
        rule of halves). A receive half spins on its peers' send halves, and engines put their
        own kernels between the halves, on this rank's stream and on the peers'. Each rank's
        spinning blocks then hold at most half of its share of the GPU's block slots, so a
        peer's send half, and the compute an engine runs before it, always find slots that
        no spinning block holds. Receive halves never trigger their successor early
        (plan_half), so no second kernel of the rank is placed beside a spinning one."""
        return max(1, min(want, self.max_grid // 2))


# -- one rank's plan and the step planner ---------------------------------------------------
FIRST_STEPS = 4  # steps that wait for peers with first_timeout_s (peers may still be loading)


@dataclass(frozen=True, eq=False)
class RankPlan:
    """What never changes in one rank after construction (alltoall.build_plan makes it): the
    kernel launches, the parameter block with its static half written, the launch-shape rules
    and the sizes plan_step reads."""
    rank: int
    params: object         # layout.A2AParams: the kernels' argument block, which every launch of the rank shares
    descs: tuple           # its payload descriptors, ids first
    payload_bytes: tuple   # bytes per token of each, ids first
    launches: dict         # protocol -> (dispatch Launch, combine Launch)
    cluster: object        # FENCE's one-cluster dispatch Launch, or None
    empty: object          # an empty kernel of the protocol kernels' shape (the benchmark's floor)
    schedule: Schedule
    crossover_tokens: int
    combine_bytes: int
    combine_input: int     # this rank's combine input section (the address)
    fp8_combine: bool
    timeout_ns: int
    first_timeout_ns: int
    first_steps: int = FIRST_STEPS
    halves: dict = None    # protocol -> {operation: (send Launch, receive Launch)} (halves.py)

    @property
    def max_grid(self) -> int:
        return self.schedule.max_grid

    def apply(self, step) -> None:
        """Write a planned step's fields into the parameter block and its grid into its launch."""
        params = self.params
        for name, value in step.fields:
            setattr(params, name, value)
        for desc, (src, vec) in zip(self.descs, step.sources):
            desc.src, desc.vec = src, vec
        step.launch.grid = step.grid
        if step.launch is self.cluster:  # (the plain launch keeps the grid too: testing.hooks.last_grids)
            self.launches["fence"][0].grid = step.grid


@dataclass(frozen=True)
class Phase:
    op: str                # "dispatch" or "combine"
    part: str = "whole"    # the whole operation, or its "send" or "receive" half (halves.py)


DISPATCH, COMBINE = Phase("dispatch"), Phase("combine")
DISPATCH_SEND, DISPATCH_RECEIVE = Phase("dispatch", "send"), Phase("dispatch", "receive")
COMBINE_SEND, COMBINE_RECEIVE = Phase("combine", "send"), Phase("combine", "receive")


@dataclass(frozen=True)
class Pending:
    """The dispatch whose combine is due: what that combine is planned from."""
    runtime_max: int
    tokens: int
    protocol: str
    splits: int


@dataclass(frozen=True)
class StepState:
    """What the next launch's plan depends on besides its own call."""
    steps: int = 0                # steps launched, counted up to the plan's first_steps
    triggered_early: bool = False  # the previous launch let its successor start (PDL)
    tag_hi: int = 0               # the active-rank hash bits of the step tag
    quantizing_combine: bool = False  # the last combine ran its own FP8 pass (the next one is predicted alike)
    pending: Pending | None = None
    sent: tuple | None = None     # a send half whose receive is due: (operation, the fields it wrote, its grid)


@dataclass(frozen=True)
class Call:
    """One phase call as the planner sees it: sizes, the protocol setting and the addresses."""
    phase: Phase
    tokens: int                  # T: this rank's tokens
    runtime_max: int             # T^: shared by every rank this step
    protocol: str | None         # dispatch: the setting, "fence", "sentinel" or "auto"; combine: None
    addresses: tuple = ()        # dispatch: each input's address, ids first; combine: the output's
    prequantized: bool = False   # combine: the epilogue wrote the FP8 input
    rejected: bool = False       # the step this rank runs without tokens after rejecting its input


@dataclass(frozen=True)
class Step:
    """What one launch needs and the state after it."""
    launch: object               # the plan's Launch to issue
    protocol: str
    grid: int
    trigger_early: bool
    fields: tuple                # (parameter-block field, value) pairs this launch writes
    sources: tuple               # dispatch: (src, vec) of each payload descriptor; else ()
    state: StepState


def check_order(plan: RankPlan, state: StepState, phase: Phase) -> None:
    """Raise HalvesOrderError unless `phase` may follow `state` (before anything is issued:
    eagerly and at capture alike). A step is dispatch then combine, each whole or as its send
    half then its receive half; nothing of the rank's all-to-all runs between a send half and
    its receive half."""
    op, part, sent = phase.op, phase.part, state.sent
    due = sent[0] if sent else None
    if part == "receive":
        if due != op:
            what = f"the {due} receive half is due" if due else f"no {op} send half is open"
            raise HalvesOrderError(f"rank {plan.rank}: {op} receive half out of order: {what}")
    elif due:
        raise HalvesOrderError(f"rank {plan.rank}: {op} {part} called while the {due} send half "
                               f"awaits its receive half ({due}_recv / handle.receive())")
    elif (op == "combine") != (state.pending is not None):
        raise HalvesOrderError(f"rank {plan.rank}: {op} {part} out of order: "
                               + ("a combine is due" if state.pending else "no dispatch before it"))


def plan_step(plan: RankPlan, state: StepState, call: Call) -> Step:
    """The launch `call` makes on a rank with this plan and state."""
    if call.phase.part != "whole" or state.sent:
        return plan_half(plan, state, call)
    if call.phase.op == "dispatch":
        return _dispatch(plan, state, call)
    return _combine(plan, state, call)


def plan_half(plan: RankPlan, state: StepState, call: Call) -> Step:
    """A send or receive half: the whole phase's fields and rules, the half's kernel and its
    grid (a receive half's by Schedule.receive_grid). A send half within half the share lets
    its successor start early (PDL: a send half waits on no peer, but for FENCE's after a
    SENTINEL step, as the whole FENCE dispatch, and the successor, its receive half, is
    held to half); a receive half never does, so no kernel is placed
    beside a spinning one. The receive half writes the very fields its send half wrote
    (kept in StepState.sent)."""
    check_order(plan, state, call.phase)
    sch, op = plan.schedule, call.phase.op
    if call.phase.part == "send":
        whole = (_dispatch if op == "dispatch" else _combine)(plan, dataclasses.replace(state, triggered_early=False), call)
        pending = whole.state.pending or state.pending
        if op == "dispatch":
            want = whole.grid
        elif whole.protocol == "fence":  # one block publishes; the FP8 pass wants the slots
            quantize = plan.fp8_combine and not call.prequantized
            want = sch.ep_size * call.runtime_max if quantize else 1
        else:  # SENTINEL: a block per received slot pushes, one more publishes
            want = sch.ep_size * call.runtime_max + 1
        half = max(1, sch.max_grid // 2)
        grid = max(1, min(want, half if state.triggered_early else sch.max_grid))
        early = sch.pdl and grid <= half  # (its receive half, held to half, may then be placed beside it)
        fields = _replaced(whole.fields, _half_fields(sch, op, whole.protocol, grid))
        after = dataclasses.replace(whole.state, triggered_early=early, pending=pending,
                                    sent=(op, fields, whole.sources))
        launch = plan.halves[whole.protocol][op][0]
        return Step(launch, whole.protocol, grid, early, fields, whole.sources, after)
    pending, (_, fields, sources) = state.pending, state.sent
    values = dict(fields)
    if op == "dispatch":
        proto, T, runtime_max = pending.protocol, pending.tokens, pending.runtime_max
        if proto == "fence":
            want = -(-sch.ep_size * runtime_max * sch.top_k // (sch.threads * 8))
        else:
            want = sch.ep_size * runtime_max
        after = dataclasses.replace(state, triggered_early=False, sent=None)
    else:
        proto = pending.protocol
        want = pending.tokens * values["combine_splits"]
        after = dataclasses.replace(state, triggered_early=False, sent=None, pending=None)
    grid = sch.receive_grid(want)
    return Step(plan.halves[proto][op][1], proto, grid, False, fields, sources, after)


def _half_fields(sch, op, protocol, grid) -> dict:
    """The fields a send half writes in place of its whole phase's: its grid is never a cluster,
    and SENTINEL's combine send half pushes from every block but the publishing one."""
    if op == "dispatch":
        return {"dispatch_cluster": 0}
    return {"combine_push_blocks": sch.send_push_blocks(grid)} if protocol == "sentinel" else {}


def _replaced(fields, values) -> tuple:
    return tuple((name, values.get(name, value)) for name, value in fields)


def _grid(plan, state, want, successor_want, successor_fills=False):
    return plan.schedule.grid(want, successor_want, state.triggered_early, successor_fills)


def _dispatch(plan, state, call):
    sch, T, runtime_max = plan.schedule, call.tokens, call.runtime_max
    proto = protocol_for(call.protocol, runtime_max, plan.crossover_tokens)
    timeout = plan.first_timeout_ns if state.steps < plan.first_steps else plan.timeout_ns
    if call.rejected:
        splits, tag, sources, groups, cluster = 1, TAG_REJECT | plan.rank, (), 0, 0
        grid, early = _grid(plan, state, sch.dispatch_want(0, runtime_max, proto), 1)
    else:
        sources = tuple((address, vector_bytes(nbytes, address))
                        for address, nbytes in zip(call.addresses, plan.payload_bytes))
        vectors = [vec for _, vec in sources]
        splits = sch.dispatch_splits(T, runtime_max, vectors) if proto == "fence" else 1
        groups = sch.loaded_groups(vectors)
        quantizing = state.quantizing_combine  # (the combine after us is predicted as the last one)
        successor = sch.combine_want(T, runtime_max, proto, vector_bytes(plan.combine_bytes, 0), quantize=quantizing)[0]
        grid, early = _grid(plan, state, sch.dispatch_want(T, runtime_max, proto, splits), successor, quantizing)
        tag = runtime_max | state.tag_hi
        cluster = int(bool(sch.dispatch_cluster(T, runtime_max, splits, grid)))
    launch = plan.cluster if cluster else plan.launches[proto][0]
    fields = (("local_num_tokens", T), ("runtime_max_tokens_per_rank", runtime_max), ("step_tag", tag),
              ("timeout_ns", timeout), ("dispatch_splits", splits), ("push_groups", groups),
              ("dispatch_cluster", cluster))
    after = StepState(min(state.steps + 1, plan.first_steps), early, state.tag_hi, state.quantizing_combine,
                      Pending(runtime_max, T, proto, splits))
    return Step(launch, proto, grid, early, fields, sources, after)


def _combine(plan, state, call):
    sch, pending, runtime_max = plan.schedule, state.pending, call.runtime_max
    T, proto = pending.tokens, pending.protocol
    (out,) = call.addresses
    if call.rejected:  # served from the poisoned combine input, as if an epilogue had quantized it
        prequantized = plan.fp8_combine
        vec = vector_bytes(plan.combine_bytes, plan.combine_input, out)
        want, splits = sch.combine_want(0, runtime_max, proto, vec, quantize=False)
        successor = 1
    else:
        prequantized = call.prequantized
        vec = vector_bytes(plan.combine_bytes, out)
        want, splits = sch.combine_want(T, runtime_max, proto, vec, quantize=not prequantized)
        successor = sch.dispatch_want(T, runtime_max, proto, pending.splits)  # the next step's, if alike
    grid, early = _grid(plan, state, want, successor)
    pushers = sch.combine_push_blocks(T, runtime_max, splits, grid) if proto == "sentinel" else 0
    fields = (("combine_out", out), ("combine_vec", vec), ("combine_prequantized", int(prequantized)),
              ("combine_splits", splits), ("combine_push_blocks", pushers))
    quantizing = state.quantizing_combine if call.rejected else plan.fp8_combine and not prequantized
    after = StepState(state.steps, early, state.tag_hi, quantizing, None)
    return Step(plan.launches[proto][1], proto, grid, early, fields, (), after)
