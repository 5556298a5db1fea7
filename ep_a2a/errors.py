"""Every exception ep_a2a raises: the driver's family (re-exported from driver/errors.py),
and those of the all-to-all, its peers, the bootstrap and the topology check. Bad arguments
raise the built-in TypeError / ValueError (validate.py)."""
from __future__ import annotations

from .driver.errors import (CudaError, DriverTooOldError, EpA2AError, ForkedProcessError,  # noqa: F401 (re-exported)
                            NoDriverError, UnsupportedDeviceError)
from .layout import ERR_PEER_ABORTED, ERR_PEER_REJECTED, ERR_TIMEOUT, ERR_TMAX_MISMATCH, PHASE_NAMES, TAG_TMAX_BITS


class StateError(EpA2AError):
    """dispatch/combine called out of order, or on a closed all-to-all."""


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
    pass


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


def error_from_record(rec, lost: bool = False):
    """The PeerError a record holds, or None. lost: the context died (a CudaError), so a
    record whose fields were written but whose kind was not (the claim taken; another rank's
    trap ended the kernel first) is reported too, rather than only the driver's
    'unspecified launch failure'. While kernels run such a record is still being written."""
    phase = PHASE_NAMES.get(rec.phase, rec.phase)
    if lost and rec.claim and not rec.kind:
        return PeerError(rec, f"rank {rec.rank} was recording a failed wait in {phase} (for rank {rec.peer} at step "
                         f"{rec.epoch}, its word read {rec.observed:#x}) when the CUDA context was lost, most likely "
                         "by another rank's trap; the record's kind never arrived")
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
