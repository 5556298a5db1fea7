"""The shared argument rules: which rule speaks first, and its exception type."""
import pytest

from ep_a2a.interop.tensor import Tensor
from ep_a2a.validate import cuda_tensor, token_tensor


def test_a_wrong_dtype_is_named_before_device_layout_and_alignment():
    t = Tensor((1 << 40) + 2, (4, 8), "float32", strides=(1, 4), device=(2, 1))  # every rule broken
    with pytest.raises(TypeError, match="token_selected_experts: dtype must be int32, got float32"):
        token_tensor(t, "token_selected_experts", (8,), "int32", None, 0, ordinal=0, max_tokens=64)


@pytest.mark.parametrize("t,rule", [
    (Tensor(1 << 40, (4, 8), "int32", device=(2, 1)), r"must be on cuda:0 \(this rank's GPU\)"),
    (Tensor(1 << 40, (4, 8), "int32", strides=(1, 4), device=(2, 0)), "must be contiguous"),
    (Tensor((1 << 40) + 2, (4, 8), "int32", device=(2, 0)), "data pointer 0x10000000002 is not aligned to its 4-byte"),
])
def test_then_device_layout_alignment_each_a_value_error(t, rule):
    with pytest.raises(ValueError, match="x: " + rule):
        token_tensor(t, "x", (8,), "int32", None, 0, ordinal=0, max_tokens=64)


def test_a_missing_tensor_is_a_type_error_everywhere():
    for call in (lambda: cuda_tensor(None, "fc2_out", 0), lambda: token_tensor(None, "partial", (8,), "int32", None, 0,
                                                                               ordinal=0, max_tokens=64)):
        with pytest.raises(TypeError, match="expected a tensor, got None"):
            call()
