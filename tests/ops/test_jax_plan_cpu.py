"""The native JAX path without a GPU: the launch plans made at trace time (ep_a2a/ops/jax_plan.py)
hold the parameter blocks eager dispatch and combine launch for the same call, byte for byte
(tests/protocol/launch_trace.py's rank, driver replaced, launches recorded by
testing.hooks.dry_run); their encoding names every XLA buffer where the kernels read it; and
the native library (native/ffi/ep_a2a_ffi.cc) loads with ctypes, exports its handlers and
reads the plans (parse only: no GPU)."""
import ctypes
import pathlib
import random

import numpy as np
import pytest

from ep_a2a.layout import A2AParams, PayloadDesc
from ep_a2a.ops import jax_ffi, jax_plan
from ep_a2a.testing import hooks
from common import ROOT, kernels_build
from jax_plan_cases import CONFIGS, block, copied, launched, native_moe_ops, random_step, record_plans, require_library, trace

@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_planned_blocks_equal_eager_launches(monkeypatch, cfg):
    rng = random.Random()
    events = []
    trace.patch_driver(monkeypatch.setattr, events)
    for _ in range(4):
        a2a, r, tmax, T, ids, pays, out = random_step(rng, events, cfg)

        def step():
            r.dispatch(ids, pays, tmax)
            r.combine(r.combine_input(tmax), tmax, out=out)
        eager = launched(step)
        d, c = jax_plan.steady_pair(r.plan, r.state.tag_hi, a2a.protocol, T, tmax, [ids.ptr] + [p.ptr for p in pays], out.ptr, False)
        d_bytes, c_bytes = jax_plan.pair_params(r.plan, d, c)
        first = r.plan.first_timeout_ns  # (the eager step is a first step: the handler patches this in)
        (fd, gd, bd), (fc, gc, bc) = eager
        assert (d.launch.function, d.grid) == (fd, gd) and (c.launch.function, c.grid) == (fc, gc)
        # (the dispatch's block holds the previous combine's fields: this step's, in a jitted loop)
        assert block(d_bytes, timeout_ns=first) == block(bd, **dict(c.fields))
        assert block(c_bytes, timeout_ns=first) == block(bc, trigger_early=0)
        a2a.close()


def test_encode_patches_every_buffer_where_the_kernel_reads_it():
    p = A2AParams()
    p.num_payloads = 3
    for q in range(3):
        p.payloads[q].src = jax_plan.fake(q)
    p.combine_out = jax_plan.fake(7, 64)
    op = jax_plan.LaunchOp(0, 0x1234, 5, 256, 0, 1, True, [bytes(p)], (A2AParams.timeout_ns.offset, 9, 3))
    copy = jax_plan.CopyOp(0, jax_plan.fake(8), 1 << 40, 4096)
    g = jax_plan.Group(0, 0x55, [(3, 0x66, 0x77, 0x88)], [op, copy])
    words = jax_plan.encode([g], 9, 4)
    found = jax_plan.patches(np.frombuffer(bytes(p), np.uint64))
    desc0 = A2AParams.payloads.offset
    want = [(desc0 + q * ctypes.sizeof(PayloadDesc) + PayloadDesc.src.offset, q, 0) for q in range(3)]
    assert sorted(found) == sorted(want + [(A2AParams.combine_out.offset, 7, 64)])
    assert words[0] == jax_plan.MAGIC and words[2] == 9
    assert jax_plan.buffer_of(1 << 40) is None and jax_plan.buffer_of(jax_plan.fake(511, 5)) == (511, 5)


def test_library_exports_the_handlers_and_has_no_python_abi():
    lib = require_library()
    for name in jax_ffi.SYMBOLS:
        assert hasattr(lib, name), name
    assert lib.ep_a2a_ffi_plan_version() == jax_plan.VERSION
    assert lib.ep_a2a_ffi_api_version() >= 3  # XLA FFI API 0.3 or newer
    data = jax_ffi.LIBRARY.read_bytes()
    assert b"libpython" not in data and b"PyObject_" not in data and b"Py_Initialize" not in data
    assert jax_ffi.info_line().startswith("JAX native library: present")


def test_library_reads_plans_and_refuses_malformed_ones():
    require_library()
    rng = np.random.default_rng()
    p = A2AParams()
    p.payloads[0].src = jax_plan.fake(0)
    p.combine_out = jax_plan.fake(int(rng.integers(1, 4)))
    ops = [jax_plan.LaunchOp(i, 0x1000 + i, int(rng.integers(1, 64)), 256, 0, 1, bool(i % 2), [bytes(p)],
                             (A2AParams.timeout_ns.offset, 9, 3)) for i in range(2)]
    ops += [jax_plan.CopyOp(1, jax_plan.fake(4), 1 << 40, 16)]
    g = jax_plan.Group(0, 0x55, [(r, 0x60 + r, 0x70 + r, 0x80 + r) for r in range(2)], ops)
    words = jax_plan.encode([g], 5, 4)
    plan = jax_ffi.Plan(words)
    assert plan.id >= 0 and plan.calls(0) == 0
    plan.release()
    for cut in (words[:-1], np.concatenate([words, words[-1:]]), np.concatenate([words[:1], np.array([7], np.uint64), words[2:]])):
        with pytest.raises(RuntimeError, match="refused a launch plan"):
            jax_ffi.Plan(cut)
    bad = jax_plan.encode([g], 3, 4)  # a copy naming buffer 4 of a call with 3
    with pytest.raises(RuntimeError, match="malformed"):
        jax_ffi.Plan(bad)


def test_build_script_builds_the_library_for_this_jaxlib(tmp_path):
    """kernels/build.py --ffi-only into a fresh folder: the library, its manifest entry naming
    this python's jaxlib, and its handler symbols (a plain C ABI: ctypes finds them)."""
    import json
    import subprocess
    import sys
    root = pathlib.Path(ROOT)
    build = kernels_build()
    version, include = build.find_jaxlib()
    if version is None:
        pytest.skip("no jaxlib in this python")
    p = subprocess.run([sys.executable, str(root / "kernels" / "build.py"), "--ffi-only", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lib = tmp_path / jax_ffi.LIBRARY.name
    info = json.loads((tmp_path / "manifest.json").read_text())["jax_ffi"]
    assert info["jaxlib"] == version and info["library"] == lib.name
    loaded = ctypes.CDLL(str(lib))
    for name in jax_ffi.SYMBOLS:
        assert hasattr(loaded, name), name


def test_traced_step_plans_what_the_native_handler_runs(monkeypatch):
    """A jitted dispatch + combine traced and lowered on the CPU with the native path (the
    driver replaced as in launch_trace): one custom call each, naming a registered plan whose
    dispatch launch reads every operand where the eager call would, copies the received views
    into the results, and whose combine stages operand 0 and writes result 0."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    require_library()
    from ep_a2a.ops import jax as ops_jax
    events = []
    trace.patch_driver(monkeypatch.setattr, events)
    made = record_plans(monkeypatch, ops_jax)
    rng = random.Random()
    with hooks.dry_run():
        a2a, r = trace.make_rank(events, rng.choice(["fence", "sentinel"]), None, True, 8, local=True)
    ops = ops_jax.JaxAlltoAll(a2a)
    assert ops.native
    tmax = rng.choice([1, 4, 16, 64])
    T = rng.randint(1, tmax)
    specs = a2a.payload_specs

    def step(ids, pays):
        d = ops.dispatch(ids, pays, tmax)
        return ops.combine(d.payloads[0], d)
    args = (jax.ShapeDtypeStruct((T, trace.TOP_K), jnp.int32),
            [jax.ShapeDtypeStruct((T,) + tuple(s.shape), jnp.dtype(s.dtype)) for s in specs])
    text = jax.jit(step).lower(*args).as_text()
    assert text.count("custom_call @ep_a2a_run") == 2 and len(ops._plans) == 2
    (dispatch,), (combine,) = made
    P = len(specs)
    d_ops, c_ops = dispatch.ops, combine.ops
    launch, copies = d_ops[0], d_ops[1:]
    block = A2AParams.from_buffer_copy(launch.args[0])
    assert [block.payloads[q].src for q in range(P + 1)] == [jax_plan.fake(q) for q in range(P + 1)]
    assert (block.local_num_tokens, block.runtime_max_tokens_per_rank) == (T, tmax) and not launch.pdl
    ids_v, views = r.dispatch_views(tmax)
    results = P + 1  # (operands: ids, then the payloads; results numbered after them)
    assert [copied(c) for c in copies] == \
        [(jax_plan.fake(results + k), v.ptr, v.nbytes) for k, v in enumerate([ids_v, *views])]
    stage, c_launch = c_ops
    assert copied(stage) == (r.plan.combine_input, jax_plan.fake(0), a2a.ep_size * tmax * r.plan.combine_bytes)
    c_block = A2AParams.from_buffer_copy(c_launch.args[0])
    assert c_block.combine_out == jax_plan.fake(2) and c_block.trigger_early == 0  # (operands: partial, ticket)
    ops.close()
    a2a.close()


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_traced_moe_pair_plans_index_gather_and_finalize(monkeypatch, quant):
    """dispatch_to_experts / combine_from_experts traced and lowered on the CPU with the native
    path: the index and gather kernels read the received views and write result 1 (the rows),
    the counts are copied into result 0, finalize reads operand 0 (fc2_out) into the combine
    input (FP8 with combine_quant="fp8", whose combine then skips its own pass)."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    ops, made, a2a, r = native_moe_ops(monkeypatch, quant)
    rng = random.Random()
    tmax = rng.choice([1, 4, 16])
    T = rng.randint(1, tmax)
    specs = a2a.payload_specs
    cap = a2a.ep_size * tmax * a2a.top_k

    def step(ids, pays, fc2):
        d = ops.dispatch_to_experts(ids, pays, tmax, gather=0, weights=2)
        return d.counts, d.rows, ops.combine_from_experts(fc2, d)
    args = (jax.ShapeDtypeStruct((T, trace.TOP_K), jnp.int32),
            [jax.ShapeDtypeStruct((T,) + tuple(s.shape), jnp.dtype(s.dtype)) for s in specs],
            jax.ShapeDtypeStruct((cap, trace.H), jnp.bfloat16))
    text = jax.jit(step).lower(*args).as_text()
    assert text.count("custom_call @ep_a2a_run") == 2
    (dispatch,), (combine,) = made
    P = len(specs)
    kinds = [type(op).__name__ for op in dispatch.ops]
    assert set(kinds) == {"LaunchOp"} and len(kinds) >= 4
    results = P + 1
    gather = dispatch.ops[-2]
    assert [(w, b) for w, b, _ in jax_plan.patches(jax_plan._arg_words(gather.args)[1])] == \
        [(8, results + 1)]  # (moe.gather_rows: src, then out = the rows result)
    dst, _, nbytes = copied(dispatch.ops[-1])  # the counts
    assert dst == jax_plan.fake(results) and nbytes == 4 * ops._num_local(r.rank)
    fin, c_launch = combine.ops
    assert [b for _, b, _ in jax_plan.patches(jax_plan._arg_words(fin.args)[1])] == [0]
    c_block = A2AParams.from_buffer_copy(c_launch.args[0])
    assert c_block.combine_prequantized == int(quant == "fp8") and c_block.combine_out == jax_plan.fake(2)
    ops.close()
    a2a.close()


def test_traced_experts_call_plans_the_expert_kernels(monkeypatch):
    """JaxAlltoAll.experts between the MoE pair, traced and lowered on the CPU with the native
    path: one call of its own whose plan is FC1 then FC2 on the rank's stream, the kernel pair
    that moe_experts.expert_fc1 / expert_fc2 take for this T^ (16-row passes while ep_size * T^ <= 16),
    FC1 reading the dispatched hidden states in the workspace and operand 0 (w_gate_up) into
    result 4 (the activations), FC2 reading those and operand 1 (w_down) into result 3."""
    import ep_a2a.moe_experts as moe_experts
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    ops, made, a2a, r = native_moe_ops(monkeypatch)
    rng = random.Random()
    tmax = rng.choice([1, 2, 4, 16])
    T = rng.randint(1, tmax)
    specs, L, inter = a2a.payload_specs, ops._num_local(r.rank), 64

    def step(ids, pays, w1, w2):
        d = ops.dispatch_to_experts(ids, pays, tmax, gather=0, weights=2)
        return ops.combine_from_experts(ops.experts(d, w1, w2), d)
    args = (jax.ShapeDtypeStruct((T, trace.TOP_K), jnp.int32),
            [jax.ShapeDtypeStruct((T,) + tuple(s.shape), jnp.dtype(s.dtype)) for s in specs],
            jax.ShapeDtypeStruct((L, 2 * inter, trace.H), jnp.bfloat16),
            jax.ShapeDtypeStruct((L, trace.H, inter), jnp.bfloat16))
    text = jax.jit(step).lower(*args).as_text()
    assert text.count("custom_call @ep_a2a_run") == 3
    (_,), (experts,), (_,) = made
    fc1, fc2 = experts.ops
    idx = ops._rank_indexes()[0]
    slots, mx = a2a.ep_size * tmax, moe_experts

    def pair(n_dim, cols):
        if slots <= mx.EXPERT_PASS_ROWS:
            return ""
        wide = slots > mx.WIDE_FROM_ROWS and trace.H <= mx.FUSED_MAX_HIDDEN and n_dim % cols == 0
        return "_wide" if wide else "_m64"
    assert fc1.function == idx.expert_function(f"moe_expert_fc1{pair(inter, mx.WIDE_FC1_COLS)}_bf16")
    assert fc2.function == idx.expert_function(f"moe_expert_fc2{pair(trace.H, mx.WIDE_FC2_COLS)}_bf16")
    words1 = jax_plan._arg_words(fc1.args)[1]
    assert int(words1[0]) == r.dispatch_views(tmax)[1][0].ptr  # (the dispatched hidden states, in place)
    assert [b for _, b, _ in jax_plan.patches(words1)] == [0, 4]
    assert [b for _, b, _ in jax_plan.patches(jax_plan._arg_words(fc2.args)[1])] == [4, 1, 3]
    ops.close()
    a2a.close()


def test_a_released_plan_id_is_never_reused():
    """A compiled program naming a released plan must find none, never a newer plan."""
    require_library()
    p = A2AParams()
    g = jax_plan.Group(0, 0, [(0, 0x60, 0, 0x80)], [jax_plan.LaunchOp(0, 0x1000, 1, 256, 0, 1, False, [bytes(p)])])
    words = jax_plan.encode([g], 1, 4)
    first = jax_ffi.Plan(words)
    old = first.id
    first.release()
    again = [jax_ffi.Plan(words) for _ in range(3)]
    assert old not in [q.id for q in again] and len({q.id for q in again}) == 3
    assert jax_ffi.library().ep_a2a_ffi_calls(old, 0) == 0
    for q in again:
        q.release()


@pytest.mark.parametrize("counts", [True, False])
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_traced_experts_combine_finalizes_in_fc2_and_combines_into_its_result(monkeypatch, quant, counts):
    """dispatch_to_experts(rows=False) then experts_combine, traced and lowered on the CPU with the
    native path: the dispatch plans no gather (no launch of it names an XLA buffer but the
    counts' copy, and with counts=False there is none); the one call of experts_combine (operands w_gate_up, w_down, ticket; results
    out, fc2 rows, activations) runs FC1, FC2 finalizing into the combine input (bf16), or FC2
    then a finalize writing the FP8 input (combine_quant="fp8"), then the combine its dispatch
    planned with its output moved to result 0 (buffer 3)."""
    from ep_a2a.layout import FinalizeArgs
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    ops, made, a2a, r = native_moe_ops(monkeypatch, quant)
    rng = random.Random()
    tmax = rng.choice([1, 2, 4, 16])
    T = rng.randint(1, tmax)
    specs, L, inter = a2a.payload_specs, ops._num_local(r.rank), 64

    def step(ids, pays, w1, w2):
        d = ops.dispatch_to_experts(ids, pays, tmax, gather=0, weights=2, rows=False, counts=counts)
        assert d.rows is None and (d.counts is None) == (not counts)
        return (d.counts if counts else None), ops.experts_combine(d, w1, w2)
    args = (jax.ShapeDtypeStruct((T, trace.TOP_K), jnp.int32),
            [jax.ShapeDtypeStruct((T,) + tuple(s.shape), jnp.dtype(s.dtype)) for s in specs],
            jax.ShapeDtypeStruct((L, 2 * inter, trace.H), jnp.bfloat16),
            jax.ShapeDtypeStruct((L, trace.H, inter), jnp.bfloat16))
    lowered = jax.jit(step).lower(*args)
    assert lowered.as_text().count("custom_call @ep_a2a_run") == 2
    sizes, y = lowered.out_info
    assert (y.shape, y.dtype) == ((T, trace.H), jnp.bfloat16) and (sizes.shape == (L,) if counts else sizes is None)
    (dispatch,), (call,) = made
    P = len(specs)
    if counts:
        assert copied(dispatch.ops[-1])[0] == jax_plan.fake(P + 1)
    rest = dispatch.ops[1:-1] if counts else dispatch.ops[1:]
    assert not [op for op in rest if op.function == "ep_copy_bytes" or jax_plan.patches(jax_plan._arg_words(op.args)[1])]
    fc1, fc2, *fin, c_launch = call.ops
    assert len(fin) == (quant == "fp8")
    assert [b for _, b, _ in jax_plan.patches(jax_plan._arg_words(fc1.args)[1])] == [0, 5]
    assert [b for _, b, _ in jax_plan.patches(jax_plan._arg_words(fc2.args)[1])] == [5, 1, 4]
    target = FinalizeArgs.from_buffer_copy(fc2.args[-1]).out
    assert target == (0 if quant else r.combine_input(tmax).ptr)
    if fin:
        assert [b for _, b, _ in jax_plan.patches(jax_plan._arg_words(fin[0].args)[1])] == [4]
    c_block = A2AParams.from_buffer_copy(c_launch.args[0])
    assert c_block.combine_out == jax_plan.fake(3) and c_block.combine_prequantized == int(quant == "fp8")
    ops.close()
    a2a.close()


def test_renumbered_moves_only_the_named_buffers():
    p = A2AParams()
    p.payloads[0].src = jax_plan.fake(1, 32)
    p.combine_out = jax_plan.fake(2, 64)
    op = jax_plan.LaunchOp(0, 0x1234, 5, 256, 0, 1, True, [bytes(p), b"\x07" * 12])
    moved = jax_plan.renumbered(op, {2: 9})
    q = A2AParams.from_buffer_copy(moved.args[0])
    assert (q.payloads[0].src, q.combine_out) == (jax_plan.fake(1, 32), jax_plan.fake(9, 64))
    assert moved.args[1] == b"\x07" * 12 and op.args[0] == bytes(p)  # (odd sizes kept; the original untouched)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_traced_route_plans_the_router_kernel_per_rank(monkeypatch, dtype):
    """JaxAlltoAll.route traced and lowered on the CPU with the native path: one call whose plan
    is moe.route's launch for these logits (the kernel of their dtype and width), reading
    operand 0 and writing results 1 (ids) and 2 (weights), with renormalize as given."""
    from ep_a2a.router import ROUTE_DTYPES
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    ops, made, a2a, r = native_moe_ops(monkeypatch)
    T, E, renorm = random.randint(1, 64), a2a.num_experts, random.choice([True, False])
    lowered = jax.jit(lambda lg: ops.route(lg, renorm)).lower(jax.ShapeDtypeStruct((T, E), jnp.dtype(dtype)))
    assert lowered.as_text().count("custom_call @ep_a2a_run") == 1
    ids, w = lowered.out_info
    assert (ids.shape, ids.dtype, w.shape, w.dtype) == ((T, trace.TOP_K), jnp.int32, (T, trace.TOP_K), jnp.float32)
    ((call,),) = made
    (launch,) = call.ops
    n = 1 << max(0, (E - 1) // 32).bit_length()
    from ep_a2a.router import router_for
    assert launch.function == router_for(r.device)._module.function(f"moe_route_{ROUTE_DTYPES[dtype]}_{n}")
    words = jax_plan._arg_words(launch.args)[1]
    assert [b for _, b, _ in jax_plan.patches(words)] == [0, 1, 2]
    assert [int(v) for v in words[3:7]] == [T, E, trace.TOP_K, int(renorm)]
    ops.close()
    a2a.close()
