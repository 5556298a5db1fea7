"""ep_a2a/ops/jax.py without a GPU: what the jit calls produce (jax.eval_shape), the trace-time
errors (the rules and messages of eager dispatch and combine), and the clear refusal of a
program that runs on the CPU."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

from ep_a2a.config import Options, PayloadSpec  # noqa: E402
from ep_a2a.ops.jax import Dispatched, JaxAlltoAll  # noqa: E402

S = jax.ShapeDtypeStruct
EP, E, K, H, TMAX = 4, 10, 3, 64, 16


def _options(**kw):
    args = dict(max_tokens_per_rank=TMAX, top_k=K, num_experts=E, combine_hidden_size=H, combine_dtype="bfloat16",
                payloads=[PayloadSpec("hidden", (H,), "bfloat16"), PayloadSpec("weights", (K,), "float32")],
                protocol="fence", timeout_s=None, first_timeout_s=None, validate_expert_ids=True, pdl=True,
                threads_per_block=256, crossover_tokens=None, on_timeout="trap", combine_quant=None)
    args.update(kw)
    return Options.check(EP, **args)


def _inputs(tokens):
    return ([S((t, K), jnp.int32) for t in tokens], [[S((t, H), jnp.bfloat16), S((t, K), jnp.float32)] for t in tokens])


def test_shapes_of_every_call_one_rank_and_four():
    for ranks, tokens in (((0,), (7,)), ((0, 1, 2, 3), (8, 3, 0, 5))):
        ops = JaxAlltoAll.traced_only(_options(), rank_numbers=ranks)
        ids, pays = _inputs(tokens)
        one = len(ranks) == 1
        if one:
            ids, pays = ids[0], pays[0]

        def step(ids, pays):
            d = ops.dispatch(ids, pays, 8)
            parts = d.payloads[0] if one else [p[0] for p in d.payloads]
            return d, ops.combine(parts, d)

        d, y = jax.eval_shape(step, ids, pays)
        assert isinstance(d, Dispatched) and d.tmax == 8 and d.num_tokens == tokens
        ids_o = [d.expert_ids] if one else d.expert_ids
        pays_o = [d.payloads] if one else d.payloads
        ys = [y] if one else y
        for i, t in enumerate(tokens):
            assert (ids_o[i].shape, ids_o[i].dtype) == ((EP, 8, K), jnp.int32)
            assert [(p.shape, p.dtype) for p in pays_o[i]] == [((EP, 8, H), jnp.bfloat16), ((EP, 8, K), jnp.float32)]
            assert (ys[i].shape, ys[i].dtype) == ((t, H), jnp.bfloat16), f"rank {i}: {ys[i]}"


def test_moe_pair_shapes_follow_each_ranks_local_experts():
    ops = JaxAlltoAll.traced_only(_options(), rank_numbers=(0, 1, 2, 3))  # 10 experts: 3, 3, 2, 2
    ids, pays = _inputs((8, 3, 0, 5))

    def step(ids, pays):
        d = ops.dispatch_to_experts(ids, pays, 8)
        return d, ops.combine_from_experts([r.astype(jnp.float32) for r in d.rows], d)

    d, y = jax.eval_shape(step, ids, pays)
    assert [c.shape for c in d.counts] == [(3,), (3,), (2,), (2,)]
    assert all((r.shape, r.dtype) == ((EP * 8 * K, H), jnp.bfloat16) for r in d.rows)
    assert [o.shape for o in y] == [(8, H), (3, H), (0, H), (5, H)]


def _raises(exc, match, fn, *args):
    with pytest.raises(exc) as e:
        jax.eval_shape(fn, *args)
    assert match in str(e.value), f"expected {match!r} in {str(e.value)!r}"


def test_trace_time_errors_name_the_argument_and_rule_as_eager():
    ops = JaxAlltoAll.traced_only(_options())
    ids, (x, w) = S((5, K), jnp.int32), [S((5, H), jnp.bfloat16), S((5, K), jnp.float32)]
    d = lambda *a, t=8: ops.dispatch(*a, t)  # noqa: E731
    _raises(ValueError, "runtime_max_tokens_per_rank: must be an int in 1..max_tokens_per_rank=16, got 17",
            lambda i, x, w: d(i, [x, w], t=17), ids, x, w)
    _raises(ValueError, "runtime_max_tokens_per_rank: must be an int in 1..max_tokens_per_rank=16, got 0",
            lambda i, x, w: d(i, [x, w], t=0), ids, x, w)
    _raises(TypeError, "token_selected_experts: dtype must be int32, got float32",
            lambda i, x, w: d(i.astype(jnp.float32), [x, w]), ids, x, w)
    _raises(ValueError, f"token_selected_experts: shape must be [tokens, {K}], got [5, 2]",
            lambda i, x, w: d(i[:, :2], [x, w]), ids, x, w)
    _raises(ValueError, "token_selected_experts: 5 local tokens exceed runtime_max_tokens_per_rank=4",
            lambda i, x, w: d(i, [x, w], t=4), ids, x, w)
    _raises(ValueError, "payloads: expected 2 tensors (hidden, weights), got 1", lambda i, x, w: d(i, [x]), ids, x, w)
    _raises(TypeError, "payloads[0] (hidden): dtype must be bfloat16, got float32",
            lambda i, x, w: d(i, [x.astype(jnp.float32), w]), ids, x, w)
    _raises(ValueError, "payloads[0] (hidden): has 4 rows but token_selected_experts has 5",
            lambda i, x, w: d(i, [x[:4], w]), ids, x, w)
    _raises(ValueError, "payloads[1] (weights): shape must be [tokens, 3], got [5, 4]",
            lambda i, x, w: d(i, [x, jnp.zeros((5, 4), jnp.float32)]), ids, x, w)
    _raises(TypeError, "token_selected_experts: expected a tensor, got None", lambda x, w: d(None, [x, w]), x, w)


def test_trace_time_errors_of_combine_and_the_moe_pair():
    ops = JaxAlltoAll.traced_only(_options())
    other = JaxAlltoAll.traced_only(_options())
    args = (S((5, K), jnp.int32), S((5, H), jnp.bfloat16), S((5, K), jnp.float32))

    def combine_with(partial_of, ops_for_combine=ops, pair="dispatch"):
        def f(i, x, w):
            dd = (ops.dispatch if pair == "dispatch" else ops.dispatch_to_experts)(i, [x, w], 8)
            return ops_for_combine.combine(partial_of(dd), dd)
        return f

    _raises(TypeError, "partial: dtype must be bfloat16, got float32",
            combine_with(lambda dd: dd.payloads[0].astype(jnp.float32)), *args)
    _raises(ValueError, f"partial: must be [ep_size={EP}, runtime_max_tokens_per_rank=8, {H}], got (4, 7, {H})",
            combine_with(lambda dd: dd.payloads[0][:, :7]), *args)
    _raises(ValueError, f"partial: last dimension must be ({H},)",
            combine_with(lambda dd: dd.payloads[0][..., :8]), *args)
    _raises(TypeError, "dispatched: expected what this JaxAlltoAll's dispatch() returned",
            combine_with(lambda dd: dd.payloads[0], other), *args)
    _raises(ValueError, "dispatched: came from dispatch_to_experts(); this call pairs with dispatch()",
            combine_with(lambda dd: jnp.zeros((EP, 8, H), jnp.bfloat16), pair="experts"), *args)

    def fc2_with(fc2_of):
        def f(i, x, w):
            dd = ops.dispatch_to_experts(i, [x, w], 8)
            return ops.combine_from_experts(fc2_of(dd), dd)
        return f
    _raises(ValueError, f"fc2_out: shape must be [rows >= capacity={EP * 8 * K}, hidden={H}], got [{EP * 8 * K - 1}, {H}]",
            fc2_with(lambda dd: dd.rows[1:]), *args)
    _raises(ValueError, "fc2_out: dtype must be one of ('bfloat16', 'float16', 'float32'), got int32",
            fc2_with(lambda dd: dd.rows.astype(jnp.int32)), *args)
    _raises(ValueError, "weights: must index a float32 [top_k=3] payload",
            lambda i, x, w: ops.dispatch_to_experts(i, [x, w], 8, weights=0), *args)


def test_rank_lists_must_match_the_ranks_of_a_gpu():
    ops = JaxAlltoAll.traced_only(_options(), rank_numbers=(0, 1))
    ids, pays = _inputs((2, 2, 2))
    _raises(ValueError, "token_selected_experts: needs one entry per rank of this process on a GPU (2: a list), got 3 entries",
            lambda i, p: ops.dispatch(i, p, 4), ids, pays)
    _raises(ValueError, "token_selected_experts: needs one entry per rank of this process on a GPU (2: a list), got one array",
            lambda i, p: ops.dispatch(i[0], p, 4), ids, pays)


def test_bytes_copied_per_call():
    ops = JaxAlltoAll.traced_only(_options(), rank_numbers=(0, 1, 2, 3))
    per_token = 4 * K + 2 * H + 4 * K
    assert ops.bytes_copied("dispatch", 8) == EP * 8 * per_token
    assert ops.bytes_copied("combine", 8) == EP * 8 * H * 2
    assert ops.bytes_copied("dispatch_to_experts", 8) == 4 * 3   # the counts of the largest rank (3 experts)
    assert ops.bytes_copied("combine_from_experts", 8) == 0
    with pytest.raises(ValueError, match="op: must be"):
        ops.bytes_copied("gather", 8)


def test_a_program_on_the_cpu_is_refused_with_the_reason():
    if jax.default_backend() != "cpu":
        pytest.skip("needs jax's CPU backend as the default")
    ops = JaxAlltoAll.traced_only(_options())
    f = jax.jit(lambda i, x, w: ops.dispatch(i, [x, w], 4).expert_ids)
    with pytest.raises(Exception) as e:
        f(jnp.zeros((2, K), jnp.int32), jnp.zeros((2, H), jnp.bfloat16), jnp.ones((2, K), jnp.float32)).block_until_ready()
    assert "ep_a2a's jit calls run on CUDA GPUs only" in str(e.value), str(e.value)[-500:]


def _experts_setup():
    """4 traced ranks of 10 experts (3, 3, 2, 2 local), their inputs and expert weights of I=128."""
    ops = JaxAlltoAll.traced_only(_options(), rank_numbers=(0, 1, 2, 3))
    ids, pays = _inputs((8, 3, 0, 5))
    L, inter = (3, 3, 2, 2), 128
    return (ops, ids, pays, [S((n, 2 * inter, H), jnp.bfloat16) for n in L], [S((n, H, inter), jnp.bfloat16) for n in L],
            L, inter)


def test_experts_call_shapes_and_its_trace_time_errors():
    """JaxAlltoAll.experts between the MoE pair: fc2_out [ep_size * T^ * top_k, hidden] bf16 per
    rank; its weights' rules (dtype, shapes from each rank's local experts, the kernels' multiples
    of 64) and its pairing with dispatch_to_experts, refused while tracing with the argument named."""
    ops, ids, pays, w1, w2, L, inter = _experts_setup()

    def step(ids, pays, w1, w2):
        d = ops.dispatch_to_experts(ids, pays, 8)
        fc2 = ops.experts(d, w1, w2)
        return fc2, ops.combine_from_experts(fc2, d)

    fc2, y = jax.eval_shape(step, ids, pays, w1, w2)
    assert all((f.shape, f.dtype) == ((EP * 8 * K, H), jnp.bfloat16) for f in fc2)
    assert [o.shape for o in y] == [(8, H), (3, H), (0, H), (5, H)]

    def with_weights(a, b, pair="dispatch_to_experts"):
        def f(ids, pays):
            d = getattr(ops, pair)(ids, pays, 8)
            return ops.experts(d, a, b)
        return f
    _raises(ValueError, "w_gate_up[1]: shape must be [E_local=3, 2 * I, hidden=64], got [2, 256, 64]",
            with_weights([w1[0], w1[2], w1[2], w1[3]], w2), ids, pays)
    _raises(ValueError, "w_down[0]: shape must be [E_local=3, hidden=64, I=128], got [3, 128, 64]",
            with_weights(w1, [S((3, inter, H), jnp.bfloat16)] + w2[1:]), ids, pays)
    _raises(TypeError, "w_gate_up[0]: dtype must be bfloat16, got float32",
            with_weights([S(w.shape, jnp.float32) for w in w1], w2), ids, pays)
    _raises(ValueError, "w_gate_up[0]: the expert kernels do not take intermediate=96",
            with_weights([S((n, 192, H), jnp.bfloat16) for n in L], [S((n, H, 96), jnp.bfloat16) for n in L]), ids, pays)
    _raises(ValueError, "w_gate_up: needs one entry per rank", with_weights(w1[:2], w2), ids, pays)
    _raises(ValueError, "dispatched: came from dispatch(); this call pairs with dispatch_to_experts()",
            with_weights(w1, w2, pair="dispatch"), ids, pays)


def test_experts_combine_shapes_and_its_trace_time_errors():
    """JaxAlltoAll.experts_combine after dispatch_to_experts(rows=False): the combine's output
    [T_r, hidden] per rank and no rows (nor counts with counts=False); refused while tracing after dispatch() and with a
    combine that does not take the experts' bf16 rows."""
    ops, ids, pays, w1, w2, L, inter = _experts_setup()

    def step(ids, pays, w1, w2):
        d = ops.dispatch_to_experts(ids, pays, 8, rows=False)
        assert d.rows is None and len(d.counts) == 4
        return ops.experts_combine(d, w1, w2)
    y = jax.eval_shape(step, ids, pays, w1, w2)
    assert [(o.shape, o.dtype) for o in y] == [((t, H), jnp.bfloat16) for t in (8, 3, 0, 5)]

    def uncounted(ids, pays, w1, w2):
        d = ops.dispatch_to_experts(ids, pays, 8, rows=False, counts=False)
        assert d.rows is None and d.counts is None
        return ops.experts_combine(d, w1, w2)
    assert [(o.shape, o.dtype) for o in jax.eval_shape(uncounted, ids, pays, w1, w2)] == [(o.shape, o.dtype) for o in y]
    _raises(ValueError, "dispatched: came from dispatch(); this call pairs with dispatch_to_experts()",
            lambda i, p: ops.experts_combine(ops.dispatch(i, p, 8), w1, w2), ids, pays)
    fp32 = JaxAlltoAll.traced_only(_options(combine_dtype="float32"), rank_numbers=(0, 1, 2, 3))
    _raises(ValueError, "dispatched: the combine must take the experts' bf16 rows of hidden=64, got combine_hidden_size=64, "
            "combine_dtype=float32", lambda i, p: fp32.experts_combine(fp32.dispatch_to_experts(i, p, 8), w1, w2), ids, pays)


def test_route_shapes_and_its_trace_time_errors():
    """JaxAlltoAll.route: (ids int32, weights fp32) [T_r, top_k] per rank; logits of another
    width or dtype, and renormalize flags not one per rank, refused while tracing."""
    ops = JaxAlltoAll.traced_only(_options(), rank_numbers=(0, 1, 2, 3))
    lgs = [S((t, E), jnp.float32) for t in (8, 3, 0, 5)]
    ids, w = jax.eval_shape(lambda lg: ops.route(lg, [True, False, True, True]), lgs)
    assert [(i.shape, i.dtype, x.shape, x.dtype) for i, x in zip(ids, w)] == \
        [((t, K), jnp.int32, (t, K), jnp.float32) for t in (8, 3, 0, 5)]
    _raises(ValueError, f"logits[1]: shape must be [tokens, num_experts={E}], got [3, 9]", ops.route,
            [lgs[0], S((3, 9), jnp.float32)] + lgs[2:])
    _raises(ValueError, "logits[0]: the router kernel does not take logits dtype int32", ops.route,
            [S((8, E), jnp.int32)] + lgs[1:])
    _raises(ValueError, "renormalize: needs one flag per rank (4), got 2", lambda lg: ops.route(lg, [True, False]), lgs)
