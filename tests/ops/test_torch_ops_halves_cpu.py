"""The halves' torch ops (ep_a2a/ops/torch_halves.py) without a GPU: schemas (each half of an
operation mutates the tensor that orders it after the other), fake implementations, and
torch.compile(fullgraph=True) tracing both halves of both operations, in order."""
import pytest

torch = pytest.importorskip("torch")

from ep_a2a.ops import torch as ops  # noqa: E402
from ep_a2a.ops import torch_halves as halves  # noqa: E402

MUTATED = {"dispatch_send": {"recv_expert_ids"}, "dispatch_recv": {"recv_expert_ids", "recv_payloads"},
           "combine_send": {"out"}, "combine_recv": {"out"}}


def test_every_half_is_registered_and_declares_what_it_mutates():
    assert set(halves.HALF_OPS) == set(MUTATED)
    assert ops.dispatch_send is halves.dispatch_send and ops.combine_recv is halves.combine_recv
    for name, op in halves.HALF_OPS.items():
        schema = op._schema
        assert str(schema) == "ep_a2a::" + halves.HALF_SCHEMAS[name], name
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == MUTATED[name], (name, written)
        assert not schema.returns
        for key in ("CUDA", "CPU"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), (name, key)


def _args(name, t):
    i32, f32 = torch.int32, torch.float32
    return {
        "dispatch_send": (1, t((3, 2), i32), [t((3, 8), f32)], 4, t((2, 4, 2), i32)),
        "dispatch_recv": (1, t((2, 4, 2), i32), [t((2, 4, 8), f32)]),
        "combine_send": (1, t((2, 4, 8), f32), None, t((2, 4, 2), i32), 4, t((3, 8), f32)),
        "combine_recv": (1, t((3, 8), f32)),
    }[name]


def test_fake_implementations_run_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        for name, op in halves.HALF_OPS.items():
            assert op(*_args(name, lambda shape, dt: torch.empty(shape, dtype=dt))) is None, name


def test_an_unknown_handle_is_named_before_anything_runs():
    for name, op in halves.HALF_OPS.items():
        with pytest.raises(ValueError, match="^rank: no ep_a2a torch binding has handle"):
            op(*_args(name, lambda shape, dt: torch.zeros(shape, dtype=dt)))


def _step(d):
    """Two micro-batches' halves interleaved (A.send, B.send, A.recv, B.recv) with compute
    between them, on CPU tensors: what a compiled overlapped step calls."""
    H = halves.HALF_OPS
    H["dispatch_send"](1, d["ids"], [d["x"]], 4, d["rv"])
    H["dispatch_send"](2, d["ids"], [d["x"]], 4, d["rv2"])
    y = d["x"] * 3
    H["dispatch_recv"](1, d["rv"], [d["rx"]])
    H["dispatch_recv"](2, d["rv2"], [d["rx2"]])
    H["combine_send"](1, d["rx"] + 1, None, d["rv"], 4, d["out"])
    H["combine_recv"](1, d["out"])
    return d["out"] + y


def test_compile_fullgraph_traces_the_halves_in_order():
    from torch._functorch.aot_autograd import aot_module_simplified
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        def keep(g, _):
            graphs.append(g)
            return g.forward
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt)  # noqa: E731
    d = dict(ids=z(3, 2, dt=torch.int32), x=z(3, 8), rv=z(2, 4, 2, dt=torch.int32), rv2=z(2, 4, 2, dt=torch.int32),
             rx=z(2, 4, 8), rx2=z(2, 4, 8), out=z(3, 8))
    with pytest.raises(ValueError, match="no ep_a2a torch binding"):
        torch.compile(_step, backend=backend, fullgraph=True)(d)
    assert len(graphs) == 1
    code = graphs[0].code
    at = [code.index(f"torch.ops.ep_a2a.{name}.default") for name in
          ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")]
    assert at == sorted(at), code
