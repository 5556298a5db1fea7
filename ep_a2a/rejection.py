"""A rank that rejects its input when its peers may already have launched the step.

Ranks in other processes (a ProcessGroup) cannot see this rank's ValueError. A peer that
launched its dispatch would wait for us until its timeout and then, in trap mode, lose its
CUDA context. So when dispatch() rejects its input on such a rank, the rank still runs that
step, without tokens and under a step tag that says so (layout.TAG_REJECT | rank, planned by
schedule.plan_step with Call.rejected), and then raises the error:
  - every peer completes the step: our dispatch sends nothing and receives what they send;
    our combine serves the slots they routed here from a combine input set to all-ones
    (NaN: poisoned_spans), so each of their tokens that chose one of our experts combines to
    NaN (and a block of theirs whose wait on us gave up poisons its other rows too: exact or
    NaN, never garbage);
  - each peer's kernels record ERR_PEER_REJECTED, never trap, and set the peer's own abort
    word, so that every later wait of that peer gives up at once (its host may have queued
    more steps before it reads the record); its combine of that step still runs, and its
    next call raises PeerRejectedError naming us;
  - this rank refuses every later call with a StateError. Build a new all-to-all everywhere.
A runtime_max_tokens_per_rank that is itself invalid forms no step: nothing runs then, and
the peers wait until their timeout. Ranks of one process (LocalGroup) raise before any
launch, as every bad argument does: their caller sees the error before it launches the
other ranks, or has launched them itself.
"""
from __future__ import annotations

from .layout import ERR_PEER_REJECTED, Q8_BLOCK


def refuses(record, mid_step: bool) -> bool:
    """A kernel left a record: refuse every call, except the combine (and synchronize) that
    completes a step the peers of a rejecting rank are in (its flags must go out)."""
    return bool(record.kind) and not (record.kind == ERR_PEER_REJECTED and mid_step)


def poisoned_spans(layout, combine_quant, hidden: int, rows: int) -> list:
    """(offset, bytes) of the combine input sections a rejected step fills with 0xFF: the
    partial results and, with an FP8 combine, the copies the peers pull as if an epilogue wrote them."""
    spans = [(layout.off_combine, rows * layout.combine_bytes)]
    if combine_quant == "fp8":
        spans += [(layout.off_combine_q, rows * hidden), (layout.off_combine_scales, rows * (hidden // Q8_BLOCK) * 4)]
    return spans


def message(rank: int, err) -> str:
    return (f"rank {rank} rejected its input at a step its peers took part in ({type(err).__name__}: {err}); "
            "it ran that step without tokens and every peer raises PeerRejectedError: build a new all-to-all on every rank")
