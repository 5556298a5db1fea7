"""Every constructor argument of the all-to-all, driven through wrong types, bounds and
combinations without a GPU (property-based): each refusal is a TypeError (wrong type) or a
ValueError (wrong value) whose message starts with the argument's name and states the rule;
a configuration the rules below allow is accepted and normalised. The rules are written
here a second time, independently of config.py, as the oracle."""
import math
import types

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from ep_a2a.config import Options, PayloadSpec  # noqa: E402
from ep_a2a.interop.tensor import DTYPES, as_dtype  # noqa: E402

CPU = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
REDUCE = ("bfloat16", "float16", "float32")

# values of every kind an argument may be handed by mistake
JUNK = st.one_of(
    st.none(), st.booleans(), st.sampled_from([np.bool_(True), np.bool_(False)]),
    st.integers(-2 ** 40, 2 ** 40), st.integers(-3, 600), st.integers(0, 300).map(np.int64),
    st.integers(0, 300).map(np.int32), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([8.0, 2.5, -1.0, 0.0, np.float32(4), complex(4)]),
    st.sampled_from(["8", "fence", "sentinel", "auto", "trap", "abort", "fp8", "Fence", "fence ", "", "bfloat16",
                     "float16", "float32", "int32", "f4", "no"]),
    st.sampled_from([[4], (4,), {}, object(), b"x", np.dtype("float32"), np.float16, np.float32]))


def is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def int_rule(lo, hi):
    return lambda x: None if is_int(x) and lo <= x <= hi else (ValueError if is_int(x) else TypeError)


def choice_rule(choices):
    def rule(x):
        if x is None and None in choices:
            return None
        if not isinstance(x, str):
            return TypeError
        return None if x in choices else ValueError
    return rule


def bool_rule(x):
    return None if isinstance(x, (bool, np.bool_)) else TypeError


def seconds_rule(x):
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        return TypeError
    return None if math.isfinite(float(x)) and 0 < float(x) <= 9e9 else ValueError


def dtype_rule(x):
    try:
        d = as_dtype(x)
    except TypeError:
        return TypeError
    return None if d.name in REDUCE else ValueError


def threads_rule(x):
    r = int_rule(96, 512)(x)
    return r or (None if x % 32 == 0 else ValueError)


RULES = {  # argument -> its own rule: None (allowed) or the exception type of a refusal
    "max_tokens_per_rank": int_rule(1, 2 ** 23 - 1),
    "top_k": int_rule(1, 22),
    "num_experts": int_rule(1, 2 ** 31 - 1),
    "combine_hidden_size": int_rule(1, 2 ** 24),
    "protocol": choice_rule(("fence", "sentinel", "auto")),
    "on_timeout": choice_rule(("trap", "abort")),
    "combine_quant": choice_rule((None, "fp8")),
    "timeout_s": seconds_rule,
    "first_timeout_s": seconds_rule,
    "validate_expert_ids": bool_rule,
    "pdl": bool_rule,
    "threads_per_block": threads_rule,
    "crossover_tokens": lambda x: None if x is None else int_rule(0, 2 ** 31 - 1)(x),
    "combine_dtype": dtype_rule,
}
NAMES = ("hidden", "scales", "w", "ids2", "x", "y", "z", "q", "r")
DTYPE_SPELLINGS = st.one_of(st.sampled_from(sorted(DTYPES)), st.sampled_from(
    [np.float16, np.float32, np.int32, np.uint8, np.dtype("float16"), np.dtype("int8"), "f4", "<f2", "u1", "i8"]))


@st.composite
def payload_specs(draw, max_size=8, max_dim=96, max_dims=3):
    n = draw(st.integers(0, max_size))
    names = draw(st.lists(st.sampled_from(NAMES), min_size=n, max_size=n, unique=True))
    return [PayloadSpec(nm, tuple(draw(st.lists(st.integers(1, max_dim), min_size=1, max_size=max_dims))),
                        draw(DTYPE_SPELLINGS)) for nm in names]


@st.composite
def valid_options(draw, small=None):
    """Arguments every rule allows (and a few spellings of each: NumPy ints, dtype objects);
    `small`: payloads of at most two dimensions of 48 (the GPU test's)."""
    protocol = draw(st.sampled_from(["fence", "sentinel", "auto"]))
    quant = draw(st.sampled_from([None, "fp8"])) if protocol == "fence" else None
    num_experts = draw(st.integers(1, 64))
    return dict(
        max_tokens_per_rank=draw(st.one_of(st.integers(1, 64), st.integers(1, 64).map(np.int64))),
        top_k=draw(st.integers(1, min(22, num_experts))), num_experts=num_experts,
        combine_hidden_size=128 * draw(st.integers(1, 4)) if quant else draw(st.integers(1, 300)),
        payloads=draw(payload_specs(4, max_dim=96 if small is None else 48, max_dims=3 if small is None else 2)), combine_dtype=draw(st.sampled_from(
            list(REDUCE) + [np.float16, np.float32, np.dtype("float32"), "f2", "<f4"])),
        protocol=protocol, combine_quant=quant, timeout_s=draw(st.sampled_from([None, 20, 20.0, np.float64(30)])),
        first_timeout_s=draw(st.sampled_from([None, 60.0, 120])), on_timeout=draw(st.sampled_from(["trap", "abort"])),
        validate_expert_ids=draw(st.sampled_from([True, False, np.bool_(True)])), pdl=draw(st.booleans()),
        threads_per_block=32 * draw(st.integers(3, 16)), crossover_tokens=draw(st.sampled_from([None, 0, 4, 64])))


def refused(exc_type, arg, call):
    with pytest.raises((TypeError, ValueError)) as e:
        call()
    msg = str(e.value)
    assert type(e.value) is exc_type, (arg, exc_type, msg)
    assert msg.startswith(f"{arg}: ") and any(w in msg for w in ("must", "needs", "at most", "not supported")), msg
    return msg


@CPU
@given(kw=valid_options(), ep=st.one_of(st.integers(1, 72), st.integers(1, 72).map(np.int32)))
def test_allowed_configurations_are_accepted_and_normalised(kw, ep):
    o = Options.check(ep, **kw)
    for name in ("ep_size", "max_tokens_per_rank", "top_k", "num_experts", "combine_hidden_size", "threads_per_block",
                 "crossover_tokens"):
        assert type(getattr(o, name)) is int, name
    assert type(o.pdl) is bool and type(o.validate_expert_ids) is bool
    assert isinstance(o.timeout_s, float) and isinstance(o.first_timeout_s, float)
    assert o.combine_dtype.name == as_dtype(kw["combine_dtype"]).name
    assert all(type(v) is int for v in o.agreement())
    assert o.agreement() == Options.check(int(ep), **kw).agreement()


@CPU
@given(data=st.data(), kw=valid_options())
def test_one_wrong_argument_is_refused_naming_it_and_its_rule(data, kw):
    arg = data.draw(st.sampled_from(sorted(RULES)), label="argument")
    value = data.draw(JUNK, label="value")
    kw = dict(kw, **{arg: value})
    if arg == "combine_quant" and value == "fp8":  # (its combinations are the next test's)
        kw.update(protocol="fence", combine_hidden_size=256)
    if arg in ("top_k", "num_experts") and is_int(value):  # keep top_k <= num_experts out of this test
        kw.update(num_experts=2 ** 31 - 1) if arg == "top_k" else kw.update(top_k=1)
    if arg == "protocol" and kw["combine_quant"] and value != "fence":
        kw.update(combine_quant=None)
    if arg == "combine_hidden_size" and kw["combine_quant"]:
        kw.update(combine_quant=None)
    expect = RULES[arg](value)
    if expect is None:
        Options.check(8, **kw)
    else:
        refused(expect, arg, lambda: Options.check(8, **kw))


@CPU
@given(kw=valid_options(), top_k=st.integers(2, 22), data=st.data())
def test_top_k_above_num_experts_is_refused(kw, top_k, data):
    experts = data.draw(st.integers(1, top_k - 1))
    msg = refused(ValueError, "top_k", lambda: Options.check(4, **dict(kw, top_k=top_k, num_experts=experts)))
    assert f"num_experts={experts}" in msg


@CPU
@given(kw=valid_options(), hidden=st.integers(1, 2000), protocol=st.sampled_from(["fence", "sentinel", "auto"]))
def test_fp8_combine_needs_fence_and_whole_blocks(kw, hidden, protocol):
    kw = dict(kw, combine_quant="fp8", combine_hidden_size=hidden, protocol=protocol)
    if protocol == "fence" and hidden % 128 == 0:
        assert Options.check(4, **kw).combine_quant == "fp8"
    else:
        refused(ValueError, "combine_quant", lambda: Options.check(4, **kw))


@CPU
@given(kw=valid_options(), specs=payload_specs(8), extra=st.integers(0, 4), dup=st.booleans())
def test_payload_lists(kw, specs, extra, dup):
    specs = specs + [PayloadSpec(f"extra{i}", (4,)) for i in range(extra)]
    if dup and specs:
        specs.append(PayloadSpec(specs[0].name, (8,), "float32"))
    names = [p.name for p in specs]
    call = lambda: Options.check(4, **dict(kw, payloads=specs))  # noqa: E731
    if len(specs) > 8:
        refused(ValueError, "payloads", call)
    elif len(set(names)) != len(names):
        assert "unique" in refused(ValueError, "payloads", call)
    else:
        assert call().payloads == tuple(specs)


@pytest.mark.parametrize("payloads", [PayloadSpec("x", (4,)), "hidden", None, [("x", (4,), "uint8")], [None], 3])
def test_payloads_must_be_a_list_of_payload_specs(payloads):
    kw = dict(max_tokens_per_rank=8, top_k=2, num_experts=4, combine_hidden_size=16)
    refused(TypeError, "payloads", lambda: Options.check(4, **kw, payloads=payloads))


@CPU
@given(name=st.one_of(st.text(max_size=6), JUNK), shape=st.one_of(
    JUNK, st.lists(st.one_of(st.integers(-4, 300), JUNK), max_size=4), st.lists(st.integers(-4, 300), max_size=4).map(tuple)),
    dtype=st.one_of(JUNK, DTYPE_SPELLINGS))
def test_payload_spec_is_checked_when_built(name, shape, dtype):
    if not isinstance(name, str):
        expect, field = TypeError, "name"
    elif not name:
        expect, field = ValueError, "name"
    elif not isinstance(shape, (list, tuple)) or not all(is_int(d) for d in shape):
        expect, field = TypeError, "shape"
    elif not shape or min(shape) < 1:
        expect, field = ValueError, "shape"
    else:
        try:
            d = as_dtype(dtype)
            expect = None if math.prod(shape) * d.itemsize < 2 ** 31 else ValueError
            field = "shape"
        except TypeError:
            expect, field = TypeError, "dtype"
    if expect is None:
        p = PayloadSpec(name, shape, dtype)
        assert p.shape == tuple(int(s) for s in shape) and all(type(s) is int for s in p.shape)
        assert p.dtype == as_dtype(dtype).name and p.bytes_per_token == math.prod(shape) * as_dtype(dtype).itemsize
        assert p == PayloadSpec(name, tuple(shape), as_dtype(dtype).name)
        return
    with pytest.raises(expect) as e:
        PayloadSpec(name, shape, dtype)
    assert str(e.value).startswith("PayloadSpec") and f" {field}: " in str(e.value), str(e.value)


def test_framework_dtypes_are_accepted_alike():
    spellings = {"bfloat16": ["bfloat16"], "float16": ["float16", np.float16, np.dtype("float16"), "f2", "<f2"],
                 "float32": ["float32", np.float32, np.dtype(np.float32), "f4"], "uint8": ["uint8", np.uint8, "u1"]}
    try:  # (jnp.bfloat16 is ml_dtypes.bfloat16)
        import ml_dtypes as ml
        spellings["bfloat16"] += [ml.bfloat16, np.dtype(ml.bfloat16)]
        spellings["float8_e4m3fn"] = [ml.float8_e4m3fn]
    except ImportError:
        pass
    try:
        import torch
        spellings["bfloat16"].append(torch.bfloat16)
        spellings["float16"] += [torch.float16, torch.half]
        spellings["float32"].append(torch.float32)
        spellings["uint8"].append(torch.uint8)
    except ImportError:
        pass
    for name, forms in spellings.items():
        for f in forms:
            assert as_dtype(f).name == name, f
            assert PayloadSpec("p", (4,), f).dtype == name
        if name in REDUCE:
            kw = dict(max_tokens_per_rank=8, top_k=2, num_experts=4, combine_hidden_size=16)
            assert {Options.check(4, **kw, combine_dtype=f).combine_dtype.name for f in forms} == {name}


@pytest.mark.parametrize("dtype", [None, True, 1, 2.0, "bf", "torch.bfloat16x", object(), "float128"])
def test_unknown_dtypes_are_type_errors(dtype):
    with pytest.raises(TypeError, match="not supported"):
        as_dtype(dtype)


@CPU
@given(group=st.one_of(JUNK, st.builds(types.SimpleNamespace, ep_size=JUNK, ranks=st.just([]))))
def test_the_group_must_be_a_group(group):
    kw = dict(max_tokens_per_rank=8, top_k=2, num_experts=4, combine_hidden_size=16)
    ep = group if not isinstance(group, types.SimpleNamespace) else group.ep_size
    if is_int(ep) and 1 <= ep <= 72:
        assert Options.check(group, **kw).ep_size == ep
    else:
        refused(ValueError if is_int(ep) else TypeError, "group", lambda: Options.check(group, **kw))


def test_unknown_and_missing_arguments_are_type_errors():
    with pytest.raises(TypeError, match="top_kk"):
        Options.check(4, max_tokens_per_rank=8, top_kk=2, num_experts=4, combine_hidden_size=16)
    with pytest.raises(TypeError, match="combine_hidden_size"):
        Options.check(4, max_tokens_per_rank=8, top_k=2, num_experts=4)


@pytest.mark.parametrize("env,value", [("EP_A2A_TIMEOUT_S", "inf"), ("EP_A2A_TIMEOUT_S", "-1"),
                                       ("EP_A2A_FIRST_TIMEOUT_S", "nan"), ("EP_A2A_SENTINEL_MAX_TOKENS", "-1"),
                                       ("EP_A2A_SENTINEL_MAX_TOKENS", "many")])
def test_environment_defaults_are_checked(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=f"^{env}: must be"):
        Options.check(4, max_tokens_per_rank=8, top_k=2, num_experts=4, combine_hidden_size=16)


def test_a_runtime_max_of_the_wrong_type_is_a_type_error_and_a_value_error():
    """T^'s other rules raise ValueError, so its type rule raises a class that is both."""
    from ep_a2a.errors import ArgumentTypeError
    from ep_a2a.validate import check_runtime_max
    for bad in ("4", 4.0, True, None, [4]):
        with pytest.raises(TypeError, match="^runtime_max_tokens_per_rank: ") as e:
            check_runtime_max(bad, 16)
        assert isinstance(e.value, ValueError) and type(e.value) is ArgumentTypeError
    for bad in (0, 17, -1):
        with pytest.raises(ValueError, match="^runtime_max_tokens_per_rank: ") as e:
            check_runtime_max(bad, 16)
        assert not isinstance(e.value, TypeError)
    check_runtime_max(np.int64(16), 16)


def test_use_protocol_and_combine_input_check_their_types(monkeypatch):
    """On an all-to-all built as on a GPU with the driver replaced (launch_trace)."""
    from launch_trace import _recorder, make_rank, patch_driver
    from ep_a2a.testing import hooks
    events = []
    patch_driver(monkeypatch.setattr, events)
    with hooks.dry_run(_recorder(events)):
        _check_protocol_and_fp8_types(*make_rank(events, "auto", None, True, 8, local=True))


def _check_protocol_and_fp8_types(a2a, r):
    with pytest.raises(TypeError, match="^protocol: "):
        a2a.use_protocol(1)
    with pytest.raises(ValueError, match="^protocol: "):
        a2a.use_protocol("fast")
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="^fp8: "):
            r.combine_input(4, fp8=bad)
    a2a.use_protocol("sentinel")
    assert a2a.protocol == "sentinel" and r.combine_input(4, fp8=False).shape[1] == 4
