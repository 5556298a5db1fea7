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
import math
import weakref
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from cuda.bindings import driver as _drv

from .driver.errors import CudaError, EpA2AError, call
from .driver.launch import Launch, launch_once, occupancy
from .driver.memory import DeviceAllocation, has_held, hold_frees, release_held
from .driver.module import load
from .driver.stream import is_capturing, stream_handle
from .interop.tensor import CUDA, Tensor, as_dtype as lookup_dtype, as_tensor
from .driver.vmm import HostMapped
from .errors import error_from_record
from .layout import (A2AParams, ErrorRecord, MAX_PAYLOADS, MAX_RANKS, MAX_TOP_K, Q8_BLOCK, TAG_TMAX_BITS,
                     WorkspaceLayout, align, landing_bytes, sentinel_kind)
from .tuning import sentinel_max_tokens
from .symmetric import SymmetricWorkspace

PROTOCOLS = ("fence", "sentinel", "auto")
ON_TIMEOUT = ("trap", "abort")
COMBINE_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


@dataclass(frozen=True)
class PayloadSpec:
    """One dispatch payload: `shape` and `dtype` of one token's data (any bytes: BF16 hidden
    states, FP8 with scales, packed FP4, router weights, opaque uint8)."""
    name: str
    shape: tuple
    dtype: str = "uint8"

    @property
    def bytes_per_token(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * lookup_dtype(self.dtype).itemsize


class StateError(EpA2AError):
    """dispatch/combine called out of order, or on a closed all-to-all."""


class Fp8Partial(NamedTuple):
    """The FP8 combine input of one rank (combine_quant="fp8"), from combine_input(T^, fp8=True):
    views of its workspace that the MoE epilogue fills (moe.finalize does), so that combine
    skips its own quantize pass. Value j of a slot is values[..., j] * scales[..., j // 128]."""
    values: Tensor  # float8_e4m3fn [ep_size, T^, hidden]
    scales: Tensor  # float32 [ep_size, T^, hidden / 128]
    dtype: str      # the combine dtype: each partial value is rounded to it before quantizing


def _vec(nbytes: int, *addresses: int) -> int:
    """The widest vector (16, 8, 4, 2, 1 bytes) that divides the size and every address:
    the lowest set bit of all of them together, at most 16."""
    x = nbytes
    for a in addresses:
        x |= a
    return min(16, x & -x) if x else 16


_HOLDING = weakref.WeakSet()  # the all-to-alls that hold frees (several ranks in this process)


def _no_rank_mid_step() -> bool:
    """No rank of any such all-to-all has dispatched without combining (a free is safe)."""
    return all(r._dispatched_tmax is None for a in list(_HOLDING) for r in a.ranks)


class MoeAlltoAll:
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
        (default: the crossover measured on the H200, ep_a2a/tuning.py), FENCE above. Both
        protocols share the step counter, so consecutive steps may use either.
      timeout_s / first_timeout_s: how long a kernel waits for a peer before it records who
        was missing; the first steps get the longer one (peers may still be loading).
      combine_quant: None, or "fp8": combine quantizes the partial results to float8 e4m3
        with one fp32 scale per 128 values (hidden must be a multiple of 128) and the
        sources pull those, dequantize and reduce in fp32: about half the combine bytes.
        Error per value of a partial result: at most 1/16 of its 128-block's largest
        magnitude (e4m3 keeps 3 mantissa bits). FENCE only.
      on_timeout: "trap" (default): the kernel then traps; the CUDA context of the process is
        lost and the next CUDA call raises, as PeerTimeoutError. "abort": the kernel tells
        every peer to stop waiting too and returns; the context survives. The error is
        raised by the next call on this object (dispatch, combine, synchronize,
        check_errors) and every call after it: close the object and build a new one (the
        workspace of an aborted step is not reusable). Results of the aborted step are
        garbage. validate_expert_ids: copy the ids to the host and check their range
        before launching (skipped while a graph is being captured; off, out-of-range ids
        are dropped by the kernel).
    """

    def __init__(self, group, *, max_tokens_per_rank: int, top_k: int, num_experts: int, payloads=(),
                 combine_hidden_size: int, combine_dtype: str = "bfloat16", protocol: str = "fence",
                 timeout_s: float = 10.0, first_timeout_s: float = 60.0, validate_expert_ids: bool = True,
                 pdl: bool = True, threads_per_block: int = 256, crossover_tokens: int = None,
                 on_timeout: str = "trap", combine_quant: str = None):
        ep = group.ep_size
        _require(1 <= ep <= MAX_RANKS, "group", f"ep_size must be in 1..{MAX_RANKS}, got {ep}")
        _require(1 <= top_k <= MAX_TOP_K, "top_k", f"must be in 1..{MAX_TOP_K}, got {top_k}")
        _require(num_experts >= 1, "num_experts", f"must be >= 1, got {num_experts}")
        _require(1 <= max_tokens_per_rank < 2 ** 23, "max_tokens_per_rank", f"must be in 1..2**23-1, got {max_tokens_per_rank}")
        _require(combine_hidden_size >= 1, "combine_hidden_size", f"must be >= 1, got {combine_hidden_size}")
        _require(protocol in PROTOCOLS, "protocol", f"must be one of {PROTOCOLS}, got {protocol!r}")
        _require(on_timeout in ON_TIMEOUT, "on_timeout", f"must be one of {ON_TIMEOUT}, got {on_timeout!r}")
        _require(timeout_s > 0 and first_timeout_s > 0, "timeout_s", "timeouts must be > 0 seconds")
        _require(combine_quant in (None, "fp8"), "combine_quant", f"must be None or 'fp8', got {combine_quant!r}")
        if combine_quant:
            _require(protocol == "fence", "combine_quant", f"'fp8' needs protocol='fence', got {protocol!r}")
            _require(combine_hidden_size % Q8_BLOCK == 0, "combine_quant",
                     f"'fp8' needs combine_hidden_size to be a multiple of {Q8_BLOCK}, got {combine_hidden_size}")
        cdt = lookup_dtype(combine_dtype)
        _require(cdt.name in COMBINE_DTYPES, "combine_dtype", f"must be one of {tuple(COMBINE_DTYPES)}, got {cdt.name}")
        payloads = tuple(payloads)
        _require(len(payloads) <= MAX_PAYLOADS - 1, "payloads", f"at most {MAX_PAYLOADS - 1} payloads, got {len(payloads)}")
        for p in payloads:
            _require(isinstance(p, PayloadSpec), "payloads", f"expected PayloadSpec entries, got {type(p).__name__}")
            _require(p.bytes_per_token > 0, "payloads", f"payload {p.name!r} has no bytes per token")
        threads = int(threads_per_block)
        _require(threads % 32 == 0 and 96 <= threads <= 512, "threads_per_block", "must be a multiple of 32 in 96..512")

        self.group, self.ep_size, self.top_k, self.num_experts = group, ep, top_k, num_experts
        self.max_tokens_per_rank, self.payload_specs, self.protocol = max_tokens_per_rank, payloads, protocol
        self.built_protocol = protocol
        self.combine_hidden_size, self.combine_dtype = combine_hidden_size, cdt
        self.timeout_s, self.first_timeout_s = timeout_s, first_timeout_s
        self.validate_expert_ids, self.pdl, self.threads = validate_expert_ids, pdl, threads
        self.on_timeout, self.combine_quant = on_timeout, combine_quant
        self.active_ranks = tuple(range(ep))
        self.crossover_tokens = sentinel_max_tokens() if crossover_tokens is None else int(crossover_tokens)
        if not group.is_local:
            kinds = tuple(sentinel_kind(lookup_dtype(p.dtype).name) for p in payloads)
            group.agree((max_tokens_per_rank, top_k, num_experts, combine_hidden_size, cdt.itemsize,
                         PROTOCOLS.index(protocol), self.crossover_tokens, int(combine_quant is not None),
                         ON_TIMEOUT.index(on_timeout))
                        + tuple(p.bytes_per_token for p in payloads) + kinds, "MoeAlltoAll arguments")
        self.kinds = (0,) + tuple(sentinel_kind(lookup_dtype(p.dtype).name) for p in payloads)
        pbytes = (4 * top_k,) + tuple(p.bytes_per_token for p in payloads)
        self.layout = WorkspaceLayout.build(ep, max_tokens_per_rank, top_k, pbytes, combine_hidden_size * cdt.itemsize,
                                            sentinel=protocol != "fence",
                                            landing=tuple(landing_bytes(b, k) for b, k in zip(pbytes, self.kinds)),
                                            q8_hidden=combine_hidden_size if combine_quant else 0)
        self.workspace = SymmetricWorkspace(group, self.layout.size)
        self.ranks = []
        # several ranks driven by this process spin on each other (on one GPU or several):
        # no cuMemFree between their launches (driver/memory.py); balanced by close() or,
        # for an all-to-all dropped unclosed, by its finalizer
        self._unhold = None
        if group.is_local and len(group.ranks) > 1:
            hold_frees(True)
            self._unhold = weakref.finalize(self, hold_frees, False)
            _HOLDING.add(self)
        try:
            for i, r in enumerate(group.ranks):
                r.device.make_current()
                call(_drv.cuMemsetD8Async, self.workspace.base(i), 0, self.workspace.size, r.stream.handle)
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
        if self.protocol != "auto":
            return self.protocol
        return "sentinel" if runtime_max_tokens_per_rank <= self.crossover_tokens else "fence"

    def use_protocol(self, protocol: str) -> None:
        """Switch the protocol of the following steps: "fence", "sentinel" or "auto", among
        those this all-to-all was built for (one built with "fence" has no SENTINEL workspace).
        Collective: every rank switches between the same two steps."""
        built = ("fence", "sentinel", "auto") if self.layout.sentinel else ("fence",)
        _require(protocol in built, "protocol", f"must be one of {built} for an all-to-all built with "
                 f"protocol={self.built_protocol!r}, got {protocol!r}")
        for r in self.ranks:
            if r.mid_step:
                raise StateError(f"rank {r.rank}: use_protocol between dispatch and combine")
        if protocol != "fence" and self.combine_quant:
            raise ValueError(f"protocol: combine_quant={self.combine_quant!r} needs 'fence', got {protocol!r}")
        self.protocol = protocol

    def set_active_ranks(self, ranks) -> None:
        """Go on without failed ranks: from the next step no kernel waits on a rank outside
        `ranks`, and selections of its experts are dropped (counted by dropped_selections()).

        Collective over the surviving ranks: every active rank must call it, with the same
        set, between the same two steps (a rank that disagrees makes its peers' next step
        fail with ActiveRanksMismatchError; the check uses 8 bits of the set's hash, so 1 in
        256 differing sets is missed and ends as a timeout). Ranks can only be removed; to add one back,
        build a new all-to-all. An inactive rank of this process may not dispatch any more.
        """
        new = tuple(sorted({int(r) for r in ranks}))
        _require(bool(new) and all(0 <= r < self.ep_size for r in new), "ranks",
                 f"must be a non-empty set of ranks in 0..{self.ep_size - 1}, got {ranks!r}")
        _require(set(new) <= set(self.active_ranks), "ranks",
                 f"can only remove ranks (active now: {list(self.active_ranks)}); rebuild to add {sorted(set(new) - set(self.active_ranks))}")
        for r in self.ranks:
            if r.mid_step:
                raise StateError(f"rank {r.rank}: set_active_ranks between dispatch and combine")
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

    @property
    def workspace_bytes_per_rank(self) -> int:
        return self.workspace.size

    def close(self) -> None:
        try:
            for r in self.ranks:
                r.close()
            self.ranks = []
            if getattr(self, "workspace", None) is not None:
                self.workspace.close()
                self.workspace = None
        finally:
            if getattr(self, "_unhold", None) is not None:
                self._unhold()  # hold_frees(False), once

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _require(ok: bool, arg: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{arg}: {rule}")


REPEAT_FAST_PATH = True  # (False: every call takes the full path; the CPU tests compare both)


class _Repeat:
    """A phase call that an identical next call may repeat without its checks and parameter
    updates: the kernel parameter block and launch shape come out byte for byte the same.

    Engines call with the same buffers every step. A call repeats the last one when it gets
    the same ep_a2a Tensor objects (same address and shape) for every tensor argument, the
    same T^ (an int) and stream (None or an int handle), and finds the state its result
    depended on unchanged: PDL's trigger choice before it, the previous step's protocol, the
    protocol setting, the active-rank tag, whether the last combine quantized (FP8); and the
    first steps' longer timeouts are over.
    Framework tensors always take the full path (their DLPack exchange orders streams).
    """
    __slots__ = ("refs", "geometry", "tmax", "stream", "early_before", "prev_proto", "setting", "tag",
                 "quantizing", "s", "T", "proto", "launch", "early", "extra")

    @classmethod
    def of(cls, rank, steps_before, early_before, stream, tmax, tensors, s, T, proto, launch, extra):
        """The record of a call just made, or None when a later call could not repeat it."""
        if not REPEAT_FAST_PATH or steps_before < 5 or not (stream is None or type(stream) is int):
            return None
        if any(t is not None and type(t) is not Tensor for t in tensors):
            return None
        r = cls()
        r.refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        r.geometry = tuple(None if t is None else (t.ptr, t.shape) for t in tensors)
        r.tmax, r.stream, r.early_before = tmax, stream, early_before
        r.prev_proto, r.setting, r.tag = rank._prev_step_protocol, rank.a2a.protocol, rank._tag_hi
        r.quantizing = rank._quantizing_combine
        r.s, r.T, r.proto, r.launch, r.early, r.extra = s, T, proto, launch, rank._prev_early, extra
        return r

    def matches(self, rank, first, rest, tmax, stream) -> bool:
        if not (type(tmax) is int and tmax == self.tmax and type(stream) is type(self.stream) and stream == self.stream
                and rank._prev_early is self.early_before and rank._prev_step_protocol == self.prev_proto
                and rank.a2a.protocol == self.setting and rank._tag_hi == self.tag
                and rank._quantizing_combine is self.quantizing):
            return False
        refs, geo = self.refs, self.geometry
        if type(rest) not in (list, tuple) or len(rest) + 1 != len(refs):
            return False
        for i, t in enumerate((first, *rest)):
            if refs[i] is None:
                if t is not None:
                    return False
            elif t is None or refs[i]() is not t or (t.ptr, t.shape) != geo[i]:  # (a dead ref reads None)
                return False
        return True


class RankAlltoAll:
    """Dispatch and combine of one rank; all state lives on the device except a phase check."""

    def __init__(self, a2a: MoeAlltoAll, index: int, rank):
        self.a2a, self.index, self.rank, self.device = a2a, index, rank.rank, rank.device
        self.default_stream = rank.stream.handle
        L = a2a.layout
        dev = self.device
        self.base = a2a.workspace.base(index)
        self.error = HostMapped(ctypes.sizeof(ErrorRecord), dev)
        self.record = ErrorRecord.from_address(self.error.host_ptr)
        ctypes.memset(self.error.host_ptr, 0, ctypes.sizeof(ErrorRecord))

        p = self.params = A2AParams()
        for q, b in enumerate(a2a.workspace.peers(index)):
            p.peer_base[q] = b
        p.error_record = self.error.device_ptr
        for f in ("off_dispatch_flags", "off_tmax", "off_combine_flags", "off_epoch", "off_done", "off_abort",
                  "off_dropped", "off_counters", "off_records", "off_combine", "off_combine_q", "off_combine_scales",
                  "off_id_slots", "off_combine_slots"):
            setattr(p, f, getattr(L, f))
        p.combine_bytes = L.combine_bytes
        p.rank, p.ep_size, p.top_k, p.num_experts = self.rank, a2a.ep_size, a2a.top_k, a2a.num_experts
        p.experts_per_rank, p.experts_remainder = divmod(a2a.num_experts, a2a.ep_size)
        p.max_tokens_per_rank = a2a.max_tokens_per_rank
        p.num_payloads = len(L.payload_bytes)
        for q, b in enumerate(L.payload_bytes):
            d = p.payloads[q]
            d.recv_offset, d.bytes_per_token, d.sentinel_kind = L.off_recv[q], b, a2a.kinds[q]
            if L.sentinel and q:
                d.landing_offset, d.landing_bytes = L.off_landing[q], L.landing_bytes[q]
        p.combine_vec = _vec(L.combine_bytes, self.base + L.off_combine)
        p.combine_kind = sentinel_kind(a2a.combine_dtype.name)
        p.combine_slot_bytes = align(L.combine_bytes, 16)
        p.abort_on_timeout = int(a2a.on_timeout == "abort")
        self._set_active(a2a.active_ranks)

        cdt = COMBINE_DTYPES[a2a.combine_dtype.name]
        protos = ("fence", "sentinel") if a2a.protocol == "auto" else (a2a.protocol,)
        q8 = "q8_" if a2a.combine_quant else ""
        fns = {pr: (load(pr, dev).function(f"{pr}_dispatch"), load(pr, dev).function(f"{pr}_combine_{q8}{cdt}"))
               for pr in protos}
        occ = min(occupancy(f, a2a.threads) for pair in fns.values() for f in pair)
        # kernels of every rank sharing this GPU spin on each other: all must be resident
        self.max_grid = max(1, occ * dev.sm_count // rank.ranks_on_device)
        self._launches = {pr: (Launch(dev, fd, [p], 1, a2a.threads, pdl=a2a.pdl),
                               Launch(dev, fc, [p], 1, a2a.threads, pdl=a2a.pdl)) for pr, (fd, fc) in fns.items()}
        self._empty = Launch(dev, load("util", dev).function("ep_empty"), [p], 1, a2a.threads, pdl=a2a.pdl)
        self.last_protocol = protos[0]

        self._out = DeviceAllocation(dev, a2a.max_tokens_per_rank * L.combine_bytes)
        self.steps = 0
        self._prev_early = False
        self._prev_step_protocol = None  # every rank computes the same sequence (from T^)
        self._views = {}               # runtime max -> cached workspace views (no per-call objects)
        self._dispatched_tmax = None   # runtime_max of the dispatch awaiting its combine
        self._local_tokens = 0
        self._seen = {}                # argument name -> (Tensor, geometry) last checked
        self._repeat_dispatch = None   # the last call of each phase, when it may be repeated cheaply
        self._repeat_combine = None
        self._out_views = {}           # T -> [T, hidden] view of the internal combine output
        # the last combine ran its own FP8 quantize pass (how dispatch predicts the next one)
        self._quantizing_combine = a2a.combine_quant == "fp8"
        self._fp8_inputs = {}          # T^ -> (its Fp8Partial, the (ptr, shape, dtype) each view must keep)
        self._descs = [p.payloads[q] for q in range(p.num_payloads)]  # (indexing makes a new wrapper)
        self._payload_names = [f"payloads[{q}] ({spec.name})" for q, spec in enumerate(a2a.payload_specs)]
        self._payload_shapes = [tuple(spec.shape) for spec in a2a.payload_specs]

    def _set_active(self, ranks) -> None:
        words = [0] * len(self.params.active)
        for r in ranks:
            words[r >> 5] |= 1 << (r & 31)
        self.params.active[:] = words
        # 8 bits of the mask's hash ride above T^ in the step tag peers compare (bit 31 stays
        # clear, so a tag never equals an id sentinel or -1)
        self._tag_hi = (zlib.crc32(np.array(words, np.uint32).tobytes()) & 0xFF) << TAG_TMAX_BITS
        self.is_active = self.rank in ranks

    def dropped_selections(self) -> int:
        """Selections this rank dropped since it was built because their expert's rank was
        inactive (set_active_ranks). Synchronizes this rank's GPU."""
        self._check_open()
        self.synchronize()
        v = np.zeros(1, np.uint32)
        call(_drv.cuMemcpyDtoH, v.ctypes.data, self.base + self.a2a.layout.off_dropped, 4)
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
        """Where the MoE writes its partial results for combine: [ep_size, T^, hidden].

        fp8=True (combine_quant="fp8" only): an Fp8Partial, the e4m3 values and per-128 scales
        that combine would quantize the partial results into; an epilogue that writes them
        itself (moe.finalize) spares combine that pass and the bf16 round trip through HBM.
        """
        a = self.a2a
        self._check_open()
        self._check_tmax(runtime_max_tokens_per_rank)
        shape = (a.ep_size, int(runtime_max_tokens_per_rank), a.combine_hidden_size)
        if fp8:
            if a.combine_quant != "fp8":
                raise ValueError(f"fp8: an FP8 combine input needs combine_quant='fp8' (this all-to-all has "
                                 f"combine_quant={a.combine_quant!r})")
            return self._fp8_input(shape[1])[0]
        return self._view(a.layout.off_combine, shape, a.combine_dtype.name, None)

    # -- the two phases -------------------------------------------------------------------
    def dispatch(self, token_selected_experts, payloads=(), runtime_max_tokens_per_rank: int = None, stream=None):
        """Push this rank's tokens to the ranks owning their experts.

        token_selected_experts: int32 [local_num_tokens, top_k] on this rank's GPU (-1 = none).
        payloads: one tensor [local_num_tokens, *spec.shape] of spec.dtype per PayloadSpec.
        Returns (expert ids view [ep_size, T^, top_k], [payload views [ep_size, T^, ...]]):
        slot j of region s holds the j-th token source s sent here; slots past its count
        carry expert id -1. The views stay valid until the next dispatch.
        """
        a = self.a2a
        self._check_open()
        if self._dispatched_tmax is not None:
            raise StateError(f"rank {self.rank}: dispatch called twice without combine")
        if not self.is_active:
            raise StateError(f"rank {self.rank}: not an active rank (set_active_ranks({list(a.active_ranks)}))")
        rep = self._repeat_dispatch  # an engine's steady state: the same call as the last one
        if rep is not None and rep.matches(self, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream):
            return self._dispatch_again(rep, token_selected_experts)
        steps_before, early_before = self.steps, self._prev_early
        tmax = runtime_max_tokens_per_rank
        self._check_tmax(tmax)
        tmax = int(tmax)  # (a NumPy integer would keep its width in the arithmetic below)
        s = self.default_stream if stream is None else stream_handle(stream)
        ids = self._input(token_selected_experts, "token_selected_experts", (a.top_k,), "int32", None, s)
        T = ids.shape[0]
        # (hot path: the messages are formatted only when a rule is broken)
        if T > tmax:
            _require(False, "token_selected_experts", f"{T} local tokens exceed runtime_max_tokens_per_rank={tmax}")
        if not isinstance(payloads, (list, tuple)):
            raise TypeError(f"payloads: expected a list of tensors, got {type(payloads).__name__}")
        if len(payloads) != len(a.payload_specs):
            _require(False, "payloads", f"expected {len(a.payload_specs)} tensors "
                     f"({', '.join(p.name for p in a.payload_specs)}), got {len(payloads)}")
        ins = [self._input(t, name, shape, spec.dtype, T, s)
               for t, spec, name, shape in zip(payloads, a.payload_specs, self._payload_names, self._payload_shapes)]
        if a.validate_expert_ids and T and not is_capturing(s):  # (a capture cannot sync)
            self._check_ids(ids, s)

        p = self.params
        p.local_num_tokens, p.runtime_max_tokens_per_rank = T, tmax
        p.step_tag = tmax | self._tag_hi
        if self.steps <= 4:  # the first steps wait longer (peers may still be loading)
            p.timeout_ns = int(1e9 * (a.first_timeout_s if self.steps < 4 else a.timeout_s))
        for d, t in zip(self._descs, [ids] + ins):
            d.src = t.ptr
            d.vec = _vec(d.bytes_per_token, t.ptr)
        proto = a.protocol_for(tmax)
        launch = self._launches[proto][0]
        p.wait_prev_combine = int(proto == "fence" and self._prev_step_protocol == "sentinel")
        q = self._quantizing_combine
        launch.grid = self._grid(self._dispatch_want(T, tmax, proto),
                                 self._combine_want(T, tmax, proto, _vec(a.layout.combine_bytes, 0), quantize=q)[0], q)
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
        self._repeat_dispatch = _Repeat.of(self, steps_before, early_before, stream, tmax,
                                           [token_selected_experts, *payloads], s, T, proto, launch, views)
        return views

    @property
    def mid_step(self) -> bool:
        """This rank has dispatched and not yet combined."""
        return self._dispatched_tmax is not None

    def abandon_dispatch(self) -> None:
        """Forget the dispatch awaiting its combine, so that the next call may be a dispatch:
        for dispatch-only CUDA graphs (the benchmark times dispatch alone). The device state
        needs nothing: a dispatch never waits for the combine before it."""
        self._dispatched_tmax = None

    def dispatch_records(self, num_tokens: int) -> Tensor:
        """The (target rank, slot) record the last dispatch left for combine, for its first
        `num_tokens` local tokens and every selection: int32 [num_tokens, top_k], packed as
        layout.record_target / layout.record_slot read them, -1 where the selection has no
        slot. Valid until the next dispatch."""
        self._check_open()
        n = self.a2a.max_tokens_per_rank
        _require(type(num_tokens) is int and 0 <= num_tokens <= n, "num_tokens", f"must be an int in 0..{n}, got {num_tokens!r}")
        return self._view(self.a2a.layout.off_records, (num_tokens, self.a2a.top_k), "int32", None)

    def _dispatch_again(self, r: "_Repeat", ids) -> tuple:
        """dispatch() with the same tensors, T^, stream and state as the last one: only what
        changes from step to step (the ids' values, PDL's trigger, the step count) is redone."""
        if self.a2a.validate_expert_ids and r.T and not is_capturing(r.s):
            self._check_ids(ids, r.s)
        self.params.trigger_early, self._prev_early = r.early, r.early
        self.device.make_current()
        self._launch(r.launch, r.s)
        self.last_protocol = r.proto
        self.steps += 1
        self._dispatched_tmax, self._local_tokens = r.tmax, r.T
        views = r.extra
        for v in (views[0], *views[1]):
            v.stream = r.s
        return views

    def combine(self, partial, runtime_max_tokens_per_rank: int = None, stream=None, out=None) -> Tensor:
        """Sum, for each local token, the partial results its target ranks computed.

        partial: [ep_size, T^, hidden] (or [ep_size * T^, hidden]) of combine_dtype: the
        view from combine_input() (zero copy) or any tensor on this GPU (staged into the
        workspace first); with combine_quant="fp8", also combine_input(T^, fp8=True) once
        the epilogue has written it (then combine does not quantize). Returns `out` or a
        [local_num_tokens, hidden] view of an internal buffer valid until the next combine.
        """
        a = self.a2a
        self._check_open()
        tmax = runtime_max_tokens_per_rank
        if self._dispatched_tmax is None:
            raise StateError(f"rank {self.rank}: combine called without a dispatch before it")
        rep = self._repeat_combine
        if (rep is not None and type(tmax) is int and tmax == self._dispatched_tmax and self._local_tokens == rep.T
                and self.last_protocol == rep.proto and rep.matches(self, partial, (out,), tmax, stream)):
            return self._combine_again(rep)
        steps_before, early_before = self.steps, self._prev_early
        self._check_tmax(tmax)
        tmax = int(tmax)  # (a NumPy integer would keep its width in the byte counts below)
        if tmax != self._dispatched_tmax:
            _require(False, "runtime_max_tokens_per_rank",
                     f"combine got {tmax} but the dispatch of this step used {self._dispatched_tmax}")
        s = self.default_stream if stream is None else stream_handle(stream)
        H, T = a.combine_hidden_size, self._local_tokens
        prequantized = isinstance(partial, Fp8Partial)
        if prequantized:
            self._check_fp8_partial(partial, tmax)
        else:
            part = self._input(partial, "partial", (H,), a.combine_dtype.name, None, s, leading_dims=(1, 2))
            if part.shape[:-1] not in ((a.ep_size * tmax,), (a.ep_size, tmax)):
                _require(False, "partial", f"must be [ep_size={a.ep_size}, runtime_max_tokens_per_rank={tmax}, {H}], "
                         f"got {part.shape}")
        if out is None:  # [T, H] views of the internal buffer, one per T (no object per call)
            out_t = self._out_views.get(T)
            if out_t is None:
                out_t = self._out_views[T] = Tensor(self._out.ptr, (T, H), a.combine_dtype,
                                                    device=(CUDA, self.device.ordinal), owner=self._out)
        else:
            out_t = self._input(out, "out", (H,), a.combine_dtype.name, T, s)
        p = self.params
        p.combine_out = out_t.ptr
        p.combine_vec = vec = _vec(a.layout.combine_bytes, out_t.ptr)
        proto = self.last_protocol
        p.combine_prequantized = int(prequantized)
        self._quantizing_combine = a.combine_quant == "fp8" and not prequantized
        want, p.combine_splits = self._combine_want(T, tmax, proto, vec, quantize=not prequantized)
        launch = self._launches[proto][1]
        launch.grid = self._grid(want, self._dispatch_want(T, tmax, proto))  # (the next step's, if alike)
        self.device.make_current()
        dst = self.base + a.layout.off_combine
        stage = (dst, part.ptr, a.ep_size * tmax * a.layout.combine_bytes) \
            if not prequantized and part.ptr != dst else None
        if stage:  # staged: the partial results live outside the workspace
            call(_drv.cuMemcpyDtoDAsync, *stage, s)
        self._launch(launch, s)
        self._dispatched_tmax = None
        self._prev_step_protocol = proto
        self._after_combine(s)
        out_t.stream = s
        self._repeat_combine = _Repeat.of(self, steps_before, early_before, stream, tmax, [partial, out], s, T,
                                          proto, launch, (out_t, stage))
        return out_t

    def _fp8_input(self, tmax: int) -> tuple:
        """(combine_input(T^, fp8=True), the geometry its views must have), made once per T^:
        an engine asks for it every step and hands it to combine, whose check is then a few
        comparisons. The geometry is kept apart because a caller may change a Tensor's fields."""
        got = self._fp8_inputs.get(tmax)
        if got is None:
            a = self.a2a
            shape = (a.ep_size, tmax, a.combine_hidden_size)
            part = Fp8Partial(self._view(a.layout.off_combine_q, shape, "float8_e4m3fn", None),
                              self._view(a.layout.off_combine_scales, shape[:2] + (shape[2] // Q8_BLOCK,),
                                         "float32", None), a.combine_dtype.name)
            got = self._fp8_inputs[tmax] = (part, tuple((t.ptr, t.shape, t.dtype.name) for t in part[:2]))
        return got

    def _check_fp8_partial(self, partial: Fp8Partial, tmax: int) -> None:
        """An Fp8Partial is only ever this rank's own workspace views for this T^ (the kernel
        reads the section in place; there is nothing to stage from elsewhere)."""
        _require(self.a2a.combine_quant == "fp8", "partial",
                 f"an Fp8Partial needs combine_quant='fp8' (this all-to-all has {self.a2a.combine_quant!r})")
        want, geometry = self._fp8_input(tmax)
        for got, geo, name in zip(partial[:2], geometry, ("values", "scales")):
            if type(got) is not Tensor or (got.ptr, got.shape, got.dtype.name) != geo:
                _require(False, "partial", f"an Fp8Partial must be this rank's combine_input({tmax}, fp8=True); its "
                         f"{name} is not that view")
        _require(partial.dtype == want.dtype, "partial", f"dtype must be {want.dtype!r}, got {partial.dtype!r}")

    def _combine_again(self, r: "_Repeat") -> Tensor:
        """combine() with the same tensors, T^, stream and state as the last one (see
        _dispatch_again): the staging copy, if any, and the launch."""
        out_t, stage = r.extra
        self.params.trigger_early, self._prev_early = r.early, r.early
        self.device.make_current()
        if stage:
            call(_drv.cuMemcpyDtoDAsync, *stage, r.s)
        self._launch(r.launch, r.s)
        self._dispatched_tmax = None
        self._prev_step_protocol = r.proto
        self._after_combine(r.s)
        out_t.stream = r.s
        return out_t

    def _after_combine(self, s: int) -> None:
        if has_held() and _no_rank_mid_step() and not is_capturing(s):
            release_held()  # every rank of the process launched both phases: no kernel waits on the host

    def _dispatch_want(self, T: int, tmax: int, proto: str) -> int:
        """Blocks a dispatch would use: a block per token (FENCE: at least enough to sanitize
        the received ids in one pass; SENTINEL: one per (source, slot) to receive)."""
        a = self.a2a
        if proto == "fence":
            return max(T, -(-a.ep_size * tmax * a.top_k // (a.threads * 8)))
        return a.ep_size * tmax

    def _combine_want(self, T: int, tmax: int, proto: str, vec: int, quantize: bool = True) -> tuple:
        """(blocks, splits) of a combine of T tokens whose output takes vectors of `vec` bytes.

        Small batches spread each token over `splits` blocks until a thread issues one round
        of loads (SENTINEL polls in 16-byte groups: it splits only when the vectors are 16
        bytes). SENTINEL pushes every received slot (a block each); the FP8 quantize pass
        spreads its 128-value blocks over the whole grid, which this sizes by the slots too
        (quantize=False: the epilogue quantized, combine_input(T^, fp8=True))."""
        a = self.a2a
        units = a.combine_hidden_size // 8 if a.combine_quant else a.layout.combine_bytes // vec
        splits = max(1, min(self.max_grid // max(T, 1), -(-units // a.threads)))
        if proto == "sentinel" and vec != 16:
            splits = 1
        slots = proto == "sentinel" or (a.combine_quant and quantize)
        return max(T * splits, a.ep_size * tmax if slots else 0), splits

    def _grid(self, want: int, successor_want: int, successor_fills: bool = False) -> int:
        """Blocks for the next launch, and whether it may let its successor launch at once (PDL).

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
        runs its own FP8 quantize pass) gets the same rule even after an unheld launch. On the
        H200 at 16 tokens (in-process ranks) that combine took 22.6 µs on half the grid, 18.8
        with no early trigger at all and 19.2 under this rule; a bf16 combine there gains from
        the early trigger.
        """
        half = max(1, self.max_grid // 2)
        held = self._prev_early and want > half
        grid = max(1, min(half if self._prev_early else self.max_grid, want))
        early = self.a2a.pdl and grid <= half and (not (held or successor_fills) or successor_want <= half)
        self.params.trigger_early = int(early)
        self._prev_early = early
        return grid

    @property
    def last_grids(self) -> tuple:
        """(dispatch, combine) grids of the last step's protocol (the benchmark's floor shape)."""
        d, c = self._launches[self.last_protocol]
        return d.grid, c.grid

    def launch_empty(self, stream=None, grid: int = 1) -> None:
        """The benchmark's latency floor: an empty kernel of the protocol kernels' shape."""
        self._empty.grid = grid
        self._launch(self._empty, self.default_stream if stream is None else stream_handle(stream))

    # -- checks ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.params is None:
            raise StateError(f"rank {self.rank}: this all-to-all is closed")
        if self.record.kind:  # a kernel gave up (abort mode): refuse every call from then on
            self.raise_recorded()

    def _check_tmax(self, tmax) -> None:
        if type(tmax) is int and 1 <= tmax <= self.a2a.max_tokens_per_rank:
            return
        _require(isinstance(tmax, (int, np.integer)) and not isinstance(tmax, bool) and 1 <= tmax <= self.a2a.max_tokens_per_rank,
                 "runtime_max_tokens_per_rank",
                 f"must be an int in 1..max_tokens_per_rank={self.a2a.max_tokens_per_rank}, got {tmax!r}")

    def _input(self, obj, name: str, inner: tuple, dtype: str, rows, stream: int, leading_dims=(1,)) -> Tensor:
        """`obj` as a Tensor, checked: dtype, this GPU, contiguous, shape [*leading, *inner]
        with len(leading) in leading_dims, and `rows` rows when given."""
        # Engines pass the same tensors step after step: an ep_a2a Tensor already checked
        # under this argument name, with the same geometry, is not checked again (~1 µs each).
        # A weak reference: holding the tensor would move its cuMemFree into a later dispatch,
        # where it would block the host between two in-process ranks' launches (deadlock).
        seen = self._seen.get(name)  # (a dead reference reads None: None itself never matches)
        if seen is not None and obj is not None and seen[0]() is obj and seen[1] == (
                obj.ptr, obj.shape, obj.strides, obj.dtype, obj.device, rows, inner, dtype):
            return obj
        t = self._check_input(obj, name, inner, dtype, rows, stream, leading_dims)
        if type(obj) is Tensor:
            self._seen[name] = (weakref.ref(obj), (obj.ptr, obj.shape, obj.strides, obj.dtype, obj.device, rows,
                                                   inner, dtype))
        return t

    def _check_input(self, obj, name: str, inner: tuple, dtype: str, rows, stream: int, leading_dims) -> Tensor:
        if obj is None:
            raise TypeError(f"{name}: expected a tensor, got None")
        try:
            # a framework tensor: its producer orders pending work before our launch stream
            # (DLPack's stream argument; 0, the legacy stream, is spelled None there)
            t = as_tensor(obj, stream=stream or None)
        except (TypeError, ValueError, BufferError, RuntimeError) as e:  # (RuntimeError: e.g. torch's own refusals)
            if type(e) not in (TypeError, ValueError, BufferError, RuntimeError):
                raise  # our own errors (CudaError, ...) and other subclasses keep their type and fields
            raise type(e)(f"{name}: {e}") from None
        want = lookup_dtype(dtype)
        if t.dtype != want:
            raise TypeError(f"{name}: dtype must be {want.name}, got {t.dtype.name}")
        if t.device != (CUDA, self.device.ordinal):
            raise ValueError(f"{name}: must be on cuda:{self.device.ordinal} (this rank's GPU), got device {t.device}")
        if not t.is_contiguous:
            raise ValueError(f"{name}: must be contiguous (row-major), got strides {t.strides} for shape {t.shape}")
        if t.ptr % t.dtype.itemsize:  # kernels read whole elements (a DLPack byte offset can break this)
            raise ValueError(f"{name}: data pointer 0x{t.ptr:x} is not aligned to its {t.dtype.itemsize}-byte elements")
        if leading_dims != (1,):
            if t.ndim - len(inner) not in leading_dims or tuple(t.shape[-len(inner):]) != inner:
                raise ValueError(f"{name}: last dimension must be {inner}, got shape {t.shape}")
            return t
        if t.ndim != 1 + len(inner) or tuple(t.shape[1:]) != inner:
            raise ValueError(f"{name}: shape must be [tokens, {', '.join(map(str, inner))}], got {list(t.shape)}")
        if rows is not None and t.shape[0] != rows:
            raise ValueError(f"{name}: has {t.shape[0]} rows but token_selected_experts has {rows}")
        _require(t.shape[0] <= self.a2a.max_tokens_per_rank, name,
                 f"{t.shape[0]} tokens exceed max_tokens_per_rank={self.a2a.max_tokens_per_rank}")
        return t

    def _check_ids(self, ids: Tensor, stream: int) -> None:
        host = np.empty(ids.shape, np.int32)
        call(_drv.cuStreamSynchronize, stream)
        call(_drv.cuMemcpyDtoH, host.ctypes.data, ids.ptr, host.nbytes)
        bad = (host < -1) | (host >= self.a2a.num_experts)
        if bad.any():
            i, k = map(int, np.argwhere(bad)[0])
            raise ValueError(f"token_selected_experts: ids must be in 0..num_experts-1={self.a2a.num_experts - 1} "
                             f"or -1 (no expert); token {i}, selection {k} is {int(host[i, k])}")

    # -- errors --------------------------------------------------------------------------------
    def _launch(self, launch: Launch, stream: int) -> None:
        try:
            launch(stream)
        except CudaError as e:
            self.raise_recorded(e)
            raise

    def raise_recorded(self, cause=None) -> None:
        err = error_from_record(self.record)
        if err is not None:
            raise err from cause

    def synchronize(self) -> None:
        """Wait for this rank's GPU; raise the PeerError a kernel recorded, if any."""
        try:
            self.device.make_current()
            call(_drv.cuCtxSynchronize)
        except CudaError as e:
            self.raise_recorded(e)
            raise
        self.raise_recorded()

    def close(self) -> None:
        if self.params is None:
            return
        try:
            self.device.make_current()
            call(_drv.cuCtxSynchronize)  # a recorded PeerError was raised already; closing is allowed
        except CudaError:
            if not self.record.kind:
                raise
        finally:
            self._out.close()
            self.error.close()
            self.params = None
