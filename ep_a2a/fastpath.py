"""The repeat fast path: a phase call identical to the last one skips its checks and
parameter updates, because the kernel parameter block and launch shape would come out
byte for byte the same.

Engines call with the same buffers every step. A call repeats the last one when it gets
the same ep_a2a Tensor objects (same address, shape, strides, dtype and device) for every
tensor argument, the same T^ (an int) and stream (None or an int handle), and finds the
state its result depended on unchanged (RankAlltoAll.repeat_state: PDL's trigger choice before it,
the protocol setting, the active-rank tag, whether the last combine quantized), and the first
steps' longer timeouts are over. A Tensor whose `stream` names another stream than the call's
takes the full path, which orders that stream's work first (as_tensor).
Framework tensors always take the full path (their DLPack exchange orders streams).

A caller that fills the very Tensor objects of the last call itself, and so knows whether it
changed any of their fields, may skip the geometry compare: dispatch_same / combine_same
take the record that call left and check the rest (ops/torch_views.py).
"""
from __future__ import annotations

import weakref

from .driver.memory import copy_dtod_async
from .driver.stream import is_capturing
from .group import release_frees_if_safe
from .interop.tensor import Tensor
from .validate import check_expert_ids_on_host

REPEAT_FAST_PATH = True  # (False: every call takes the full path; the CPU tests compare both)
FIRST_STEPS = 5          # steps whose timeouts differ (the first ones wait longer): never repeated


class Repeat:
    """A phase call that an identical next call may repeat (see the module docstring)."""
    __slots__ = ("refs", "geometry", "tmax", "stream", "state", "s", "T", "proto", "launch", "early", "extra")

    @classmethod
    def of(cls, rank, steps_before, early_before, stream, tmax, tensors, s, T, proto, launch, extra):
        """The record of a call just made, or None when a later call could not repeat it."""
        if not REPEAT_FAST_PATH or steps_before < FIRST_STEPS or not (stream is None or type(stream) is int):
            return None
        if any(t is not None and type(t) is not Tensor for t in tensors):
            return None
        r = cls()
        r.refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        r.geometry = tuple(None if t is None else (t.ptr, t.shape, t.strides, t.dtype, t.device) for t in tensors)
        r.tmax, r.stream = tmax, stream
        now = rank.repeat_state()
        r.state = (early_before,) + now[1:]   # what a repeating call must find before it
        r.s, r.T, r.proto, r.launch, r.early, r.extra = s, T, proto, launch, now[0], extra
        return r

    def same_call(self, rank, tmax, stream) -> bool:
        """The call's T^ and stream are the recorded call's, and the rank's state is as it found it."""
        return (type(tmax) is int and tmax == self.tmax and type(stream) is type(self.stream) and stream == self.stream
                and rank.repeat_state() == self.state)

    def matches(self, rank, first, rest, tmax, stream) -> bool:
        if not self.same_call(rank, tmax, stream):
            return False
        refs, geo = self.refs, self.geometry
        if type(rest) not in (list, tuple) or len(rest) + 1 != len(refs):
            return False
        # (hot path: `first`, then `rest` by index, without building the tuple of both to loop
        # over: ~15% less per steady-state call)
        s, i, t = self.s, 0, first
        while True:
            ref = refs[i]
            if ref is None:
                if t is not None:
                    return False
            elif t is None or ref() is not t or (t.ptr, t.shape, t.strides, t.dtype, t.device) != geo[i] \
                    or (t.stream is not None and t.stream != s):
                return False  # (a dead ref reads None; a tensor changed in place takes the full path's checks)
            if i == len(rest):
                return True
            t = rest[i]
            i += 1


class RepeatedCalls:
    """RankAlltoAll's repeats (a mixin): the state a repeat depends on, the repeated launches,
    and the entry points for callers that vouch for their Tensors themselves."""

    def repeat_state(self) -> tuple:
        """What a repeated call's result depends on besides its arguments (Repeat)."""
        return (self._prev_early, self.a2a.protocol, self._tag_hi, self._quantizing_combine)

    @property
    def last_repeats(self) -> tuple:
        """(dispatch, combine) repeat records of this rank's last calls (Repeat, None where the
        call cannot be repeated): what dispatch_same and combine_same take."""
        return self._repeat_dispatch, self._repeat_combine

    def dispatch_same(self, record: Repeat, runtime_max_tokens_per_rank: int, stream):
        """dispatch() again with the Tensors of the call that left `record`, for a caller that
        fills those very Tensor objects itself and vouches that it changed none of their
        fields since that call: the geometry compare is skipped, everything else a repeat
        checks is not. Returns the views, or None where the call does not repeat `record`
        (the caller then makes the full call, which says why)."""
        self._check_open()
        if (record is not self._repeat_dispatch or self._dispatched_tmax is not None or not self.is_active
                or not record.same_call(self, runtime_max_tokens_per_rank, stream)):
            return None
        if self.validate_expert_ids:  # (its host check may refuse the ids: the peers are told, as dispatch() does)
            return self._dispatch_or_reject(record, record.refs[0](), None, runtime_max_tokens_per_rank, stream)
        return self._dispatch_again(record, None)

    def combine_same(self, record: Repeat, runtime_max_tokens_per_rank: int, stream):
        """combine() again with the Tensors of the call that left `record`, vouched for as in
        dispatch_same. Returns `out` (as combine does), or None where the call does not
        repeat `record` (the caller then makes the full call)."""
        self._check_open()
        if (record is not self._repeat_combine or not self._combine_repeats(record, runtime_max_tokens_per_rank)
                or not record.same_call(self, runtime_max_tokens_per_rank, stream)):
            return None
        return self._combine_again(record)

    def _combine_repeats(self, rep: Repeat, tmax) -> bool:
        """What a repeated combine needs besides its arguments: this step's dispatch is the one
        the record followed (its T^, token count and protocol)."""
        return (type(tmax) is int and tmax == self._dispatched_tmax and self._local_tokens == rep.T
                and self.last_protocol == rep.proto)

    def _dispatch_again(self, r: Repeat, ids) -> tuple:
        """dispatch() as the last one: only the ids' check, PDL's trigger and the count redone."""
        if self.validate_expert_ids and r.T and not is_capturing(r.s):
            check_expert_ids_on_host(ids, r.s, self.a2a.num_experts)
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

    def _combine_again(self, r: Repeat) -> Tensor:
        """combine() as the last one: the staging copy, if any, and the launch."""
        out_t, stage = r.extra
        self.params.trigger_early, self._prev_early = r.early, r.early
        self.device.make_current()
        if stage:
            copy_dtod_async(*stage, r.s)
        self._launch(r.launch, r.s)
        self._dispatched_tmax = None
        release_frees_if_safe(r.s)
        out_t.stream = r.s
        return out_t
