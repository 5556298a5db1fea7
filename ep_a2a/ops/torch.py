"""ep_a2a as PyTorch ops: dispatch, combine and the MoE helpers registered with torch.library,
on torch's current stream, usable eagerly, under torch.compile(fullgraph=True) and inside
torch.cuda.graph capture.

    from ep_a2a.ops import torch as ep_ops
    ep_ops.route(logits, topk_ids, topk_w)          # the router: top-k ids int32 and weights fp32, one kernel
    tr = ep_ops.bind(a2a.ranks[0])                  # once per rank; tr.prepare([T_hat, ...]) before compiling
    ids, (x, w) = ep_ops.dispatch(tr, topk_ids, [hidden, topk_w], T_hat)   # torch views of the workspace
    ix = ep_ops.expert_index(tr)                    # once: an ExpertIndex with torch views
    ep_ops.build_index(ix, ids, w)
    ep_ops.gather_rows(ix, x, x_rows)               # ... FC1 (grouped GEMM) -> h [rows, 2 * I]
    ep_ops.activation(ix, h, act)                   # silu(h[:, :I]) * h[:, I:], rows < total; FC2 -> fc2_out
    # at decode sizes instead of gather, FC1, activation and FC2 (ep_a2a's expert kernels):
    ep_ops.expert_fc1(ix, x, w_gate_up, act); ep_ops.expert_fc2(ix, act, w_down, fc2_out)
    ep_ops.finalize(ix, fc2_out, ep_ops.combine_input(tr, T_hat))
    # or FC2 and finalize in one kernel: ep_ops.expert_fc2(ix, act, w_down, fc2_out, ep_ops.combine_input(tr, T_hat))
    y = ep_ops.combine(tr, ep_ops.combine_input(tr, T_hat), T_hat)      # [local tokens, hidden]

Each op writes into tensors it declares mutated (`Tensor(a!)`) and returns nothing, so
functionalization under torch.compile sees every write: dispatch "mutates" the torch
views of the workspace it delivers into (the same tensors every step with that T^, made
once per T^), finalize mutates the combine input, combine mutates `out`, and combine reads
the dispatched ids view, so nothing can move it before its dispatch. An op never returns a
view of a persistent buffer: the Python functions here return the views they passed as
mutated arguments (if a compiler hands an op a copy instead, the op copies its result
there). The fake implementations do nothing (no outputs), so tracing needs no device.
torch.compile traces only views already made: call each T^ once eagerly, or tr.prepare().

Registration: `torch.library.Library("ep_a2a", "DEF")` with define + impl (CUDA; the same
function for CPU, where the all-to-all's own device rule raises naming the argument) +
register_fake, chosen over `@torch.library.custom_op`, whose per-call cost is several times
higher. The functions here call the OpOverloads, except in plain eager calls (no compile,
tracing, mode or transform; plain torch.Tensor arguments: plain_eager()), where they run the
same implementations directly: the dispatcher costs far more per call than the checks that
it would do nothing else.

Host cost: the ops never call DLPack per call. Each tensor argument fills an ep_a2a Tensor
kept per argument position (interop/torch_tensor.TensorSlot), so a step whose tensors sit
where the last step's did takes the all-to-all's repeat fast path; since the slots see
whether a fill changed anything, such a step repeats without the all-to-all's geometry
compare (RankAlltoAll.dispatch_same / combine_same); the stream is read as a raw handle.
The MoE pieces (route, build_index, gather_rows, activation, expert_fc1 / expert_fc2,
finalize) do likewise: a call whose tensors all sit where that op's last call had them
relaunches its last launches as they were, without moe.*'s checks (torch_views.Replays).
combine(out=None) allocates its output: engines pass out=. Expert ids
are not copied to the host by default (bind(validate_expert_ids=False)): the kernel drops
ids outside 0..num_experts-1 and -1; True checks them on the host at every eager dispatch (a
synchronization; skipped under capture).

Streams: the kernels run on torch's current stream of the rank's GPU, or on `stream=`
(which first waits for the current stream; the inputs are then held until an event after
the kernels completes, never through record_stream). In-process ranks (LocalGroup) must
run concurrently: give each its own torch stream (`with torch.cuda.stream(s_r): ...`) and
issue every rank's dispatch before anything that blocks the host, as in layers/base.py.
CUDA graphs: capture with torch.cuda.graph(g, capture_error_mode="global"); the ops make no
allocation, free or synchronization (the all-to-all's deferred frees wait while a stream
is capturing); capture one graph per T^ after one eager step with it; replay in any order.
"""
from __future__ import annotations

import torch

from ..config import Fp8Partial
from ..driver.stream import is_capturing, stream_handle
from ..errors import StateError
from ..interop.torch_tensor import TensorSlot
from ..moe import ExpertIndex, activation as moe_activation, build_index as moe_build_index, \
    finalize as moe_finalize, gather_rows as moe_gather_rows
from ..moe_experts import expert_fc1 as moe_expert_fc1, expert_fc2 as moe_expert_fc2
from ..router import Router, router_for
from ..validate import check_expert_ids_on_host
from .torch_views import INDEX_SLOTS, INDEXES, RANKS, Replays, StreamUse, TorchIndex, TorchRank, bind, \
    current_stream_handle, lookup, register_ops

__all__ = ["route", "bind", "dispatch", "combine", "combine_input", "expert_index", "build_index", "gather_rows", "activation",
           "expert_fc1", "expert_fc2", "finalize", "TorchRank", "TorchIndex", "SCHEMAS", "copies"]

SCHEMAS = {
    "route": "route(Tensor logits, Tensor(a!) ids, Tensor(b!) weights, bool renormalize=True, int stream=-1) -> ()",
    "dispatch": "dispatch(int rank, Tensor token_selected_experts, Tensor[] payloads, int runtime_max_tokens_per_rank, "
                "Tensor(a!) recv_expert_ids, Tensor(b!)[] recv_payloads, int stream=-1) -> ()",
    "combine": "combine(int rank, Tensor partial, Tensor? scales, Tensor dispatched, int runtime_max_tokens_per_rank, "
               "Tensor(a!) out, int stream=-1) -> ()",
    "build_index": "build_index(int index, Tensor expert_ids, Tensor weights, Tensor(a!) counts, Tensor(b!) offsets, "
                   "Tensor(c!) rows, Tensor(d!) row_weight, Tensor(e!) row_of, int stream=-1) -> ()",
    "gather_rows": "gather_rows(int index, Tensor rows, Tensor offsets, Tensor src, Tensor(a!) out, int stream=-1) -> ()",
    "activation": "activation(int index, Tensor offsets, Tensor fc1_out, Tensor(a!) out, int stream=-1) -> ()",
    "expert_fc1": "expert_fc1(int index, Tensor rows, Tensor offsets, Tensor src, Tensor w_gate_up, Tensor(a!) out, "
                  "int stream=-1) -> ()",
    "expert_fc2": "expert_fc2(int index, Tensor offsets, Tensor act, Tensor w_down, Tensor(a!) out, int stream=-1) -> ()",
    "expert_fc2_finalize": "expert_fc2_finalize(int index, Tensor offsets, Tensor row_of, Tensor row_weight, Tensor act, "
                           "Tensor w_down, Tensor(a!) out, Tensor(b!) finalize_into, int stream=-1) -> ()",
    "finalize": "finalize(int index, Tensor row_of, Tensor row_weight, Tensor fc2_out, Tensor(a!) out, "
                "int stream=-1) -> ()",
    "finalize_fp8": "finalize_fp8(int index, Tensor row_of, Tensor row_weight, Tensor fc2_out, Tensor(a!) values, "
                    "Tensor(b!) scales, str dtype, int stream=-1) -> ()",
}


_COPIES = [0]


def copies() -> int:
    """How many times an op was handed another tensor than its own view and copied its
    result there (0 under eager calls and inductor, which hands the views themselves: the
    tests and the benchmark check it, because a late copy back into the workspace could
    overwrite what a peer's next dispatch already delivered)."""
    return _COPIES[0]


def _same_or_copy(passed, own) -> None:
    """The op wrote `own`; a compiler that handed it another tensor (a functionalized copy)
    gets the result there too."""
    if passed.data_ptr() != own.data_ptr():
        _COPIES[0] += 1
        passed.copy_(own)


# -- implementations (run by the dispatcher with real tensors, or directly by eager calls) -------------
# (The implementations hold their inputs with an inline `if explicit:`: a shared helper's
# call is a visible share of an eager step's host time.)
def run_dispatch(b: TorchRank, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream: int) -> None:
    """The dispatch itself, into b's own views: what the op runs, and what an eager call runs
    without the dispatcher."""
    # (torch's current stream, the usual case, read here: cheaper than StreamUse.pick's call)
    s, explicit = (current_stream_handle(b.ordinal), False) if stream == -1 else b.streams.pick(stream)
    # The record is taken off until this call has succeeded: a call that fails after a slot
    # took a new tensor leaves that slot "unchanged" for the next call with the same tensor,
    # which then must not repeat the record's launch (TorchRank.vouched_dispatch).
    record, b.vouched_dispatch = b.vouched_dispatch, None
    try:
        ids, pays, same = b.dispatch_args(token_selected_experts, payloads)
        if b.validate_expert_ids and ids.shape[0] and not is_capturing(s):
            check_expert_ids_on_host(ids, s, b.a2a.num_experts)
    except (TypeError, ValueError) as e:  # refused here, before the all-to-all saw it:
        b.r.reject_step(runtime_max_tokens_per_rank, s, e)  # peers in other processes may have launched
        raise
    # (the slots' own objects, none of their fields changed: the all-to-all's repeat without its
    # geometry compare)
    if not (same and record is not None and b.r.dispatch_same(record, runtime_max_tokens_per_rank, s) is not None):
        b.r.dispatch(ids, pays, runtime_max_tokens_per_rank, s)
        record = b.r.last_repeats[0]
    b.vouched_dispatch = record
    b.local_tokens = ids.shape[0]
    if explicit:
        b.streams.hold(s, (token_selected_experts, *payloads))


def run_combine(b: TorchRank, partial, scales, runtime_max_tokens_per_rank, out, stream: int) -> None:
    """The combine itself, into `out` (see run_dispatch)."""
    s, explicit = (current_stream_handle(b.ordinal), False) if stream == -1 else b.streams.pick(stream)
    (record, vouched_part), b.vouched_combine = b.vouched_combine, (None, None)  # (as in run_dispatch)
    part, same = b.partial_arg(partial, scales, runtime_max_tokens_per_rank)
    same &= b.out_slot.update(out)
    if not (same and record is not None and part is vouched_part
            and b.r.combine_same(record, runtime_max_tokens_per_rank, s) is not None):
        b.r.combine(part, runtime_max_tokens_per_rank, s, b.out_slot.tensor)  # (positional: cheaper than keywords)
        record = b.r.last_repeats[1]
    b.vouched_combine = record, part
    if explicit:
        b.streams.hold(s, (partial, out))


def dispatch_impl(rank, token_selected_experts, payloads, runtime_max_tokens_per_rank, recv_expert_ids,
                  recv_payloads, stream=-1):
    b = lookup(RANKS, rank, "rank")
    run_dispatch(b, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream)
    own_ids, own_pays = b.dispatch_views(runtime_max_tokens_per_rank)
    _same_or_copy(recv_expert_ids, own_ids)
    for got, own in zip(recv_payloads, own_pays):
        _same_or_copy(got, own)


def combine_impl(rank, partial, scales, dispatched, runtime_max_tokens_per_rank, out, stream=-1):
    run_combine(lookup(RANKS, rank, "rank"), partial, scales, runtime_max_tokens_per_rank, out, stream)


def run_build_index(ix: TorchIndex, expert_ids, weights, stream: int) -> None:
    """moe.build_index into ix's own buffers (see run_dispatch), or its last launches again
    (ops/torch_views.Replays)."""
    s, explicit = ix.streams.pick(stream)
    i, slots = ix.index, ix.slots
    same = slots["build_index.expert_ids"].update(expert_ids) & slots["build_index.weights"].update(weights)
    if not (same and not i.closed and ix.replays.replay("build_index", s, i.runtime_max_tokens_per_rank, i.device)):
        ix.replays.forget("build_index")
        moe_build_index(slots["build_index.expert_ids"].tensor, slots["build_index.weights"].tensor,
                        num_experts=i.num_experts, ep_size=i.ep_size, rank=i.rank, stream=s, out=i)
        ix.replays.record("build_index", s, i.runtime_max_tokens_per_rank, i.last_issued)
    if explicit:
        ix.streams.hold(s, (expert_ids, weights))


def build_index_impl(index, expert_ids, weights, counts, offsets, rows, row_weight, row_of, stream=-1):
    ix = lookup(INDEXES, index, "index")
    run_build_index(ix, expert_ids, weights, stream)
    own = ix.views(ix.index.runtime_max_tokens_per_rank)
    for got, mine in zip((counts, offsets, rows, row_weight, row_of), (ix.counts, ix.offsets) + own):
        _same_or_copy(got, mine)


def _index_piece(ix: TorchIndex, op: str, piece, tensors, stream: int) -> None:
    """One MoE piece after build_index on ix's index (moe.gather_rows, activation, finalize):
    its slots `op.<argument>` rewritten from `tensors` in order, then moe's call, or its last
    launches again where the slots and the index's T^ are as they were (Replays)."""
    s, explicit = ix.streams.pick(stream)
    i, slots, names = ix.index, ix.slots, _PIECE_SLOTS[op]
    same = True
    for name, t in zip(names, tensors):
        same &= slots[name].update(t)
    if not (same and not i.closed and ix.replays.replay(op, s, i.runtime_max_tokens_per_rank, i.device)):
        ix.replays.forget(op)
        piece(i, *[slots[name].tensor for name in names], stream=s)
        ix.replays.record(op, s, i.runtime_max_tokens_per_rank, i.last_issued)
    if explicit:
        ix.streams.hold(s, tuple(tensors))


_PIECE_SLOTS = {op: tuple(f"{op}.{n}" for n in names) for op, names in INDEX_SLOTS.items()}


def gather_rows_impl(index, rows, offsets, src, out, stream=-1):
    _index_piece(lookup(INDEXES, index, "index"), "gather_rows", moe_gather_rows, (src, out), stream)


def activation_impl(index, offsets, fc1_out, out, stream=-1):
    _index_piece(lookup(INDEXES, index, "index"), "activation", moe_activation, (fc1_out, out), stream)


def expert_fc1_impl(index, rows, offsets, src, w_gate_up, out, stream=-1):
    _index_piece(lookup(INDEXES, index, "index"), "expert_fc1", moe_expert_fc1, (src, w_gate_up, out), stream)


def expert_fc2_impl(index, offsets, act, w_down, out, stream=-1):
    _index_piece(lookup(INDEXES, index, "index"), "expert_fc2", moe_expert_fc2, (act, w_down, out), stream)


def _fc2_finalize(index, act, w_down, out, finalize_into, stream):
    moe_expert_fc2(index, act, w_down, out, stream=stream, finalize_into=finalize_into)


def expert_fc2_finalize_impl(index, offsets, row_of, row_weight, act, w_down, out, finalize_into, stream=-1):
    _index_piece(lookup(INDEXES, index, "index"), "expert_fc2_finalize", _fc2_finalize, (act, w_down, out, finalize_into),
                 stream)


def finalize_impl(index, row_of, row_weight, fc2_out, out, stream=-1):
    _index_piece(lookup(INDEXES, index, "index"), "finalize", moe_finalize, (fc2_out, out), stream)


def finalize_fp8_impl(index, row_of, row_weight, fc2_out, values, scales, dtype, stream=-1):
    ix = lookup(INDEXES, index, "index")
    s, explicit = ix.streams.pick(stream)
    slots = ix.slots
    part = Fp8Partial(slots["finalize_fp8.values"](values), slots["finalize_fp8.scales"](scales), dtype)
    moe_finalize(ix.index, slots["finalize_fp8.fc2_out"](fc2_out), part, stream=s)
    if explicit:
        ix.streams.hold(s, (fc2_out, values, scales))


class TorchRouter:
    """What the route op keeps per GPU: the stream choice and, per output (the ids tensor's
    address: one per caller, such as each layer's routing buffer), a moe.Router of its own (so
    callers do not rewrite each other's Launch), the argument slots and the replay record."""

    CALLERS = 64  # (past this many addresses the table starts over: outputs allocated per call
    #                get no replay, and the table does not grow)

    def __init__(self, ordinal: int):
        self.device = router_for(ordinal).device  # (the GPU's kernels fetched once, here)
        self.streams = StreamUse(self.device, ordinal)
        self.callers = {}

    def caller(self, ids) -> tuple:
        """(moe.Router, slots, Replays) of the caller writing into `ids`."""
        key = ids.data_ptr()
        c = self.callers.get(key)
        if c is None:
            if len(self.callers) >= self.CALLERS:
                self.callers.clear()
            c = self.callers[key] = (Router(self.device), {n: TensorSlot(n) for n in ("logits", "ids", "weights")},
                                     Replays())
        return c


_ROUTERS = {}


def torch_router(ordinal: int) -> TorchRouter:
    """The route op's state for cuda:`ordinal`, made on first use (it loads the kernels: make
    it before a graph capture, as TorchMoeLayer does)."""
    r = _ROUTERS.get(ordinal)
    if r is None:
        r = _ROUTERS[ordinal] = TorchRouter(ordinal)
    return r


def route_impl(logits, ids, weights, renormalize=True, stream=-1):
    ordinal = logits.get_device()
    if ordinal < 0:
        raise ValueError(f"logits: must be on a CUDA GPU, got {logits.device}")
    r = torch_router(ordinal)
    s, explicit = r.streams.pick(stream)
    router, slots, replays = r.caller(ids)
    renormalize = bool(renormalize)
    same = slots["logits"].update(logits) & slots["ids"].update(ids) & slots["weights"].update(weights)
    if not (same and replays.replay("route", s, renormalize, r.device)):
        replays.forget("route")
        router(slots["logits"].tensor, slots["ids"].tensor, slots["weights"].tensor, renormalize=renormalize, stream=s)
        replays.record("route", s, renormalize, router.last_issued)
    if explicit:
        r.streams.hold(s, (logits, ids, weights))


IMPLS = {"route": route_impl, "dispatch": dispatch_impl, "combine": combine_impl, "build_index": build_index_impl,
         "gather_rows": gather_rows_impl, "activation": activation_impl, "expert_fc1": expert_fc1_impl,
         "expert_fc2": expert_fc2_impl, "expert_fc2_finalize": expert_fc2_finalize_impl, "finalize": finalize_impl,
         "finalize_fp8": finalize_fp8_impl}


LIB = torch.library.Library("ep_a2a", "DEF")
OPS = register_ops(LIB, SCHEMAS, IMPLS)
_DISPATCH, _COMBINE = OPS["dispatch"], OPS["combine"]


# -- the functions users call -----------------------------------------------------------------------
EAGER_DIRECT = True  # (False: eager calls go through the dispatcher too; the GPU tests run both)
_Tensor, _is_compiling = torch.Tensor, torch.compiler.is_compiling
try:
    _TLS_CHECKS = (torch._C._len_torch_dispatch_stack, torch._C._is_torch_function_mode_enabled,
                   torch._C._are_functorch_transforms_active, torch._C._is_tracing)
except AttributeError:  # (a torch without one of them: every call takes the dispatcher)
    EAGER_DIRECT = False


def plain_eager() -> bool:
    """Whether an eager call may run the implementation without the torch dispatcher (the
    larger part of an eager op's host cost): not under torch.compile / export tracing (is_compiling() comes
    first: dynamo folds it to True and traces nothing after it), no torch_dispatch mode
    (FakeTensorMode, functionalization, make_fx, FlopCounterMode, opcheck's schema check...),
    no torch_function mode, no functorch transform, no torch.jit.trace. With none of these,
    and plain torch.Tensor arguments (checked by the callers: a subclass takes the dispatcher,
    which runs its __torch_dispatch__), the dispatcher would run the same implementation with
    the same tensors (it keeps no autograd record of these ops and bumps no versions). (The
    type tests stay with the callers: inline they cost less than a loop over *args here.)"""
    if not EAGER_DIRECT or _is_compiling():
        return False
    modes, function_modes, functorch, jit_tracing = _TLS_CHECKS
    return not (modes() or function_modes() or functorch() or jit_tracing())


def _all_plain(tensors) -> bool:
    for t in tensors:
        if type(t) is not _Tensor:
            return False
    return True


def _stream_arg(stream) -> int:
    return -1 if stream is None else stream_handle(stream)


def route(logits, ids, weights, renormalize: bool = True, stream=None) -> tuple:
    """moe.route on torch tensors, on torch's current stream (or `stream`): ids int32 and
    weights fp32 [tokens, top_k] written with the top-k experts of logits (fp32 / bf16 / fp16
    [tokens, num_experts <= 1024], contiguous) and their softmax weights; returns (ids, weights)."""
    op = route_impl if plain_eager() and type(logits) is _Tensor and type(ids) is _Tensor and type(weights) is _Tensor \
        else OPS["route"]
    op(logits, ids, weights, bool(renormalize), _stream_arg(stream))
    return ids, weights


def _binding(rank) -> TorchRank:
    return rank if isinstance(rank, TorchRank) else bind(rank)


def dispatch(rank, token_selected_experts, payloads, runtime_max_tokens_per_rank: int, stream=None) -> tuple:
    """RankAlltoAll.dispatch on torch tensors: (expert ids view int32 [ep_size, T^, top_k],
    [payload views [ep_size, T^, ...]]), torch tensors over the workspace, the same ones every
    step with this T^, valid until the next dispatch. rank: a TorchRank (bind()) or a
    RankAlltoAll. stream: None (torch's current stream) or a stream to run on."""
    b = rank if isinstance(rank, TorchRank) else bind(rank)  # (inline: _binding, _stream_arg as calls cost more)
    ids_v, pays_v = b.dispatch_views(runtime_max_tokens_per_rank)
    if type(payloads) not in (list, tuple):
        payloads = list(payloads)
    if plain_eager() and type(token_selected_experts) is _Tensor and _all_plain(payloads):
        run_dispatch(b, token_selected_experts, payloads, runtime_max_tokens_per_rank,
                     -1 if stream is None else stream_handle(stream))
    else:
        b.local_tokens = token_selected_experts.shape[0]  # (here too: torch.compile traces it)
        _DISPATCH(b.handle, token_selected_experts, list(payloads), runtime_max_tokens_per_rank, ids_v, pays_v,
                  _stream_arg(stream))
    return ids_v, pays_v


def combine_input(rank, runtime_max_tokens_per_rank: int, fp8: bool = False):
    """RankAlltoAll.combine_input as torch tensors (made once per T^): [ep_size, T^, hidden],
    or with fp8=True the pair (values e4m3, scales fp32) an FP8 epilogue fills."""
    return _binding(rank).combine_input(runtime_max_tokens_per_rank, fp8)


def combine(rank, partial, runtime_max_tokens_per_rank: int, out=None, stream=None, num_tokens: int = None):
    """RankAlltoAll.combine on torch tensors: out [local tokens, hidden] (a new tensor unless
    `out` is given; rows: num_tokens, default the last dispatch's). partial: combine_input(T^)
    (zero copy), any [ep_size, T^, hidden] tensor (staged), or combine_input(T^, fp8=True).
    An engine that keeps its output buffer passes out= (a slice of it): the allocation of a
    new tensor is a few µs of the call's host time."""
    b = rank if isinstance(rank, TorchRank) else bind(rank)
    scales = None
    if type(partial) in (tuple, list):
        partial, scales = partial
    direct = plain_eager() and type(partial) is _Tensor
    if out is None:
        T = b.local_tokens if num_tokens is None else num_tokens
        if T is None:
            raise StateError(f"rank {b.rank}: combine without a dispatch through these ops before it: "
                             "pass out= or num_tokens=")
        # (eager: new_empty of a tensor with the dtype and device parses two ints, cheaper than
        # torch.empty's keywords; traced code keeps torch.empty, which names them)
        out = b.out_like.new_empty(T, b.hidden) if direct else \
            torch.empty((T, b.hidden), dtype=b.combine_dtype, device=b.device)
    if direct and type(out) is _Tensor:
        run_combine(b, partial, scales, runtime_max_tokens_per_rank, out, -1 if stream is None else stream_handle(stream))
    else:
        dispatched = b.dispatch_views(runtime_max_tokens_per_rank)[0]
        _COMBINE(b.handle, partial, scales, dispatched, runtime_max_tokens_per_rank, out, _stream_arg(stream))
    return out


def expert_index(rank) -> TorchIndex:
    """A TorchIndex for one rank (an ExpertIndex sized for it, with torch views); allocates:
    make it before the first dispatch."""
    b = _binding(rank)
    return TorchIndex(ExpertIndex.for_rank(b.r), b.a2a.combine_dtype.name)


def build_index(index: TorchIndex, expert_ids, weights, stream=None) -> TorchIndex:
    """moe.build_index into `index` (its views for this T^ then hold the result)."""
    runtime_max = int(expert_ids.shape[1]) if expert_ids.dim() == 3 else 0
    rows, w, row_of = index.views(runtime_max)
    if plain_eager() and type(expert_ids) is _Tensor and type(weights) is _Tensor:
        run_build_index(index, expert_ids, weights, _stream_arg(stream))
    else:
        OPS["build_index"](index.handle, expert_ids, weights, index.counts, index.offsets, rows, w, row_of,
                           _stream_arg(stream))
    index.rows, index.row_weight, index.row_of = rows, w, row_of
    return index


def gather_rows(index: TorchIndex, src, out, stream=None) -> None:
    """moe.gather_rows: out[p] = src[rows[p]] for the rows of the last build."""
    op = gather_rows_impl if plain_eager() and type(src) is _Tensor and type(out) is _Tensor else OPS["gather_rows"]
    op(index.handle, index.rows, index.offsets, src, out, _stream_arg(stream))


def activation(index: TorchIndex, fc1_out, out, stream=None) -> None:
    """moe.activation: out[p] = silu(fc1_out[p, :I]) * fc1_out[p, I:] for the rows of the last
    build (p < total, read on the device; rows past it untouched), bitwise torch's eager
    F.silu(gate) * up."""
    op = activation_impl if plain_eager() and type(fc1_out) is _Tensor and type(out) is _Tensor else OPS["activation"]
    op(index.handle, index.offsets, fc1_out, out, _stream_arg(stream))


def expert_fc1(index: TorchIndex, src, w_gate_up, out, stream=None) -> None:
    """moe_experts.expert_fc1: out[p] = silu(gate) * up of FC1 on src[rows[p]] for the rows of the last
    build (gather, FC1 and the activation in one kernel, for decode sizes)."""
    op = expert_fc1_impl if plain_eager() and type(src) is _Tensor and type(w_gate_up) is _Tensor \
        and type(out) is _Tensor else OPS["expert_fc1"]
    op(index.handle, index.rows, index.offsets, src, w_gate_up, out, _stream_arg(stream))


def expert_fc2(index: TorchIndex, act, w_down, out, stream=None, finalize_into=None) -> None:
    """moe_experts.expert_fc2: out[p] = act[p] @ w_down[e].T for the rows of the last build; with
    finalize_into (a bf16 combine_input(T^)), finalize(index, out, finalize_into) in the same kernel."""
    direct = plain_eager() and type(act) is _Tensor and type(w_down) is _Tensor and type(out) is _Tensor
    if finalize_into is None:
        (expert_fc2_impl if direct else OPS["expert_fc2"])(index.handle, index.offsets, act, w_down, out,
                                                            _stream_arg(stream))
    else:
        op = expert_fc2_finalize_impl if direct and type(finalize_into) is _Tensor else OPS["expert_fc2_finalize"]
        op(index.handle, index.offsets, index.row_of, index.row_weight, act, w_down, out, finalize_into,
           _stream_arg(stream))


def finalize(index: TorchIndex, fc2_out, out, stream=None) -> None:
    """moe.finalize into out: combine_input(T^), or the (values, scales) of combine_input(T^, fp8=True)."""
    direct = plain_eager() and type(fc2_out) is _Tensor
    if isinstance(out, (tuple, list)):
        values, scales = out
        op = finalize_fp8_impl if direct and type(values) is _Tensor and type(scales) is _Tensor else OPS["finalize_fp8"]
        op(index.handle, index.row_of, index.row_weight, fc2_out, values, scales, index.combine_dtype,
           _stream_arg(stream))
    else:
        op = finalize_impl if direct and type(out) is _Tensor else OPS["finalize"]
        op(index.handle, index.row_of, index.row_weight, fc2_out, out, _stream_arg(stream))


# the send and receive halves (ops/torch_halves.py: they register beside the whole ops)
from .torch_halves import combine_recv, combine_send, dispatch_recv, dispatch_send  # noqa: E402,F401
