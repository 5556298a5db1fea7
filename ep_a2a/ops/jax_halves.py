"""The send and receive halves (ep_a2a/halves.py) of dispatch and combine inside jax.jit.

    A, B = JaxAlltoAll(a2a_a), JaxAlltoAll(a2a_b)        # two micro-batches: two all-to-alls
    @jax.jit
    def step(...):
        ta = A.dispatch_send(ids_a, [x_a, w_a], T_hat)   # a ticket: the send half issued
        ...                                             # B's attention
        da = A.dispatch_recv(ta)                        # dispatch()'s Dispatched
        tb = B.dispatch_send(ids_b, [x_b, w_b], T_hat)
        ca = A.combine_send(experts(da), da)             # a ticket
        db = B.dispatch_recv(tb)
        ya = A.combine_recv(ca)                          # combine()'s output
        ...

Each half is one XLA FFI call on the native path (jax_ffi.py), planned while tracing from
the state the previous half of its all-to-all leaves (jax_plan.steady_halves). Order: XLA
may reorder calls that share no data, so each half takes the previous half's ticket (a
uint32[1] nobody reads) as an operand: a receive runs after its send, a combine send after
its dispatch receive. What data cannot say (nothing else of the same all-to-all between a
send and its receive, a ticket received twice) is checked while tracing, by the eager rule
(schedule.check_order), per trace: one jitted function is one program in one order; across
separately jitted functions the order is the caller's, as for CUDA graph replays.

There is no Python fallback for the halves: without the native library they raise.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import numpy as np

from ..errors import HalvesOrderError
from ..schedule import COMBINE_RECEIVE, COMBINE_SEND, DISPATCH_RECEIVE, DISPATCH_SEND, StepState, check_order
from . import jax_ffi
from .jax_plan import CopyOp, fake, half_params, steady_halves, step_launch

_TICKET = jax.ShapeDtypeStruct((1,), np.uint32)


def _trace_key():
    """The trace being built (its order state lives with it), or a fresh key where this jax
    has no such hook (then only the tickets order the halves)."""
    try:
        from jax.extend.core import get_opaque_trace_state
    except ImportError:
        try:
            from jax._src.core import get_opaque_trace_state
        except ImportError:  # (its absence costs the checks that span calls, nothing else)
            return object()
    return get_opaque_trace_state()


class _Calls:
    rank = "*"  # (check_order names a rank; one jit call covers every rank alike)


class TraceOrder:
    """The halves and whole calls of one all-to-all in the trace being built: which send half
    awaits its receive and whether a dispatch awaits its combine (StepState.sent / pending).
    A trace starts unknown (its first call is taken as it comes: it may continue a step
    that an earlier, separately jitted function began)."""

    def __init__(self):
        self.key, self.state, self.received = None, None, set()

    def check(self, name: str, phase, site: int = None) -> None:
        """Raise HalvesOrderError unless `phase` (called as `name`, its ticket's `site`) may
        come now. Whole calls are refused only while a send half awaits its receive."""
        key = _trace_key()
        if self.key is None or not key == self.key:
            self.key, self.state, self.received = key, None, set()
        st = self.state
        if phase.part == "receive" and (phase.op, site) in self.received:
            raise HalvesOrderError(f"JaxAlltoAll.{name}: this {phase.op} send half's ticket was received already")
        if st is None or (phase.part == "whole" and st.sent is None):
            return
        if phase.part == "receive" and st.sent is not None and st.sent[0] == phase.op and st.sent[1] != site:
            raise HalvesOrderError(f"JaxAlltoAll.{name}: this ticket is not the {phase.op} send half due "
                                   f"(another {phase.op}_send came after it)")
        try:
            check_order(_Calls, st, phase)
        except HalvesOrderError as e:
            raise HalvesOrderError(f"JaxAlltoAll.{name}: {str(e).split(': ', 1)[1]}") from None

    def done(self, phase, site: int = None) -> None:
        """The state after `phase` (it depends on that call alone)."""
        if phase.part == "receive":
            self.received.add((phase.op, site))
        after_combine = phase.op == "combine" and phase.part != "send"
        sent = (phase.op, site) if phase.part == "send" else None
        self.state = StepState(pending=None if after_combine else True, sent=sent)


@jax.tree_util.register_pytree_node_class
class SendTicket:
    """A send half in flight under jit: its ticket array (the data dependence that orders the
    receive after it) and the static facts its receive needs."""

    def __init__(self, ticket, *, ops, op: str, tmax: int, num_tokens: tuple, single: bool, site: int):
        self.ticket, self.ops, self.op, self.tmax, self.num_tokens, self.single, self.site = \
            ticket, ops, op, tmax, num_tokens, single, site

    def tree_flatten(self):
        return (self.ticket,), (self.ops, self.op, self.tmax, self.num_tokens, self.single, self.site)

    @classmethod
    def tree_unflatten(cls, aux, children):
        ops, op, tmax, num_tokens, single, site = aux
        return cls(children[0], ops=ops, op=op, tmax=tmax, num_tokens=num_tokens, single=single, site=site)

    def __repr__(self):
        return f"<{self.op} send half {self.site} (T^={self.tmax})>"


class HalvesCalls(NamedTuple):
    """What the halves take from their JaxAlltoAll (ops/jax.py), handed over when it is made:
    the halves keep their own state (the planned steps per send site) and reach the rest only
    through these."""
    owner: object                 # the JaxAlltoAll: tickets and Dispatched name it
    options: object               # its config.Options
    a2a: object                   # its MoeAlltoAll (None: traced_only)
    native: bool                  # whether the native FFI path is in use
    order: TraceOrder             # the trace's order, shared with the whole calls
    site: Callable                # () -> a new call site number
    call: Callable                # (ops_for, outs, *args) -> results: one FFI call
    check_dispatch: Callable      # dispatch()'s argument checks
    check_ticket: Callable        # combine()'s check of a Dispatched
    check_partials: Callable      # combine()'s check of the partial results
    dispatched: type              # the Dispatched class


class JaxHalves:
    """The send and receive halves of one JaxAlltoAll's dispatch and combine (module
    docstring); JaxAlltoAll.dispatch_send and the others call these."""

    def __init__(self, calls: HalvesCalls):
        self.calls = calls
        self.planned = {}  # send site -> per GPU ordinal, per rank: (the step's four halves, their blocks)

    def _ready(self, name: str) -> None:
        if self.calls.a2a is None:
            raise RuntimeError(f"JaxAlltoAll.{name}: this JaxAlltoAll was made by traced_only(); the halves "
                               "plan their launches while tracing and need a MoeAlltoAll")
        if not self.calls.native:
            raise RuntimeError(f"JaxAlltoAll.{name}: the halves run only on the native path (libep_a2a_jax.so "
                               f"through the XLA FFI), which is not in use: {jax_ffi.why()}. There is no Python "
                               "fallback for the halves: use dispatch() and combine(), or build the library")

    def _send_ticket(self, ticket, op: str, name: str) -> SendTicket:
        if not isinstance(ticket, SendTicket):
            raise TypeError(f"JaxAlltoAll.{name}: expected the ticket {op}_send returned, got {type(ticket).__name__}")
        if ticket.ops is not self.calls.owner:
            raise HalvesOrderError(f"JaxAlltoAll.{name}: the ticket is another all-to-all's (each micro-batch "
                                   "receives its own send halves)")
        if ticket.op != op:
            raise HalvesOrderError(f"JaxAlltoAll.{name}: the ticket is a {ticket.op} send half's, not a {op} one")
        return ticket

    # -- dispatch ---------------------------------------------------------------------------------
    def dispatch_send(self, token_selected_experts, payloads=(), runtime_max_tokens_per_rank: int = None) -> SendTicket:
        """dispatch()'s send half (its arguments): issues every store and flag and waits on no
        peer; returns the ticket dispatch_recv takes."""
        c = self.calls
        tmax, ids_l, pays_l, single, tokens = c.check_dispatch(token_selected_experts, payloads,
                                                               runtime_max_tokens_per_rank)
        self._ready("dispatch_send")
        site = c.site()
        c.order.check("dispatch_send", DISPATCH_SEND, site)
        ticket = c.call(self._dispatch_send_ops(site, tmax, tokens), _TICKET, ids_l, pays_l)
        c.order.done(DISPATCH_SEND, site)
        return SendTicket(ticket, ops=c.owner, op="dispatch", tmax=tmax, num_tokens=tokens, single=single, site=site)

    def _dispatch_send_ops(self, site, tmax, tokens):
        """ops_for of a dispatch send (operands ids[n] then payloads[n][P]; result: the ticket).
        Plans the step's four halves per rank, the combine output as result i of the combine
        receive's call (operand 0 there is its ticket)."""
        P, planned = len(self.calls.options.payloads), {}
        self.planned[site] = planned

        def ops_for(dev, n_in):
            n, ops, steps_of = len(dev.ranks), [], []
            for i, r in enumerate(dev.ranks):
                # (a rank without tokens: XLA's empty buffers may have no address; ours stand in)
                sources = [fake(i)] + [fake(n + i * P + q) for q in range(P)] if tokens[i] else [r.base] * (P + 1)
                steps = steady_halves(r.plan, r.state.tag_hi, r.a2a.protocol, tokens[i], tmax, sources,
                                      fake(1 + i) if tokens[i] else r.base)
                blocks = half_params(r.plan, steps)
                steps_of.append((steps, blocks))
                ops.append(step_launch(r.plan, i, steps[0], blocks[0], first=True))
            planned[dev.device.ordinal] = steps_of
            return ops
        return ops_for

    def _half_ops(self, site: int, half: int, extra=None):
        """ops_for of a later half (1: dispatch receive, 2: combine send, 3: combine receive):
        its planned launch per rank, launched without PDL (the call's fork came between),
        after extra(dev, i, r, n_in) ops (combine send: the staging copy) or before them
        (dispatch receive: the copies out of the workspace)."""
        planned = self.planned.get(site)
        if planned is None:
            raise RuntimeError("the send half of this ticket was traced by another JaxAlltoAll or not at all")

        def ops_for(dev, n_in):
            ops = []
            for i, r in enumerate(dev.ranks):
                steps, blocks = planned[dev.device.ordinal][i]
                launch = step_launch(r.plan, i, steps[half], blocks[half], first=True)
                more = extra(dev, i, r, n_in) if extra is not None else []
                ops += more + [launch] if half == 2 else [launch] + more
            return ops
        return ops_for

    def dispatch_recv(self, ticket: SendTicket):
        """The receive half of dispatch_send's `ticket`: waits for every peer, then returns what
        dispatch() returns (a Dispatched: copies of the received views), for combine_send."""
        c = self.calls
        t = self._send_ticket(ticket, "dispatch", "dispatch_recv")
        self._ready("dispatch_recv")
        c.order.check("dispatch_recv", DISPATCH_RECEIVE, t.site)
        a, n, P, tmax = c.options, len(t.num_tokens), len(c.options.payloads), t.tmax
        shapes = [jax.ShapeDtypeStruct((a.ep_size, tmax) + tuple(s.shape), jax.numpy.dtype(s.dtype)) for s in a.payloads]
        outs = ([jax.ShapeDtypeStruct((a.ep_size, tmax, a.top_k), np.int32)] * n, [shapes] * n, _TICKET)

        def copies(dev, i, r, n_in):
            ids_v, pays_v = r.dispatch_views(tmax)
            return [CopyOp(i, fake(n_in + i), ids_v.ptr, ids_v.nbytes)] + \
                [CopyOp(i, fake(n_in + n + i * P + q), v.ptr, v.nbytes) for q, v in enumerate(pays_v)]
        ids_o, pays_o, tk = c.call(self._half_ops(t.site, 1, copies), outs, t.ticket)
        c.order.done(DISPATCH_RECEIVE, t.site)
        return c.dispatched(ids_o[0] if t.single else ids_o, pays_o[0] if t.single else pays_o, tk, ops=c.owner,
                            kind="dispatch_recv", tmax=tmax, num_tokens=t.num_tokens, site=t.site, single=t.single)

    # -- combine ----------------------------------------------------------------------------------
    def combine_send(self, partial, dispatched) -> SendTicket:
        """combine()'s send half: partial as combine() takes it, `dispatched` from dispatch_recv.
        Stages the partial results into the workspace and publishes them (FENCE) or pushes them
        to their owners (SENTINEL); returns the ticket combine_recv takes."""
        c = self.calls
        tmax, single = c.check_ticket(dispatched, "dispatch_recv")
        parts = c.check_partials(partial, tmax, single)
        self._ready("combine_send")
        c.order.check("combine_send", COMBINE_SEND, dispatched.site)
        nbytes = c.options.ep_size * tmax

        def stage(dev, i, r, n_in):
            return [CopyOp(i, r.plan.combine_input, fake(i), nbytes * r.plan.combine_bytes)]
        tk = c.call(self._half_ops(dispatched.site, 2, stage), _TICKET, parts, dispatched.ticket)
        c.order.done(COMBINE_SEND, dispatched.site)
        return SendTicket(tk, ops=c.owner, op="combine", tmax=tmax, num_tokens=dispatched.num_tokens, single=single,
                          site=dispatched.site)

    def combine_recv(self, ticket: SendTicket):
        """The receive half of combine_send's `ticket`: waits for every peer, reduces; returns
        what combine() returns ([local tokens, hidden] per rank)."""
        c = self.calls
        t = self._send_ticket(ticket, "combine", "combine_recv")
        self._ready("combine_recv")
        c.order.check("combine_recv", COMBINE_RECEIVE, t.site)
        a = c.options
        outs = [jax.ShapeDtypeStruct((T, a.combine_hidden_size), jax.numpy.dtype(a.combine_dtype.name))
                for T in t.num_tokens]
        res = c.call(self._half_ops(t.site, 3), outs, t.ticket)
        c.order.done(COMBINE_RECEIVE, t.site)
        return res[0] if t.single else res
