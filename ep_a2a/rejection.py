"""A rank that rejects its input when its peers may already have launched the step.

Ranks in other processes (a ProcessGroup) cannot see this rank's ValueError. A peer that
launched its dispatch would wait for us until its timeout and then, in trap mode, lose its
CUDA context. So when dispatch() rejects its input on such a rank, the rank still runs that
step, without tokens and under a step tag that says so (layout.TAG_REJECT | rank), and then
raises the error:
  - every peer completes the step: our dispatch sends nothing and receives what they send;
    our combine serves the slots they routed here from a combine input set to all-ones
    (NaN), so each of their tokens that chose one of our experts combines to NaN (and a
    block of theirs whose wait on us gave up poisons its other rows too: exact or NaN,
    never garbage);
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

from . import schedule
from .driver.memory import memset_d8_async
from .driver.stream import stream_handle
from .layout import ERR_PEER_REJECTED, Q8_BLOCK, TAG_REJECT
from .validate import check_runtime_max


class RejectedStep:
    """RankAlltoAll's part of the rule above (a mixin: it runs the rank's own launches)."""

    def _dispatch_or_reject(self, repeat, token_selected_experts, payloads, runtime_max_tokens_per_rank, stream):
        """dispatch() after its state checks: the repeat of the last call (`repeat`: its host
        id check may still reject) or the full path."""
        try:
            if repeat is not None:
                return self._dispatch_again(repeat, token_selected_experts)
            return self._dispatch_checked(token_selected_experts, payloads, runtime_max_tokens_per_rank, stream)
        except (TypeError, ValueError) as e:
            self.reject_step(runtime_max_tokens_per_rank, stream, e)
            raise

    def _refuses(self) -> bool:
        """A kernel left a record: refuse every call, except the combine (and synchronize)
        that completes a step the peers of a rejecting rank are in (its flags must go out)."""
        return bool(self.record.kind) and not (self.record.kind == ERR_PEER_REJECTED and self.mid_step)

    def reject_step(self, runtime_max_tokens_per_rank, stream, err) -> None:
        """This rank rejects its input for the next step (`err`, which the caller raises):
        on a rank alone in its process, run that step without tokens as above; on ranks of
        one process, nothing. dispatch() does this itself; a framework layer that refuses
        its arguments before it calls dispatch() calls this first."""
        if not self._tells_peers or self.rejected or self.mid_step:
            return
        a, tmax = self.a2a, runtime_max_tokens_per_rank
        try:
            check_runtime_max(tmax, a.max_tokens_per_rank)
            s = self.default_stream if stream is None else stream_handle(stream)
        except (TypeError, ValueError):
            return
        tmax, p, L, sch = int(tmax), self.params, a.layout, self.schedule
        proto = a.protocol_for(tmax)
        self.rejected = (f"rank {self.rank} rejected its input at a step its peers took part in "
                         f"({type(err).__name__}: {err}); it ran that step without tokens and every peer raises "
                         "PeerRejectedError: build a new all-to-all on every rank")
        dispatch, combine = self._launches[proto]
        p.local_num_tokens, p.runtime_max_tokens_per_rank, p.step_tag = 0, tmax, TAG_REJECT | self.rank
        p.dispatch_splits = 1
        self.device.make_current()
        dispatch.grid = self._grid(sch.dispatch_want(0, tmax, proto), 1)
        self._launch(dispatch, s)
        H, rows = a.combine_hidden_size, a.ep_size * tmax
        spans = [(L.off_combine, rows * L.combine_bytes)]
        if a.combine_quant == "fp8":  # the FP8 copies the peers pull, as if an epilogue wrote them
            spans += [(L.off_combine_q, rows * H), (L.off_combine_scales, rows * (H // Q8_BLOCK) * 4)]
        for off, nbytes in spans:
            memset_d8_async(self.base + off, 0xFF, nbytes, s)
        p.combine_out, p.combine_prequantized = self._out.ptr, int(a.combine_quant == "fp8")
        p.combine_vec = schedule.vector_bytes(L.combine_bytes, self.base + L.off_combine, self._out.ptr)
        want, p.combine_splits = sch.combine_want(0, tmax, proto, p.combine_vec, quantize=False)
        combine.grid = self._grid(want, 1)
        self._launch(combine, s)
        self.steps += 1
        self._repeat_dispatch = self._repeat_combine = None
