"""The rejection rule (ep_a2a/rejection.py) on a rank whose launches are recorded, not run:
a rank alone in its process that rejects its input runs the step without tokens under the
reject tag, with its combine input poisoned, then refuses every call; ranks of one process
and an invalid T^ launch nothing."""
import pytest

import ep_a2a.alltoall as A
from ep_a2a import layout
from ep_a2a.errors import StateError
from ep_a2a.interop.tensor import Tensor
from test_repeat_cpu import EP, H, _rank, recorder  # noqa: F401 (recorder: the fixture)

T = 4


def _inputs(hidden_dtype="bfloat16"):
    return (Tensor(1 << 33, (T, 8), "int32", device=(2, 0)),
            [Tensor(1 << 34, (T, H), hidden_dtype, device=(2, 0)), Tensor(1 << 35, (T, 8), "float32", device=(2, 0))])


def _launches(rec):
    return [(fn, layout.A2AParams.from_buffer_copy(p)) for kind, fn, p, *_ in (x for x in rec if x[0] == "launch")]


@pytest.mark.parametrize("proto", ["fence", "sentinel"])
def test_a_rank_alone_in_its_process_runs_the_rejected_step_without_tokens(proto, recorder, monkeypatch):
    memsets = []
    monkeypatch.setattr(A, "memset_d8_async", lambda *args: memsets.append(args))
    a2a, r, _ = _rank(local=False)
    a2a.protocol = proto
    ids, pays = _inputs("float32")  # the hidden states must be bfloat16
    with pytest.raises(TypeError, match="payloads"):
        r.dispatch(ids, pays, 8)
    (d_fn, d), (c_fn, c) = _launches(recorder)
    assert (d_fn, c_fn) == (f"{proto}_dispatch", f"{proto}_combine_bf16")
    for p in (d, c):
        assert p.step_tag == layout.TAG_REJECT | r.rank and p.local_num_tokens == 0 and p.runtime_max_tokens_per_rank == 8
    assert memsets == [(r.base + a2a.layout.off_combine, 0xFF, EP * 8 * H * 2, r.default_stream)]
    assert not r.mid_step
    with pytest.raises(StateError, match="rejected its input"):
        r.dispatch(*_inputs(), 8)
    assert len(_launches(recorder)) == 2


def test_ranks_of_one_process_reject_before_any_launch(recorder, monkeypatch):
    monkeypatch.setattr(A, "memset_d8_async", lambda *args: pytest.fail("memset"))
    a2a, r, _ = _rank(local=True)
    with pytest.raises(TypeError, match="payloads"):
        r.dispatch(*_inputs("float32"), 8)
    assert _launches(recorder) == [] and r.rejected is None
    r.dispatch(*_inputs(), 8)  # the rank is as it was
    assert len(_launches(recorder)) == 1


def test_an_invalid_runtime_max_forms_no_step(recorder, monkeypatch):
    monkeypatch.setattr(A, "memset_d8_async", lambda *args: pytest.fail("memset"))
    a2a, r, _ = _rank(local=False)
    with pytest.raises(ValueError, match="runtime_max_tokens_per_rank"):
        r.dispatch(*_inputs(), 0)
    assert _launches(recorder) == [] and r.rejected is None


@pytest.mark.parametrize("vouched", [False, True], ids=["dispatch", "dispatch_same"])
def test_a_repeated_call_refused_by_the_host_id_check_also_runs_the_rejected_step(vouched, recorder, monkeypatch):
    """The repeat fast path's host id check can refuse too (same tensors, new values): the
    peers are told the same way, also when a caller vouched for its Tensors (dispatch_same)."""
    import ep_a2a.alltoall as A
    import ep_a2a.schedule as P
    monkeypatch.setattr(A, "memset_d8_async", lambda *args: None)
    refuse = []

    def check(ids, stream, num_experts):
        if refuse:
            raise ValueError("token_selected_experts: ids must be in 0..num_experts-1 or -1")
    monkeypatch.setattr(A, "check_expert_ids_on_host", check)
    monkeypatch.setattr(A, "is_capturing", lambda stream: False)
    a2a, r, _ = _rank(local=False)
    a2a.protocol = "fence"
    r.validate_expert_ids = True
    ids, pays = _inputs()
    repeats = []
    full = r._dispatch_checked
    monkeypatch.setattr(r, "_dispatch_checked", lambda *args: repeats.append(-1) or full(*args))
    done = r._dispatched
    monkeypatch.setattr(r, "_dispatched", lambda *args: repeats.append(1) or done(*args))
    for _ in range(P.FIRST_STEPS + 2):
        r.dispatch(ids, pays, 8)
        r.combine(r.combine_input(8), 8)
    assert sum(repeats) > 0, "the warm-up never reached the repeat fast path"
    refuse.append(1)
    n = len(_launches(recorder))
    with pytest.raises(ValueError, match="token_selected_experts"):
        r.dispatch_same(r.last_repeats[0], 8, None) if vouched else r.dispatch(ids, pays, 8)
    new = _launches(recorder)[n:]
    assert [p.step_tag for _, p in new] == [layout.TAG_REJECT | r.rank] * 2 and r.rejected
