"""The JAX halves (ep_a2a/ops/jax_halves.py) without a GPU: the launches planned at trace time
are the eager halves' for the same step (kernel, grid, parameter block byte for byte; the
driver replaced as in tests/protocol/launch_trace.py); a traced step of two micro-batches
names every XLA buffer where the kernels read it; out-of-order halves are refused while
tracing with HalvesOrderError, per trace; without the native library the halves say why."""
import random

import pytest

from ep_a2a.errors import HalvesOrderError
from ep_a2a.layout import A2AParams
from ep_a2a.ops import jax_plan
from ep_a2a.schedule import StepState
from ep_a2a.testing import hooks
from jax_plan_cases import CONFIGS, block, copied, launched, random_step, record_plans, require_library, trace

HALVES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_planned_halves_equal_eager_halves(monkeypatch, cfg):
    rng = random.Random()
    events = []
    trace.patch_driver(monkeypatch.setattr, events)
    for _ in range(4):
        a2a, r, tmax, T, ids, pays, out = random_step(rng, events, cfg)

        def halves():
            r.dispatch_send(ids, pays, tmax).receive()
            r.combine_send(r.combine_input(tmax), tmax, out=out).receive()
        eager = launched(halves)
        steps = jax_plan.steady_halves(r.plan, r.state.tag_hi, a2a.protocol, T, tmax, [ids.ptr] + [p.ptr for p in pays],
                                       out.ptr)
        blocks = jax_plan.half_params(r.plan, steps)
        # the steady state: the combine receive leaves the state the dispatch send was planned from
        assert steps[3].state == StepState(steps=r.plan.first_steps, tag_hi=r.state.tag_hi,
                                           quantizing_combine=r.plan.fp8_combine)
        assert [(s.launch.function, s.grid) for s in steps] == [(f, g) for f, g, _ in eager]
        assert not steps[1].trigger_early and not steps[3].trigger_early
        first = r.plan.first_timeout_ns  # (the eager step is a first step: the handler patches this in)
        # (the dispatch halves' blocks hold the previous combine's fields: this step's, in a jitted loop)
        for k in (0, 1):
            assert block(blocks[k], timeout_ns=first) == block(eager[k][2], **dict(steps[2].fields)), HALVES[k]
        for k in (2, 3):
            assert block(blocks[k], timeout_ns=first) == eager[k][2], HALVES[k]
        a2a.close()


def test_half_blocks_keep_only_their_own_calls_buffers(monkeypatch):
    """Stand-ins of another half's call (the dispatch inputs, the combine output) become a
    mapped address in every block but their own call's."""
    events = []
    trace.patch_driver(monkeypatch.setattr, events)
    with hooks.dry_run():
        a2a, r = trace.make_rank(events, random.choice(["fence", "sentinel"]), None, True, 8, local=True)
    P = len(a2a.payload_specs)
    steps = jax_plan.steady_halves(r.plan, 0, a2a.protocol, 3, 4, [jax_plan.fake(q) for q in range(P + 1)],
                                   jax_plan.fake(1))
    blocks = [A2AParams.from_buffer_copy(b) for b in jax_plan.half_params(r.plan, steps)]
    srcs = [[b.payloads[q].src for q in range(P + 1)] for b in blocks]
    assert srcs[0] == [jax_plan.fake(q) for q in range(P + 1)]
    assert all(s == [r.plan.combine_input] * (P + 1) for s in srcs[1:])
    assert [b.combine_out for b in blocks] == [r.plan.combine_input] * 3 + [jax_plan.fake(1)]
    a2a.close()


@pytest.fixture
def two(monkeypatch):
    """Two all-to-alls (two micro-batches) of one rank each with the driver replaced, their
    JaxAlltoAlls on the native path, and the plans each call encoded (groups, per call)."""
    pytest.importorskip("jax")
    require_library()
    from ep_a2a.ops import jax as ops_jax
    events = []
    trace.patch_driver(monkeypatch.setattr, events)
    made = record_plans(monkeypatch, ops_jax)
    proto = random.choice(["fence", "sentinel"])
    with hooks.dry_run():
        (a, ra), (b, rb) = (trace.make_rank(events, proto, None, True, 8, local=True) for _ in range(2))
    A, B = ops_jax.JaxAlltoAll(a), ops_jax.JaxAlltoAll(b)
    assert A.native and B.native
    yield A, B, ra, rb, made
    A.close()
    B.close()
    a.close()
    b.close()


def _args(a2a, T):
    import jax
    import jax.numpy as jnp
    return (jax.ShapeDtypeStruct((T, trace.TOP_K), jnp.int32),
            [jax.ShapeDtypeStruct((T,) + tuple(s.shape), jnp.dtype(s.dtype)) for s in a2a.payload_specs])


def _tbo(A, B, tmax):
    def step(ids_a, pays_a, ids_b, pays_b):
        ta = A.dispatch_send(ids_a, pays_a, tmax)
        da = A.dispatch_recv(ta)
        tb = B.dispatch_send(ids_b, pays_b, tmax)
        ca = A.combine_send(da.payloads[0], da)
        db = B.dispatch_recv(tb)
        ya = A.combine_recv(ca)
        cb = B.combine_send(db.payloads[0], db)
        return da.expert_ids, ya, B.combine_recv(cb)
    return step


def _both_sends_first(A, B, tmax):
    def step(ids_a, pays_a, ids_b, pays_b):
        ta, tb = A.dispatch_send(ids_a, pays_a, tmax), B.dispatch_send(ids_b, pays_b, tmax)
        da, db = A.dispatch_recv(ta), B.dispatch_recv(tb)
        ca, cb = A.combine_send(da.payloads[0], da), B.combine_send(db.payloads[0], db)
        return A.combine_recv(ca), B.combine_recv(cb)
    return step


@pytest.mark.parametrize("order", [_tbo, _both_sends_first])
def test_traced_micro_batches_plan_what_the_handler_runs(two, order):
    """Two micro-batches' halves traced and lowered on the CPU: eight custom calls, each a
    registered plan; the dispatch send reads its operands where the eager call would, the
    receive copies the views into its results, the combine send stages operand 0 and the
    combine receive writes its result; every launch goes without PDL (a call's fork comes
    between two halves)."""
    import jax
    A, B, ra, rb, made = two
    rng = random.Random()
    tmax = rng.choice([1, 4, 16, 64])
    Ta, Tb = rng.randint(1, tmax), rng.randint(1, tmax)
    text = jax.jit(order(A, B, tmax)).lower(*_args(A.a2a, Ta), *_args(B.a2a, Tb)).as_text()
    assert text.count("custom_call @ep_a2a_run") == 8 and len(A._plans) == len(B._plans) == 4
    calls = [g.ops for (g,) in made]
    P = len(A.a2a.payload_specs)
    by_kernel = {}
    for ops in calls:
        launch = next(op for op in ops if op.function != "ep_copy_bytes")  # (copies are launches too)
        assert not launch.pdl
        by_kernel.setdefault(str(launch.function).split("_", 1)[1].rsplit("_bf16", 1)[0], []).append(ops)
    assert sorted(by_kernel) == sorted(HALVES) and all(len(v) == 2 for v in by_kernel.values())
    for (send,), r, T in zip(by_kernel["dispatch_send"], (ra, rb), (Ta, Tb)):
        block = A2AParams.from_buffer_copy(send.args[0])
        assert [block.payloads[q].src for q in range(P + 1)] == [jax_plan.fake(q) for q in range(P + 1)]
        assert (block.local_num_tokens, block.runtime_max_tokens_per_rank) == (T, tmax)
    for (launch, *copies), r in zip(by_kernel["dispatch_recv"], (ra, rb)):
        ids_v, views = r.dispatch_views(tmax)
        assert [copied(c) for c in copies] == \
            [(jax_plan.fake(1 + k), v.ptr, v.nbytes) for k, v in enumerate([ids_v, *views])]  # (operand: the ticket)
    for (stage, launch), r in zip(by_kernel["combine_send"], (ra, rb)):
        assert copied(stage) == (r.plan.combine_input, jax_plan.fake(0),
                                                        r.a2a.ep_size * tmax * r.plan.combine_bytes)
    for (launch,) in by_kernel["combine_recv"]:
        block = A2AParams.from_buffer_copy(launch.args[0])
        assert block.combine_out == jax_plan.fake(1) and block.trigger_early == 0


def _shape(A, step, T=2, a2a=None):
    import jax
    return jax.eval_shape(step, *_args(a2a or A.a2a, T))


def test_out_of_order_halves_are_refused_while_tracing(two):
    A, B, *_ = two
    tmax = 4

    def recv_twice(ids, pays):
        t = A.dispatch_send(ids, pays, tmax)
        A.dispatch_recv(t)
        return A.dispatch_recv(t).expert_ids

    def send_twice(ids, pays):
        A.dispatch_send(ids, pays, tmax)
        return A.dispatch_send(ids, pays, tmax).ticket

    def whole_between(ids, pays):
        t = A.dispatch_send(ids, pays, tmax)
        A.dispatch(ids, pays, tmax)
        return A.dispatch_recv(t).expert_ids

    def others_ticket(ids, pays):
        A.dispatch_send(ids, pays, tmax)
        return A.dispatch_recv(B.dispatch_send(ids, pays, tmax)).expert_ids

    def combine_ticket_to_dispatch_recv(ids, pays):
        d = A.dispatch_recv(A.dispatch_send(ids, pays, tmax))
        return A.dispatch_recv(A.combine_send(d.payloads[0], d)).expert_ids

    def next_step_before_combine(ids, pays):
        A.dispatch_recv(A.dispatch_send(ids, pays, tmax))
        return A.dispatch_send(ids, pays, tmax).ticket

    def combine_between(ids, pays):
        d = A.dispatch_recv(A.dispatch_send(ids, pays, tmax))
        c = A.combine_send(d.payloads[0], d)
        A.combine(d.payloads[0], d)
        return A.combine_recv(c)

    cases = {recv_twice: "dispatch_recv: this dispatch send half's ticket was received already",
             send_twice: "dispatch_send: dispatch send called while the dispatch send half awaits",
             whole_between: "JaxAlltoAll.dispatch: dispatch whole called while the dispatch send half awaits",
             others_ticket: "dispatch_recv: the ticket is another all-to-all's",
             combine_ticket_to_dispatch_recv: "dispatch_recv: the ticket is a combine send half's",
             next_step_before_combine: "dispatch_send: dispatch send out of order: a combine is due",
             combine_between: "dispatch_recv\\(\\); this call pairs with dispatch\\(\\)"}
    for fn, message in cases.items():
        with pytest.raises((HalvesOrderError, ValueError), match=message):
            _shape(A, fn)


def test_the_order_is_per_trace(two):
    """A trace that failed half way leaves nothing behind, a later trace starts afresh, and a
    step split over two jitted functions (the order across them is the caller's) traces."""
    import jax
    A, B, *_ = two
    tmax = 4

    def fails(ids, pays):
        A.dispatch_send(ids, pays, tmax)
        raise KeyError("the model failed while tracing")

    with pytest.raises(KeyError):
        _shape(A, fails)

    def whole(ids, pays):
        d = A.dispatch_recv(A.dispatch_send(ids, pays, tmax))
        return A.combine_recv(A.combine_send(d.payloads[0], d))
    _shape(A, whole)
    _shape(A, whole)
    ticket = _shape(A, lambda ids, pays: A.dispatch_send(ids, pays, tmax))
    assert isinstance(ticket.ticket, jax.ShapeDtypeStruct) and ticket.ticket.shape == (1,)
    d = jax.eval_shape(A.dispatch_recv, ticket)
    assert d.expert_ids.shape == (A.a2a.ep_size, tmax, trace.TOP_K)


def test_without_the_native_library_the_halves_say_why(monkeypatch):
    pytest.importorskip("jax")
    from ep_a2a.ops.jax import JaxAlltoAll
    events = []
    trace.patch_driver(monkeypatch.setattr, events)
    monkeypatch.setenv("EP_A2A_JAX_NATIVE", "0")
    with hooks.dry_run():
        a2a, r = trace.make_rank(events, "fence", None, True, 8, local=True)
    ops = JaxAlltoAll(a2a)
    assert not ops.native
    with pytest.raises(RuntimeError, match="dispatch_send: the halves run only on the native path.*EP_A2A_JAX_NATIVE=0"
                                           ".*no Python fallback"):
        _shape(ops, lambda ids, pays: ops.dispatch_send(ids, pays, 4))
    only = JaxAlltoAll.traced_only(a2a.options, (3,))
    with pytest.raises(RuntimeError, match="dispatch_send: this JaxAlltoAll was made by traced_only"):
        _shape(only, lambda ids, pays: only.dispatch_send(ids, pays, 4), a2a=a2a)
    ops.close()
    a2a.close()
