"""The torch ops (ep_a2a/ops/torch.py) without a GPU: registration and schemas (mutated
arguments declared), fake implementations, torch.compile(fullgraph=True) tracing of every
op, inductor handing the ops the very tensors they mutate (no copies), argument errors, and
the torch-tensor slots the ops fill instead of a DLPack exchange."""
import itertools

import pytest

torch = pytest.importorskip("torch")

from ep_a2a.interop.tensor import CPU, CUDA, DTYPES  # noqa: E402
from ep_a2a.interop.torch_tensor import TensorSlot, torch_dtype  # noqa: E402
from ep_a2a.ops import torch as ops  # noqa: E402
from ep_a2a.validate import token_tensor  # noqa: E402

MUTATED = {"dispatch": {"recv_expert_ids", "recv_payloads"}, "combine": {"out"},
           "build_index": {"counts", "offsets", "rows", "row_weight", "row_of"}, "gather_rows": {"out"},
           "finalize": {"out"}, "finalize_fp8": {"values", "scales"}, "activation": {"out"},
           "expert_fc1": {"out"}, "expert_fc2": {"out"}, "expert_fc2_finalize": {"out", "finalize_into"},
           "route": {"ids", "weights"}}


def test_every_op_is_registered_with_its_schema_and_declares_what_it_mutates():
    assert set(ops.OPS) == set(MUTATED)
    for name, op in ops.OPS.items():
        schema = op._schema
        assert str(schema) == "ep_a2a::" + ops.SCHEMAS[name], name
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == MUTATED[name], (name, written)
        assert not schema.returns, f"{name}: the ops return nothing (results are their mutated arguments)"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), name


def _args(name, fake_like):
    """Arguments of op `name` of plausible shapes (ep=2, T^=4, top_k=2, hidden=8)."""
    t = fake_like
    i32, f32 = torch.int32, torch.float32
    return {
        "route": (t((3, 8), f32), t((3, 2), i32), t((3, 2), f32), True),
        "dispatch": (1, t((3, 2), i32), [t((3, 8), f32)], 4, t((2, 4, 2), i32), [t((2, 4, 8), f32)]),
        "combine": (1, t((2, 4, 8), f32), None, t((2, 4, 2), i32), 4, t((3, 8), f32)),
        "build_index": (2, t((2, 4, 2), i32), t((2, 4, 2), f32), t((3,), i32), t((4,), i32), t((16,), i32),
                        t((16,), f32), t((8, 2), i32)),
        "gather_rows": (2, t((16,), i32), t((4,), i32), t((2, 4, 8), f32), t((16, 8), f32)),
        "finalize": (2, t((8, 2), i32), t((16,), f32), t((16, 8), f32), t((2, 4, 8), f32)),
        "activation": (2, t((4,), i32), t((16, 16), torch.bfloat16), t((16, 8), torch.bfloat16)),
        "expert_fc1": (2, t((16,), i32), t((4,), i32), t((2, 4, 64), torch.bfloat16), t((3, 128, 64), torch.bfloat16),
                       t((16, 64), torch.bfloat16)),
        "expert_fc2": (2, t((4,), i32), t((16, 64), torch.bfloat16), t((3, 64, 64), torch.bfloat16),
                       t((16, 64), torch.bfloat16)),
        "expert_fc2_finalize": (2, t((4,), i32), t((8, 2), i32), t((16,), f32), t((16, 64), torch.bfloat16),
                                t((3, 64, 64), torch.bfloat16), t((16, 64), torch.bfloat16),
                                t((2, 4, 64), torch.bfloat16)),
        "finalize_fp8": (2, t((8, 2), i32), t((16,), f32), t((16, 128), f32), t((2, 4, 128), torch.float8_e4m3fn),
                         t((2, 4, 1), f32), "bfloat16"),
    }[name]


def test_fake_implementations_run_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        for name, op in ops.OPS.items():
            assert op(*_args(name, lambda shape, dt: torch.empty(shape, dtype=dt))) is None, name


def test_an_unknown_handle_is_named_before_anything_runs():
    for name, op in ops.OPS.items():
        if name == "route":  # (no handle: the route op finds its GPU from the logits)
            continue
        what = "rank" if name in ("dispatch", "combine") else "index"
        with pytest.raises(ValueError, match=f"^{what}: no ep_a2a torch binding has handle"):
            op(*_args(name, lambda shape, dt: torch.zeros(shape, dtype=dt)))


def _step(d):
    """Every op once, on CPU tensors in a dict: what a compiled MoE step calls."""
    ops.OPS["route"](d["logits"], d["ids"], d["w"], True)
    ops.OPS["dispatch"](1, d["ids"], [d["x"]], 4, d["rv"], [d["rx"]])
    ops.OPS["build_index"](2, d["rv"], d["rw"], d["counts"], d["offsets"], d["rows"], d["roww"], d["rowof"])
    ops.OPS["gather_rows"](2, d["rows"], d["offsets"], d["rx"], d["xg"])
    y = d["xg"] * 2
    ops.OPS["finalize"](2, d["rowof"], d["roww"], y, d["cin"])
    ops.OPS["combine"](1, d["cin"], None, d["rv"], 4, d["out"])
    return d["out"] + 1


def _tensors():
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt)  # noqa: E731
    i = torch.int32
    return dict(logits=z(3, 8), w=z(3, 2), ids=z(3, 2, dt=i), x=z(3, 8), rv=z(2, 4, 2, dt=i), rx=z(2, 4, 8), rw=z(2, 4, 2), counts=z(3, dt=i),
                offsets=z(4, dt=i), rows=z(16, dt=i), roww=z(16), rowof=z(8, 2, dt=i), xg=z(16, 8), cin=z(2, 4, 8),
                out=z(3, 8))


def test_compile_fullgraph_traces_every_op_functionalized():
    """dynamo + AOT autograd with fullgraph=True: one graph, every op in it as an
    auto_functionalized call (the forward graph is captured before the real op runs, which
    then raises for the unknown handle: there is no GPU here)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        def keep(g, _):
            graphs.append(g)
            return g.forward
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)
    with pytest.raises(ValueError, match="logits: must be on a CUDA GPU"):
        torch.compile(_step, backend=backend, fullgraph=True)(_tensors())
    assert len(graphs) == 1
    code = graphs[0].code
    for name in ("route", "dispatch", "build_index", "gather_rows", "finalize", "combine"):
        assert f"torch.ops.ep_a2a.{name}.default" in code, (name, code)
    assert code.count("auto_functionalized") >= 6, code


def test_inductor_hands_the_ops_the_tensors_they_mutate():
    """The same schemas under a test namespace with recording CPU kernels: inductor re-inplaces
    every op onto the caller's tensors (a copy would make the real ops copy their results,
    and a late copy back into the workspace could land after a peer's next dispatch)."""
    lib = torch.library.Library("ep_a2a_schema_check", "DEF")
    seen = []
    for name, schema in ops.SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, lambda *a, _n=name, **k: seen.append((_n, [x.data_ptr() for x in a if isinstance(x, torch.Tensor)]
                                                              + [y.data_ptr() for x in a if isinstance(x, list) for y in x])),
                 "CPU")
        torch.library.register_fake(f"ep_a2a_schema_check::{name}", lambda *a, **k: None, lib=lib)
    check = torch.ops.ep_a2a_schema_check
    d = _tensors()

    def step():
        check.route.default(d["logits"], d["ids"], d["w"], True)
        check.dispatch.default(1, d["ids"], [d["x"]], 4, d["rv"], [d["rx"]])
        check.build_index.default(2, d["rv"], d["rw"], d["counts"], d["offsets"], d["rows"], d["roww"], d["rowof"])
        check.gather_rows.default(2, d["rows"], d["offsets"], d["rx"], d["xg"])
        check.finalize.default(2, d["rowof"], d["roww"], d["xg"] * 2, d["cin"])
        check.combine.default(1, d["cin"], None, d["rv"], 4, d["out"])
        return d["out"] + 1
    torch._dynamo.reset()
    try:
        torch.compile(step, fullgraph=True)()
    except Exception as e:  # no C++ compiler for inductor's CPU code on this machine
        if "compiler" in str(e).lower() or "cpp" in str(e).lower():
            pytest.skip(f"inductor cannot build CPU code here: {type(e).__name__}: {str(e)[:200]}")
        raise
    ptrs = {k: v.data_ptr() for k, v in d.items()}
    got = dict(seen)
    assert got["route"] == [ptrs["logits"], ptrs["ids"], ptrs["w"]], "route got copies of its outputs"
    assert got["dispatch"] == [ptrs["ids"], ptrs["rv"], ptrs["x"], ptrs["rx"]], "dispatch got copies of its outputs"
    assert got["build_index"][2:] == [ptrs[k] for k in ("counts", "offsets", "rows", "roww", "rowof")]
    assert got["gather_rows"][-1] == ptrs["xg"] and got["finalize"][-1] == ptrs["cin"]
    assert got["combine"] == [ptrs["cin"], ptrs["rv"], ptrs["out"]]


def test_slot_mirrors_the_torch_tensor_and_stays_one_object():
    slot = TensorSlot("token_selected_experts")
    a = torch.zeros(5, 8, dtype=torch.int32)
    w = slot(a)
    assert (w.ptr, w.shape, w.strides, w.dtype.name, w.device) == (a.data_ptr(), (5, 8), (8, 1), "int32", (CPU, 0))
    b = torch.zeros(16, 8, dtype=torch.int32)[::2]  # a strided view: the slot says so, the library refuses it
    assert slot(b) is w and w.shape == (8, 8) and w.strides == (16, 1) and not w.is_contiguous
    c = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert slot(c) is w and (w.ptr, w.shape, w.dtype.name) == (c.data_ptr(), (3, 4), "bfloat16") and w.is_contiguous
    assert slot.fill(a) is w and (w.shape, w.strides, w.dtype.name) == ((5, 8), (8, 1), "int32")  # (__call__ is fill)


def test_slot_sees_every_stride_change_even_where_is_contiguous_stands_for_stride():
    """fill() reads is_contiguous() instead of stride() when the last tensor was contiguous too:
    a same-shape tensor with other strides must still be seen, and a tensor torch calls
    contiguous (extents of 1, numel 0 included) gets the row-major strides, which address each
    of its elements where its own strides do (checked element by element)."""
    from ep_a2a.interop.tensor import contiguous_strides
    buf = torch.zeros(4096, dtype=torch.float32)
    slot = TensorSlot("x")

    def same(t):
        before = None if slot.tensor is None else (slot.tensor.ptr, slot.tensor.shape, slot.tensor.strides,
                                                    slot.tensor.dtype, slot.tensor.device)
        unchanged = slot.update(t)
        w = slot.tensor
        want = contiguous_strides(tuple(t.shape)) if t.is_contiguous() else t.stride()
        assert (w.ptr, w.shape, w.strides) == (t.data_ptr(), tuple(t.shape), want)
        # update() says "unchanged" exactly when the Tensor's fields are what they were
        assert unchanged == (before == (w.ptr, w.shape, w.strides, w.dtype, w.device)), (t.shape, t.stride(), before)
        for idx in itertools.product(*(range(n) for n in t.shape)):  # the same address for every element
            assert sum(i * s for i, s in zip(idx, w.strides)) == sum(i * s for i, s in zip(idx, t.stride()))
    same(buf[:32].view(4, 8))
    same(buf.as_strided((4, 8), (1, 4)))          # same shape, transposed strides: not contiguous
    same(buf[:32].view(4, 8))                     # back to dense
    same(buf.as_strided((4, 8), (9, 1)))          # padded rows
    same(buf.as_strided((1, 8), (8, 1)))
    same(buf.as_strided((1, 8), (100, 1)))        # contiguous to torch, other strides: an extent of 1
    same(buf.as_strided((0, 8), (8, 1)))
    same(buf.as_strided((0, 8), (3, 5)))          # numel 0: any strides are contiguous to torch
    same(buf[8:40].view(4, 8))                    # another address, same geometry
    same(buf[8:40].view(4, 8))                    # unchanged
    same(buf[8:40].view(4, 8).to(torch.float64)[:, :4].contiguous())  # another dtype
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    for _ in range(400):  # random walks over shapes and strides, repeats included (fresh each run)
        nd = int(torch.randint(1, 4, (), generator=gen))
        shape = [int(torch.randint(0, 4, (), generator=gen)) for _ in range(nd)]
        kind = int(torch.randint(0, 3, (), generator=gen))
        if kind == 0:
            t = buf[:max(1, torch.Size(shape).numel())].view(-1)[:torch.Size(shape).numel()].view(shape)
        else:
            strides = [int(torch.randint(0, 6, (), generator=gen)) for _ in range(nd)]
            t = buf[int(torch.randint(0, 8, (), generator=gen)):].as_strided(shape, strides)
        same(t)
        same(t)


def test_dispatch_args_fill_every_slot_for_any_payload_count():
    """TorchRank.dispatch_args (straight calls for 1 and 2 payloads, a loop beyond, the given count
    when it is not the rank's): each Tensor mirrors its torch tensor, the same slot objects;
    `same` only when the rank's count of tensors left every slot as it was (every slot is
    filled even after one changed)."""
    from ep_a2a.ops.torch_views import TorchRank
    for n_slots in (1, 2, 3):
        b = TorchRank.__new__(TorchRank)
        b.ids_slot, b.payload_slots = TensorSlot("ids"), [TensorSlot(f"p{q}") for q in range(n_slots)]
        for n in (n_slots, n_slots + 1, max(0, n_slots - 1)):
            for _ in range(2):
                rows = int(torch.randint(1, 9, ()))
                ids = torch.randint(0, 8, (rows, 4), dtype=torch.int32)
                pays = [torch.randn(rows, 3 + q).to(torch.bfloat16 if q % 2 else torch.float32) for q in range(n)]
                w, ws, same = b.dispatch_args(ids, pays)
                assert not same, "new tensors are never the same"
                assert b.dispatch_args(ids, pays)[2] == (n == n_slots), (n, n_slots)
                moved = [p.clone() for p in pays]
                if n == n_slots:  # one payload elsewhere: not the same, and every slot still rewritten
                    assert not b.dispatch_args(ids, pays[:-1] + moved[-1:])[2]
                    assert not b.dispatch_args(ids, pays)[2]
                    assert b.dispatch_args(ids, pays)[2]
                w, ws, _ = b.dispatch_args(ids, pays)
                assert w is b.ids_slot.tensor and (w.ptr, w.shape) == (ids.data_ptr(), (rows, 4))
                assert len(ws) == n
                for q, (t, p) in enumerate(zip(ws, pays)):
                    assert (t.ptr, t.shape, t.strides, t.dtype.name) == (p.data_ptr(), tuple(p.shape), p.stride(),
                                                                        str(p.dtype).split(".")[1])
                    assert q >= n_slots or t is b.payload_slots[q].tensor


def test_slot_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"^payloads\[0\] \(hidden\): torch dtype torch.complex64 has no ep_a2a"):
        TensorSlot("payloads[0] (hidden)")(torch.zeros(2, dtype=torch.complex64))
    cpu = TensorSlot("token_selected_experts")(torch.zeros(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^token_selected_experts: must be on cuda:0 \(this rank's GPU\)"):
        token_tensor(cpu, "token_selected_experts", (8,), "int32", None, 0, ordinal=0, max_tokens=16)
    wrong = TensorSlot("token_selected_experts")(torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match="^token_selected_experts: dtype must be int32, got int64"):
        token_tensor(wrong, "token_selected_experts", (8,), "int32", None, 0, ordinal=0, max_tokens=16)


def test_dtype_tables_agree_with_torch():
    for name, d in DTYPES.items():
        t = torch_dtype(name)
        assert torch.empty(0, dtype=t).element_size() == d.itemsize, name
        assert TensorSlot("x")(torch.empty(2, dtype=t)).dtype is d


def test_cuda_device_is_read_without_a_gpu():
    meta = torch.empty(2, 3, device="meta")  # (get_device() is -1 off CUDA: CPU in the slot)
    assert TensorSlot("x")(meta).device == (CPU, 0) != (CUDA, 0)


def test_eager_calls_skip_the_dispatcher_only_where_it_would_do_nothing_else():
    """plain_eager(): True in plain eager code; False under every way torch has of seeing
    an op call (dynamo, export, dispatch modes, function modes, functorch transforms, jit
    tracing), where the functions must call the registered ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode
    assert ops.plain_eager()
    for mode in (FakeTensorMode(), FunctionalTensorMode(), FlopCounterMode(display=False), torch.device("meta")):
        with mode:
            assert not ops.plain_eager(), type(mode).__name__
    seen = []

    def f(x):
        seen.append(ops.plain_eager())
        return x + 1
    x = torch.zeros(2, 2)
    make_fx(f)(x)
    torch.func.functionalize(f)(x)
    torch.func.vmap(f)(x)
    torch.jit.trace(f, x, check_trace=False)

    class M(torch.nn.Module):
        def forward(self, x):
            return f(x)
    torch.export.export(M(), (x,), strict=False)
    assert seen == [False] * 5, seen
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: t + (0 if ops.plain_eager() else 1), backend="eager", fullgraph=True)
    assert compiled(x).tolist() == [[1, 1], [1, 1]], "dynamo must trace the op path"
    assert ops.plain_eager()
    ops.EAGER_DIRECT = False
    try:
        assert not ops.plain_eager()
    finally:
        ops.EAGER_DIRECT = True
