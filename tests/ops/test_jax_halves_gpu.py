"""The JAX halves (ep_a2a/ops/jax_halves.py) on the GPU: two micro-batches (two all-to-alls of
one group of 8 in-process ranks) inside one jax.jit, their halves in the TBO order, both sends
first, or a random legal interleaving, random token counts per rank, both protocols, each
micro-batch checked bitwise against the NumPy reference (test_jax_ops_gpu.check_step); steps of
halves alternate with steps whose micro-batch A takes the whole calls; XLA command buffers on and off
(subprocesses: XLA_FLAGS must be set before jax loads). The halves run on the native path only."""
import os
import random
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (before jax: room for our workspaces)

import pytest  # noqa: E402
from common import fresh_rng  # noqa: E402

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")

import test_jax_ops_gpu as t  # noqa: E402
from ep_a2a.testing.halves_step import BOTH_SENDS_FIRST, OPS, TBO, interleaving  # noqa: E402

EP, E, TMAX = 8, 17, 16


def _native_or_skip():
    from ep_a2a.ops import jax_ffi
    if jax_ffi.why() is not None:
        pytest.skip(f"the JAX halves need the native library: {jax_ffi.why()}")


def _parts(d):
    """The partial results combine takes: the received hidden states (bitwise reference)."""
    return d.payloads[0] if not isinstance(d.expert_ids, list) else [p[0] for p in d.payloads]


def two_batch_step(A, B, tmax, order):
    """A jitted step of micro-batches A and B whose halves run in `order` ((name, half) pairs),
    or "mixed": A's whole calls, B's halves. (Not both whole: with nothing ordering them, XLA
    may run two whole calls at once, and two spinning all-to-alls may not fit on one GPU.)"""
    ops = {"A": A, "B": B}
    if order == "mixed":
        order = [("A", "whole")] + [("B", half) for half in OPS]

    def step(ins_a, ins_b):
        ins, sent, got = {"A": ins_a, "B": ins_b}, {}, {}
        for m, half in order:
            o = ops[m]
            if half == "whole":
                got[m, "d"] = d = o.dispatch(*ins[m], tmax)
                got[m, "y"] = o.combine(_parts(d), d)
            elif half == "dispatch_send":
                sent[m] = o.dispatch_send(*ins[m], tmax)
            elif half == "dispatch_recv":
                got[m, "d"] = o.dispatch_recv(sent[m])
            elif half == "combine_send":
                sent[m] = o.combine_send(_parts(got[m, "d"]), got[m, "d"])
            else:
                got[m, "y"] = o.combine_recv(sent[m])
        return tuple((got[m, "d"].expert_ids, got[m, "d"].payloads, got[m, "y"]) for m in "AB")
    return jax.jit(step)


def check_two(A, B, rng, tokens, tmax, dev, f, msg) -> None:
    """One step of f for both micro-batches, each checked by check_step: B's check draws its
    inputs and calls in, A's check inside it draws A's and runs the joint step."""
    got = {}

    def step_b(ids_b, pays_b):
        def step_a(ids_a, pays_a):
            got["A"], got["B"] = f((ids_a, pays_a), (ids_b, pays_b))
            return got["A"]
        t.check_step(A, A.a2a, rng, tokens[0], tmax, dev, step_a, f"{msg} micro-batch A")
        return got["B"]
    t.check_step(B, B.a2a, rng, tokens[1], tmax, dev, step_b, f"{msg} micro-batch B")


def run_steps(protocol, steps, seed_rng=None, label=""):
    """`steps` jitted steps of two micro-batches on 8 in-process ranks: the TBO order, both
    sends first, then random legal interleavings or A whole and B halved, random sizes."""
    import ep_a2a
    from ep_a2a.ops.jax import JaxAlltoAll
    rng, seed = seed_rng or fresh_rng()
    rnd = random.Random(int(rng.integers(1 << 30)))
    dev = jax.devices("gpu")[0]
    kw = dict(max_tokens_per_rank=TMAX, top_k=t.K, num_experts=E, payloads=t._specs(), combine_hidden_size=t.H,
              protocol=protocol, timeout_s=20.0)
    with ep_a2a.LocalGroup([0] * EP) as group, ep_a2a.MoeAlltoAll(group, **kw) as a, \
            ep_a2a.MoeAlltoAll(group, **kw) as b, JaxAlltoAll(a) as A, JaxAlltoAll(b) as B:
        for step in range(steps):
            order = {0: TBO, 1: BOTH_SENDS_FIRST}.get(step) or rnd.choice(["mixed", interleaving(rnd)])
            tmax = int(rnd.choice([1, 4, TMAX]))
            tokens = [[int(x) for x in rng.integers(0, tmax + 1, EP)] for _ in "AB"]
            f = two_batch_step(A, B, tmax, order)
            for again in range(2):  # a new trace, then the same program with new routing
                check_two(A, B, rng, tokens, tmax, dev, f, f"{seed} {label} {protocol} step {step}.{again} "
                          f"T^={tmax} tokens={tokens} order={order}")
        return t._path(A), t._path(B)


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_two_micro_batches_under_jit_match_the_reference(protocol):
    t._gpu()
    _native_or_skip()
    assert run_steps(protocol, 6) == ("native", "native")


def test_one_rank_per_gpu_takes_bare_arrays():
    """One rank on the GPU: arguments and results are bare arrays, not lists."""
    import ep_a2a
    from ep_a2a.ops.jax import JaxAlltoAll
    dev = t._gpu()
    _native_or_skip()
    rng, seed = fresh_rng()
    with ep_a2a.LocalGroup([0]) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=8, top_k=t.K, num_experts=5, payloads=t._specs(),
                               combine_hidden_size=t.H, timeout_s=20.0) as a2a, JaxAlltoAll(a2a) as ops:
        @jax.jit
        def step(ids, pays):
            d = ops.dispatch_recv(ops.dispatch_send(ids, pays, 8))
            return d.expert_ids, d.payloads, ops.combine_recv(ops.combine_send(d.payloads[0], d))
        f = lambda ids, pays: (lambda r: ([r[0]], [r[1]], [r[2]]))(step(ids[0], pays[0]))  # noqa: E731
        for T in (8, int(rng.integers(0, 9))):
            t.check_step(ops, a2a, rng, [T], 8, dev, f, f"{seed} one rank T={T}")


CHILD = r"""
import os, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path[:0] = [{root!r}, {tests!r}, {here!r}]
import test_jax_halves_gpu as h
paths = [h.run_steps(p, 4, label="XLA_FLAGS=" + str(os.environ.get("XLA_FLAGS"))) for p in ("fence", "sentinel")]
print("CHILD OK", paths, os.environ.get("XLA_FLAGS"))
"""


@pytest.mark.parametrize("flags,captured", [(t.CAPTURE, True), (t.CAPTURE, False), ("--xla_gpu_enable_command_buffer=", True)])
def test_command_buffers_on_and_off(flags, captured):
    """The halves in XLA's command buffers (CUDA graphs: captured once, replayed), with the
    handler XLA never captures (EP_A2A_JAX_COMMAND_BUFFERS=0), and with command buffers off."""
    t._gpu()
    _native_or_skip()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS=flags)
    if not captured:
        env["EP_A2A_JAX_COMMAND_BUFFERS"] = "0"
    code = CHILD.format(root=os.path.dirname(os.path.dirname(here)), tests=os.path.dirname(here), here=here)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=here)
    assert p.returncode == 0 and "CHILD OK [('native', 'native'), ('native', 'native')]" in p.stdout, \
        f"XLA_FLAGS={flags!r} captured={captured}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
