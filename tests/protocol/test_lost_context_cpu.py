"""After a peer's kernel trapped, every driver call of this process fails (CUDA_ERROR_LAUNCH_FAILED)
while this rank's own record may be empty: each public call must then raise the PeerError
that a rank of the process recorded, never the raw CudaError, whichever driver call it
reaches first (the host expert-id check's copy, a stream wait, a staging copy, a launch, a
synchronize). On the CPU: test_repeat_cpu's rank, whose driver calls here all fail."""
import types

import numpy as np
import pytest

import ep_a2a.alltoall as A
import ep_a2a.interop.tensor as tensor_module
from ep_a2a import layout
from ep_a2a.errors import CudaError, LAUNCH_FAILED, PeerTimeoutError
from ep_a2a.interop.tensor import Tensor
from test_repeat_cpu import EP, H, _rank, recorder  # noqa: F401 (recorder: the fixture)

T, TMAX = 4, 16


def _inputs(specs, offset=0):
    ids = Tensor((1 << 33) + offset, (T, 8), "int32", device=(2, 0))
    pays = [Tensor((1 << 34) + offset + (1 << 30) * q, (T,) + tuple(s.shape), s.dtype, device=(2, 0))
            for q, s in enumerate(specs)]
    return ids, pays


def _lose_context(monkeypatch, a2a, r, peer_rank):
    """A kernel of another rank of this process recorded a timeout and trapped: from now on
    every driver call fails as a lost context does."""
    peer = types.SimpleNamespace(record=layout.ErrorRecord())
    peer.record.kind, peer.record.rank, peer.record.peer, peer.record.phase = layout.ERR_TIMEOUT, peer_rank, 0, 0
    a2a.ranks = [r, peer]
    calls = []

    def lost(name):
        def fail(*args, **kw):
            calls.append(name)
            raise CudaError(name, LAUNCH_FAILED)
        return fail
    for name in ("check_expert_ids_on_host", "copy_dtod_async", "copy_dtoh", "memset_d8_async"):
        monkeypatch.setattr(A, name, lost(name))
    monkeypatch.setattr(tensor_module, "_wait", lost("cuStreamWaitEvent"))
    r.device.synchronize = lost("cuCtxSynchronize")
    monkeypatch.setattr(type(r.plan.launches["fence"][0]), "__call__", lambda self, stream: lost("cuLaunchKernelEx")())
    return calls


def _calls(r, specs):
    ids, pays = _inputs(specs)
    on_other_stream = Tensor(1 << 33, (T, 8), "int32", device=(2, 0), stream=99)
    return {
        "dispatch (the host id check first)": lambda: r.dispatch(ids, pays, TMAX),
        "dispatch (an input of another stream)": lambda: r.dispatch(on_other_stream, pays, TMAX),
        "dispatch_same": lambda: r.dispatch_same(r.last_repeats[0], TMAX, None),
        "synchronize": lambda: r.synchronize(),
        "dropped_selections": lambda: r.dropped_selections(),
    }


@pytest.mark.parametrize("validate", [True, False])
def test_every_dispatch_side_call_raises_the_recorded_error(validate, recorder, monkeypatch):
    a2a, r, specs = _rank()
    a2a.protocol = "fence"
    monkeypatch.setattr(A, "is_capturing", lambda stream: False)
    r.validate_expert_ids = validate
    monkeypatch.setattr(A, "check_expert_ids_on_host", lambda *args: None)
    ids, pays = _inputs(specs)
    for _ in range(3):  # a repeat record for dispatch_same / combine_same
        r.dispatch(ids, pays, TMAX)
        r.combine(r.combine_input(TMAX), TMAX)
    peer = int(np.random.default_rng().integers(1, EP))
    reached = _lose_context(monkeypatch, a2a, r, peer)
    for what, call in _calls(r, specs).items():
        reached.clear()
        with pytest.raises(PeerTimeoutError, match=f"rank {peer} timed out") as e:
            call()
        assert isinstance(e.value.__cause__, CudaError) and reached, (what, reached)


def test_every_combine_side_call_raises_the_recorded_error(recorder, monkeypatch):
    a2a, r, specs = _rank()
    a2a.protocol = "fence"
    ids, pays = _inputs(specs)
    for _ in range(3):
        r.dispatch(ids, pays, TMAX)
        r.combine(r.combine_input(TMAX), TMAX)
    record = r.last_repeats[1]
    r.dispatch(ids, pays, TMAX)  # the step is open: its combine is due when the context is lost
    peer = int(np.random.default_rng().integers(1, EP))
    reached = _lose_context(monkeypatch, a2a, r, peer)
    staged = Tensor(1 << 38, (EP, TMAX, H), "bfloat16", device=(2, 0))
    for what, call in {"combine (the combine input)": lambda: r.combine(r.combine_input(TMAX), TMAX),
                       "combine (a staged partial)": lambda: r.combine(staged, TMAX),
                       "combine_same": lambda: r.combine_same(record, TMAX, None)}.items():
        reached.clear()
        with pytest.raises(PeerTimeoutError, match=f"rank {peer} timed out"):
            call()
        assert reached, what


def test_a_rejected_step_after_a_lost_context_raises_the_recorded_error(recorder, monkeypatch):
    """A rank alone in its process whose input is refused runs the step without tokens: its
    launch fails on the lost context, and the caller gets the PeerError, not the CudaError."""
    a2a, r, specs = _rank(local=False)
    a2a.protocol = "fence"
    _lose_context(monkeypatch, a2a, r, 5)
    with pytest.raises(PeerTimeoutError, match="rank 5 timed out"):
        r.reject_step(TMAX, None, ValueError("token_selected_experts: out of range"))
