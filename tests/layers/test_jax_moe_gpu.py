"""The JAX MoE layer (ep_a2a/layers/jax.py) on in-process ranks of one GPU, against the same dense
float64 NumPy reference and bf16 tolerances as the PyTorch layer (ep_a2a/layers/torch.py); the
jitted layer (the MoE pair: dispatch_to_experts / combine_from_experts, with ep_a2a's expert
kernels between them for gemm="fused", on the native path where its library is built) bitwise
equal to the eager layer, bf16 and FP8 combine, both protocols; the expert kernels' step under
XLA's command buffers and on the Python callbacks (subprocesses)."""
import contextlib
import os
import subprocess
import sys

# JAX takes 75% of the GPU at its first use unless told otherwise; ep_a2a's workspaces and the
# other frameworks of this test process need room too. Set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from common import fresh_rng, layer_token_counts  # noqa: E402

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

CASES = [  # ep, experts, top_k, hidden, intermediate, max_tokens_per_rank
    (1, 8, 2, 256, 128, 32),
    (2, 16, 4, 512, 256, 48),
    (4, 9, 4, 256, 128, 24),
]


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend")


def _bf16(bits, dev):
    return jax.device_put(jnp.asarray(np.ascontiguousarray(bits).view(jnp.bfloat16)), dev)


@contextlib.contextmanager
def _jax_layers(dev, rng, ep, E, top_k, H, I, tmax, gemm, **options):
    """Random weights of E experts (their bf16 bits too) and one JaxMoeLayer per rank of an
    all-to-all of `ep` ranks on GPU 0 (`options`: the all-to-all's others); closed on exit.
    Yields (layers, (w_gate_up bits, w_down bits))."""
    import ep_a2a
    from ep_a2a.layers.base import payload_specs
    from ep_a2a.layers.jax import JaxMoeLayer
    from ep_a2a.moe import local_experts
    from ep_a2a.testing.layer_oracle import random_weights
    w1_bits, w2_bits = random_weights(rng, E, H, I)
    w1, w2 = _bf16(w1_bits, dev), _bf16(w2_bits, dev)
    with ep_a2a.LocalGroup([0] * ep) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=tmax, top_k=top_k, num_experts=E, payloads=payload_specs(H, top_k),
                               combine_hidden_size=H, timeout_s=20.0, **options) as a2a:
        layers = []
        try:
            for r in a2a.ranks:
                first, n = local_experts(E, ep, r.rank)
                layers.append(JaxMoeLayer(r, w1[first:first + n], w2[first:first + n], gemm=gemm))
            yield layers, (w1_bits, w2_bits)
        finally:
            for layer in layers:
                layer.close()


@pytest.mark.parametrize("gemm", ["padded", "ragged", "loop", "fused"])
@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
@pytest.mark.parametrize("ep,E,top_k,H,I,tmax", CASES)
def test_jax_layer_matches_dense_reference(ep, E, top_k, H, I, tmax, protocol, gemm):
    from ep_a2a.interop.arrays import copy_from_numpy
    from ep_a2a.layers.jax import moe_forward_all_ranks
    from ep_a2a.testing.reference import from_float32
    from ep_a2a.testing.layer_oracle import check_layer_output, dense_reference, distinct_logits, route_reference
    dev = _gpu()
    if gemm == "ragged" and not hasattr(jax.lax, "ragged_dot"):
        pytest.skip(f"jax {jax.__version__} has no lax.ragged_dot")
    rng, seed = fresh_rng()
    with _jax_layers(dev, rng, ep, E, top_k, H, I, tmax, gemm, protocol=protocol) as (layers, (w1_bits, w2_bits)):
        for step in range(2):
            tokens = layer_token_counts(rng, ep, tmax, step)
            msg = f"{seed} {protocol} {gemm} step {step} tokens={tokens}"
            xs_bits = [from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16") for T in tokens]
            logits = [distinct_logits(rng, T, E) for T in tokens]
            routing = [route_reference(lg, top_k) for lg in logits]
            for layer in layers:  # poison (bf16 NaN) what the step must overwrite
                copy_from_numpy(layer._out, np.full(layer._out.nbytes, 0xFF, np.uint8))
                copy_from_numpy(layer._xg, np.full(layer._xg.nbytes, 0xFF, np.uint8))
            outs = moe_forward_all_ranks(layers, [_bf16(x, dev) for x in xs_bits],
                                         [jax.device_put(jnp.asarray(lg), dev) for lg in logits])
            want = dense_reference(np.concatenate(xs_bits), np.concatenate([r[0] for r in routing]),
                                   np.concatenate([r[1] for r in routing]), w1_bits, w2_bits)
            start = 0
            for r, (layer, out) in enumerate(zip(layers, outs)):
                T = tokens[r]
                assert out.shape == (T, H) and out.dtype == jnp.bfloat16, f"{msg} rank {r}: {out.shape} {out.dtype}"
                check_layer_output(np.asarray(out).astype(np.float32), want[start:start + T], f"{msg} rank {r}")
                ids, w = (np.asarray(t) for t in layer.routing)
                assert np.array_equal(ids, routing[r][0]), f"{msg} rank {r}: router ids"
                np.testing.assert_allclose(w, routing[r][1], rtol=1e-5, atol=1e-7, err_msg=f"{msg} rank {r}: router weights")
                start += T


@pytest.mark.parametrize("protocol,quant,gemm", [("fence", None, "padded"), ("sentinel", None, "padded"),
                                                 ("fence", "fp8", "padded"), ("sentinel", None, "ragged"),
                                                 ("fence", None, "fused"), ("sentinel", None, "fused"),
                                                 ("fence", "fp8", "fused")])
def test_jitted_layer_is_the_eager_layer_bitwise(protocol, quant, gemm):
    from ep_a2a.layers.jax import jit_forward_all_ranks, moe_forward_all_ranks
    from ep_a2a.ops import jax_ffi
    from ep_a2a.testing.layer_oracle import distinct_logits
    from ep_a2a.testing.reference import from_float32
    dev = _gpu()
    if gemm == "ragged" and not hasattr(jax.lax, "ragged_dot"):
        pytest.skip(f"jax {jax.__version__} has no lax.ragged_dot")
    rng, seed = fresh_rng()
    ep, E, top_k, H, I, tmax = 8, 16, 4, 256, 128, 16
    with _jax_layers(dev, rng, ep, E, top_k, H, I, tmax, gemm, protocol=protocol, combine_quant=quant) as (layers, _):
        f = jit_forward_all_ranks(layers, tmax)
        for step in range(4):
            tokens = [int(t) for t in rng.integers(0, tmax + 1, ep)] if step % 2 else [tmax] * ep
            msg = f"{seed} {protocol} {quant} {gemm} step {step} tokens={tokens}"
            xs = [_bf16(from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16"), dev) for T in tokens]
            lg = [jax.device_put(jnp.asarray(distinct_logits(rng, T, E)), dev) for T in tokens]
            got = jax.block_until_ready(f(xs, lg))
            eager = moe_forward_all_ranks(layers, xs, lg, tmax)
            for r, (g, e) in enumerate(zip(got, eager)):
                g, e = np.asarray(g).view(np.uint16), np.asarray(e).view(np.uint16)
                assert g.shape == (tokens[r], H) and np.array_equal(g, e), \
                    f"{msg} rank {r}: jit differs from eager in {int((g != e).sum())} values"
        ops = layers[0]._jit_ops
        if jax_ffi.LIBRARY.is_file() and os.environ.get("EP_A2A_JAX_NATIVE") != "0":
            assert ops.native and any(p.calls(0) > 0 for p in ops._plans), f"{seed}: the native path did not run"


@pytest.mark.parametrize("gemm", ["fused", "padded"])
def test_the_jitted_step_takes_the_weights_as_arguments(gemm):
    """jit_forward_all_ranks hands every layer's weights to its program as arguments: lowering
    captures no constant of a weight's size (jax.jit over a closure that reads the layers' arrays
    does, and warns: the control), and the result is the closure's bit for bit."""
    import warnings
    from ep_a2a.layers.jax import jit_forward_all_ranks, moe_forward_traced, traced_params
    dev = _gpu()
    rng, seed = fresh_rng()
    ep, E, top_k, H, I, tmax = 2, 8, 2, 256, 128, 4
    with _jax_layers(dev, rng, ep, E, top_k, H, I, tmax, gemm) as (layers, _):
        read = {"fused": {"w1", "w2"}, "padded": {"w1t", "w2t"}}[gemm]   # (only what the step reads)
        assert [set(p) for p in traced_params(layers, tmax)] == [read] * ep
        assert all(set(p) >= read for p in traced_params(layers))       # (T^ left to the trace: all)
        xs = [jax.device_put(jnp.asarray(rng.standard_normal((tmax, H)).astype(np.float32)), dev).astype(jnp.bfloat16)
              for _ in range(ep)]
        lg = [jax.device_put(jnp.asarray(rng.standard_normal((tmax, E)).astype(np.float32)), dev) for _ in range(ep)]
        limit = H * I * 2  # (bytes: below one expert's FC2 weights, above the step's own constants)
        old = jax.config.jax_captured_constants_warn_bytes
        jax.config.update("jax_captured_constants_warn_bytes", limit)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                ours = jax.block_until_ready(jit_forward_all_ranks(layers, tmax)(xs, lg))
            assert not [w for w in seen if "constants were captured" in str(w.message)], f"{seed}: {[str(w.message) for w in seen]}"
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                closed = jax.block_until_ready(jax.jit(lambda a, b: moe_forward_traced(layers, a, b, tmax))(xs, lg))
            assert [w for w in seen if "constants were captured" in str(w.message)], f"{seed}: the control captured none"
        finally:
            jax.config.update("jax_captured_constants_warn_bytes", old)
        for r in range(ep):
            assert np.array_equal(np.asarray(ours[r]).view(np.uint16), np.asarray(closed[r]).view(np.uint16)), f"{seed} rank {r}"
        other = {"fused": ("w1t", "w2t"), "padded": ("w1", "w2")}[gemm]   # (the layout this T^ does not read)
        wrong = [{k: v for k, v in p.items() if k in other} for p in [layer.params for layer in layers]]
        with pytest.raises(ValueError, match=r"params\[0\]: a step of T\^=4"):
            jax.jit(lambda ps, a, b: moe_forward_traced(layers, a, b, tmax, ps))(wrong, xs, lg)


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_padded_experts_take_every_row_when_the_caller_repeats_an_expert(protocol):
    """Caller ids may name one expert several times per token: every selection of every token
    then lands on one expert (the workspace's whole capacity), past the ep_size x T^ rows the
    padded GEMM allows through our router. Eager and jitted, against the float64 reference."""
    from ep_a2a.layers.jax import jit_forward_all_ranks, moe_forward_all_ranks
    from ep_a2a.testing.layer_oracle import check_layer_output, dense_reference
    from ep_a2a.testing.reference import from_float32
    dev = _gpu()
    rng, seed = fresh_rng()
    ep, E, top_k, H, I, tmax = 4, 8, 4, 256, 128, 16
    with _jax_layers(dev, rng, ep, E, top_k, H, I, tmax, "padded", protocol=protocol) as (layers, (w1_bits, w2_bits)):
        hot = int(rng.integers(E))
        xs_bits = [from_float32(rng.standard_normal((tmax, H)).astype(np.float32), "bfloat16") for _ in range(ep)]
        ids = [np.full((tmax, top_k), hot, np.int32) for _ in range(ep)]
        ws = [rng.random((tmax, top_k)).astype(np.float32) / top_k for _ in range(ep)]
        xs = [_bf16(x, dev) for x in xs_bits]
        routers = [(jax.device_put(jnp.asarray(i), dev), jax.device_put(jnp.asarray(w), dev)) for i, w in zip(ids, ws)]
        eager = moe_forward_all_ranks(layers, xs, routers, tmax)
        jitted = jax.block_until_ready(jit_forward_all_ranks(layers, tmax)(xs, routers))
        want = dense_reference(np.concatenate(xs_bits), np.concatenate(ids), np.concatenate(ws), w1_bits, w2_bits)
        for r in range(ep):
            msg = f"{seed} {protocol} expert {hot} rank {r}"
            check_layer_output(np.asarray(eager[r]).astype(np.float32), want[r * tmax:(r + 1) * tmax], msg)
            assert np.array_equal(np.asarray(jitted[r]).view(np.uint16), np.asarray(eager[r]).view(np.uint16)), \
                f"{msg}: jit differs from eager"


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_auto_runs_the_expert_kernels_up_to_its_rows_and_xla_past_them(protocol):
    """gemm="auto": the expert kernels while ep_size * T^ <= layers.jax.auto_fused_rows (8 ranks,
    hidden 256: T^ <= 128), XLA's experts past it, in one set of layers; jitted and eager bitwise
    equal at both sizes (each their own jit), and both against the float64 reference."""
    from ep_a2a.layers.jax import auto_fused_rows, jit_forward_all_ranks, moe_forward_all_ranks
    from ep_a2a.testing.layer_oracle import check_layer_output, dense_reference, distinct_logits, route_reference
    from ep_a2a.testing.reference import from_float32
    dev = _gpu()
    rng, seed = fresh_rng()
    ep, E, top_k, H, I = 8, 16, 4, 256, 128
    edge = auto_fused_rows(H, I) // ep
    with _jax_layers(dev, rng, ep, E, top_k, H, I, edge + 1, "auto", protocol=protocol) as (layers, (w1_bits, w2_bits)):
        for tmax, want_gemm in ((edge, "fused"), (edge + 1, "padded"), (edge, "fused")):
            assert [layer.expert_gemm(tmax) for layer in layers] == [want_gemm] * ep
            tokens = [int(t) for t in rng.integers(0, tmax + 1, ep)]
            tokens[int(rng.integers(ep))] = tmax
            msg = f"{seed} {protocol} T^={tmax} ({want_gemm}) tokens={tokens}"
            xs_bits = [from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16") for T in tokens]
            logits = [distinct_logits(rng, T, E) for T in tokens]
            routing = [route_reference(lg, top_k) for lg in logits]
            xs = [_bf16(x, dev) for x in xs_bits]
            lg = [jax.device_put(jnp.asarray(x), dev) for x in logits]
            jitted = jax.block_until_ready(jit_forward_all_ranks(layers, tmax)(xs, lg))
            eager = moe_forward_all_ranks(layers, xs, lg, tmax)
            want = dense_reference(np.concatenate(xs_bits), np.concatenate([r[0] for r in routing]),
                                   np.concatenate([r[1] for r in routing]), w1_bits, w2_bits)
            start = 0
            for r, T in enumerate(tokens):
                check_layer_output(np.asarray(eager[r]).astype(np.float32), want[start:start + T], f"{msg} rank {r}")
                assert np.array_equal(np.asarray(jitted[r]).view(np.uint16), np.asarray(eager[r]).view(np.uint16)), \
                    f"{msg} rank {r}: jit differs from eager"
                start += T


FUSED_CHILD = """
import os, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path[:0] = [{root!r}, {tests!r}]
import jax, jax.numpy as jnp, numpy as np
from common import fresh_rng
import test_jax_moe_gpu as t
from ep_a2a.layers.jax import jit_forward_all_ranks, moe_forward_all_ranks
from ep_a2a.testing.layer_oracle import distinct_logits
from ep_a2a.testing.reference import from_float32
rng, seed = fresh_rng()
dev = jax.devices("gpu")[0]
ep, E, top_k, H, I, tmax = 8, 16, 4, 256, 128, 8
with t._jax_layers(dev, rng, ep, E, top_k, H, I, tmax, "fused", protocol={protocol!r}) as (layers, _):
    f = jit_forward_all_ranks(layers, tmax)
    for step in range(5):
        tokens = [tmax] * ep if step % 2 == 0 else [int(x) for x in rng.integers(0, tmax + 1, ep)]
        xs = [t._bf16(from_float32(rng.standard_normal((T, H)).astype(np.float32), "bfloat16"), dev) for T in tokens]
        lg = [jax.device_put(jnp.asarray(distinct_logits(rng, T, E)), dev) for T in tokens]
        got = jax.block_until_ready(f(xs, lg))
        eager = moe_forward_all_ranks(layers, xs, lg, tmax)
        for r, (g, e) in enumerate(zip(got, eager)):
            assert np.array_equal(np.asarray(g).view(np.uint16), np.asarray(e).view(np.uint16)), \\
                f"{{seed}} step {{step}} tokens={{tokens}} rank {{r}}: jit differs from eager"
    ops = layers[0]._jit_ops
    path = "native" if ops.native and any(p.calls(0) > 0 for p in ops._plans) else "python"
print("CHILD OK", path)
"""
CAPTURE = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


@pytest.mark.parametrize("protocol,flags,native", [("fence", CAPTURE, True), ("sentinel", CAPTURE, True),
                                                   ("fence", None, False)])
def test_the_expert_kernels_step_under_command_buffers_and_on_the_python_path(protocol, flags, native):
    """The jitted step of gemm="fused" (dispatch_to_experts without rows, experts_combine) bitwise
    equal to the eager step over five steps of changing token counts, with XLA's command buffers
    capturing it, and through the Python callbacks (EP_A2A_JAX_NATIVE=0)."""
    from ep_a2a.ops import jax_ffi
    _gpu()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = flags
    if not native:
        env["EP_A2A_JAX_NATIVE"] = "0"
    code = FUSED_CHILD.format(root=os.path.dirname(os.path.dirname(here)), tests=os.path.dirname(here), protocol=protocol)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=here)
    assert p.returncode == 0 and "CHILD OK" in p.stdout, f"{protocol} XLA_FLAGS={flags!r}: rc={p.returncode}\n" \
        f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    want = "native" if native and jax_ffi.LIBRARY.is_file() else "python"
    assert f"CHILD OK {want}" in p.stdout, p.stdout[-2000:]


def test_the_jax_layer_benchmark_on_a_small_shape(tmp_path):
    """`python -m ep_a2a.bench_layer --framework jax` on a small shape, with the expert kernels at
    1 token (auto) and XLA's experts past auto's rows: every row jitted == eager bitwise, close to
    the baseline, its times, the weights its routing reads and its stages (torch.profiler)
    recorded."""
    import json
    _gpu()
    out = tmp_path / "r.json"
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, "-m", "ep_a2a.bench_layer", "--framework", "jax", "--ranks", "4", "--hidden", "256",
           "--intermediate", "128", "--experts", "16", "--top-k", "4", "--tokens", "1,300", "--iters", "3", "--warmup", "1",
           "--stage-replays", "3", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens_per_rank"], r["gemm"]) for r in rows] == [(1, "fused"), (300, "padded")], rows
    for r in rows:
        assert r["jit_equals_eager_bitwise"] and r["max_rel_diff_vs_baseline"] < 0.05, r
        times = ("jit_us", "eager_us", "baseline_us", "pipelined_us", "baseline_pipelined_us", "jax_call_us", "issue_us",
                 "jax_issue_us")
        assert min(r[k] for k in times) > 0 and r["handler_runs_per_call"] >= 0, r
        assert 0 < r["experts_touched"] <= 16 and r["weight_bytes_read"] == r["experts_touched"] * 3 * 256 * 128 * 2, r
        assert r["weight_read_floor_us"] > 0, r
        if "error" not in r["stages"] or "no kernel records" not in r["stages"]["error"]:  # (torch absent: none)
            assert r["stages"]["mean_us"]["dispatch"] > 0 and r["stages"]["mean_us"]["combine"] > 0, r["stages"]
