"""The errors the all-to-all raises besides the driver's."""
from __future__ import annotations

from .driver.errors import EpA2AError
from .layout import ERR_TIMEOUT, ERR_TMAX_MISMATCH, PHASE_NAMES


class PeerError(EpA2AError):
    """A kernel stopped waiting on a peer and left a record (read from host-mapped memory).

    Attributes: rank (who waited), phase ('dispatch', 'combine', ...), peer (for whom),
    epoch (the step), observed/expected (what the flag read and what it needed).
    The CUDA context of the process is lost after such a trap: tear down and restart.
    """

    def __init__(self, rec, message: str):
        self.rank, self.peer, self.epoch = rec.rank, rec.peer, rec.epoch
        self.phase = PHASE_NAMES.get(rec.phase, str(rec.phase))
        self.observed, self.expected = rec.observed, rec.expected
        super().__init__(message)


class PeerTimeoutError(PeerError, TimeoutError):
    pass


class RuntimeMaxMismatchError(PeerError):
    """Ranks passed different runtime_max_tokens_per_rank in one step."""


def error_from_record(rec):
    if rec.kind == ERR_TIMEOUT:
        return PeerTimeoutError(rec, f"rank {rec.rank} timed out in {PHASE_NAMES.get(rec.phase, rec.phase)} "
                                f"waiting for rank {rec.peer} at step {rec.epoch} (its flag read {rec.observed})")
    if rec.kind == ERR_TMAX_MISMATCH:
        return RuntimeMaxMismatchError(rec, f"runtime_max_tokens_per_rank differs between ranks at step {rec.epoch}: "
                                       f"rank {rec.rank} used {rec.expected}, rank {rec.peer} used {rec.observed}")
    return None
