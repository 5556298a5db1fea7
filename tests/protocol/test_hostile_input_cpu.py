"""Host-only parts of input validation, property-based: the contiguity rule the API enforces,
PayloadSpec sizes and dtypes, and the routing generator the soak and the tests draw from."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from ep_a2a import PayloadSpec  # noqa: E402
from ep_a2a.testing.formats import routing  # noqa: E402
from ep_a2a.interop.tensor import DTYPES, as_dtype, as_tensor  # noqa: E402

CPU_SETTINGS = settings(max_examples=200, deadline=None, database=None)


@st.composite
def strided_views(draw):
    """A NumPy view with arbitrary slicing steps, transposition and size-1/size-0 dimensions."""
    base = draw(hnp.arrays(np.int32, hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=6)))
    idx = tuple(slice(draw(st.integers(0, 2)), None, draw(st.integers(1, 3))) for _ in range(base.ndim))
    v = base[idx]
    if draw(st.booleans()):
        v = v.transpose(draw(st.permutations(range(v.ndim))))
    return v


@CPU_SETTINGS
@given(strided_views())
def test_is_contiguous_agrees_with_numpy(v):
    """The API rejects non-contiguous inputs through Tensor.is_contiguous: it must match NumPy's
    C-contiguity (NumPy, like DLPack, ignores the strides of extent-1 dimensions)."""
    t = as_tensor(v)
    assert t.is_contiguous == v.flags.c_contiguous, (v.shape, v.strides)
    assert t.shape == v.shape and t.dtype.name == "int32"


@CPU_SETTINGS
@given(shape=st.lists(st.integers(1, 64), min_size=1, max_size=3).map(tuple), dtype=st.sampled_from(sorted(DTYPES)))
def test_payload_spec_bytes_per_token(shape, dtype):
    assert PayloadSpec("p", shape, dtype).bytes_per_token == int(np.prod(shape)) * as_dtype(dtype).itemsize


@CPU_SETTINGS
@given(dtype=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(lambda s: s not in DTYPES))
def test_payload_spec_unknown_dtype_is_a_type_error(dtype):
    try:
        known = as_dtype(dtype)  # NumPy spellings ("i4", "f") are accepted as their dtype
    except TypeError:
        known = None
    if known is None:
        with pytest.raises(TypeError, match="not supported"):
            PayloadSpec("p", (4,), dtype).bytes_per_token


@CPU_SETTINGS
@given(seed=st.integers(0, 2 ** 32 - 1), T=st.integers(0, 40), top_k=st.integers(1, 22), experts=st.integers(1, 64),
       ep=st.integers(1, 16), kind=st.sampled_from(["uniform", "zipf", "perfect"]),
       invalid=st.sampled_from([0.0, 0.05, 0.5, 1.0]))
def test_routing_ids_are_in_range(seed, T, top_k, experts, ep, kind, invalid):
    """Every id the harness draws is -1 or an expert; uniform/zipf pick distinct experts per token."""
    hypothesis.assume(experts >= ep)
    ids = routing(kind, np.random.default_rng(seed), T, top_k, experts, ep, seed % ep, invalid_fraction=invalid)
    assert ids.shape == (T, top_k) and ids.dtype == np.int32
    assert ((ids == -1) | ((ids >= 0) & (ids < experts))).all()
    if kind != "perfect":
        for row in ids:
            valid = row[row >= 0]
            assert len(set(valid.tolist())) == len(valid)
    if invalid == 1.0:
        assert (ids == -1).all()


@pytest.mark.parametrize("dtype", ["01", "007"])
def test_payload_spec_malformed_dtype_string_is_a_type_error(dtype):
    with pytest.raises(TypeError):
        PayloadSpec("p", (4,), dtype).bytes_per_token
