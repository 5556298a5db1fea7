"""Dispatch and combine in two halves each, for engines that overlap communication with compute.

    h = rank.dispatch_send(ids, [x], T_hat)    # issues every store and flag; waits on no peer*
    ...                                        # the GPU runs other work here (another micro-batch)
    ids_v, (x_v,) = h.receive()                # or rank.dispatch_recv(): waits, sanitizes
    c = rank.combine_send(partial, T_hat)      # publishes our partial results (FENCE) / pushes them (SENTINEL)
    ...
    y = c.receive()                            # or rank.combine_recv(): waits, reduces

* Except FENCE's dispatch send right after a SENTINEL step (protocol="auto" switching): it
first waits for every peer's end of that step, as the whole FENCE dispatch does.

A send half and its receive half are two kernels on one stream (the send's): the receive
half reads the step the send half left on the device, so graphs of the halves, captured
separately, replay in any order that keeps each send before its receive on that stream.
What each half is, per protocol (docs/overlap.md):
- FENCE dispatch: send = pick slots, push, publish the counts (Alg. 1 lines 1-10); receive =
  wait for every rank's counts, sanitize the ids (lines 11-15).
- FENCE combine: send = publish that our partial results are ready, FP8-quantized first when
  combine quantizes (lines 16-19); the flag also says this rank reads nothing of the step's
  dispatch any more; receive = wait for every rank's flag, pull and reduce (lines 20-23).
- SENTINEL dispatch: send = push tokens and expert ids (Alg. 2 lines 2-4); receive = poll
  and copy (lines 5-11). SENTINEL combine: send = push our partial results to their owners
  (line 13); receive = poll and reduce (lines 15-19).

Nothing of the same all-to-all may run between a send half and its receive half: a receive
without its send, twice, or after another call raises HalvesOrderError before any launch
(schedule.check_order), eagerly and while capturing. Two micro-batches in flight are two
all-to-alls (each its own workspace and steps), in any interleaving of their halves.
"""
from __future__ import annotations

import dataclasses

from .driver.memory import copy_dtod_async
from .errors import HalvesOrderError, StateError
from .group import release_frees_if_safe
from .schedule import COMBINE_RECEIVE, COMBINE_SEND, DISPATCH_RECEIVE, DISPATCH_SEND, Call, check_order

_RECEIVES = {"dispatch": Call(DISPATCH_RECEIVE, 0, 0, None), "combine": Call(COMBINE_RECEIVE, 0, 0, None)}


class Handle:
    """A send half in flight: `receive()` issues its receive half (the hook engines call later)."""
    __slots__ = ("_halves", "op", "stream", "result", "received")

    def __init__(self, halves, op: str, stream: int, result):
        self._halves, self.op, self.stream, self.result, self.received = halves, op, stream, result, False

    def receive(self):
        """Issue the receive half on the send's stream; returns what the whole call returns
        (dispatch: the views; combine: the output)."""
        return self._halves.receive(self.op, self)

    def __repr__(self):
        return f"<{self.op} send half of rank {self._halves.rank.rank}{', received' if self.received else ''}>"


class Halves:
    """The halves of one rank (RankAlltoAll.halves): the handle whose receive is due."""

    def __init__(self, rank):
        self.rank, self.due = rank, None

    def dispatch_send(self, token_selected_experts, payloads=(), runtime_max_tokens_per_rank: int = None,
                      stream=None) -> Handle:
        """dispatch()'s send half: the same arguments; returns the handle whose receive()
        returns dispatch()'s views."""
        rank = self.rank
        rank.check_open()
        check_order(rank.plan, rank.state, DISPATCH_SEND)
        if not rank.is_active:
            raise StateError(f"rank {rank.rank}: not an active rank (set_active_ranks)")
        try:
            call, handle, views = rank.dispatch_call(token_selected_experts, payloads, runtime_max_tokens_per_rank, stream)
        except (TypeError, ValueError) as e:
            rank.reject_step(runtime_max_tokens_per_rank, stream, e)
            raise
        rank.run_half(dataclasses.replace(call, phase=DISPATCH_SEND), handle)
        return self._sent("dispatch", handle, views)

    def combine_send(self, partial, runtime_max_tokens_per_rank: int = None, stream=None, out=None) -> Handle:
        """combine()'s send half: the same arguments (the output `out` is written by the
        receive half); returns the handle whose receive() returns combine()'s output."""
        rank = self.rank
        rank.check_open()
        check_order(rank.plan, rank.state, COMBINE_SEND)
        call, handle, out_t, stage = rank.combine_call(partial, runtime_max_tokens_per_rank, stream, out)
        if stage:
            rank.device.make_current()
            copy_dtod_async(*stage, handle)
        rank.run_half(dataclasses.replace(call, phase=COMBINE_SEND), handle)
        return self._sent("combine", handle, out_t)

    def _sent(self, op, stream, result) -> Handle:
        self.due = Handle(self, op, stream, result)
        return self.due

    def receive(self, op: str, handle: Handle = None):
        """The receive half of `op` (`handle`: the send's, or None for the one due)."""
        rank = self.rank
        rank.check_open()
        if handle is not None and handle is not self.due:
            state = "was received already" if handle.received else "is not the send half due on this rank"
            raise HalvesOrderError(f"rank {rank.rank}: {handle!r} {state}")
        check_order(rank.plan, rank.state, _RECEIVES[op].phase)
        due = self.due
        rank.run_half(_RECEIVES[op], due.stream)
        self.due, due.received = None, True
        if op == "dispatch":
            ids, views = due.result
            for view in (ids, *views):
                view.stream = due.stream  # consumers on other streams wait for this half (DLPack)
        else:
            release_frees_if_safe(due.stream)
            due.result.stream = due.stream
        return due.result
