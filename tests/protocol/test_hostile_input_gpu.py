"""Hostile input to the public API (property-based, hypothesis) on in-process ranks of one GPU.

Every rejected call must raise the exception validate.py documents for its rule (TypeError for
a wrong dtype or a non-tensor, ValueError for shape, strides, device, range and count rules,
StateError for calls out of order or on a closed all-to-all), naming the argument, before
anything is launched: every rank's workspace bytes, error record and step counter are
compared before and after. The next valid call must still agree with the NumPy reference.

Hostile tensors are views into one scratch allocation of random bytes, so that a call
accepted by mistake reads memory that exists (the test then fails instead of faulting), and
finishes the step it started on the other ranks, so no kernel is left waiting for its peers.
"""
import ctypes
import gc
from dataclasses import dataclass

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.gpu

EP, MAXT, TOP_K, E, H = 3, 16, 4, 10, 40   # 10 experts over 3 ranks: blocks of 4, 3, 3
FMT = "mxfp8"                               # fp8 hidden, uint8 scales, float32 weights
CDT = "bfloat16"
GPU_SETTINGS = settings(max_examples=60, deadline=None, database=None, print_blob=True,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                               HealthCheck.filter_too_much])
CUDA, CPU, CUDA_HOST, CUDA_MANAGED = 2, 1, 3, 13


@dataclass
class Env:
    group: object
    a2a: object
    dev: object
    scratch: object  # Tensor of random bytes: the memory behind every hostile view
    protocol: str


def _build(group, protocol):
    # abort mode: a failing example leaves a half-done step whose waits give up in 2 s without
    # losing the CUDA context; fresh() then rebuilds, so one failure cannot cascade into the
    # examples after it (hypothesis would report those as flaky and hide the first one)
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    return ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=MAXT, top_k=TOP_K, num_experts=E,
                              payloads=payload_formats(H, TOP_K)[FMT], combine_hidden_size=H, combine_dtype=CDT,
                              protocol=protocol, timeout_s=2.0, first_timeout_s=2.0, on_timeout="abort")


def fresh(env):
    """Start an example from a clean all-to-all: rebuild it if the last one left a step open."""
    if any(r.mid_step or r.record.kind for r in env.a2a.ranks):
        try:
            env.a2a.close()
        except Exception:  # noqa: BLE001 - its recorded error was the earlier example's failure
            pass
        env.a2a = _build(env.group, env.protocol)


@pytest.fixture(scope="module", params=["fence", "sentinel"])
def env(request):
    import ep_a2a
    from ep_a2a.interop.arrays import copy_from_numpy, empty
    group = ep_a2a.LocalGroup([0] * EP)
    a2a = _build(group, request.param)
    dev = group.ranks[0].device
    scratch = empty((1 << 20,), "uint8", dev)
    copy_from_numpy(scratch, np.random.default_rng().integers(0, 256, scratch.nbytes, dtype=np.uint8))
    e = Env(group, a2a, dev, scratch, request.param)
    yield e
    e.a2a.close()
    group.close()


# ------------------------------------------------------------------------ helpers

def view(env, shape, dtype, strides=None, device=(CUDA, 0), offset=0):
    """A tensor over the scratch bytes with any shape, dtype, strides and claimed device."""
    from ep_a2a.interop.tensor import Tensor
    return Tensor(env.scratch.ptr + offset, shape, dtype, strides=strides, device=device, owner=env.scratch)


def host_tensor(shape, dtype):
    """A tensor over host (NumPy) memory with the right dtype, even where NumPy has no such dtype."""
    from ep_a2a.interop.tensor import Tensor, as_dtype
    arr = np.zeros(int(np.prod(shape)) * as_dtype(dtype).itemsize + 16, np.uint8)
    return Tensor(arr.ctypes.data, shape, dtype, device=(CPU, 0), owner=arr)


def snapshot(a2a):
    """Everything a launch would change: every rank's workspace bytes, error record, step count."""
    from ep_a2a.interop.arrays import to_numpy
    from ep_a2a.interop.tensor import Tensor
    a2a.synchronize()
    ws = [to_numpy(Tensor(a2a.workspace.base(i), (a2a.workspace.size,), "uint8", device=(CUDA, r.device.ordinal)))
          for i, r in enumerate(a2a.ranks)]
    recs = [ctypes.string_at(ctypes.addressof(r.record), ctypes.sizeof(r.record)) for r in a2a.ranks]
    return ws, recs, [r.steps for r in a2a.ranks]


def assert_same(before, after):
    for i, (a, b) in enumerate(zip(before[0], after[0])):
        if not np.array_equal(a, b):
            n = int(np.count_nonzero(a != b))
            raise AssertionError(f"rank {i}: {n} workspace bytes changed by a rejected call (first at "
                                 f"offset {int(np.argmax(a != b))})")
    assert before[1] == after[1], "an error record was written by a rejected call"
    assert before[2] == after[2], f"step counters moved: {before[2]} -> {after[2]}"


def expect_rejected(env, call, exc, name, finish):
    """Run `call`; it must raise `exc` naming `name` and change nothing. If it is accepted,
    `finish()` completes the step on the other ranks (so no kernel hangs) and the test fails."""
    before = snapshot(env.a2a)
    try:
        call()
    except exc as e:
        if name is not None:
            assert name in str(e), f"{type(e).__name__} does not name {name!r}: {e}"
        assert_same(before, snapshot(env.a2a))
        return e
    except Exception as e:  # noqa: BLE001 - an undocumented exception type is the failure
        raise AssertionError(f"expected {exc.__name__}, got {type(e).__name__}: {e}") from e
    finish()
    raise AssertionError(f"accepted a call that must raise {exc.__name__}")


def good_inputs(env, rng, T):
    from ep_a2a.testing.formats import random_payload, routing
    from ep_a2a.interop.arrays import from_numpy
    ids = from_numpy(routing("uniform", rng, T, TOP_K, E, EP, 0, invalid_fraction=0.1), env.dev, "int32")
    pay = [from_numpy(random_payload(rng, s, T), env.dev, s.dtype) for s in env.a2a.payload_specs]
    return ids, pay


def finish_dispatch_step(env):
    """Rank 0 dispatched by mistake: the others dispatch nothing at its T^, then all combine."""
    from ep_a2a.interop.arrays import empty
    r0 = env.a2a.ranks[0]
    tmax = r0.state.pending.runtime_max
    for r in env.a2a.ranks[1:]:
        r.dispatch(empty((0, TOP_K), "int32", env.dev), [empty((0,) + s.shape, s.dtype, env.dev)
                                                         for s in env.a2a.payload_specs], tmax)
    for r in env.a2a.ranks:
        r.combine(r.combine_input(tmax), tmax)
    env.a2a.synchronize()


def valid_step(env, rng):
    """The next valid step: every byte against the reference."""
    from ep_a2a.testing.harness import run_step
    gc.collect()  # no cuMemFree of an old input between two ranks' launches (they spin on each other)
    tmax = int(rng.integers(1, MAXT + 1))
    tokens = [int(t) for t in rng.integers(0, tmax + 1, EP)]
    rep = run_step(env.a2a, rng, tokens, tmax, route=("uniform", "zipf", "perfect")[int(rng.integers(3))],
                   invalid_fraction=0.1)
    assert not rep.mismatches, rep.mismatches[:3]
    assert rep.combine_rows_checked == sum(tokens)


@dataclass
class Step:
    tokens: list
    tmax: int
    outs: list
    partial_h: list
    records: list


def begin_step(env, rng, tokens, tmax):
    """Dispatch on every rank (checked against the reference), then write the stand-in MoE's
    partial results into every rank's combine input: the step waits for its combine."""
    from ep_a2a.testing import reference as ref
    from ep_a2a.testing.formats import random_payload, routing
    from ep_a2a.testing.harness import StepReport, check_dispatch, read_records
    from ep_a2a.interop.arrays import copy_from_numpy, empty, from_numpy
    a2a = env.a2a
    gc.collect()
    ids_h = [routing("uniform", rng, tokens[s], TOP_K, E, EP, s, invalid_fraction=0.1) for s in range(EP)]
    pay_h = [[random_payload(rng, sp, tokens[s]) for sp in a2a.payload_specs] for s in range(EP)]
    ins = [(from_numpy(ids_h[s], env.dev, "int32"), [from_numpy(x, env.dev, sp.dtype) for x, sp in
                                                     zip(pay_h[s], a2a.payload_specs)]) for s in range(EP)]
    outs = [empty((tokens[s], H), CDT, env.dev) for s in range(EP)]
    for o in outs:
        copy_from_numpy(o, np.full(o.nbytes, 0xFF, np.uint8))
    partial_h = [ref.from_float32(rng.integers(-64, 65, (EP, tmax, H)).astype(np.float32), CDT) for _ in range(EP)]
    views = {s: r.dispatch(ins[s][0], ins[s][1], tmax) for s, r in enumerate(a2a.ranks)}
    a2a.synchronize()
    records = [read_records(r, tokens[s]) for s, r in enumerate(a2a.ranks)]
    sentinel = a2a.protocol_for(tmax) == "sentinel"
    want_pay = [[ref.sentinel_escape(x, k) for x, k in zip(pay_h[s], a2a.kinds[1:])] for s in range(EP)] \
        if sentinel else pay_h
    rep = StepReport(list(tokens), tmax)
    check_dispatch(a2a, rep, ids_h, want_pay, dict(enumerate(records)), views, sentinel)
    assert not rep.mismatches, rep.mismatches[:3]
    for s, r in enumerate(a2a.ranks):
        copy_from_numpy(r.combine_input(tmax), partial_h[s])
    return Step(list(tokens), tmax, outs, partial_h, records)


def finish_step(env, stp, skip=()):
    """Combine on every rank not in `skip`, then every output against the reference."""
    from ep_a2a.testing import reference as ref
    from ep_a2a.interop.arrays import to_numpy
    from ep_a2a.layout import sentinel_kind
    a2a = env.a2a
    for s, r in enumerate(a2a.ranks):
        if s not in skip:
            r.combine(r.combine_input(stp.tmax), stp.tmax, out=stp.outs[s])
    a2a.synchronize()
    if skip:
        return
    arrived = stp.partial_h
    if a2a.protocol_for(stp.tmax) == "sentinel":
        k = sentinel_kind(CDT)
        arrived = [ref.sentinel_escape(p.reshape(-1, H), k).reshape(p.shape) for p in stp.partial_h]
    want = ref.combine(arrived, stp.records, CDT)
    for s in range(EP):
        got = to_numpy(stp.outs[s])
        assert np.array_equal(got.view(np.uint16), want[s].view(np.uint16)), f"combine output of rank {s} differs"


# ------------------------------------------------------------------------ strategies

def _other_dtype(right):
    from ep_a2a.interop.tensor import DTYPES
    return st.sampled_from(sorted(n for n in DTYPES if n != right))


@st.composite
def bad_strides(draw, shape):
    """Strides (elements) that make `shape` non-contiguous, within the scratch buffer."""
    strides = tuple(draw(st.integers(0, 3 * max(shape) + 2)) for _ in shape)
    from ep_a2a.interop.tensor import contiguous_strides
    contiguous = contiguous_strides(shape)
    moving = [i for i, n in enumerate(shape) if n > 1]
    hypothesis.assume(moving and any(strides[i] != contiguous[i] for i in moving))
    return strides


def _bad_tensor(draw, env, right_shape, right_dtype, name, probed_elsewhere):
    """A wrong tensor for an argument whose right form is (right_shape, right_dtype):
    (tensor or object, exception type, text the message must contain or None).
    probed_elsewhere(shape): shapes left to other corruptions (row counts, accepted forms)."""
    kind = draw(st.sampled_from(["dtype", "shape", "strides", "numpy_host", "host", "other_device", "not_tensor",
                                 "none"]), label=f"{name} corruption")
    if kind == "dtype":
        return view(env, right_shape, draw(_other_dtype(right_dtype), label="dtype")), TypeError, name
    if kind == "shape":
        ndim = draw(st.integers(0, 4), label="ndim")
        shape = tuple(draw(st.lists(st.integers(0, MAXT + 2), min_size=ndim, max_size=ndim), label="shape"))
        hypothesis.assume(shape != tuple(right_shape) and not probed_elsewhere(shape))
        return view(env, shape, right_dtype), ValueError, name
    if kind == "strides":
        t = view(env, right_shape, right_dtype, strides=draw(bad_strides(right_shape), label="strides"))
        hypothesis.assume(not t.is_contiguous)  # (a tensor with no elements is always contiguous)
        return t, ValueError, name
    if kind == "numpy_host":
        from ep_a2a.interop.tensor import as_dtype
        np_dt = as_dtype(right_dtype).numpy
        if np_dt is None or np_dt.kind not in "iuf":  # bfloat16 / float8: no NumPy dtype
            return host_tensor(right_shape, right_dtype), ValueError, name
        return np.zeros(right_shape, np_dt), ValueError, name  # a real NumPy array (DLPack, kDLCPU)
    if kind == "host":
        return host_tensor(right_shape, right_dtype), ValueError, name
    if kind == "other_device":
        device = draw(st.sampled_from([(CUDA, 1), (CUDA, 7), (CUDA_HOST, 0), (CUDA_MANAGED, 0)]), label="device")
        return view(env, right_shape, right_dtype, device=device), ValueError, name
    if kind == "not_tensor":
        obj = draw(st.sampled_from([[[0] * right_shape[-1]], "tensor", 3, 2.5, object(), b"x"]), label="object")
        return obj, TypeError, name
    return None, TypeError, name


def _same_tmax(v, tmax) -> bool:
    try:
        return bool(v == tmax)
    except Exception:  # noqa: BLE001
        return False


# ------------------------------------------------------------------------ dispatch

@GPU_SETTINGS
@given(data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_hostile_dispatch_rejected_before_launch(env, data, seed):
    fresh(env)
    from ep_a2a.interop.arrays import from_numpy
    rng = np.random.default_rng(seed)
    r0, specs = env.a2a.ranks[0], env.a2a.payload_specs
    tmax = data.draw(st.integers(1, MAXT), label="runtime_max")
    T = data.draw(st.integers(0, tmax), label="tokens")
    ids, pay = good_inputs(env, rng, T)
    kw = dict(token_selected_experts=ids, payloads=list(pay), runtime_max_tokens_per_rank=tmax)
    what = data.draw(st.sampled_from(["ids", "payload", "payload_rows", "payload_count", "payloads_obj",
                                      "expert_range", "tokens_over_tmax", "tokens_over_max", "tmax", "stream"]),
                     label="corruption")
    if what == "ids":
        kw["token_selected_experts"], exc, name = _bad_tensor(
            data.draw, env, (T, TOP_K), "int32", "token_selected_experts",
            lambda sh: len(sh) == 2 and sh[1] == TOP_K)  # row counts: tokens_over_*, payload_rows
    elif what == "payload":
        q = data.draw(st.integers(0, len(specs) - 1), label="payload index")
        inner = tuple(specs[q].shape)
        kw["payloads"][q], exc, name = _bad_tensor(data.draw, env, (T,) + inner, specs[q].dtype, f"payloads[{q}]",
                                                   lambda sh: len(sh) == 1 + len(inner) and sh[1:] == inner)
    elif what == "payload_rows":
        q = data.draw(st.integers(0, len(specs) - 1), label="payload index")
        rows = data.draw(st.integers(0, MAXT).filter(lambda n: n != T), label="rows")
        kw["payloads"][q], exc, name = view(env, (rows,) + specs[q].shape, specs[q].dtype), ValueError, f"payloads[{q}]"
    elif what == "payload_count":
        n = data.draw(st.integers(0, len(specs) + 3).filter(lambda n: n != len(specs)), label="count")
        kw["payloads"] = (pay * 3)[:n]
        exc, name = ValueError, "payloads"
    elif what == "payloads_obj":
        kw["payloads"] = data.draw(st.sampled_from([None, 5, 1.5]), label="payloads object")
        exc, name = TypeError, "payloads"
    elif what == "expert_range":
        hypothesis.assume(T > 0)
        h = np.asarray(routing_host(rng, T))
        n_bad = data.draw(st.integers(1, T * TOP_K), label="bad ids")
        bad = data.draw(st.lists(st.one_of(st.integers(E, 2 ** 31 - 1), st.integers(-2 ** 31, -2)),
                                 min_size=n_bad, max_size=n_bad), label="bad values")
        pos = rng.choice(T * TOP_K, n_bad, replace=False)
        h.reshape(-1)[pos] = bad
        kw["token_selected_experts"] = from_numpy(h, env.dev, "int32")
        exc, name = ValueError, "token_selected_experts"
    elif what == "tokens_over_tmax":
        hypothesis.assume(tmax < MAXT)
        T2 = data.draw(st.integers(tmax + 1, MAXT), label="tokens over T^")
        kw["token_selected_experts"], kw["payloads"] = good_inputs(env, rng, T2)
        exc, name = ValueError, "token_selected_experts"
    elif what == "tokens_over_max":
        T2 = data.draw(st.integers(MAXT + 1, 4 * MAXT), label="tokens over max")
        kw["token_selected_experts"], kw["payloads"] = good_inputs(env, rng, T2)
        kw["runtime_max_tokens_per_rank"] = data.draw(st.sampled_from([MAXT, T2]), label="T^")
        exc, name = ValueError, None  # either the T^ range or the token count rule, each naming its argument
    elif what == "tmax":
        kw["runtime_max_tokens_per_rank"] = data.draw(bad_tmax(), label="bad T^")
        exc, name = ValueError, "runtime_max_tokens_per_rank"
    else:
        kw["stream"] = data.draw(st.sampled_from(["0", 1.5, object(), [1], None.__class__]), label="stream")
        exc, name = TypeError, "stream"
    expect_rejected(env, lambda: r0.dispatch(**kw), exc, name, lambda: finish_dispatch_step(env))
    valid_step(env, rng)


def routing_host(rng, T):
    from ep_a2a.testing.formats import routing
    return routing("uniform", rng, T, TOP_K, E, EP)


def bad_tmax():
    return st.one_of(st.integers(-2 ** 40, 0), st.integers(MAXT + 1, 2 ** 40),
                     st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from([None, "4", b"4", 4.0, complex(4), np.float32(4), [4], (4,)]))


# ------------------------------------------------------------------------ combine

@GPU_SETTINGS
@given(data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_hostile_combine_rejected_before_launch(env, data, seed):
    fresh(env)
    rng = np.random.default_rng(seed)
    tmax = data.draw(st.integers(1, MAXT), label="runtime_max")
    tokens = data.draw(st.lists(st.integers(0, tmax), min_size=EP, max_size=EP), label="tokens")
    r0 = env.a2a.ranks[0]
    what = data.draw(st.sampled_from(["tmax", "partial", "partial_shape", "out", "out_rows", "stream",
                                      "combine_input"]), label="corruption")
    stp = begin_step(env, rng, tokens, tmax)
    kw = dict(partial=r0.combine_input(tmax), runtime_max_tokens_per_rank=tmax, out=stp.outs[0])
    call = None
    if what == "tmax":
        # a non-int equal to T^ (4.0 for 4) is probed by test_combine_runtime_max_must_be_an_int
        kw["runtime_max_tokens_per_rank"] = data.draw(st.one_of(bad_tmax(), st.integers(1, MAXT)).filter(
            lambda v: not _same_tmax(v, tmax)), label="bad T^")
        exc, name = ValueError, "runtime_max_tokens_per_rank"
    elif what == "partial":
        kw["partial"], exc, name = _bad_tensor(data.draw, env, (EP, tmax, H), CDT, "partial",
                                               lambda sh: len(sh) in (2, 3) and sh[-1] == H)  # partial_shape
    elif what == "partial_shape":
        shape = data.draw(st.one_of(
            st.tuples(st.integers(0, 3 * EP * MAXT), st.just(H)),                        # [rows, H]
            st.tuples(st.integers(0, EP + 2), st.integers(0, MAXT + 2), st.just(H)),      # [ep, T^, H]
            st.tuples(st.integers(0, EP * MAXT), st.integers(0, 4), st.integers(0, 2 * H)),
            st.lists(st.integers(0, 8), min_size=0, max_size=5).map(tuple)), label="partial shape")
        ok = shape in ((EP * tmax, H), (EP, tmax, H))
        hypothesis.assume(not ok)
        kw["partial"], exc, name = view(env, shape, CDT), ValueError, "partial"
    elif what == "out":
        kw["out"], exc, name = _bad_tensor(data.draw, env, (tokens[0], H), CDT, "out",
                                           lambda sh: len(sh) == 2 and sh[1] == H)  # out_rows
        if kw["out"] is None:  # out=None is the documented default (an internal buffer), not an error
            hypothesis.assume(False)
    elif what == "out_rows":
        rows = data.draw(st.integers(0, MAXT).filter(lambda n: n != tokens[0]), label="out rows")
        kw["out"], exc, name = view(env, (rows, H), CDT), ValueError, "out"
    elif what == "stream":
        kw["stream"] = data.draw(st.sampled_from(["0", 1.5, object(), [1]]), label="stream")
        exc, name = TypeError, "stream"
    else:
        bad = data.draw(bad_tmax(), label="bad T^")
        call, exc, name = (lambda: r0.combine_input(bad)), ValueError, "runtime_max_tokens_per_rank"
    call = call or (lambda: r0.combine(**kw))
    # accepted by mistake: rank 0 has combined, the others complete the step
    expect_rejected(env, call, exc, name, lambda: finish_step(env, stp, skip=(0,)))
    finish_step(env, stp)  # the valid combine of the same step still gives the reference's sums


@GPU_SETTINGS
@given(seed=st.integers(0, 2 ** 32 - 1), staged=st.booleans())
def test_calls_out_of_order_raise_state_error(env, seed, staged):
    fresh(env)
    from ep_a2a import StateError
    from ep_a2a.interop.arrays import from_numpy
    rng = np.random.default_rng(seed)
    r0 = env.a2a.ranks[0]
    tmax = int(rng.integers(1, MAXT + 1))
    tokens = [int(t) for t in rng.integers(0, tmax + 1, EP)]
    # combine with no dispatch before it
    part = r0.combine_input(tmax) if not staged else from_numpy(np.zeros((EP * tmax, H), np.uint16), env.dev, CDT)
    expect_rejected(env, lambda: r0.combine(part, tmax), StateError, "without a dispatch", lambda: None)
    stp = begin_step(env, rng, tokens, tmax)
    # dispatch twice: a second dispatch would overwrite what the first delivered
    ids, pay = good_inputs(env, rng, min(tokens[0], tmax))
    expect_rejected(env, lambda: r0.dispatch(ids, pay, tmax), StateError, "twice",
                    lambda: finish_step(env, stp, skip=(0,)))
    finish_step(env, stp)
    # combine twice
    expect_rejected(env, lambda: r0.combine(r0.combine_input(tmax), tmax), StateError, "without a dispatch",
                    lambda: None)
    valid_step(env, rng)


def test_partial_with_extra_middle_dimension_rejected(env):
    """combine documents partial as [ep, T^, H] or [ep * T^, H]; [ep * T^, 2, H] is neither (twice
    the data: combine would silently use the first half). With [ep * T^, 0, H] the same check
    would copy ep * T^ rows out of an empty tensor."""
    fresh(env)
    rng = np.random.default_rng()
    tmax = int(rng.integers(1, MAXT + 1))
    tokens = [int(t) for t in rng.integers(0, tmax + 1, EP)]
    stp = begin_step(env, rng, tokens, tmax)
    r0 = env.a2a.ranks[0]
    bad = view(env, (EP * tmax, 2, H), CDT)
    try:
        expect_rejected(env, lambda: r0.combine(bad, tmax, out=stp.outs[0]), ValueError, "partial",
                        lambda: finish_step(env, stp, skip=(0,)))
    finally:
        if env.a2a.ranks[0].mid_step:
            finish_step(env, stp)
    valid_step(env, rng)


def test_non_tensor_arguments_name_the_argument(env):
    """README: bad input raises TypeError/ValueError 'naming the argument and the rule'."""
    fresh(env)
    rng = np.random.default_rng()
    ids, pay = good_inputs(env, rng, 2)
    r0 = env.a2a.ranks[0]
    for kw, name in ((dict(token_selected_experts=[[0, 1, 2, 3]] * 2, payloads=pay), "token_selected_experts"),
                     (dict(token_selected_experts=ids, payloads=[pay[0], "x", pay[2]]), "payloads[1]"),
                     (dict(token_selected_experts=ids, payloads=None), "payloads")):
        expect_rejected(env, lambda: r0.dispatch(runtime_max_tokens_per_rank=4, **kw), TypeError, name,
                        lambda: finish_dispatch_step(env))
    valid_step(env, rng)


def test_combine_runtime_max_must_be_an_int(env):
    fresh(env)
    rng = np.random.default_rng()
    tmax = int(rng.integers(1, MAXT + 1))
    stp = begin_step(env, rng, [int(t) for t in rng.integers(0, tmax + 1, EP)], tmax)
    r0 = env.a2a.ranks[0]
    try:
        expect_rejected(env, lambda: r0.combine(r0.combine_input(tmax), float(tmax), out=stp.outs[0]), ValueError,
                        "runtime_max_tokens_per_rank", lambda: finish_step(env, stp, skip=(0,)))
    finally:
        if r0.mid_step:
            finish_step(env, stp)


def test_numpy_integer_runtime_max_is_accepted():
    """check_runtime_max accepts NumPy integers: they must work like ints, end to end (own all-to-all:
    a failure here must not leave the module's ranks mid-step)."""
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    from ep_a2a.testing.harness import run_step
    rng = np.random.default_rng()
    with ep_a2a.LocalGroup([0] * EP) as group, ep_a2a.MoeAlltoAll(
            group, max_tokens_per_rank=MAXT, top_k=TOP_K, num_experts=E, payloads=payload_formats(H, TOP_K)[FMT],
            combine_hidden_size=H, protocol="auto", crossover_tokens=MAXT // 2, timeout_s=20.0) as a2a:
        for tmax in (np.int64(MAXT), np.int32(1), np.uint16(MAXT // 2 + 1)):
            rep = run_step(a2a, rng, [int(t) for t in rng.integers(0, int(tmax) + 1, EP)], tmax)
            assert not rep.mismatches, rep.mismatches[:3]
