"""Every exception ep_a2a raises: the driver's family (re-exported from driver/errors.py),
and those of the all-to-all, its peers, the bootstrap and the topology check. Bad arguments
raise the built-in TypeError / ValueError (validate.py)."""
from __future__ import annotations

import functools

from .driver.errors import (CudaError, DriverTooOldError, EpA2AError, ForkedProcessError,  # noqa: F401 (re-exported)
                            NoDriverError, UnsupportedDeviceError)
from .layout import ERR_PEER_ABORTED, ERR_PEER_REJECTED, ERR_TIMEOUT, ERR_TMAX_MISMATCH, PHASE_NAMES, TAG_TMAX_BITS


class StateError(EpA2AError):
    """dispatch/combine called out of order, or on a closed all-to-all."""


class ArgumentTypeError(TypeError, ValueError):
    """A call argument of the wrong type, where that argument's other rules raise ValueError:
    code that catches either class catches it."""


class HalvesOrderError(StateError):
    """A send or receive half called out of its order (halves.py): raised before any launch."""


class BootstrapError(EpA2AError):
    """The group could not be formed or a collective failed; the bootstrap is closed afterwards."""


class BootstrapTimeout(BootstrapError):
    """A wait ran past the timeout; `missing` lists the ranks that did not arrive."""

    def __init__(self, message: str, missing=()):
        self.missing = sorted(missing)
        super().__init__(message)


class TopologyError(EpA2AError):
    """The GPUs of a group cannot all reach each other over NVLink, or NVML cannot tell."""


class PeerError(EpA2AError):
    """A kernel stopped waiting on a peer and left a record (read from host-mapped memory).

    Attributes: rank (who waited), phase ('dispatch', 'combine', ...), peer (for whom),
    epoch (the step), observed/expected (what the flag read and what it needed).
    With on_timeout="trap" the CUDA context of the process is lost: tear down and restart.
    With on_timeout="abort" it survives: close the all-to-all and build a new one.
    """

    def __init__(self, rec, message: str):
        self.rank, self.peer, self.epoch = rec.rank, rec.peer, rec.epoch
        self.phase = PHASE_NAMES.get(rec.phase, str(rec.phase))
        self.observed, self.expected = rec.observed, rec.expected
        super().__init__(message)


class PeerTimeoutError(PeerError, TimeoutError):
    """A kernel waited for a peer past its deadline (timeout_s); `peer`, `phase` and `epoch`
    say who was missing where."""


class PeerAbortedError(PeerError):
    """on_timeout="abort": another rank gave up (`peer`), so this one stopped waiting too."""


class RuntimeMaxMismatchError(PeerError):
    """Ranks passed different runtime_max_tokens_per_rank in one step."""


class PeerRejectedError(PeerError):
    """Rank `peer` (in another process) rejected its input at step `epoch` and ran that step
    without tokens: every token of ours that chose one of its experts combined to NaN (others
    of that step may have too, never to anything else). No context was lost; build a new
    all-to-all on every rank (ep_a2a/rejection.py)."""


class ActiveRanksMismatchError(PeerError):
    """Ranks used different active-rank sets (set_active_ranks) in one step."""


LAUNCH_FAILED = 719  # CUDA_ERROR_LAUNCH_FAILED: what a kernel's trap leaves (the context is lost)


def error_from_records(own, others=(), cause=None):
    """The PeerError of record `own`, or None. When `cause` is the CudaError a trap leaves,
    the context is lost for every rank of this process, so the first complete record among
    `others` (those ranks' records) comes next, and failing that a record whose claim was
    taken but whose kind never arrived (its writer was ended first: by a block of its own
    rank that lost the claim and trapped at once, or by another rank's trap). While kernels
    run such a record is still being written, so only a lost context reads it."""
    err = error_from_record(own)
    if err is not None or getattr(cause, "code", None) != LAUNCH_FAILED:
        return err
    recs = [own, *others]
    err = next((e for e in map(error_from_record, recs) if e is not None), None)
    rec = next((r for r in recs if r.claim and not r.kind), None)
    if err is not None or rec is None:
        return err
    what = (f"rank {rec.rank} was recording a failure in {PHASE_NAMES[rec.phase]} (its fields, which may be incomplete, "
            f"name rank {rec.peer} at step {rec.epoch} and the word {rec.observed:#x})" if rec.phase in PHASE_NAMES
            else "a kernel had begun recording a failure (none of its fields arrived)")
    return PeerError(rec, f"{what} when the CUDA context was lost, before the record's kind was written")


def error_from_record(rec):
    phase = PHASE_NAMES.get(rec.phase, rec.phase)
    if rec.kind == ERR_TIMEOUT:
        return PeerTimeoutError(rec, f"rank {rec.rank} timed out in {phase} "
                                f"waiting for rank {rec.peer} at step {rec.epoch} (its flag read {rec.observed})")
    if rec.kind == ERR_PEER_ABORTED:
        return PeerAbortedError(rec, f"rank {rec.rank} stopped waiting in {phase} at step {rec.epoch}: "
                                f"rank {rec.peer} gave up on a peer (on_timeout='abort')")
    if rec.kind == ERR_PEER_REJECTED:
        return PeerRejectedError(rec, f"rank {rec.peer} rejected its input at step {rec.epoch} and took part without "
                                 f"tokens (its dispatch raised there): rank {rec.rank}'s tokens routed to it "
                                 "combined to NaN, others of that step may have too; build a new all-to-all on "
                                 "every rank")
    if rec.kind == ERR_TMAX_MISMATCH:  # observed/expected are step tags: T^ | mask hash above
        low = (1 << TAG_TMAX_BITS) - 1
        theirs, ours = rec.observed & low, rec.expected & low
        if theirs == ours:
            return ActiveRanksMismatchError(rec, f"active ranks differ between ranks at step {rec.epoch}: rank "
                                            f"{rec.peer} did not call set_active_ranks with the same set as rank {rec.rank}")
        return RuntimeMaxMismatchError(rec, f"runtime_max_tokens_per_rank differs between ranks at step {rec.epoch}: "
                                       f"rank {rec.rank} used {ours}, rank {rec.peer} used {theirs}")
    return None


def recorded_on_lost_context(method):
    """Decorates a public call of an all-to-all rank (anything with raise_recorded): a driver
    call failing after a lost context raises the PeerError a kernel recorded, not the CudaError."""
    @functools.wraps(method)
    def call(self, *args, **kw):
        try:
            return method(self, *args, **kw)
        except CudaError as e:
            self.raise_recorded(e)
            raise
    return call
