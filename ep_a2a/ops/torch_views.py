"""What the torch ops keep per rank and per expert index: torch tensors over the workspace
views (made once per T^, one DLPack exchange each, never per call), the argument slots
that turn torch tensors into ep_a2a Tensors without DLPack (interop/torch_tensor.py), the
stream choice, and the keep-alive of inputs used on a stream other than the current one.

A binding is registered under an int handle that never repeats in the process: the ops'
schemas carry that int (torch.library arguments are tensors and scalars), and a compiled
graph or a captured CUDA graph keeps calling the rank it was built for. Bindings live
until release() (or the end of the process): a closed all-to-all's binding raises the
all-to-all's own StateError when used.
"""
from __future__ import annotations

import collections
import itertools

import torch

from ..driver.stream import Event
from ..interop.torch_tensor import TensorSlot, torch_view
from ..moe import ExpertIndex
from ..validate import check_runtime_max

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (absent from CPU-only builds)
_HANDLES = itertools.count(1)
RANKS = {}     # handle -> TorchRank
INDEXES = {}   # handle -> TorchIndex
_BOUND = {}    # id(RankAlltoAll) -> its TorchRank (the binding keeps the rank alive, so ids stay unique)


def _current_stream_object(ordinal: int) -> int:
    return torch.cuda.current_stream(ordinal).cuda_stream


# torch's current stream on cuda:`ordinal` as a raw handle (building a torch.cuda.Stream object
# to read it, the fallback where torch lacks the raw accessor, costs an order of magnitude more)
current_stream_handle = _raw_stream if _raw_stream is not None else _current_stream_object


def lookup(table: dict, handle: int, what: str):
    b = table.get(handle)
    if b is None:
        raise ValueError(f"{what}: no ep_a2a torch binding has handle {handle!r} (make one with "
                         f"ep_a2a.ops.torch.{'bind' if table is RANKS else 'expert_index'}(); released ones stay gone)")
    return b


class StreamUse:
    """The stream a call runs on: torch's current one (nothing to order: the inputs were made
    there and the caching allocator reuses their memory only after work queued there), or an
    explicit one, which first waits for the current stream; the inputs are then held until an
    event recorded after the kernels has completed (polled at later calls), because a block
    freed by the caller would otherwise be reused on the current stream while our kernels
    still read it there. No record_stream: it records events on that stream when the tensor
    is freed, and in-process ranks' streams may be destroyed by then."""

    def __init__(self, device, ordinal: int):
        self.device, self.ordinal = device, ordinal
        self.fork = None                 # our event: the explicit stream waits on it
        self.held = collections.deque()  # (torch event, tensors) in launch order
        self.spare = []
        self.streams = {}                # handle -> torch ExternalStream (made once)

    def pick(self, stream: int) -> tuple:
        """(handle to launch on, whether it is an explicit other stream)."""
        cur = current_stream_handle(self.ordinal)
        if stream == -1 or stream == cur:
            return cur, False
        if self.fork is None:
            self.fork = Event(self.device)
        self.fork.record(cur).wait_on(stream)
        return stream, True

    def hold(self, stream: int, tensors) -> None:
        if torch.cuda.is_current_stream_capturing():
            return  # a graph's memory is its own pool, alive with the graph; no event query in a capture
        while self.held and self.held[0][0].query():
            self.spare.append(self.held.popleft()[0])
        ext = self.streams.get(stream)
        if ext is None:
            ext = self.streams[stream] = torch.cuda.ExternalStream(stream, device=torch.device("cuda", self.ordinal))
        ev = self.spare.pop() if self.spare else torch.cuda.Event()
        ev.record(ext)
        self.held.append((ev, tuple(tensors)))


class TorchRank:
    """The torch side of one rank of a MoeAlltoAll (ep_a2a.ops.torch.bind makes it).

    validate_expert_ids: False (default): the ids are not read on the host; ids out of
    0..num_experts-1 (and not -1) are dropped by the kernel. True: every eager dispatch
    copies them to the host and raises naming the first bad one (a host synchronization
    per call, skipped under graph capture). The rank's own host check is turned off
    (r.validate_expert_ids = False): the torch path decides for itself.
    """

    def __init__(self, rank_a2a, validate_expert_ids: bool = False):
        r = self.r = rank_a2a
        a = self.a2a = rank_a2a.a2a
        self.ordinal = r.device.ordinal
        self.device = torch.device("cuda", self.ordinal)
        self.validate_expert_ids = bool(validate_expert_ids)
        r.validate_expert_ids = False
        self.hidden, self.combine_dtype = a.combine_hidden_size, torch_dtype_of(a.combine_dtype.name)
        self.out_like = torch.empty(0, dtype=self.combine_dtype, device=self.device)  # (combine's new outputs: new_empty)
        self.ids_slot = TensorSlot("token_selected_experts")
        self.payload_slots = [TensorSlot(f"payloads[{q}] ({s.name})") for q, s in enumerate(a.payload_specs)]
        self.partial_slot, self.out_slot = TensorSlot("partial"), TensorSlot("out")
        self.streams = StreamUse(r.device, self.ordinal)
        self.local_tokens = None  # tokens of the last dispatch (combine's default output rows)
        self.half_out = None      # the torch output of the combine send half in flight (ops/torch_halves.py)
        # The all-to-all's repeat records (RankAlltoAll.last_repeats) as our last call of each
        # phase left them, with the partial it was given: a call handing the same objects,
        # none of whose fields an update changed, repeats it without the geometry compare
        # (dispatch_same). None while a call runs: one that fails leaves none.
        self.vouched_dispatch, self.vouched_combine = None, (None, None)
        self._dispatch, self._combine, self._fp8 = {}, {}, {}
        self.handle = next(_HANDLES)
        RANKS[self.handle] = self

    @property
    def rank(self) -> int:
        return self.r.rank

    # -- workspace views, torch tensors made once per T^ --------------------------------------------
    def dispatch_views(self, tmax: int) -> tuple:
        """(expert ids int32 [ep_size, T^, top_k], [payloads [ep_size, T^, ...]]): where dispatch
        delivers; the same torch tensors every step with this T^."""
        v = self._dispatch.get(tmax)
        if v is None:
            check_runtime_max(tmax, self.a2a.max_tokens_per_rank)
            ids, pays = self.r.dispatch_views(tmax)
            v = self._dispatch[tmax] = (torch_view(ids), [torch_view(p) for p in pays])
        return v

    def combine_input(self, tmax: int, fp8: bool = False):
        """[ep_size, T^, hidden] of the combine dtype: where the MoE writes its partial
        results. fp8=True (combine_quant="fp8"): (values e4m3 [ep_size, T^, hidden], scales
        fp32 [ep_size, T^, hidden / 128]), which finalize fills and combine reads as they are."""
        if fp8:
            v = self._fp8.get(tmax)
            if v is None:
                part = self.r.combine_input(tmax, fp8=True)
                v = self._fp8[tmax] = ((torch_view(part.values), torch_view(part.scales)), part)
            return v[0]
        v = self._combine.get(tmax)
        if v is None:
            t = self.r.combine_input(tmax)
            v = self._combine[tmax] = (torch_view(t), t)
        return v[0]

    def prepare(self, runtime_max_values) -> "TorchRank":
        """Make the views of every T^ given now (torch.compile traces only cached views)."""
        for t in runtime_max_values:
            self.dispatch_views(t)
            self.combine_input(t)
            if self.a2a.combine_quant == "fp8":
                self.combine_input(t, fp8=True)
        return self

    # -- what the op implementations use ---------------------------------------------------------
    def dispatch_args(self, token_selected_experts, payloads) -> tuple:
        """(ids, [payloads], same) as the all-to-all takes them: this rank's slots rewritten from
        the torch tensors, in one frame; same: no slot changed (TensorSlot.update). A payload
        count other than the rank's goes on as it is given (the all-to-all names the count it
        expects)."""
        ids_slot, slots = self.ids_slot, self.payload_slots
        n = len(payloads)
        if n != len(slots):
            return ids_slot.fill(token_selected_experts), [
                (slots[q] if q < len(slots) else TensorSlot(f"payloads[{q}]"))(t) for q, t in enumerate(payloads)], False
        # (straight calls for the usual count, cheaper than a loop over two payloads; `&`, not
        # `and`: every slot is filled)
        if n == 2:
            same = ids_slot.update(token_selected_experts) & slots[0].update(payloads[0]) & slots[1].update(payloads[1])
            return ids_slot.tensor, [slots[0].tensor, slots[1].tensor], same
        same = ids_slot.update(token_selected_experts)
        for slot, t in zip(slots, payloads):
            same &= slot.update(t)
        return ids_slot.tensor, [slot.tensor for slot in slots], same

    def partial_arg(self, partial, scales, tmax: int) -> tuple:
        """(combine's partial as the all-to-all takes it, same): this rank's own workspace view
        when `partial` is the torch combine_input(T^) (zero copy, and the same Tensor object
        every step; the view object itself is checked by its address alone: changing its shape
        or strides in place is not supported), an FP8 input only as this rank's own views, else
        a slot (staged by combine). same: the object returned has the geometry it had at
        the last call that returned it (TensorSlot.update), and the view no stream to wait for."""
        if scales is not None:
            got = self._fp8.get(tmax)
            if got is None or partial.data_ptr() != got[1].values.ptr or scales.data_ptr() != got[1].scales.ptr:
                raise ValueError(f"partial: an FP8 combine input must be this rank's combine_input({tmax}, fp8=True) "
                                 "(values and scales, as that call returned them)")
            return got[1], True
        own = self._combine.get(tmax)
        if own is not None:
            ptr = partial.data_ptr()
            if ptr == own[1].ptr and (partial is own[0] or (partial.shape == own[0].shape
                                                           and partial.dtype == own[0].dtype and partial.is_contiguous())):
                # (the view itself, as combine_input made it: only set_ could have moved it; the
                # all-to-all hands that Tensor to any caller, so its stream field is its own)
                return own[1], own[1].stream is None
        same = self.partial_slot.update(partial)
        return self.partial_slot.tensor, same

    def release(self) -> None:
        RANKS.pop(self.handle, None)
        _BOUND.pop(id(self.r), None)


class Replays:
    """The last full call of each MoE op on one launch owner (an ExpertIndex or a moe.Router):
    the stream, the owner state it depended on and the Launches it issued with their stamps.
    A call whose tensors all sit where that call's did (its slots unchanged) relaunches them
    as they were, skipping moe.*'s checks and argument packing (which cost several times the
    launch), unless a stamp moved: some other call rewrote that Launch since. An op forgets
    its record before a full call, so that one failing after its slots took new tensors
    leaves nothing to replay for them."""

    __slots__ = ("records",)

    def __init__(self):
        self.records = {}

    def replay(self, op: str, stream: int, state, device) -> bool:
        rec = self.records.get(op)
        if rec is None or rec[0] != stream or rec[1] != state:
            return False
        for launch, stamp in rec[2]:
            if launch.stamp != stamp:
                return False
        device.make_current()
        for launch, _ in rec[2]:
            launch(stream)
        return True

    def forget(self, op: str) -> None:
        self.records.pop(op, None)

    def record(self, op: str, stream: int, state, issued) -> None:
        self.records[op] = (stream, state, tuple((launch, launch.stamp) for launch in issued))


# The tensor arguments of each MoE op, named as its errors name them: one TensorSlot each per index.
INDEX_SLOTS = {"build_index": ("expert_ids", "weights"), "gather_rows": ("src", "out"),
               "activation": ("fc1_out", "out"), "expert_fc1": ("src", "w_gate_up", "out"),
               "expert_fc2": ("act", "w_down", "out"), "expert_fc2_finalize": ("act", "w_down", "out", "finalize_into"),
               "finalize": ("fc2_out", "out"), "finalize_fp8": ("fc2_out", "values", "scales")}


class TorchIndex:
    """An ExpertIndex with torch tensors over its buffers, for the torch MoE ops
    (ep_a2a.ops.torch.expert_index makes it). counts, offsets: int32 [local experts (+1)];
    for the T^ of the last build, rows, row_weight [capacity] and row_of [ep_size * T^, top_k]."""

    def __init__(self, index: ExpertIndex, combine_dtype: str = None):
        self.index, self.combine_dtype = index, combine_dtype
        self.ordinal = index.device.ordinal
        self.device = torch.device("cuda", self.ordinal)
        self.counts, self.offsets = torch_view(index.counts), torch_view(index.offsets)
        rows, w, row_of = (torch_view(t) for t in (index.rows, index.row_weight, index.row_of))
        self._full = (rows, w, row_of.view(-1))   # made at max_tokens_per_rank: every T^ is a prefix
        self._by_tmax = {}
        # one slot per op and argument position, so that an unchanged slot means "as at this op's
        # last call" (Replays); each named as the argument its errors name
        self.slots = {f"{op}.{n}": TensorSlot(n) for op, names in INDEX_SLOTS.items() for n in names}
        self.replays = Replays()
        self.streams = StreamUse(index.device, self.ordinal)
        self.rows = self.row_weight = self.row_of = None
        self.handle = next(_HANDLES)
        INDEXES[self.handle] = self

    def views(self, tmax: int) -> tuple:
        """(rows, row_weight, row_of) torch views for T^ = tmax (made once per T^)."""
        v = self._by_tmax.get(tmax)
        if v is None:
            ix = self.index
            require_tmax(tmax, ix.max_tokens_per_rank)
            cap = ix.ep_size * tmax * ix.top_k
            rows, w, row_of = self._full
            v = self._by_tmax[tmax] = (rows[:cap], w[:cap], row_of[:cap].view(ix.ep_size * tmax, ix.top_k))
        return v

    def release(self) -> None:
        INDEXES.pop(self.handle, None)


def require_tmax(tmax, most: int) -> None:
    if not (type(tmax) is int and 1 <= tmax <= most):
        raise ValueError(f"expert_ids: T^ must be in 1..max_tokens_per_rank={most}, got {tmax!r}")


def torch_dtype_of(name: str):
    from ..interop.torch_tensor import torch_dtype
    return torch_dtype(name)


def bind(rank_a2a, validate_expert_ids: bool = None) -> TorchRank:
    """The TorchRank of a RankAlltoAll (a2a.ranks[i]), made on first use; validate_expert_ids
    given later changes it (None keeps it)."""
    b = _BOUND.get(id(rank_a2a))
    if b is None or b.r is not rank_a2a:
        b = _BOUND[id(rank_a2a)] = TorchRank(rank_a2a, bool(validate_expert_ids))
    elif validate_expert_ids is not None:
        b.validate_expert_ids = bool(validate_expert_ids)
    return b


def _fake(*args, **kwargs):
    """Every ep_a2a op only writes its mutated arguments: under fake tensors there is nothing to do."""
    return None


def register_ops(lib, schemas: dict, impls: dict) -> dict:
    """Define `schemas` in `lib`, each with its implementation for CUDA and CPU tensors and the
    fake one; the OpOverloads by name (the cheapest handle to call)."""
    for name, schema in schemas.items():
        lib.define(schema)
        for key in ("CUDA", "CPU"):
            lib.impl(name, impls[name], key)
        torch.library.register_fake(f"ep_a2a::{name}", _fake, lib=lib)
    return {name: getattr(torch.ops.ep_a2a, name).default for name in schemas}

