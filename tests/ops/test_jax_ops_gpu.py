"""ep_a2a/ops/jax.py on the GPU: dispatch and combine inside jax.jit against the NumPy reference
(bitwise), one JAX process driving 1, 4 and 8 in-process ranks of one GPU (the single controller;
the call forks XLA's stream to the ranks' streams and joins back), routing changing from call to
call, T^ shuffled between traces, shard_map over the local devices, XLA command buffers on and
off and the Python fallback (subprocesses), eager and jit errors alike, a failure recorded by a
kernel refusing the next jitted call, and the MoE layer under jit bitwise equal to the eager
layer. The calls take the native path (ops/jax_ffi.py) where its library is built: each test
checks which path ran (_path)."""
import os
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (before jax: room for our workspaces)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from common import fresh_rng, layer_token_counts  # noqa: E402

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

import ep_a2a  # noqa: E402
from ep_a2a import PayloadSpec  # noqa: E402
from ep_a2a.testing import reference as ref  # noqa: E402
from ep_a2a.testing.harness import rows_of  # noqa: E402

H, K = 128, 4


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend")


def _specs():
    return [PayloadSpec("hidden", (H,), "bfloat16"), PayloadSpec("weights", (K,), "float32")]


def _inputs(rng, tokens, E, dev):
    ids = [rng.integers(-1, E, (t, K)).astype(np.int32) for t in tokens]
    xs = [ref.from_float32(rng.standard_normal((t, H)).astype(np.float32), "bfloat16") for t in tokens]
    ws = [rng.random((t, K)).astype(np.float32) for t in tokens]
    put = lambda a: jax.device_put(jnp.asarray(a), dev)  # noqa: E731
    return ids, xs, ws, [put(i) for i in ids], [put(x.view(jnp.bfloat16)) for x in xs], [put(w) for w in ws]


def check_step(ops, a2a, rng, tokens, tmax, dev, step_fn, msg):
    """One jitted dispatch + combine of every rank against the reference: each (source, target)
    region holds the reference's tokens as a set (FENCE fills slots in any order; SENTINEL puts
    token i in slot i), empty slots carry id -1, and combine of partial = the received hidden
    states is bitwise the reference."""
    ep, E = a2a.ep_size, a2a.num_experts
    fence = a2a.protocol_for(tmax) == "fence"
    ids, xs, ws, jids, jxs, jws = _inputs(rng, tokens, E, dev)
    got_ids, got_pays, ys = step_fn(jids, [[x, w] for x, w in zip(jxs, jws)])
    received, records = ref.dispatch(ids, [[x, w] for x, w in zip(xs, ws)], ep, E, tmax)
    for t in range(ep):
        gi, gx, gw = np.asarray(got_ids[t]), np.asarray(got_pays[t][0]).view(np.uint16), np.asarray(got_pays[t][1])
        r = received[t]
        for s in range(ep):
            n = int(r["counts"][s])
            slots = np.arange(n) if fence else np.asarray(r["tokens"][s], np.int64)
            want = rows_of(r["expert_ids"][s, :n], r["payloads"][0][s, :n], r["payloads"][1][s, :n])
            got = rows_of(gi[s, slots], gx[s, slots], gw[s, slots])
            assert np.array_equal(np.sort(got), np.sort(want)), f"{msg}: rank {t} region {s}: received tokens differ"
            empty = np.setdiff1d(np.arange(tmax), slots)
            assert (gi[s, empty] == -1).all(), f"{msg}: rank {t} region {s}: slots without a token must carry id -1"
    partials = [r["payloads"][0] for r in received]
    want_y = ref.combine(partials, records, "bfloat16")
    for s in range(ep):
        got = np.asarray(ys[s]).view(np.uint16)
        assert got.shape == (tokens[s], H), f"{msg}: rank {s} output shape {got.shape}"
        assert np.array_equal(got, want_y[s]), f"{msg}: rank {s}: combine differs from the reference " \
            f"at {np.argwhere(got != want_y[s])[:3].tolist()}"


def _path(ops) -> str:
    """Which path ops' calls took: "native" (its plans served calls on GPU 0)
    or "python" (the library is absent: jax_ffi.why() says why)."""
    from ep_a2a.ops import jax_ffi
    if not ops.native:
        assert jax_ffi.why() is not None
        return "python"
    assert any(p.calls(0) > 0 for p in ops._plans), "no native plan ever ran"
    return "native"


def _expect_native(ops):
    from ep_a2a.ops import jax_ffi
    if os.environ.get("EP_A2A_JAX_NATIVE") != "0" and jax_ffi.LIBRARY.is_file():
        assert _path(ops) == "native", f"the native library is present but unused: {jax_ffi.why()}"


def _jitted(ops, tmax):
    def step(ids, pays):
        d = ops.dispatch(ids, pays, tmax)
        parts = d.payloads[0] if not isinstance(d.expert_ids, list) else [p[0] for p in d.payloads]
        return d.expert_ids, d.payloads, ops.combine(parts, d)
    f = jax.jit(step)
    if ops.per_device == 1:
        return lambda ids, pays: (lambda r: ([r[0]], [r[1]], [r[2]]))(f(ids[0], pays[0]))
    return f


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
@pytest.mark.parametrize("ep", [1, 4, 8])
def test_jit_dispatch_combine_match_reference(ep, protocol):
    from ep_a2a.ops.jax import JaxAlltoAll
    dev = _gpu()
    rng, seed = fresh_rng()
    E, tmax = max(2 * ep + 1, K + 1), 12  # (top_k <= num_experts, at ep=1 too)
    with ep_a2a.LocalGroup([0] * ep) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=16, top_k=K, num_experts=E, payloads=_specs(),
                               combine_hidden_size=H, protocol=protocol, timeout_s=20.0) as a2a, \
            JaxAlltoAll(a2a) as ops:
        f = _jitted(ops, tmax)
        for step in range(4):  # the same shapes with new routing, then new token counts (a new trace)
            tokens = [tmax] * ep if step < 2 else layer_token_counts(rng, ep, tmax, step - 2)
            check_step(ops, a2a, rng, tokens, tmax, dev, f, f"{seed} ep={ep} {protocol} step {step} tokens={tokens}")
        _expect_native(ops)


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_shuffled_sizes_alternate_between_traces(protocol):
    """T^ and the token counts shuffled from call to call: each size's trace keeps its own plan,
    and a step of one size after a step of another is still bitwise the reference."""
    from ep_a2a.ops.jax import JaxAlltoAll
    dev = _gpu()
    rng, seed = fresh_rng()
    ep, E = 8, 17
    with ep_a2a.LocalGroup([0] * ep) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=32, top_k=K, num_experts=E, payloads=_specs(),
                               combine_hidden_size=H, protocol=protocol, timeout_s=20.0) as a2a, \
            JaxAlltoAll(a2a) as ops:
        fs = {tmax: _jitted(ops, tmax) for tmax in (1, 3, 8, 32)}
        sizes = [int(t) for t in rng.permutation(list(fs) * 3)]
        for step, tmax in enumerate(sizes):
            tokens = [int(t) for t in rng.integers(0, tmax + 1, ep)]
            check_step(ops, a2a, rng, tokens, tmax, dev, fs[tmax], f"{seed} {protocol} step {step} T^={tmax} {tokens}")
        _expect_native(ops)


def test_a_timeout_inside_a_jitted_step_refuses_the_next_call():
    """on_timeout="abort": rank 1 runs one dispatch ahead, eagerly, so inside the next jitted
    step its peers' dispatches pair with that one and its own jitted dispatch waits for a step
    that never comes: its kernel gives up inside the jitted step, records the failure and tells
    the peers. The next jitted call fails with an error naming it (the handler reads every
    rank's record before launching), never silently, and a2a.error() holds it."""
    from ep_a2a.ops.jax import JaxAlltoAll
    dev = _gpu()
    rng, seed = fresh_rng()
    ep, tmax = 4, 8
    with ep_a2a.LocalGroup([0] * ep) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=K, num_experts=9, payloads=_specs(),
                               combine_hidden_size=H, timeout_s=0.5, first_timeout_s=0.5,
                               on_timeout="abort") as a2a, JaxAlltoAll(a2a) as ops:
        f = _jitted(ops, tmax)
        check_step(ops, a2a, rng, [tmax] * ep, tmax, dev, f, f"{seed} before the failure")
        assert a2a.error() is None
        ids, xs, ws, jids, jxs, jws = _inputs(rng, [tmax] * ep, 9, dev)
        args = (jids, [[x, w] for x, w in zip(jxs, jws)])
        a2a.ranks[1].dispatch(jids[1], [jxs[1], jws[1]], tmax)  # (rank 1 one step ahead)
        try:
            jax.block_until_ready(f(*args))  # (native: the step completes, its kernels having given up)
        except Exception as e:  # noqa: BLE001  (the Python path refuses rank 1's second dispatch at once)
            assert not ops.native, f"{seed}: the jitted step itself raised {e!r}"
        a2a.ranks[0].device.synchronize()
        assert a2a.error() is not None, f"{seed}: the timeout inside the jitted step recorded nothing"
        with pytest.raises(Exception) as e:
            jax.block_until_ready(f(*args))
        if ops.native:
            assert "recorded a failure" in str(e.value), str(e.value)


def test_shard_map_over_local_devices():
    """One call per device under shard_map (here the one H200: 4 in-process ranks on it)."""
    from jax.sharding import Mesh, PartitionSpec as P
    from ep_a2a.ops.jax import JaxAlltoAll
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    dev = _gpu()
    rng, seed = fresh_rng()
    ep, E, tmax = 4, 9, 8
    mesh = Mesh(np.array([dev]), ("d",))
    with ep_a2a.LocalGroup([0] * ep) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=K, num_experts=E, payloads=_specs(),
                               combine_hidden_size=H, timeout_s=20.0) as a2a, JaxAlltoAll(a2a) as ops:
        def body(ids, pays):
            d = ops.dispatch(ids, pays, tmax)
            return d.expert_ids, d.payloads, ops.combine([p[0] for p in d.payloads], d)
        f = jax.jit(shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))
        for step in range(2):
            check_step(ops, a2a, rng, [tmax, 3, 0, 5], tmax, dev, f, f"{seed} shard_map step {step}")
        _expect_native(ops)


def test_errors_under_jit_are_eagers():
    """The same bad call, eager and traced: the same exception type and message."""
    from ep_a2a.ops.jax import JaxAlltoAll
    dev = _gpu()
    with ep_a2a.LocalGroup([0]) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=8, top_k=K, num_experts=4, payloads=_specs(),
                               combine_hidden_size=H, timeout_s=20.0) as a2a, JaxAlltoAll(a2a) as ops:
        r = a2a.ranks[0]
        good = dict(ids=jnp.zeros((4, K), jnp.int32), x=jnp.zeros((4, H), jnp.bfloat16), w=jnp.ones((4, K), jnp.float32))
        bad = [dict(good, ids=good["ids"].astype(jnp.float32)), dict(good, x=good["x"][:3]),
               dict(good, w=jnp.ones((4, K + 1), jnp.float32)), dict(good, x=good["x"].astype(jnp.float16))]
        for case in bad:
            case = {k: jax.device_put(v, dev) for k, v in case.items()}
            with pytest.raises((TypeError, ValueError)) as eager:
                r.dispatch(case["ids"], [case["x"], case["w"]], 4)
            with pytest.raises(type(eager.value)) as traced:
                jax.jit(lambda i, x, w: ops.dispatch(i, [x, w], 4).expert_ids)(case["ids"], case["x"], case["w"])
            assert str(traced.value) == str(eager.value), f"eager {eager.value!r} / jit {traced.value!r}"
        with pytest.raises(ValueError) as eager:
            r.dispatch(good["ids"], [good["x"], good["w"]], 2)
        with pytest.raises(ValueError) as traced:
            jax.jit(lambda i, x, w: ops.dispatch(i, [x, w], 2).expert_ids)(good["ids"], good["x"], good["w"])
        assert str(traced.value) == str(eager.value)
        assert not r.mid_step, "a refused call must not start a step"


CHILD = r"""
import os, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path[:0] = [{root!r}, {tests!r}]
import jax, numpy as np
import ep_a2a
from ep_a2a.ops.jax import JaxAlltoAll
from common import fresh_rng
import test_jax_ops_gpu as t
rng, seed = fresh_rng()
dev = jax.devices("gpu")[0]
with ep_a2a.LocalGroup([0] * 4) as group, ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=8, top_k=t.K, num_experts=9,
        payloads=t._specs(), combine_hidden_size=t.H, timeout_s=20.0) as a2a, JaxAlltoAll(a2a) as ops:
    f = t._jitted(ops, 8)
    for step in range(6):
        tokens = [8, 5, 0, 8] if step % 2 == 0 else [int(x) for x in rng.integers(0, 9, 4)]
        t.check_step(ops, a2a, rng, tokens, 8, dev, f, f"{{seed}} XLA_FLAGS={{os.environ.get('XLA_FLAGS')}} step {{step}}")
    path = t._path(ops)
    graphed, calls = (ops.native_calls(0, graphed=True), ops.native_calls(0)) if ops.native else (0, 0)
print("CHILD OK", path, f"graphed={{graphed}}/{{calls}}", os.environ.get("XLA_FLAGS"))
"""

CAPTURE = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


@pytest.mark.parametrize("flags,native", [(None, None), ("--xla_gpu_enable_command_buffer=", None), (CAPTURE, None),
                                          (CAPTURE, "uncaptured"), ("--xla_gpu_enable_command_buffer=", "direct"),
                                          (None, "python")])
def test_command_buffers_on_and_off(flags, native):
    """XLA's command buffers (CUDA graphs) enabled, disabled and by default, results unchanged:
    the native handler is declared command-buffer compatible (captured and replayed, CAPTURE);
    EP_A2A_JAX_COMMAND_BUFFERS=0 picks the handler XLA never captures, whose every call then
    replays the handler's own graph; EP_A2A_JAX_OWN_GRAPHS=0 launches kernel by kernel instead;
    EP_A2A_JAX_NATIVE=0 the Python callbacks (never captured either)."""
    _gpu()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if flags is not None:
        env["XLA_FLAGS"] = flags
    if native == "uncaptured":
        env["EP_A2A_JAX_COMMAND_BUFFERS"] = "0"
    if native == "python":
        env["EP_A2A_JAX_NATIVE"] = "0"
    env.pop("EP_A2A_JAX_OWN_GRAPHS", None)
    if native == "direct":
        env["EP_A2A_JAX_OWN_GRAPHS"] = "0"
    code = CHILD.format(root=os.path.dirname(os.path.dirname(here)), tests=os.path.dirname(here))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=here)
    assert p.returncode == 0 and "CHILD OK" in p.stdout, f"XLA_FLAGS={flags!r} {native}: rc={p.returncode}\n" \
        f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    from ep_a2a.ops import jax_ffi
    if native == "python":
        assert "CHILD OK python" in p.stdout
    elif jax_ffi.LIBRARY.is_file():
        assert "CHILD OK native" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
        graphed, calls = map(int, p.stdout.split("graphed=")[1].split()[0].split("/"))
        if native == "uncaptured":
            assert 0 < graphed == calls, p.stdout[-2000:]
        if native == "direct":
            assert graphed == 0 < calls, p.stdout[-2000:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jitted_route_is_the_router_kernel_bitwise(dtype):
    """JaxAlltoAll.route under jit for 4 in-process ranks (one with no tokens, renormalize per
    rank): the ids and weights of moe.route on the same logits, bit for bit, and the ids of the
    float64 reference (distinct logits: no ties)."""
    from ep_a2a.interop.arrays import from_numpy, to_numpy
    from ep_a2a.interop.tensor import as_tensor
    from ep_a2a.layers.base import payload_specs
    from ep_a2a.moe import route
    from ep_a2a.ops.jax import JaxAlltoAll
    from ep_a2a.testing.layer_oracle import distinct_logits, route_reference
    dev = _gpu()
    rng, seed = fresh_rng()
    E, tokens, flags = 64, [7, 0, 16, 1], [True, False, True, False]
    with ep_a2a.LocalGroup([0] * 4) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=16, top_k=K, num_experts=E, payloads=payload_specs(H, K),
                               combine_hidden_size=H, timeout_s=20.0) as a2a, JaxAlltoAll(a2a) as ops:
        lgs = [jax.device_put(jnp.asarray(distinct_logits(rng, T, E)).astype(dtype), dev) for T in tokens]
        ids, ws = jax.block_until_ready(jax.jit(lambda lg: ops.route(lg, flags))(lgs))
        for r, (lg, T) in enumerate(zip(lgs, tokens)):
            msg = f"{seed} {dtype} rank {r} T={T}"
            assert ids[r].shape == ws[r].shape == (T, K), msg
            if T:  # moe.route eagerly, into poisoned buffers of ours
                want_i = from_numpy(np.full((T, K), -7, np.int32), a2a.ranks[0].device)
                want_w = from_numpy(np.full((T, K), np.nan, np.float32), a2a.ranks[0].device)
                route(as_tensor(lg), want_i, want_w, renormalize=flags[r])
                a2a.ranks[0].device.synchronize()
                assert np.array_equal(np.asarray(ids[r]), to_numpy(want_i)), msg
                assert np.array_equal(np.asarray(ws[r]).view(np.uint32), to_numpy(want_w).view(np.uint32)), msg
            ref_ids, _ = route_reference(np.asarray(lg.astype(jnp.float32)), K, flags[r])
            assert np.array_equal(np.asarray(ids[r]), ref_ids), msg
        _expect_native(ops)


@pytest.mark.parametrize("ep,E,I,tmax", [(1, 8, 128, 16), (4, 9, 128, 24), (8, 16, 64, 8)])
def test_layer_under_jit_is_the_eager_layer_bitwise(ep, E, I, tmax):
    from ep_a2a.layers.base import payload_specs
    from ep_a2a.layers.jax import JaxMoeLayer, jit_forward_all_ranks, moe_forward_all_ranks
    from ep_a2a.moe import local_experts
    from ep_a2a.testing.layer_oracle import check_layer_output, dense_reference, distinct_logits, random_weights
    dev = _gpu()
    if not hasattr(jax.lax, "ragged_dot"):
        pytest.skip(f"jax {jax.__version__} has no lax.ragged_dot")
    rng, seed = fresh_rng()
    hid = 256
    w1_bits, w2_bits = random_weights(rng, E, hid, I)
    bf = lambda b: jax.device_put(jnp.asarray(np.ascontiguousarray(b).view(jnp.bfloat16)), dev)  # noqa: E731
    w1, w2 = bf(w1_bits), bf(w2_bits)
    with ep_a2a.LocalGroup([0] * ep) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=K, num_experts=E, payloads=payload_specs(hid, K),
                               combine_hidden_size=hid, timeout_s=20.0) as a2a:
        layers = []
        try:
            for r in a2a.ranks:
                first, n = local_experts(E, ep, r.rank)
                layers.append(JaxMoeLayer(r, w1[first:first + n], w2[first:first + n], gemm="ragged"))
            f = jit_forward_all_ranks(layers, tmax)
            for step in range(4):  # the same shapes with new routing twice, then other token counts
                tokens = [tmax] * ep if step < 2 else layer_token_counts(rng, ep, tmax, step - 2)
                msg = f"{seed} ep={ep} step {step} tokens={tokens}"
                xs_bits = [ref.from_float32(rng.standard_normal((T, hid)).astype(np.float32), "bfloat16") for T in tokens]
                logits = [distinct_logits(rng, T, E) for T in tokens]
                xs = [bf(x) for x in xs_bits]
                lg = [jax.device_put(jnp.asarray(v), dev) for v in logits]
                got = jax.block_until_ready(f(xs, lg))  # (its calls run at execution: before eager's)
                eager = moe_forward_all_ranks(layers, xs, lg, tmax)
                ids = np.concatenate([np.asarray(layer.routing[0]) for layer in layers])
                w = np.concatenate([np.asarray(layer.routing[1]) for layer in layers])
                want = dense_reference(np.concatenate(xs_bits), ids, w, w1_bits, w2_bits)
                start = 0
                for r, (g, e) in enumerate(zip(got, eager)):
                    g, e = np.asarray(g), np.asarray(e)
                    assert g.shape == (tokens[r], hid), f"{msg} rank {r}: shape {g.shape}"
                    assert np.array_equal(g.view(np.uint16), e.view(np.uint16)), \
                        f"{msg} rank {r}: jit differs from eager in {int((g != e).sum())} values"
                    check_layer_output(g.astype(np.float32), want[start:start + tokens[r]], f"{msg} rank {r}")
                    start += tokens[r]
            _expect_native(layers[0]._jit_ops)
            if ep == 1:  # a rank alone on its GPU: the layer itself under jit
                y = jax.block_until_ready(jax.jit(layers[0].forward)(xs[0], lg[0]))
                assert np.array_equal(np.asarray(y).view(np.uint16), np.asarray(got[0]).view(np.uint16)), \
                    f"{seed}: jax.jit(layer) differs from jit_forward_all_ranks"
        finally:
            for layer in layers:
                layer.close()
