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

from . import fastpath, schedule
from .config import PROTOCOLS, Fp8Partial, Options, PayloadSpec, REDUCE_DTYPES, peers_on_device  # noqa: F401 (PayloadSpec: re-exported)
from .driver.errors import CudaError
from .driver.lifetime import Owned
from .driver.launch import Launch, cluster_launch, launch_once, occupancy
from .driver.memory import DeviceAllocation, copy_dtod_async, copy_dtoh, memset_d8_async, release_held
from .driver.module import load
from .driver.stream import is_capturing, stream_handle
from .driver.vmm import HostMapped
from .errors import StateError, error_from_record, error_from_records
from .group import hold_frees_for, release_frees_if_safe
from .interop.tensor import CUDA, Tensor, as_dtype as lookup_dtype
from .layout import A2AParams, ErrorRecord, Q8_BLOCK, TAG_TMAX_BITS, WorkspaceLayout, landing_bytes, sentinel_kind
from .rejection import RejectedStep
from .symmetric import SymmetricWorkspace
from .validate import CheckedInputs, check_expert_ids_on_host, check_fp8_partial, check_runtime_max, require


def _between_steps(a2a, what: str) -> None:
    for r in a2a.ranks:
        if r.mid_step:
            raise StateError(f"rank {r.rank}: {what} between dispatch and combine")


class MoeAlltoAll(Owned):
    """Dispatch/combine for every rank of `group` that lives in this process (built collectively).

    Args:
      max_tokens_per_rank: most tokens any rank passes in one step (sizes the workspace).
      top_k, num_experts: routing; experts are split over ranks in contiguous blocks, the
        first `num_experts % ep_size` ranks owning one more.
      payloads: PayloadSpec of each dispatched tensor besides the expert ids (at most 8).
      combine_hidden_size, combine_dtype: the partial results combine reduces (bf16, fp16
        or fp32; accumulated in fp32).
      protocol: "fence" (counts + release fence + flags; large batches), "sentinel" (the data
        words signal arrival; small batches; needs the extra workspace listed in layout.py),
        or "auto": per call, SENTINEL while runtime_max_tokens_per_rank <= crossover_tokens
        (default: the crossover measured on the H200, ep_a2a/schedule.py), FENCE above. Both
        protocols share the step counter, so consecutive steps may use either.
      timeout_s / first_timeout_s: how long a kernel waits for a peer before it records who
        was missing; the first steps get the longer one (peers may still be loading).
        Defaults for engines, 300 s and 1800 s (config.py says why), or $EP_A2A_TIMEOUT_S and
        $EP_A2A_FIRST_TIMEOUT_S.
      combine_quant: None, or "fp8": combine quantizes the partial results to float8 e4m3
        with one fp32 scale per 128 values (hidden must be a multiple of 128) and the
        sources pull those, dequantize and reduce in fp32: about half the combine bytes.
        Error per value of a partial result: at most 1/16 of its 128-block's largest
        magnitude (e4m3 keeps 3 mantissa bits). FENCE only.
      on_timeout: "trap" (default): the kernel then traps; the CUDA context of the process is
        lost and the next CUDA call raises, as PeerTimeoutError. "abort": the kernel tells
        every peer to stop waiting too and returns; the context survives, the step's outputs
        are poisoned (NaN rows, -1 ids: README) and every later call raises (error() polls
        without raising): build a new all-to-all. validate_expert_ids: copy the ids to the
        host and check their range before launching (skipped under graph capture; off,
        out-of-range ids are dropped by the kernel). A rank alone in its process that
        rejects its input still runs the step without tokens, so that its peers never wait
        in vain (rejection.py).
    """
    _kind = "alltoalls"

    def __init__(self, group, *, max_tokens_per_rank: int, top_k: int, num_experts: int, payloads=(),
                 combine_hidden_size: int, combine_dtype: str = "bfloat16", protocol: str = "fence",
                 timeout_s: float = None, first_timeout_s: float = None, validate_expert_ids: bool = True,
                 pdl: bool = True, threads_per_block: int = 256, crossover_tokens: int = None,
                 on_timeout: str = "trap", combine_quant: str = None):
        o = self.options = Options.check(
            group.ep_size, max_tokens_per_rank=max_tokens_per_rank, top_k=top_k, num_experts=num_experts,
            payloads=payloads, combine_hidden_size=combine_hidden_size, combine_dtype=combine_dtype,
            protocol=protocol, timeout_s=timeout_s, first_timeout_s=first_timeout_s,
            validate_expert_ids=validate_expert_ids, pdl=pdl, threads_per_block=threads_per_block,
            crossover_tokens=crossover_tokens, on_timeout=on_timeout, combine_quant=combine_quant)
        self.group, self.ep_size, self.top_k, self.num_experts = group, o.ep_size, o.top_k, o.num_experts
        self.max_tokens_per_rank, self.payload_specs, self.protocol = o.max_tokens_per_rank, o.payloads, o.protocol
        self.built_protocol = o.protocol
        self.combine_hidden_size, self.combine_dtype = o.combine_hidden_size, o.combine_dtype
        self.timeout_s, self.first_timeout_s = o.timeout_s, o.first_timeout_s
        self.validate_expert_ids, self.pdl, self.threads = o.validate_expert_ids, o.pdl, o.threads_per_block
        self.on_timeout, self.combine_quant = o.on_timeout, o.combine_quant
        self.active_ranks = tuple(range(o.ep_size))
        self.crossover_tokens = o.crossover_tokens
        if not group.is_local:
            group.agree(o.agreement(), "MoeAlltoAll arguments")
        self.kinds, pbytes = o.payload_kinds, o.payload_bytes
        self.layout = WorkspaceLayout.build(o.ep_size, o.max_tokens_per_rank, o.top_k, pbytes,
                                            o.combine_hidden_size * o.combine_dtype.itemsize,
                                            sentinel=o.protocol != "fence",
                                            landing=tuple(landing_bytes(b, k) for b, k in zip(pbytes, self.kinds)),
                                            q8_hidden=o.combine_hidden_size if o.combine_quant else 0)
        self.workspace = SymmetricWorkspace(group, self.layout.size)
        self.ranks = []
        # several ranks driven by this process spin on each other: no cuMemFree between
        # their launches (group.hold_frees_for)
        self._unhold = hold_frees_for(self) if group.is_local and len(group.ranks) > 1 else None
        self._opened()  # from here a failure closes what was made
        try:
            for i, r in enumerate(group.ranks):
                r.device.make_current()
                memset_d8_async(self.workspace.base(i), 0, self.workspace.size, r.stream.handle)
                fill = load("util", r.device).function("ep_fill_u32")
                for off, nbytes, word in self.layout.sentinel_ranges():
                    launch_once(r.device, fill, [ctypes.c_uint64(self.workspace.base(i) + off),
                                                 ctypes.c_uint64(nbytes // 4), ctypes.c_uint32(word)],
                                min(1024, max(1, nbytes // 4096)), 256, r.stream.handle)
                r.stream.synchronize()
            # no peer may write into a workspace before its owner has cleared it
            if not group.is_local:
                group.bootstrap.barrier()
            self.ranks = [RankAlltoAll(self, i, r) for i, r in enumerate(group.ranks)]
        except BaseException:
            self.close()
            raise

    # Convenience for one rank per process.
    def _only(self) -> "RankAlltoAll":
        if len(self.ranks) != 1:
            raise StateError(f"this process holds {len(self.ranks)} ranks: call a2a.ranks[i].dispatch/combine")
        return self.ranks[0]

    def dispatch(self, *args, **kw):
        return self._only().dispatch(*args, **kw)

    def combine(self, *args, **kw):
        return self._only().combine(*args, **kw)

    def combine_input(self, *args, **kw):
        return self._only().combine_input(*args, **kw)

    def protocol_for(self, runtime_max_tokens_per_rank: int) -> str:
        """The protocol a step with this T^ uses (the same on every rank: T^ is shared)."""
        return schedule.protocol_for(self.protocol, runtime_max_tokens_per_rank, self.crossover_tokens)

    def use_protocol(self, protocol: str) -> None:
        """Switch the protocol of the following steps: one built with protocol="auto" has both
        protocols' workspace and kernels and may switch among "fence", "sentinel" and "auto";
        one built with a single protocol keeps it. Collective: every rank switches between
        the same two steps."""
        built = PROTOCOLS if self.built_protocol == "auto" else (self.built_protocol,)
        require(protocol in built, "protocol", f"must be one of {built} for an all-to-all built with "
                 f"protocol={self.built_protocol!r}, got {protocol!r}")
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
        new = tuple(sorted({int(r) for r in ranks}))
        require(bool(new) and all(0 <= r < self.ep_size for r in new), "ranks",
                 f"must be a non-empty set of ranks in 0..{self.ep_size - 1}, got {ranks!r}")
        require(set(new) <= set(self.active_ranks), "ranks",
                 f"can only remove ranks (active now: {list(self.active_ranks)}); rebuild to add {sorted(set(new) - set(self.active_ranks))}")
        _between_steps(self, "set_active_ranks")
        self.active_ranks = new
        for r in self.ranks:
            r._set_active(new)

    def synchronize(self) -> None:
        for r in self.ranks:
            r.synchronize()
        release_held()

    def check_errors(self) -> None:
        """Raise the PeerError a kernel of this process recorded, if any."""
        for r in self.ranks:
            r.raise_recorded()

    def error(self):
        """The PeerError a kernel of this process recorded, or None: a cheap poll (host-mapped
        memory, no driver call) for an engine replaying CUDA graphs, after each synchronize."""
        return next((e for e in (r.recorded_error() for r in self.ranks) if e is not None), None)

    @property
    def workspace_bytes_per_rank(self) -> int:
        return self.workspace.size

    def _release(self) -> None:
        """Every part is released even when one fails (a lost context): the first error is raised."""
        first = None
        for part in [*self.ranks, self.workspace]:
            try:
                part.close()
            except BaseException as e:
                first = first or e
        self.ranks, self.workspace = [], None
        if self._unhold is not None:
            self._unhold()  # hold_frees(False), once
        if first is not None:
            raise first


class RankAlltoAll(RejectedStep, fastpath.RepeatedCalls):
    """Dispatch and combine of one rank; all state lives on the device except a phase check."""

    def __init__(self, a2a: MoeAlltoAll, index: int, rank):
        self.a2a, self.index, self.rank, self.device = a2a, index, rank.rank, rank.device
        self.default_stream = rank.stream.handle
        L = a2a.layout
        dev = self.device
        self.base = a2a.workspace.base(index)
        self.record_page = HostMapped(ctypes.sizeof(ErrorRecord), dev)  # where kernels write failures
        self.record = ErrorRecord.from_address(self.record_page.host_ptr)
        ctypes.memset(self.record_page.host_ptr, 0, ctypes.sizeof(ErrorRecord))

        p = self.params = A2AParams()
        for q, b in enumerate(a2a.workspace.peers(index)):
            p.peer_base[q] = b
        p.error_record = self.record_page.device_ptr
        L.fill_params(p, a2a.kinds)
        p.rank, p.ep_size, p.top_k, p.num_experts = self.rank, a2a.ep_size, a2a.top_k, a2a.num_experts
        p.experts_per_rank, p.experts_remainder = divmod(a2a.num_experts, a2a.ep_size)
        p.combine_vec = schedule.vector_bytes(L.combine_bytes, self.base + L.off_combine)
        p.combine_kind = sentinel_kind(a2a.combine_dtype.name)
        p.abort_on_timeout, p.peers_on_device = int(a2a.on_timeout == "abort"), peers_on_device(rank.ranks_on_device, a2a.ep_size)
        self._set_active(a2a.active_ranks)

        cdt = REDUCE_DTYPES[a2a.combine_dtype.name]
        protos = ("fence", "sentinel") if a2a.protocol == "auto" else (a2a.protocol,)
        q8 = "q8_" if a2a.combine_quant else ""
        fns = {pr: (load(pr, dev).function(f"{pr}_dispatch"), load(pr, dev).function(f"{pr}_combine_{q8}{cdt}"))
               for pr in protos}
        occ = min(occupancy(f, a2a.threads) for pair in fns.values() for f in pair)
        # kernels of every rank sharing this GPU spin on each other: all must be resident
        self.max_grid = max(1, occ * dev.sm_count // rank.ranks_on_device)
        self._descs = [p.payloads[q] for q in range(p.num_payloads)]  # (indexing makes a new wrapper)
        groups = schedule.push_groups([d.bytes_per_token for d in self._descs], a2a.threads)
        sch = schedule.Schedule(a2a.ep_size, a2a.top_k, a2a.threads, a2a.combine_hidden_size, L.combine_bytes,
                                bool(a2a.combine_quant), bool(a2a.pdl), self.max_grid, groups)
        cl = "fence" in fns and sch.clusters_fit(occ, dev.sm_count, rank.ranks_on_device) and cluster_launch(
            dev, fns["fence"][0], [p], schedule.CLUSTER_BLOCKS, a2a.threads, a2a.pdl, rank.ranks_on_device)
        self._cluster, self.schedule = (cl, dataclasses.replace(sch, clusters=True)) if cl else (None, sch)  # FENCE's one-cluster grids
        self._launches = {pr: (Launch(dev, fd, [p], 1, a2a.threads, pdl=a2a.pdl),
                               Launch(dev, fc, [p], 1, a2a.threads, pdl=a2a.pdl)) for pr, (fd, fc) in fns.items()}
        self._empty = Launch(dev, load("util", dev).function("ep_empty"), [p], 1, a2a.threads, pdl=a2a.pdl)
        self.last_protocol = protos[0]

        self._out = DeviceAllocation(dev, a2a.max_tokens_per_rank * L.combine_bytes)
        self.steps = 0
        self._prev_early = False
        self._views = {}               # runtime max -> cached workspace views (no per-call objects)
        self._dispatched_tmax = None   # runtime_max of the dispatch awaiting its combine
        self._local_tokens = 0
        self._input = CheckedInputs(dev.ordinal, a2a.max_tokens_per_rank)  # remembers what it checked
        self.validate_expert_ids = a2a.validate_expert_ids  # per rank: the torch ops (ops/torch.py) check their own way
        self._repeat_dispatch = self._repeat_combine = None  # the last call of each phase, when it may be repeated cheaply
        self._out_views = {}           # T -> [T, hidden] view of the internal combine output
        # the last combine ran its own FP8 quantize pass (how dispatch predicts the next one)
        self._quantizing_combine = a2a.combine_quant == "fp8"
        self._fp8_inputs = {}          # T^ -> (its Fp8Partial, the (ptr, shape, dtype) each view must keep)
        self._combine_inputs = {}      # T^ -> combine_input(T^): one object, so a step passing it repeats the last
        self._payload_names = [f"payloads[{q}] ({spec.name})" for q, spec in enumerate(a2a.payload_specs)]
        self._payload_shapes = [tuple(spec.shape) for spec in a2a.payload_specs]
        self._tells_peers, self.rejected = not a2a.group.is_local and a2a.ep_size > 1, None  # (rejection.py)

    def _set_active(self, ranks) -> None:
        words = [0] * len(self.params.active)
        for r in ranks:
            words[r >> 5] |= 1 << (r & 31)
        self.params.active[:] = words
        # 8 bits of the mask's hash ride above T^ in the step tag peers compare (bit 31 stays
        # clear: it marks a rejecting rank's tag, layout.TAG_REJECT)
        self._tag_hi = (zlib.crc32(np.array(words, np.uint32).tobytes()) & 0xFF) << TAG_TMAX_BITS
        self.is_active = self.rank in ranks

    def dropped_selections(self) -> int:
        """Selections this rank dropped since it was built because their expert's rank was
        inactive (set_active_ranks). Synchronizes this rank's GPU."""
        self._check_open()
        self.synchronize()
        v = np.zeros(1, np.uint32)
        copy_dtoh(v.ctypes.data, self.base + self.a2a.layout.off_dropped, 4)
        return int(v[0])

    # -- views into the workspace ------------------------------------------------------
    def _view(self, offset: int, shape, dtype, stream) -> Tensor:
        return Tensor(self.base + offset, tuple(shape), lookup_dtype(dtype), device=(CUDA, self.device.ordinal),
                      owner=self, stream=stream)

    def dispatch_views(self, tmax: int):
        """(expert ids [ep, T^, top_k], [payload views [ep, T^, *shape]]) for runtime max T^."""
        a, L = self.a2a, self.a2a.layout
        ids = self._view(L.off_recv[0], (a.ep_size, tmax, a.top_k), "int32", None)
        views = [self._view(L.off_recv[q + 1], (a.ep_size, tmax) + tuple(s.shape), s.dtype, None)
                 for q, s in enumerate(a.payload_specs)]
        return ids, views

    def combine_input(self, runtime_max_tokens_per_rank: int, fp8: bool = False):
        """Where the MoE writes its partial results for combine: [ep_size, T^, hidden], the same
        Tensor at every call with this T^ (so a combine handed it repeats: fastpath.py).

        fp8=True (combine_quant="fp8" only): an Fp8Partial, the e4m3 values and per-128 scales
        that combine would quantize the partial results into; an epilogue that writes them
        itself (moe.finalize) spares combine that pass and the bf16 round trip through HBM.
        """
        a = self.a2a
        self._check_open()
        check_runtime_max(runtime_max_tokens_per_rank, a.max_tokens_per_rank)
        shape = (a.ep_size, int(runtime_max_tokens_per_rank), a.combine_hidden_size)
        if fp8:
            if a.combine_quant != "fp8":
                raise ValueError(f"fp8: an FP8 combine input needs combine_quant='fp8' (this all-to-all has "
                                 f"combine_quant={a.combine_quant!r})")
            return self._fp8_input(shape[1])[0]
        got = self._combine_inputs.get(shape[1])
        if got is None:
            got = self._combine_inputs[shape[1]] = self._view(a.layout.off_combine, shape, a.combine_dtype.name, None)
        return got

    # -- the two phases -------------------------------------------------------------------
    def dispatch(self, token_selected_experts, payloads=(), runtime_max_tokens_per_rank: int = None, stream=None):
        """Push this rank's tokens to the ranks owning their experts.

        token_selected_experts: int32 [local_num_tokens, top_k] on this rank's GPU (-1 = none).
        payloads: one tensor [local_num_tokens, *spec.shape] of spec.dtype per PayloadSpec.
        Returns (expert ids view [ep_size, T^, top_k], [payload views [ep_size, T^, ...]]):
        slot j of region s holds the j-th token source s sent here; slots past its count
        carry expert id -1. The views stay valid until the next dispatch.
        """
        self._check_open()
        if self._dispatched_tmax is not None:
            raise StateError(f"rank {self.rank}: dispatch called twice without combine")
        if not self.is_active:
            raise StateError(f"rank {self.rank}: not an active rank (set_active_ranks({list(self.a2a.active_ranks)}))")
        rep = self._repeat_dispatch  # an engine's steady state: the same call as the last one
        again = rep is not None and rep.matches(self, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream)
        return self._dispatch_or_reject(rep if again else None, token_selected_experts, payloads, runtime_max_tokens_per_rank,
                                        stream)

    def _dispatch_checked(self, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream):
        a = self.a2a
        steps_before, early_before = self.steps, self._prev_early
        tmax = runtime_max_tokens_per_rank
        check_runtime_max(tmax, a.max_tokens_per_rank)
        tmax = int(tmax)  # (a NumPy integer would keep its width in the arithmetic below)
        s = self.default_stream if stream is None else stream_handle(stream)
        ids = self._input(token_selected_experts, "token_selected_experts", (a.top_k,), "int32", None, s)
        T = ids.shape[0]
        # (hot path: the messages are formatted only when a rule is broken)
        if T > tmax:
            require(False, "token_selected_experts", f"{T} local tokens exceed runtime_max_tokens_per_rank={tmax}")
        if not isinstance(payloads, (list, tuple)):
            raise TypeError(f"payloads: expected a list of tensors, got {type(payloads).__name__}")
        if len(payloads) != len(a.payload_specs):
            require(False, "payloads", f"expected {len(a.payload_specs)} tensors "
                     f"({', '.join(p.name for p in a.payload_specs)}), got {len(payloads)}")
        ins = [self._input(t, name, shape, spec.dtype, T, s)
               for t, spec, name, shape in zip(payloads, a.payload_specs, self._payload_names, self._payload_shapes)]
        if self.validate_expert_ids and T and not is_capturing(s):  # (a capture cannot sync)
            check_expert_ids_on_host(ids, s, a.num_experts)

        p = self.params
        p.local_num_tokens, p.runtime_max_tokens_per_rank = T, tmax
        p.step_tag = tmax | self._tag_hi
        if self.steps <= 4:  # the first steps wait longer (peers may still be loading)
            p.timeout_ns = int(1e9 * (a.first_timeout_s if self.steps < 4 else a.timeout_s))
        for d, t in zip(self._descs, [ids] + ins):
            d.src, d.vec = t.ptr, schedule.vector_bytes(d.bytes_per_token, t.ptr)
        proto, q, sch = a.protocol_for(tmax), self._quantizing_combine, self.schedule
        p.dispatch_splits = splits = sch.dispatch_splits(T, tmax, self._descs) if proto == "fence" else 1
        grid = self._grid(sch.dispatch_want(T, tmax, proto, splits),
                          sch.combine_want(T, tmax, proto, schedule.vector_bytes(a.layout.combine_bytes, 0), quantize=q)[0], q)
        launch = self._cluster if sch.dispatch_cluster(T, tmax, splits, grid) else self._launches[proto][0]
        launch.grid = self._launches[proto][0].grid = grid  # (the latter also for last_grids)
        self.device.make_current()
        self._launch(launch, s)
        self.last_protocol = proto
        self.steps += 1
        self._dispatched_tmax, self._local_tokens = tmax, T
        views = self._views.get(tmax)
        if views is None:
            views = self._views[tmax] = self.dispatch_views(tmax)
        for v in (views[0], *views[1]):
            v.stream = s  # consumers on other streams wait for this dispatch (DLPack)
        self._repeat_dispatch = fastpath.Repeat.of(self, steps_before, early_before, stream, tmax,
                                           [token_selected_experts, *payloads], s, T, proto, launch, views)
        return views

    @property
    def mid_step(self) -> bool:
        """This rank has dispatched and not yet combined."""
        return self._dispatched_tmax is not None

    def abandon_dispatch(self) -> None:
        """Forget the dispatch awaiting its combine, so that the next call may be a dispatch (for
        dispatch-only CUDA graphs: the benchmark times FENCE's alone). FENCE only: SENTINEL resets
        its landing slots in place, and a peer's next push could land before that reset."""
        if self.last_protocol == "sentinel" and self._dispatched_tmax is not None:
            raise StateError(f"rank {self.rank}: abandon_dispatch after a SENTINEL dispatch: its slots are reused only after a combine")
        self._dispatched_tmax = None

    def dispatch_records(self, num_tokens: int) -> Tensor:
        """The (target rank, slot) record (layout.record_target / record_slot) the last dispatch left
        for combine: int32 [num_tokens, top_k], -1 where a selection has no slot; until the next dispatch."""
        self._check_open()
        n = self.a2a.max_tokens_per_rank
        require(type(num_tokens) is int and 0 <= num_tokens <= n, "num_tokens", f"must be an int in 0..{n}, got {num_tokens!r}")
        return self._view(self.a2a.layout.off_records, (num_tokens, self.a2a.top_k), "int32", None)

    def combine(self, partial, runtime_max_tokens_per_rank: int = None, stream=None, out=None) -> Tensor:
        """Sum, for each local token, the partial results its target ranks computed.

        partial: [ep_size, T^, hidden] (or [ep_size * T^, hidden]) of combine_dtype: the
        view from combine_input() (zero copy) or any tensor on this GPU (staged into the
        workspace first); with combine_quant="fp8", also combine_input(T^, fp8=True) once
        the epilogue has written it (then combine does not quantize). Returns `out` or a
        [local_num_tokens, hidden] view of an internal buffer valid until the next combine.
        """
        self._check_open()
        tmax = runtime_max_tokens_per_rank
        if self._dispatched_tmax is None:
            raise StateError(f"rank {self.rank}: combine called without a dispatch before it")
        rep = self._repeat_combine
        if rep is not None and self._combine_repeats(rep, tmax) and rep.matches(self, partial, (out,), tmax, stream):
            return self._combine_again(rep)
        a = self.a2a
        steps_before, early_before = self.steps, self._prev_early
        check_runtime_max(tmax, a.max_tokens_per_rank)
        tmax = int(tmax)  # (a NumPy integer would keep its width in the byte counts below)
        if tmax != self._dispatched_tmax:
            require(False, "runtime_max_tokens_per_rank",
                     f"combine got {tmax} but the dispatch of this step used {self._dispatched_tmax}")
        s = self.default_stream if stream is None else stream_handle(stream)
        H, T = a.combine_hidden_size, self._local_tokens
        prequantized = isinstance(partial, Fp8Partial)
        if prequantized:
            check_fp8_partial(partial, tmax, a.combine_quant, lambda: self._fp8_input(tmax))
        else:
            part = self._input(partial, "partial", (H,), a.combine_dtype.name, None, s, leading_dims=(1, 2))
            if part.shape[:-1] not in ((a.ep_size * tmax,), (a.ep_size, tmax)):
                require(False, "partial", f"must be [ep_size={a.ep_size}, runtime_max_tokens_per_rank={tmax}, {H}], "
                         f"got {part.shape}")
        if out is None:  # [T, H] views of the internal buffer, one per T (no object per call)
            out_t = self._out_views.get(T)
            if out_t is None:
                out_t = self._out_views[T] = Tensor(self._out.ptr, (T, H), a.combine_dtype, device=(CUDA, self.device.ordinal), owner=self._out)
        else:
            out_t = self._input(out, "out", (H,), a.combine_dtype.name, T, s)
        p = self.params
        p.combine_out = out_t.ptr
        p.combine_vec = vec = schedule.vector_bytes(a.layout.combine_bytes, out_t.ptr)
        proto = self.last_protocol
        p.combine_prequantized = int(prequantized)
        self._quantizing_combine = a.combine_quant == "fp8" and not prequantized
        want, p.combine_splits = self.schedule.combine_want(T, tmax, proto, vec, quantize=not prequantized)
        launch = self._launches[proto][1]
        launch.grid = self._grid(want, self.schedule.dispatch_want(T, tmax, proto, p.dispatch_splits))  # (the next step's, if alike)
        self.device.make_current()
        dst = self.base + a.layout.off_combine
        stage = (dst, part.ptr, a.ep_size * tmax * a.layout.combine_bytes) if not prequantized and part.ptr != dst else None
        if stage:  # staged: the partial results live outside the workspace
            copy_dtod_async(*stage, s)
        self._launch(launch, s)
        self._dispatched_tmax = None
        release_frees_if_safe(s)
        out_t.stream = s
        self._repeat_combine = fastpath.Repeat.of(self, steps_before, early_before, stream, tmax, [partial, out], s, T,
                                          proto, launch, (out_t, stage))
        return out_t

    def _fp8_input(self, tmax: int) -> tuple:
        """(combine_input(T^, fp8=True), the geometry its views must have), made once per T^ (combine's
        check is then a few comparisons; kept apart because a caller may change a Tensor's fields)."""
        got = self._fp8_inputs.get(tmax)
        if got is None:
            a = self.a2a
            shape = (a.ep_size, tmax, a.combine_hidden_size)
            part = Fp8Partial(self._view(a.layout.off_combine_q, shape, "float8_e4m3fn", None),
                              self._view(a.layout.off_combine_scales, shape[:2] + (shape[2] // Q8_BLOCK,),
                                         "float32", None), a.combine_dtype.name)
            got = self._fp8_inputs[tmax] = (part, tuple((t.ptr, t.shape, t.dtype.name) for t in part[:2]))
        return got

    def _grid(self, want: int, successor_want: int, successor_fills: bool = False) -> int:
        """schedule.Schedule.grid with this rank's PDL history: the blocks of the next launch."""
        grid, early = self.schedule.grid(want, successor_want, self._prev_early, successor_fills)
        self.params.trigger_early = int(early)
        self._prev_early = early
        return grid

    @property
    def last_grids(self) -> tuple:
        """(dispatch, combine) grids of the last step's protocol (the benchmark's floor shape)."""
        return tuple(launch.grid for launch in self._launches[self.last_protocol])

    def launch_empty(self, stream=None, grid: int = 1) -> None:
        """The benchmark's latency floor: an empty kernel of the protocol kernels' shape."""
        self._empty.grid = grid
        self._launch(self._empty, self.default_stream if stream is None else stream_handle(stream))

    # -- checks ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.params is None:
            raise StateError(f"rank {self.rank}: this all-to-all is closed")
        if self.rejected:
            raise StateError(self.rejected)
        if self._refuses():  # a kernel gave up (abort mode) or a peer rejected: every call from then on
            self.raise_recorded()

    # -- errors --------------------------------------------------------------------------------
    def _launch(self, launch: Launch, stream: int) -> None:
        try:
            launch(stream)
        except CudaError as e:
            self.raise_recorded(e)
            raise

    def recorded_error(self):
        """This rank's recorded PeerError, or None (see MoeAlltoAll.error)."""
        return error_from_record(self.record) if self.record.kind else None

    def raise_recorded(self, cause=None) -> None:  # (cause: the CudaError; a lost context reads every rank's record)
        err = error_from_records(self.record, [r.record for r in self.a2a.ranks] if cause is not None else (), cause)
        if err is not None:
            raise err from cause

    def synchronize(self) -> None:
        """Wait for this rank's GPU; raise the PeerError a kernel recorded, if any (a peer's
        rejection only once this rank's step is complete: its combine must still run)."""
        try:
            self.device.synchronize()
        except CudaError as e:
            self.raise_recorded(e)
            raise
        if self._refuses():
            self.raise_recorded()

    def close(self) -> None:
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
