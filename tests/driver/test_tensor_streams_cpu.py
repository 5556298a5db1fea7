"""Stream ordering of ep_a2a Tensors handed to as_tensor (no GPU: the wait is recorded)."""
from ep_a2a.interop import tensor as T
from ep_a2a.interop.tensor import Tensor, as_tensor


def test_as_tensor_of_a_tensor_orders_its_stream_before_the_one_given(monkeypatch):
    """as_tensor(t, stream=X) on an ep_a2a Tensor still produced on stream P makes X wait
    for P (the same rule as its __dlpack__); the same stream, no stream and -1 wait for
    nothing; the driver's NULL stream 0 is DLPack's legacy stream 1. Also on the checked-
    input cache's hit path, where the all-to-all meets the same Tensor step after step."""
    from ep_a2a.validate import CheckedInputs
    waits = []
    monkeypatch.setattr(T, "_wait", lambda consumer, producer, dev: waits.append((consumer, producer)))
    t = Tensor(1 << 40, (4, 8), "int32", device=(T.CUDA, 0), stream=5)
    assert as_tensor(t, stream=7) is t and waits == [(7, 5)]
    for s in (5, None, -1):
        as_tensor(t, stream=s)
    assert waits == [(7, 5)]
    as_tensor(t, stream=0)
    assert waits[-1] == (1, 5)
    checked = CheckedInputs(0, 16)
    waits.clear()
    checked(t, "token_selected_experts", (8,), "int32", None, 5)  # checked once, on its own stream
    checked(t, "token_selected_experts", (8,), "int32", None, 9)  # cached, another stream
    assert waits == [(9, 5)]
