"""The public all-to-all: dispatch and combine over a symmetric workspace (NVLinkOneSided).

    group = ep_a2a.LocalGroup([0] * 8)                 # or ProcessGroup(bootstrap, device)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=256, top_k=8, num_experts=256,
                             payloads=[ep_a2a.PayloadSpec("hidden", (7168,), "bfloat16")],
                             combine_hidden_size=7168)
    r = a2a.ranks[0]                                    # one per rank living in this process
    ids, (hidden,) = r.dispatch(topk_ids, [x], runtime_max_tokens_per_rank=T_hat)
    r.combine_input(T_hat)   # [ep_size, T_hat, hidden] in the workspace: the MoE writes here
    y = r.combine(partial, T_hat)                       # [local_num_tokens, hidden]
"""
from __future__ import annotations

import ctypes
import dataclasses
import zlib

import numpy as np

from . import rejection, schedule
from .config import PROTOCOLS, Fp8Partial, Options, PayloadSpec  # noqa: F401 (PayloadSpec: re-exported)
from .driver.errors import CudaError
from .driver.lifetime import Owned
from .driver.launch import launch_once
from .driver.memory import DeviceAllocation, copy_dtod_async, copy_dtoh, memset_d8_async, release_held
from .driver.module import load
from .driver.stream import is_capturing, stream_handle
from .driver.vmm import HostMapped
from .errors import StateError, error_from_record, error_from_records, recorded_on_lost_context
from .fastpath import Repeat
from .group import hold_frees_for, release_frees_if_safe
from .halves import Halves
from .interop.tensor import CUDA, Tensor, as_dtype as lookup_dtype
from .layout import ErrorRecord, Q8_BLOCK, TAG_TMAX_BITS, WorkspaceLayout, landing_bytes
from .rank_plan import build_plan
from .schedule import COMBINE, DISPATCH, Call, StepState, check_order, plan_step
from .symmetric import SymmetricWorkspace
from .validate import (CheckedInputs, check_bool, check_choice, check_combine_runtime_max, check_dispatch_inputs,
                       check_expert_ids_on_host, check_fp8_partial, check_partial_shape, check_runtime_max, require)

def _one_rank(name: str):
    """MoeAlltoAll.<name> of a process with one rank: that rank's method."""
    def call(self, *args, **kw):
        return getattr(self._only(), name)(*args, **kw)
    call.__name__, call.__qualname__ = name, f"MoeAlltoAll.{name}"
    call.__doc__ = f"RankAlltoAll.{name} of this process's one rank."
    return call


def _between_steps(a2a, what: str) -> None:
    for rank in a2a.ranks:
        if rank.mid_step:
            raise StateError(f"rank {rank.rank}: {what} between dispatch and combine")


class MoeAlltoAll(Owned):
    """Dispatch/combine for every rank of `group` that lives in this process (built collectively).

    The options are keywords after the group (max_tokens_per_rank, top_k, num_experts,
    combine_hidden_size; payloads, protocol, combine_quant, ... with defaults): config.Options
    defines and documents them, and gives this __init__ its signature. Every option reads
    back as an attribute (a2a.top_k); `protocol` is the setting now (use_protocol).
    """
    _kind = "alltoalls"
    # (the names the ranks, tools and engines read some options and derived values by)
    _ALIASES = {"threads": "threads_per_block", "payload_specs": "payloads", "built_protocol": "protocol",
                "kinds": "payload_kinds"}

    def __init__(self, group, **given):
        options = self.options = Options.check(group, **given)
        self.group, self.protocol, self.active_ranks = group, options.protocol, tuple(range(options.ep_size))
        if not group.is_local:
            group.agree(options.agreement(), "MoeAlltoAll arguments")
        pbytes = options.payload_bytes
        self.layout = WorkspaceLayout.build(options.ep_size, options.max_tokens_per_rank, options.top_k, pbytes,
                                            options.combine_hidden_size * options.combine_dtype.itemsize,
                                            sentinel=options.protocol != "fence",
                                            landing=tuple(landing_bytes(nbytes, kind)
                                                          for nbytes, kind in zip(pbytes, options.payload_kinds)),
                                            q8_hidden=options.combine_hidden_size if options.combine_quant else 0)
        self.workspace = SymmetricWorkspace(group, self.layout.size)
        self.ranks = []
        # several ranks driven by this process spin on each other: no cuMemFree between
        # their launches (group.hold_frees_for)
        self._unhold = hold_frees_for(self) if group.is_local and len(group.ranks) > 1 else None
        self._opened()  # from here a failure closes what was made
        try:
            for index, rank in enumerate(group.ranks):
                rank.device.make_current()
                memset_d8_async(self.workspace.base(index), 0, self.workspace.size, rank.stream.handle)
                fill = load("util", rank.device).function("ep_fill_u32")
                for off, nbytes, word in self.layout.sentinel_ranges():
                    launch_once(rank.device, fill, [ctypes.c_uint64(self.workspace.base(index) + off),
                                                 ctypes.c_uint64(nbytes // 4), ctypes.c_uint32(word)],
                                min(1024, max(1, nbytes // 4096)), 256, rank.stream.handle)
                rank.stream.synchronize()
            # no peer may write into a workspace before its owner has cleared it
            if not group.is_local:
                group.bootstrap.barrier()
            self.ranks = [RankAlltoAll(self, index, rank) for index, rank in enumerate(group.ranks)]
        except BaseException:
            self.close()
            raise

    __init__.__signature__ = Options.signature()

    def __getattr__(self, name):  # (every option reads back as an attribute: a2a.top_k)
        options, name = self.__dict__.get("options"), self._ALIASES.get(name, name)
        if options is None or name.startswith("_") or not hasattr(options, name):
            raise AttributeError(f"'MoeAlltoAll' object has no attribute {name!r}")
        return getattr(options, name)

    def _only(self) -> "RankAlltoAll":
        if len(self.ranks) != 1:
            raise StateError(f"this process holds {len(self.ranks)} ranks: call a2a.ranks[i].dispatch/combine")
        return self.ranks[0]

    dispatch, combine, combine_input = _one_rank("dispatch"), _one_rank("combine"), _one_rank("combine_input")
    dispatch_send, combine_send = _one_rank("dispatch_send"), _one_rank("combine_send")

    def protocol_for(self, runtime_max_tokens_per_rank: int) -> str:
        """The protocol a step with this T^ uses (the same on every rank: T^ is shared)."""
        return schedule.protocol_for(self.protocol, runtime_max_tokens_per_rank, self.crossover_tokens)

    def use_protocol(self, protocol: str) -> None:
        """Switch the protocol of the following steps: one built with protocol="auto" has both
        protocols' workspace and kernels and may switch among "fence", "sentinel" and "auto";
        one built with a single protocol keeps it. Collective: every rank switches between
        the same two steps."""
        built = PROTOCOLS if self.built_protocol == "auto" else (self.built_protocol,)
        require(check_choice(protocol, "protocol", PROTOCOLS) in built, "protocol",
                f"must be one of {built} for an all-to-all built with protocol={self.built_protocol!r}, got {protocol!r}")
        _between_steps(self, "use_protocol")
        self.protocol = protocol

    def set_active_ranks(self, ranks) -> None:
        """Go on without failed ranks: from the next step no kernel waits on a rank outside
        `ranks`, and selections of its experts are dropped (counted by dropped_selections()).

        Collective over the surviving ranks: every active rank must call it, with the same
        set, between the same two steps (a rank that disagrees makes its peers' next step
        fail with ActiveRanksMismatchError; the check uses 8 bits of the set's hash, so 1 in
        256 differing sets is missed and ends as a timeout). Ranks can only be removed; to add
        one back, build a new all-to-all. An inactive rank of this process may not dispatch.
        """
        new = tuple(sorted({int(rank) for rank in ranks}))
        require(bool(new) and all(0 <= rank < self.ep_size for rank in new), "ranks",
                 f"must be a non-empty set of ranks in 0..{self.ep_size - 1}, got {ranks!r}")
        require(set(new) <= set(self.active_ranks), "ranks",
                 f"can only remove ranks (active now: {list(self.active_ranks)}); rebuild to add {sorted(set(new) - set(self.active_ranks))}")
        _between_steps(self, "set_active_ranks")
        self.active_ranks = new
        for rank in self.ranks:
            rank._set_active(new)

    def synchronize(self) -> None:
        """Wait for every rank of this process; raise the PeerError a kernel recorded, if any."""
        for rank in self.ranks:
            rank.synchronize()
        try:
            release_held()
        except CudaError as e:  # (a lost context: the recorded PeerError names the cause)
            if self.ranks:
                self.ranks[0].raise_recorded(e)
            raise

    def check_errors(self) -> None:
        """Raise the PeerError a kernel of this process recorded, if any."""
        for rank in self.ranks:
            rank.raise_recorded()

    def error(self):
        """The PeerError a kernel of this process recorded, or None: a cheap poll (host-mapped
        memory, no driver call) for an engine replaying CUDA graphs, after each synchronize."""
        return next((err for err in (rank.recorded_error() for rank in self.ranks) if err is not None), None)

    workspace_bytes_per_rank = property(lambda self: self.workspace.size, doc="Bytes of symmetric memory each rank holds.")

    def _release(self) -> None:
        """Every part is released even when one fails (a lost context): the first error is raised."""
        first = None
        for part in [*self.ranks, self.workspace]:
            try:
                part.close()
            except BaseException as err:
                first = first or err
        self.ranks, self.workspace = [], None
        if self._unhold is not None:
            self._unhold()  # hold_frees(False), once
        if first is not None:
            raise first


class RankAlltoAll:
    """Dispatch and combine of one rank: a fixed plan (schedule.RankPlan), the planner's state
    (schedule.StepState) and the objects handed back to the caller."""

    def __init__(self, a2a: MoeAlltoAll, index: int, rank):
        self.a2a, self.index, self.rank, self.device = a2a, index, rank.rank, rank.device
        self.default_stream, self.ranks_on_device = rank.stream.handle, rank.ranks_on_device  # (GPU shared: grids)
        self.base = a2a.workspace.base(index)
        self.record_page = HostMapped(ctypes.sizeof(ErrorRecord), self.device)  # where kernels write failures
        self.record = ErrorRecord.from_address(self.record_page.host_ptr)
        self.plan = build_plan(a2a, index, rank, self.record_page.device_ptr)
        self.params, self.schedule, self.max_grid = self.plan.params, self.plan.schedule, self.plan.max_grid
        self.state = StepState(quantizing_combine=a2a.combine_quant == "fp8")
        self._memo = {}                # (StepState, Call) -> Step: the planner's results
        self._applied = {}             # operation -> (state, call, Step) whose fields the parameter block holds
        self._set_active(a2a.active_ranks)
        self.last_protocol = next(iter(self.plan.launches))
        self.steps = 0
        self._out = DeviceAllocation(self.device, a2a.max_tokens_per_rank * a2a.layout.combine_bytes)
        self._views = {}               # runtime max -> cached workspace views (no per-call objects)
        self._out_views = {}           # T -> [T, hidden] view of the internal combine output
        self._fp8_inputs = {}          # T^ -> (its Fp8Partial, the (ptr, shape, dtype) each view must keep)
        self._combine_inputs = {}      # T^ -> combine_input(T^): one object, so a step passing it repeats the last
        self._input = CheckedInputs(self.device.ordinal, a2a.max_tokens_per_rank)  # remembers what it checked
        self.validate_expert_ids = a2a.validate_expert_ids  # per rank: the torch ops (ops/torch.py) check their own way
        self._repeat_dispatch = self._repeat_combine = None  # the last call of each phase, when it may be repeated cheaply
        self._payload_names = [f"payloads[{q}] ({spec.name})" for q, spec in enumerate(a2a.payload_specs)]
        self._payload_shapes = [tuple(spec.shape) for spec in a2a.payload_specs]
        self._tells_peers, self.rejected = not a2a.group.is_local and a2a.ep_size > 1, None  # (rejection.py)
        self.halves = Halves(self)

    def _set_active(self, ranks) -> None:
        words = [0] * len(self.params.active)
        for peer in ranks:
            words[peer >> 5] |= 1 << (peer & 31)
        self.params.active[:] = words
        # 8 bits of the mask's hash ride above T^ in the step tag peers compare (bit 31 stays
        # clear: it marks a rejecting rank's tag, layout.TAG_REJECT)
        tag_hi = (zlib.crc32(np.array(words, np.uint32).tobytes()) & 0xFF) << TAG_TMAX_BITS
        self.state = dataclasses.replace(self.state, tag_hi=tag_hi)
        self.is_active = self.rank in ranks

    @recorded_on_lost_context
    def dropped_selections(self) -> int:
        """Selections this rank dropped since it was built because their expert's rank was
        inactive (set_active_ranks). Synchronizes this rank's GPU."""
        self.check_open()
        self.synchronize()
        dropped = np.zeros(1, np.uint32)
        copy_dtoh(dropped.ctypes.data, self.base + self.a2a.layout.off_dropped, 4)
        return int(dropped[0])

    # -- views into the workspace ------------------------------------------------------
    def _view(self, offset: int, shape, dtype, stream) -> Tensor:
        return Tensor(self.base + offset, tuple(shape), lookup_dtype(dtype), device=(CUDA, self.device.ordinal),
                      owner=self, stream=stream)

    def dispatch_views(self, runtime_max: int):
        """(expert ids [ep, T^, top_k], [payload views [ep, T^, *shape]]) for runtime max T^."""
        a2a, layout = self.a2a, self.a2a.layout
        ids = self._view(layout.off_recv[0], (a2a.ep_size, runtime_max, a2a.top_k), "int32", None)
        views = [self._view(layout.off_recv[index + 1], (a2a.ep_size, runtime_max) + tuple(spec.shape), spec.dtype, None)
                 for index, spec in enumerate(a2a.payload_specs)]
        return ids, views

    @recorded_on_lost_context
    def combine_input(self, runtime_max_tokens_per_rank: int, fp8: bool = False):
        """Where the MoE writes its partial results for combine: [ep_size, T^, hidden], the same
        Tensor at every call with this T^ (so a combine handed it repeats: fastpath.py).

        fp8=True (combine_quant="fp8" only): an Fp8Partial, the e4m3 values and per-128 scales
        that combine would quantize the partial results into; an epilogue that writes them
        itself (moe.finalize) spares combine that pass and the bf16 round trip through HBM.
        """
        a2a = self.a2a
        self.check_open()
        check_runtime_max(runtime_max_tokens_per_rank, a2a.max_tokens_per_rank)
        runtime_max = int(runtime_max_tokens_per_rank)
        if check_bool(fp8, "fp8"):
            if a2a.combine_quant != "fp8":
                raise ValueError(f"fp8: an FP8 combine input needs combine_quant='fp8' (this all-to-all has "
                                 f"combine_quant={a2a.combine_quant!r})")
            return self._fp8_input(runtime_max)[0]
        got = self._combine_inputs.get(runtime_max)
        if got is None:
            shape = (a2a.ep_size, runtime_max, a2a.combine_hidden_size)
            got = self._view(a2a.layout.off_combine, shape, a2a.combine_dtype.name, None)
            self._combine_inputs[runtime_max] = got
        return got

    # -- the two phases -------------------------------------------------------------------
    @recorded_on_lost_context
    def dispatch(self, token_selected_experts, payloads=(), runtime_max_tokens_per_rank: int = None, stream=None):
        """Push this rank's tokens to the ranks owning their experts.

        token_selected_experts: int32 [local_num_tokens, top_k] on this rank's GPU (-1 = none).
        payloads: one tensor [local_num_tokens, *spec.shape] of spec.dtype per PayloadSpec.
        Returns (expert ids view [ep_size, T^, top_k], [payload views [ep_size, T^, ...]]):
        slot j of region s holds the j-th token source s sent here; slots past its count
        carry expert id -1. The views stay valid until the next dispatch.
        """
        self.check_open()
        if self.state.pending is not None:
            raise StateError(f"rank {self.rank}: dispatch called twice without combine")
        if not self.is_active:
            raise StateError(f"rank {self.rank}: not an active rank (set_active_ranks({list(self.a2a.active_ranks)}))")
        rep = self._repeat_dispatch  # an engine's steady state: the same call as the last one
        again = rep is not None and rep.matches(token_selected_experts, payloads, runtime_max_tokens_per_rank, stream)
        return self._dispatch_or_reject(rep if again else None, token_selected_experts, payloads,
                                        runtime_max_tokens_per_rank, stream)

    def _dispatch_or_reject(self, repeat, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream):
        """dispatch() after its state checks: the repeat of the last call (`repeat`: its host
        id check may still reject) or the full path; a rejection runs the step without tokens."""
        try:
            if repeat is not None:
                repeat.order_producers()  # (framework tensors: what their DLPack exchange ordered)
                if self.validate_expert_ids and repeat.call.tokens and not is_capturing(repeat.handle):
                    check_expert_ids_on_host(repeat.first or token_selected_experts, repeat.handle, self.a2a.num_experts)
                call = repeat.call
                if call.protocol != self.a2a.protocol:  # (use_protocol since: the same call under the new setting)
                    call = dataclasses.replace(call, protocol=self.a2a.protocol)
                return self._dispatched(call, repeat.handle, repeat.extra)
            return self._dispatch_checked(token_selected_experts, payloads, runtime_max_tokens_per_rank, stream)
        except (TypeError, ValueError) as e:
            self.reject_step(runtime_max_tokens_per_rank, stream, e)
            raise

    def _dispatch_checked(self, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream):
        call, handle, views = self.dispatch_call(token_selected_experts, payloads, runtime_max_tokens_per_rank, stream)
        views = self._dispatched(call, handle, views)
        self._repeat_dispatch = Repeat.of(stream, int(runtime_max_tokens_per_rank), [token_selected_experts, *payloads], handle, call, views)
        return views

    def dispatch_call(self, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream):
        """(the planner's Call, the stream handle, the views) of a dispatch with these
        arguments, checked; nothing is launched (dispatch and halves.dispatch_send launch it)."""
        a2a = self.a2a
        check_runtime_max(runtime_max_tokens_per_rank, a2a.max_tokens_per_rank)
        runtime_max = int(runtime_max_tokens_per_rank)  # (a NumPy integer would keep its width in the arithmetic below)
        handle = self.default_stream if stream is None else stream_handle(stream)
        ids = self._input(token_selected_experts, "token_selected_experts", (a2a.top_k,), "int32", None, handle)
        tokens = ids.shape[0]
        check_dispatch_inputs(tokens, runtime_max, payloads, a2a.payload_specs)
        ins = [self._input(tensor, name, shape, spec.dtype, tokens, handle)
               for tensor, spec, name, shape in zip(payloads, a2a.payload_specs, self._payload_names,
                                                    self._payload_shapes)]
        if self.validate_expert_ids and tokens and not is_capturing(handle):  # (a capture cannot sync)
            check_expert_ids_on_host(ids, handle, a2a.num_experts)
        call = Call(DISPATCH, tokens, runtime_max, a2a.protocol, tuple(tensor.ptr for tensor in (ids, *ins)))
        views = self._views.get(runtime_max)
        if views is None:
            views = self._views[runtime_max] = self.dispatch_views(runtime_max)
        return call, handle, views

    def _dispatched(self, call, handle, views):
        """Launch a planned dispatch; hand its views to the consumers of `handle`'s stream."""
        self._run(call, handle)
        self.steps += 1
        for view in (views[0], *views[1]):
            view.stream = handle  # consumers on other streams wait for this dispatch (DLPack)
        return views

    def _run(self, call, handle) -> None:
        """Plan `call` (the memo first), write what the plan changed, launch."""
        op, state = call.phase.op, self.state
        last = self._applied.get(op)  # (state, call, step) of this operation's last launch
        if last is not None and last[0] is state and last[1] is call:
            step = last[2]  # (an engine's steady state: the very objects of the last call, no hashing)
        else:
            step = self._memo.get((state, call))
            if step is None:
                if len(self._memo) >= 256:  # (sizes an engine cycles through stay; a sweep does not grow it)
                    self._memo.clear()
                step = self._memo[(state, call)] = plan_step(self.plan, state, call)
            if last is None or last[2] is not step:  # (only this operation's steps write its fields)
                self.plan.apply(step)
            self._applied[op] = (state, call, step)
        self.params.trigger_early = step.trigger_early
        self.device.make_current()
        step.launch(handle)
        self.state, self.last_protocol = step.state, step.protocol

    # -- the halves (halves.py) -------------------------------------------------------------
    def dispatch_send(self, token_selected_experts, payloads=(), runtime_max_tokens_per_rank: int = None, stream=None):
        """dispatch()'s send half (halves.py); returns a Handle whose receive() returns the views."""
        return self.halves.dispatch_send(token_selected_experts, payloads, runtime_max_tokens_per_rank, stream)

    def dispatch_recv(self, handle=None):
        """The receive half of the dispatch send half due (or of `handle`): dispatch()'s views."""
        return self.halves.receive("dispatch", handle)

    def combine_send(self, partial, runtime_max_tokens_per_rank: int = None, stream=None, out=None):
        """combine()'s send half (halves.py); returns a Handle whose receive() returns the output."""
        return self.halves.combine_send(partial, runtime_max_tokens_per_rank, stream, out)

    def combine_recv(self, handle=None):
        """The receive half of the combine send half due (or of `handle`): combine()'s output."""
        return self.halves.receive("combine", handle)

    def run_half(self, call, handle) -> None:
        """Plan and launch a half (halves.py has checked its arguments and order)."""
        self._run(call, handle)
        self.steps += call.phase == schedule.DISPATCH_SEND

    @property
    def mid_step(self) -> bool:
        """This rank has dispatched and not yet combined."""
        return self.state.pending is not None

    def forget_dispatch(self) -> None:
        """(testing.hooks.abandon_dispatch, which says when this is safe) No combine follows the last dispatch."""
        self.state = dataclasses.replace(self.state, pending=None)

    @recorded_on_lost_context
    def dispatch_records(self, num_tokens: int) -> Tensor:
        """The (target rank, slot) record (layout.record_target / record_slot) the last dispatch left
        for combine: int32 [num_tokens, top_k], -1 where a selection has no slot; until the next dispatch."""
        self.check_open()
        most = self.a2a.max_tokens_per_rank
        if not (type(num_tokens) is int and 0 <= num_tokens <= most):
            raise ValueError(f"num_tokens: must be an int in 0..{most}, got {num_tokens!r}")
        return self._view(self.a2a.layout.off_records, (num_tokens, self.a2a.top_k), "int32", None)

    @recorded_on_lost_context
    def combine(self, partial, runtime_max_tokens_per_rank: int = None, stream=None, out=None) -> Tensor:
        """Sum, for each local token, the partial results its target ranks computed.

        partial: [ep_size, T^, hidden] (or [ep_size * T^, hidden]) of combine_dtype: the
        view from combine_input() (zero copy) or any tensor on this GPU (staged into the
        workspace first); with combine_quant="fp8", also combine_input(T^, fp8=True) once
        the epilogue has written it (then combine does not quantize). Returns `out` or a
        [local_num_tokens, hidden] view of an internal buffer valid until the next combine.
        """
        self.check_open()
        if self.state.pending is None:
            raise StateError(f"rank {self.rank}: combine called without a dispatch before it")
        rep = self._repeat_combine
        if rep is not None and rep.call.tokens == self.state.pending.tokens and \
                rep.matches(partial, (out,), runtime_max_tokens_per_rank, stream):
            rep.order_producers()
            return self._combined(rep.call, rep.handle, *rep.extra)
        call, handle, out_t, stage = self.combine_call(partial, runtime_max_tokens_per_rank, stream, out)
        out_t = self._combined(call, handle, out_t, stage)
        self._repeat_combine = Repeat.of(stream, int(runtime_max_tokens_per_rank), [partial, out], handle, call, (out_t, stage))
        return out_t

    def combine_call(self, partial, runtime_max_tokens_per_rank, stream, out):
        """(the planner's Call, the stream handle, the output, the staging copy or None) of a
        combine with these arguments, checked; nothing is issued (combine and
        halves.combine_send issue it)."""
        a2a, pending = self.a2a, self.state.pending
        check_runtime_max(runtime_max_tokens_per_rank, a2a.max_tokens_per_rank)
        runtime_max = int(runtime_max_tokens_per_rank)  # (a NumPy integer would keep its width in the byte counts below)
        handle = self.default_stream if stream is None else stream_handle(stream)
        hidden, tokens = a2a.combine_hidden_size, pending.tokens
        check_combine_runtime_max(runtime_max, pending.runtime_max)
        prequantized = isinstance(partial, Fp8Partial)
        if prequantized:
            check_fp8_partial(partial, runtime_max, a2a.combine_quant, lambda: self._fp8_input(runtime_max))
        else:
            part = self._input(partial, "partial", (hidden,), a2a.combine_dtype.name, None, handle, leading_dims=(1, 2))
            check_partial_shape(part.shape, a2a.ep_size, runtime_max, hidden)
        if out is None:  # [T, H] views of the internal buffer, one per T (no object per call)
            out_t = self._out_views.get(tokens)
            if out_t is None:
                out_t = self._out_views[tokens] = Tensor(self._out.ptr, (tokens, hidden), a2a.combine_dtype,
                                                         device=(CUDA, self.device.ordinal), owner=self._out)
        else:
            out_t = self._input(out, "out", (hidden,), a2a.combine_dtype.name, tokens, handle)
        stage = None  # staged: the partial results live outside the workspace
        if not prequantized and part.ptr != self.plan.combine_input:
            stage = (self.plan.combine_input, part.ptr, a2a.ep_size * runtime_max * a2a.layout.combine_bytes)
        call = Call(COMBINE, tokens, runtime_max, None, (out_t.ptr,), prequantized)  # (its dispatch chose the protocol)
        return call, handle, out_t, stage

    def _combined(self, call, handle, out_t, stage) -> Tensor:
        """Stage the partial results if they live elsewhere, launch a planned combine."""
        if self.state.sent is not None or call.phase.part != "whole":  # (before the copy: peers may still read the input)
            check_order(self.plan, self.state, call.phase)
        if stage:
            self.device.make_current()
            copy_dtod_async(*stage, handle)
        self._run(call, handle)
        if call.phase.part != "send":
            release_frees_if_safe(handle)
        out_t.stream = handle
        return out_t

    def _fp8_input(self, runtime_max: int) -> tuple:
        """(combine_input(T^, fp8=True), the geometry its views must have: a caller may change a Tensor's fields)."""
        got = self._fp8_inputs.get(runtime_max)
        if got is None:
            a2a = self.a2a
            shape = (a2a.ep_size, runtime_max, a2a.combine_hidden_size)
            part = Fp8Partial(self._view(a2a.layout.off_combine_q, shape, "float8_e4m3fn", None),
                              self._view(a2a.layout.off_combine_scales, shape[:2] + (shape[2] // Q8_BLOCK,),
                                         "float32", None), a2a.combine_dtype.name)
            geometry = tuple((view.ptr, view.shape, view.dtype.name) for view in part[:2])
            got = self._fp8_inputs[runtime_max] = (part, geometry)
        return got

    # -- repeats vouched for by the caller (ops/torch_views.py) --------------------------------
    @property
    def last_repeats(self) -> tuple:
        """(dispatch, combine) records of this rank's last calls (fastpath.Repeat or None): dispatch_same's, combine_same's."""
        return self._repeat_dispatch, self._repeat_combine

    @recorded_on_lost_context
    def dispatch_same(self, record: Repeat, runtime_max_tokens_per_rank: int, stream):
        """dispatch() again with the Tensors of the call that left `record`, for a caller that
        fills those very Tensor objects itself and vouches that it changed none of their
        fields since that call: the geometry compare is skipped, everything else a repeat
        checks is not. Returns the views, or None where the call does not repeat `record`
        (the caller then makes the full call, which says why)."""
        self.check_open()
        if (record is not self._repeat_dispatch or self.mid_step or not self.is_active
                or not record.same_call(runtime_max_tokens_per_rank, stream)):
            return None
        return self._dispatch_or_reject(record, record.refs[0](), None, runtime_max_tokens_per_rank, stream)

    @recorded_on_lost_context
    def combine_same(self, record: Repeat, runtime_max_tokens_per_rank: int, stream):
        """combine() again with the Tensors of the call that left `record`, vouched for as in
        dispatch_same. Returns `out` (as combine does), or None where the call does not
        repeat `record` (the caller then makes the full call)."""
        self.check_open()
        pending = self.state.pending
        if (record is not self._repeat_combine or pending is None or pending.tokens != record.call.tokens
                or not record.same_call(runtime_max_tokens_per_rank, stream)):
            return None
        record.order_producers()
        return self._combined(record.call, record.handle, *record.extra)

    # -- a rejected step (rejection.py) ----------------------------------------------------------
    @recorded_on_lost_context
    def reject_step(self, runtime_max_tokens_per_rank, stream, err) -> None:
        """This rank rejects its input for the next step (`err`, which the caller raises):
        on a rank alone in its process, run that step without tokens (rejection.py); on ranks
        of one process, nothing. dispatch() does this itself; a framework layer that refuses
        its arguments before it calls dispatch() calls this first."""
        if not self._tells_peers or self.rejected or self.mid_step:
            return
        a2a = self.a2a
        try:
            check_runtime_max(runtime_max_tokens_per_rank, a2a.max_tokens_per_rank)
            handle = self.default_stream if stream is None else stream_handle(stream)
        except (TypeError, ValueError):
            return
        runtime_max = int(runtime_max_tokens_per_rank)
        self.rejected = rejection.message(self.rank, err)
        self._run(Call(DISPATCH, 0, runtime_max, a2a.protocol, rejected=True), handle)
        for off, nbytes in rejection.poisoned_spans(a2a.layout, a2a.combine_quant, a2a.combine_hidden_size,
                                                    a2a.ep_size * runtime_max):
            memset_d8_async(self.base + off, 0xFF, nbytes, handle)
        self._run(Call(COMBINE, 0, runtime_max, None, (self._out.ptr,), rejected=True), handle)
        self.steps += 1
        self._repeat_dispatch = self._repeat_combine = None

    # -- checks ------------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.params is None:
            raise StateError(f"rank {self.rank}: this all-to-all is closed")
        if self.rejected:
            raise StateError(self.rejected)
        if rejection.refuses(self.record, self.mid_step):  # a kernel gave up (abort mode) or a peer rejected
            self.raise_recorded()

    # -- errors --------------------------------------------------------------------------------
    def recorded_error(self):
        """This rank's recorded PeerError, or None (see MoeAlltoAll.error)."""
        return error_from_record(self.record) if self.record.kind else None

    def raise_recorded(self, cause=None) -> None:
        """Raise the PeerError this rank's record holds (cause: the CudaError of a lost context,
        which reads every rank's record)."""
        others = [rank.record for rank in self.a2a.ranks] if cause is not None else ()
        err = error_from_records(self.record, others, cause)
        if err is not None:
            raise err from cause

    @recorded_on_lost_context
    def synchronize(self) -> None:
        """Wait for this rank's GPU; raise the PeerError a kernel recorded, if any (a peer's
        rejection only once this rank's step is complete: its combine must still run)."""
        self.device.synchronize()
        if rejection.refuses(self.record, self.mid_step):
            self.raise_recorded()

    def close(self) -> None:
        """Free this rank's kernels' parameters, streams and views (MoeAlltoAll.close calls it)."""
        if self.params is None:
            return
        try:
            self.device.synchronize()  # a recorded PeerError was raised already; closing is allowed
        except CudaError:
            if not (self.record.kind or self.record.claim):
                raise
        finally:
            # the record outlives the host-mapped page it lives in: raise_recorded and
            # check_errors after close read this copy, never freed memory
            self.record = ErrorRecord.from_buffer_copy(self.record)
            self.params = None
            try:
                self._out.close()
            finally:
                self.record_page.close()  # (also when freeing the output fails: a lost context)
