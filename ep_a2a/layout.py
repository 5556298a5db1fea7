"""The one definition of the workspace layout and of the kernel parameter block.

Python computes every offset here; the kernels read them from `A2AParams`, whose C
declaration (kernels/generated/params.cuh) is generated from the ctypes structures below
by kernels/build.py (`make header`), so the two sides cannot drift apart. The same header
carries the MoE index kernels' argument block (MoeIndexArgs), the expert FC2's finalize
block (FinalizeArgs) and the packing of the slot records dispatch leaves for combine
(record_target / record_slot).

Standard library only: kernels/build.py loads this file by its path with a bare python3,
before any dependency is installed (`python3 -I -S ep_a2a/layout.py --header` prints the
header the same way; the `-m ep_a2a.layout` form needs the package on sys.path, which
`-I` removes).

A rank's workspace is one VMM allocation, mapped into every rank of the group. Its
sections (each 256-byte aligned; offsets identical on every rank):

  sync        peers write here: dispatch flags u64[ep_size][2] (step << 32 | slot count,
              step << 32 | the sender's step tag: T^ and active-set hash), combine flags
              u32[ep_size]; the abort word (0, or 1 + the rank that gave up: abort mode
              only, written by whichever rank timed out first). SENTINEL adds nothing here.
  local       this rank only: step counter (epoch) and, in the word after it, 1 while a
              FENCE dispatch must first wait for the readers of a SENTINEL step (set by a
              SENTINEL combine, cleared by FENCE's kernels: decided on the device, so that a
              graph replayed after any other works), finished-blocks counter, count of
              selections dropped because their rank was inactive, slot counters u32[ep_size], and the (target rank, slot) record of every selection
              i32[max_tokens_per_rank][top_k].
  recv[p]     dispatch workspace of payload p: ep_size regions of runtime_max_tokens_per_rank
              slots, packed with that runtime stride (so views are contiguous), sized for
              max_tokens_per_rank. payload 0 is always the int32 expert ids.
  combine     combine workspace: [ep_size, T^, combine bytes]. Its offset depends only on
              construction arguments, never on runtime_max_tokens_per_rank: a later dispatch
              must never overwrite combine data a peer may still be reading.
  combine_q   FP8 combine only: e4m3 copies of the partial results [ep_size, T^, hidden]
              and their fp32 scales [ep_size, T^, hidden / 128] (quantized by combine,
              pulled by the sources: half the bytes of bf16 over NVLink).
  SENTINEL    landing[p] [ep_size][max][landing_bytes(p)], expert-id slots
              I[2][ep_size][max][top_k + 1] (the ids, then the sender's T^), combine slots
              M[max][ep_size][round16(combine bytes)]: all initialised to their sentinel.
              Landing and combine slots are strided by max_tokens_per_rank, never by T^.
              has u8[ep_size][max]: 1 where the last dispatch received a token in slot
              (source, i) (this rank only): combine decides from it which partial results
              to push, never from the received expert ids, which a FENCE dispatch of a peer
              may overwrite while our combine still runs (protocol.cuh, protocol switch).

SENTINEL payload words (each aligned 32-bit word arrives whole, so a slot is complete when
none of its words equals the sentinel 0xFFFFFFFF); how each payload avoids that pattern:
  KIND_RAW16  formats where every bit pattern is data (packed FP4, ue8m0/uint8 scales, int32,
              opaque bytes): each 32-bit word travels as two landing words holding 16 data
              bits each (upper half zero), so no landing word can equal the sentinel. Exact,
              at twice the landing bytes for those payloads.
  KIND_F16    bf16/fp16: a word of two all-ones NaNs (0xFFFF) is stored as two 0x7FFF NaNs.
  KIND_F32    fp32: 0xFFFFFFFF (a NaN) is stored as 0x7FFFFFFF (a NaN).
  KIND_F8     fp8 e4m3/e5m2: four 0xFF NaN bytes are stored as four 0x7F NaN bytes.
Only NaNs are rewritten, and only into NaNs of the same format; reference.sentinel_escape
states the same rule for the tests.
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

MAX_RANKS = 72          # one NVL72 domain
MAX_PAYLOADS = 9        # expert ids + 8 user payloads
MAX_TOP_K = 22
ALIGN = 256
SENTINEL_WORD = 0xFFFFFFFF      # landing and combine slots (payload words)
SENTINEL_IDS = 0x88888888       # expert-id slots (differs from -1)
KIND_RAW16, KIND_F16, KIND_F32, KIND_F8 = 0, 1, 2, 3
_ESCAPABLE = {"bfloat16": KIND_F16, "float16": KIND_F16, "float32": KIND_F32,
              "float8_e4m3fn": KIND_F8, "float8_e5m2": KIND_F8}


def sentinel_kind(dtype_name: str) -> int:
    return _ESCAPABLE.get(dtype_name, KIND_RAW16)


def landing_bytes(bytes_per_token: int, kind: int) -> int:
    """Bytes of one SENTINEL landing slot: whole 16-byte vectors, doubled for KIND_RAW16."""
    b = align(bytes_per_token, 16)
    return 2 * b if kind == KIND_RAW16 else b

# error-record kinds and phases (host-mapped memory, read after a trap)
ERR_TIMEOUT, ERR_TMAX_MISMATCH, ERR_PEER_ABORTED, ERR_PEER_REJECTED = 1, 2, 3, 4
# SENTINEL's id slots and FENCE's dispatch flags carry a step tag: T^ (< 2**23) in the low bits and
# 8 bits of the active-rank mask's CRC above (bit 31 stays clear, so a tag never equals the id
# sentinel or -1), so a rank can tell both mismatches apart. A different mask is caught with
# probability 255/256; a missed one ends as a timeout on the rank that waits for too many.
TAG_TMAX_BITS = 23
# A step tag with bit 31 set says "this rank rejected its input and runs the step without
# tokens" (TAG_REJECT | its rank: never the id sentinel, never -1): peers record
# ERR_PEER_REJECTED, never trap, and complete the step (rejection.py).
TAG_REJECT = 1 << 31
Q8_BLOCK = 128  # FP8 combine: values per fp32 scale
# the kernel phase an error record names (the kernels use the EP_PHASE_* constants)
PHASE_DISPATCH, PHASE_COMBINE, PHASE_SENTINEL_DISPATCH, PHASE_SENTINEL_COMBINE = 1, 2, 3, 4
PHASE_NAMES = {PHASE_DISPATCH: "dispatch", PHASE_COMBINE: "combine",
               PHASE_SENTINEL_DISPATCH: "sentinel-dispatch", PHASE_SENTINEL_COMBINE: "sentinel-combine"}

# Dispatch's record of one selection, for combine: -1 (no slot: an invalid expert, or a
# second expert of a rank the token already reaches) or slot << RECORD_TARGET_BITS | target.
RECORD_TARGET_BITS = 8
RECORD_TARGET_MASK = (1 << RECORD_TARGET_BITS) - 1
assert MAX_RANKS <= RECORD_TARGET_MASK + 1, "a target rank must fit its record bits"

# FENCE dispatch: 16-byte groups of a token each thread loads in one round, all before the
# selection (A2AParams.push_groups; the host splits only tokens that fit).
PRELOAD_GROUPS = 4


def ids_per_load(top_k: int) -> int:
    """Expert ids of whole tokens one warp-wide load reads (A2AParams.ids_per_round: the rounds
    in which FENCE's split dispatch reads the earlier tokens' ids)."""
    return 32 // top_k * top_k


def record_target(rec):
    """Target rank of a record (int or NumPy integer array; only & is applied, so -1 is not
    mapped: callers keep records < 0 apart)."""
    return rec & RECORD_TARGET_MASK


def record_slot(rec):
    """Slot of a record on its target rank (int or NumPy integer array; only >> is applied)."""
    return rec >> RECORD_TARGET_BITS


class PayloadDesc(ctypes.Structure):
    _fields_ = [
        ("src", ctypes.c_uint64),            # this rank's [local_num_tokens, bytes] input
        ("recv_offset", ctypes.c_uint64),    # offset of recv[p] in every workspace
        ("landing_offset", ctypes.c_uint64), # SENTINEL landing slots (0 for FENCE)
        ("bytes_per_token", ctypes.c_uint32),
        ("vec", ctypes.c_uint32),            # widest aligned vector: 16, 8, 4, 2 or 1 bytes
        ("sentinel_kind", ctypes.c_uint32),  # how SENTINEL keeps words off the sentinel (KIND_*)
        ("landing_bytes", ctypes.c_uint32),  # SENTINEL landing slot stride
    ]


class A2AParams(ctypes.Structure):
    _fields_ = [
        ("peer_base", ctypes.c_uint64 * MAX_RANKS),  # every rank's workspace, as mapped here
        ("error_record", ctypes.c_uint64),           # host-mapped ErrorRecord (survives a trap)
        ("combine_out", ctypes.c_uint64),            # [local_num_tokens, hidden] output
        ("timeout_ns", ctypes.c_uint64),
        ("off_dispatch_flags", ctypes.c_uint64),     # FENCE: per source, (step, count) and (step, step tag)
        ("off_combine_flags", ctypes.c_uint64),
        ("off_epoch", ctypes.c_uint64),
        ("off_done", ctypes.c_uint64),
        ("off_abort", ctypes.c_uint64),
        ("off_dropped", ctypes.c_uint64),
        ("off_counters", ctypes.c_uint64),
        ("off_records", ctypes.c_uint64),
        ("off_combine", ctypes.c_uint64),
        ("off_combine_q", ctypes.c_uint64),          # FP8 combine: e4m3 partial results [ep, T^, hidden]
        ("off_combine_scales", ctypes.c_uint64),     # FP8 combine: fp32 scale per 128 values [ep, T^, hidden/128]
        ("off_id_slots", ctypes.c_uint64),           # SENTINEL expert-id slots (two sets)
        ("off_combine_slots", ctypes.c_uint64),      # SENTINEL combine slots
        ("off_sentinel_has", ctypes.c_uint64),       # SENTINEL: u8 per received slot, 1 if it held a token
        ("combine_bytes", ctypes.c_uint32),          # hidden * element size
        ("combine_vec", ctypes.c_uint32),
        ("rank", ctypes.c_int32),
        ("ep_size", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("experts_per_rank", ctypes.c_int32),        # floor(num_experts / ep_size)
        ("experts_remainder", ctypes.c_int32),       # the first ranks own one more
        ("local_num_tokens", ctypes.c_int32),
        ("runtime_max_tokens_per_rank", ctypes.c_int32),
        ("max_tokens_per_rank", ctypes.c_int32),
        ("num_payloads", ctypes.c_int32),
        ("combine_kind", ctypes.c_int32),            # SENTINEL escape of the partial results
        ("combine_slot_bytes", ctypes.c_int32),      # SENTINEL combine slot stride
        ("trigger_early", ctypes.c_int32),           # PDL: let the next kernel launch early (small grids; FENCE dispatch: after its pushes)
        ("combine_splits", ctypes.c_int32),          # blocks sharing one token's reduction (small batches)
        ("dispatch_splits", ctypes.c_int32),         # FENCE: blocks sharing one token's pushes (small batches)
        ("combine_prequantized", ctypes.c_int32),    # FP8 combine: the MoE epilogue wrote combine_q itself
        ("abort_on_timeout", ctypes.c_int32),        # 1: a failed wait records, tells the peers and returns; 0: traps
        ("peers_on_device", ctypes.c_int32),         # 1: every rank lives on this GPU, so the flags use gpu scope
        ("step_tag", ctypes.c_uint32),               # T^ | mask hash << TAG_TMAX_BITS: what peers must agree on
        ("active", ctypes.c_uint32 * ((MAX_RANKS + 31) // 32)),  # bit r: rank r takes part (active-rank mask)
        ("payloads", PayloadDesc * MAX_PAYLOADS),
        # Decisions of the host (schedule.py) the kernels take as given, after the payloads so
        # that every field above keeps its offset:
        ("push_groups", ctypes.c_int32),          # FENCE dispatch: a token's 16-byte groups, each thread's loaded before the selection; 0: payload by payload
        ("ids_per_round", ctypes.c_int32),        # FENCE split dispatch: ids of whole tokens one warp-wide load reads (ids_per_load)
        ("dispatch_cluster", ctypes.c_int32),     # FENCE dispatch: 1 when the grid is one cluster (the cluster barrier replaces the election)
        ("combine_push_blocks", ctypes.c_int32),  # SENTINEL combine: blocks [0, n) push the received slots (Schedule.combine_push_blocks)
    ]


class ErrorRecord(ctypes.Structure):
    """What a kernel leaves for the host before it traps (or, in abort mode, returns)."""
    _fields_ = [
        ("kind", ctypes.c_uint32),       # 0: none, ERR_*; written last (release): non-zero = complete
        ("rank", ctypes.c_int32),        # the rank that waited
        ("phase", ctypes.c_int32),       # PHASE_NAMES
        ("peer", ctypes.c_int32),        # the rank it waited for
        ("epoch", ctypes.c_uint32),      # the step it waited for
        ("observed", ctypes.c_uint32),   # what it last read
        ("expected", ctypes.c_uint32),
        ("claim", ctypes.c_uint32),      # 1 once a failing thread took the record (it alone writes it)
    ]


class MoeIndexArgs(ctypes.Structure):
    """Argument block of the MoE index kernels (kernels/moe_compute.cu): device pointers as
    u64 here, typed in C (_c_types_)."""
    _fields_ = [
        ("expert_ids", ctypes.c_uint64),    # [slots, top_k]: the dispatched expert ids
        ("weights", ctypes.c_uint64),       # [slots, top_k]: the dispatched router weights
        ("counts", ctypes.c_uint64),        # [num_local]: rows of each local expert
        ("offsets", ctypes.c_uint64),       # [num_local + 1]: first row of each local expert; last = total rows
        ("rows", ctypes.c_uint64),          # [slots * top_k]: the slot permuted row p comes from
        ("row_weight", ctypes.c_uint64),    # [slots * top_k]: the router weight of permuted row p
        ("row_of", ctypes.c_uint64),        # [slots, top_k]: permuted row of (slot, k), -1 if not a local expert
        ("tile_counts", ctypes.c_uint64),   # [num_local, num_tiles]: the table of the multi-kernel path
        ("n_entries", ctypes.c_int32),      # slots * top_k
        ("top_k", ctypes.c_int32),
        ("first_expert", ctypes.c_int32),   # this rank's local experts are [first_expert, first_expert + num_local)
        ("num_local", ctypes.c_int32),
        ("tile_entries", ctypes.c_int32),   # entries of one warp tile (a multiple of 32)
        ("num_tiles", ctypes.c_int32),      # warp tiles of the multi-kernel path (gridDim.x * warps per block)
    ]
    _c_types_ = {"expert_ids": "const int*", "weights": "const float*", "counts": "int*", "offsets": "int*",
                 "rows": "int*", "row_weight": "float*", "row_of": "int*", "tile_counts": "int*"}


class FinalizeArgs(ctypes.Structure):
    """The finalize that FC2 of the expert kernels runs after its rows (kernels/moe_experts.cu,
    moe_experts.expert_fc2(finalize_into=...)); out = 0: none."""
    _fields_ = [
        ("out", ctypes.c_uint64),           # [slots, hidden] bf16: the combine input
        ("row_of", ctypes.c_uint64),        # [slots, top_k] of the index
        ("row_weight", ctypes.c_uint64),    # [slots * top_k] of the index
        ("done", ctypes.c_uint64),          # a count per column tile, zero between calls (the last block resets it)
        ("slots", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
    ]
    _c_types_ = {"out": "void*", "row_of": "const int*", "row_weight": "const float*", "done": "int*"}


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class WorkspaceLayout:
    """Byte offsets of every section of one rank's workspace (identical on every rank)."""
    ep_size: int
    max_tokens_per_rank: int
    top_k: int
    payload_bytes: tuple          # bytes per token of each payload, payload 0 = expert ids
    combine_bytes: int
    sentinel: bool
    off_dispatch_flags: int = 0
    off_combine_flags: int = 0
    off_epoch: int = 0
    off_done: int = 0
    off_abort: int = 0
    off_dropped: int = 0
    off_counters: int = 0
    off_records: int = 0
    off_recv: tuple = ()
    off_combine: int = 0
    off_combine_q: int = 0
    off_combine_scales: int = 0
    off_landing: tuple = ()
    off_id_slots: int = 0
    off_combine_slots: int = 0
    off_sentinel_has: int = 0
    landing_bytes: tuple = ()
    size: int = 0

    @classmethod
    def build(cls, ep_size, max_tokens_per_rank, top_k, payload_bytes, combine_bytes, sentinel=True,
              landing=None, q8_hidden=0):
        """landing: bytes of each payload's SENTINEL landing slot (landing_bytes()); payload 0,
        the expert ids, travels in the id slots instead. q8_hidden: hidden size of an FP8
        combine (0: none)."""
        P, T = ep_size, max_tokens_per_rank
        o = {}
        cur = 0

        def take(name, nbytes):
            nonlocal cur
            o[name] = cur
            cur = align(cur + nbytes)
            return o[name]

        take("off_dispatch_flags", 16 * P)  # two u64 words per source (kernels/protocol.cuh: dispatch_flag)
        take("off_combine_flags", 4 * P)
        take("off_epoch", 8)   # u32 epoch, u32 "the last combine was SENTINEL's"
        take("off_done", 4)
        take("off_abort", 4)
        take("off_dropped", 4)
        take("off_counters", 4 * P)
        take("off_records", 4 * T * top_k)
        recv = tuple(take(f"recv{i}", P * T * b) for i, b in enumerate(payload_bytes))
        take("off_combine", P * T * combine_bytes)
        if q8_hidden:
            take("off_combine_q", P * T * q8_hidden)
            take("off_combine_scales", P * T * (q8_hidden // Q8_BLOCK) * 4)
        off_landing = ()
        if sentinel:
            landing_b = landing or tuple(landing_bytes(b, KIND_RAW16) for b in payload_bytes)
            off_landing = (0,) + tuple(take(f"land{i}", P * T * landing_b[i]) for i in range(1, len(payload_bytes)))
            take("off_id_slots", 2 * P * T * 4 * (top_k + 1))
            take("off_combine_slots", T * P * align(combine_bytes, 16))
            take("off_sentinel_has", P * T)
            o["landing_b"] = landing_b
        fields = {k: v for k, v in o.items() if k.startswith("off_")}
        return cls(ep_size=P, max_tokens_per_rank=T, top_k=top_k, payload_bytes=tuple(payload_bytes),
                   combine_bytes=combine_bytes, sentinel=sentinel, off_recv=recv, off_landing=off_landing,
                   landing_bytes=tuple(o.get("landing_b", ())), size=max(cur, ALIGN), **fields)

    def sentinel_ranges(self):
        """(offset, nbytes, word) ranges that SENTINEL needs initialised before the first step."""
        if not self.sentinel:
            return []
        P, T = self.ep_size, self.max_tokens_per_rank
        out = [(self.off_landing[i], P * T * self.landing_bytes[i], SENTINEL_WORD)
               for i in range(1, len(self.payload_bytes))]
        out.append((self.off_id_slots, 2 * P * T * 4 * (self.top_k + 1), SENTINEL_IDS))
        out.append((self.off_combine_slots, T * P * align(self.combine_bytes, 16), SENTINEL_WORD))
        return out

    def fill_params(self, p: "A2AParams", kinds) -> None:
        """Write this layout into a kernel parameter block: every section offset, the combine
        slot sizes and each payload's receive (and SENTINEL landing) geometry; `kinds` is the
        sentinel kind of each payload, the expert ids first."""
        for f in ("off_dispatch_flags", "off_combine_flags", "off_epoch", "off_done", "off_abort",
                  "off_dropped", "off_counters", "off_records", "off_combine", "off_combine_q", "off_combine_scales",
                  "off_id_slots", "off_combine_slots", "off_sentinel_has"):
            setattr(p, f, getattr(self, f))
        p.combine_bytes = self.combine_bytes
        p.combine_slot_bytes = align(self.combine_bytes, 16)
        p.max_tokens_per_rank = self.max_tokens_per_rank
        p.ids_per_round = ids_per_load(self.top_k)
        p.num_payloads = len(self.payload_bytes)
        for q, b in enumerate(self.payload_bytes):
            d = p.payloads[q]
            d.recv_offset, d.bytes_per_token, d.sentinel_kind = self.off_recv[q], b, kinds[q]
            if self.sentinel and q:
                d.landing_offset, d.landing_bytes = self.off_landing[q], self.landing_bytes[q]

    def expert_major_bytes(self, num_local_experts: int) -> int:
        """Receive bytes an expert-major layout would need for the same setting (paper §3.2)."""
        per_token = sum(self.payload_bytes) + self.combine_bytes
        return self.ep_size * self.max_tokens_per_rank * min(self.top_k, num_local_experts) * per_token


# ---------------------------------------------------------------------------------------
# C header generation (make runs this; kernels include the result)
_CTYPES_TO_C = {ctypes.c_uint64: "unsigned long long", ctypes.c_uint32: "unsigned int",
                ctypes.c_int32: "int"}


def _c_struct(st) -> str:
    lines = [f"struct {st.__name__} {{"]
    c_types = getattr(st, "_c_types_", {})
    for name, typ in st._fields_:
        if name in c_types:     # a typed device pointer, the same 8 bytes as its u64
            assert ctypes.sizeof(typ) == 8, name
            lines.append(f"  {c_types[name]} {name};")
        elif hasattr(typ, "_length_"):
            base, n = typ._type_, typ._length_
            cname = _CTYPES_TO_C.get(base, base.__name__)
            lines.append(f"  {cname} {name}[{n}];")
        else:
            lines.append(f"  {_CTYPES_TO_C[typ]} {name};")
    lines.append("};")
    lines.append(f"static_assert(sizeof({st.__name__}) == {ctypes.sizeof(st)}, \"layout.py and the kernels disagree\");")
    return "\n".join(lines)


def c_header() -> str:
    consts = {"KIND_RAW16": KIND_RAW16, "KIND_F16": KIND_F16, "KIND_F32": KIND_F32, "KIND_F8": KIND_F8,
              "MAX_RANKS": MAX_RANKS, "MAX_PAYLOADS": MAX_PAYLOADS, "MAX_TOP_K": MAX_TOP_K,
              "SENTINEL_WORD": f"0x{SENTINEL_WORD:08X}u", "SENTINEL_IDS": f"0x{SENTINEL_IDS:08X}u",
              "ERR_TIMEOUT": ERR_TIMEOUT, "ERR_TMAX_MISMATCH": ERR_TMAX_MISMATCH,
              "ERR_PEER_ABORTED": ERR_PEER_ABORTED, "ERR_PEER_REJECTED": ERR_PEER_REJECTED,
              "TAG_TMAX_BITS": TAG_TMAX_BITS, "TAG_REJECT": f"0x{TAG_REJECT:08X}u", "Q8_BLOCK": Q8_BLOCK,
              "PHASE_DISPATCH": PHASE_DISPATCH, "PHASE_COMBINE": PHASE_COMBINE,
              "PHASE_SENTINEL_DISPATCH": PHASE_SENTINEL_DISPATCH, "PHASE_SENTINEL_COMBINE": PHASE_SENTINEL_COMBINE,
              "RECORD_TARGET_BITS": RECORD_TARGET_BITS, "RECORD_TARGET_MASK": f"0x{RECORD_TARGET_MASK:X}",
              "PRELOAD_GROUPS": PRELOAD_GROUPS}
    parts = ["// Generated from ep_a2a/layout.py by kernels/build.py (make header). Do not edit.",
             "#pragma once"]
    parts += [f"#define EP_{k} {v}" for k, v in consts.items()]
    parts += [_c_struct(s) for s in (PayloadDesc, A2AParams, ErrorRecord, MoeIndexArgs, FinalizeArgs)]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--header"]:
        sys.stdout.write(c_header())
    else:
        sys.exit("usage: python3 ep_a2a/layout.py --header")
