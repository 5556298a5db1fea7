"""What the native JAX path's CPU tests share (test_jax_plan_cpu.py, test_jax_halves_plan_cpu.py):
tests/protocol/launch_trace.py's rank with the driver replaced, the configurations swept, one
random step's arguments, the eager launches of a body, and the plans a traced call encodes."""
import importlib.util
import pathlib
import struct

import pytest

from ep_a2a.layout import A2AParams
from ep_a2a.ops import jax_ffi, jax_plan
from ep_a2a.testing import hooks

_spec = importlib.util.spec_from_file_location(
    "launch_trace_for_jax", pathlib.Path(__file__).resolve().parents[1] / "protocol" / "launch_trace.py")
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)

# (protocol, combine_quant, pdl, ranks on the device)
CONFIGS = [(proto, q, pdl, rod) for proto in ("fence", "sentinel", "auto") for q in (None, "fp8")
           for pdl in (True, False) for rod in (8, 1) if not (q and proto != "fence")]


def block(data: bytes, **fields) -> bytes:
    """A parameter block with `fields` set."""
    p = A2AParams.from_buffer_copy(data)
    for k, v in fields.items():
        setattr(p, k, v)
    return bytes(p)


def copied(op) -> tuple:
    """(dst, src, nbytes) of a planned copy: a launch of util.cu's ep_copy_bytes (jax_plan.copy_launch;
    the replaced driver's functions are their names)."""
    assert isinstance(op, jax_plan.LaunchOp) and op.function == "ep_copy_bytes", op
    assert op.block == 256 and op.grid >= 1 and not op.pdl
    return struct.unpack("<QQQ", b"".join(op.args))


def launched(body) -> list:
    """(kernel, grid, parameter block) of every launch body() makes, recorded instead of issued."""
    seen = []
    with hooks.dry_run(lambda launch, stream: seen.append((launch.function, launch.grid, bytes(launch.args[0])))):
        body()
    return seen


def random_step(rng, events, cfg) -> tuple:
    """A fresh rank of configuration `cfg` and one random step's arguments:
    (a2a, rank, T^, T, ids, payloads, out)."""
    tmax = rng.choice([1, 2, 4, 16, 64, 128, 1024])
    T = rng.randint(0, tmax)
    with hooks.dry_run():
        a2a, r = trace.make_rank(events, *cfg, local=True)
    ids, pays = trace._tensors(rng.randrange(4), T, rng.choice([0, 0, 4]))
    out = trace.Tensor((1 << 39) + rng.choice([0, 2, 16]), (T, trace.H), "bfloat16", device=(2, 0))
    return a2a, r, tmax, T, ids, pays, out


def require_library():
    """The native library, or the test skips."""
    lib = jax_ffi.library()
    if lib is None:
        pytest.skip(f"native JAX library absent: {jax_ffi._why}")
    return lib


def record_plans(monkeypatch, ops_jax) -> list:
    """Stand-in handles for the driver's objects, and the groups each traced call encodes
    (appended to the returned list)."""
    made = []
    monkeypatch.setattr(jax_plan, "handle_of", lambda o: o if isinstance(o, int) else 0x1000 + len(str(o)))
    real_encode = ops_jax.encode
    monkeypatch.setattr(ops_jax, "encode", lambda groups, *a: made.append(groups) or real_encode(groups, *a))
    return made


def native_moe_ops(monkeypatch, combine_quant=None) -> tuple:
    """(JaxAlltoAll on the native path over launch_trace's rank with the driver replaced and
    the MoE helpers' device stood in, the groups each traced call encodes, the all-to-all, its
    rank): the setting of the MoE pair's plan tests."""
    import types
    import ep_a2a.moe as moe
    import ep_a2a.router as router
    from ep_a2a.ops import jax as ops_jax
    from ep_a2a.testing import hooks
    require_library()
    events = []
    trace.patch_driver(monkeypatch.setattr, events)
    monkeypatch.setattr(moe, "Device", types.SimpleNamespace)
    monkeypatch.setattr(router, "Device", types.SimpleNamespace)
    monkeypatch.setattr(router, "_ROUTERS", {})  # (routers of the stand-in device stay in this test)
    made = record_plans(monkeypatch, ops_jax)
    with hooks.dry_run():
        a2a, r = trace.make_rank(events, "fence", combine_quant, True, 8, local=True)
    return ops_jax.JaxAlltoAll(a2a), made, a2a, r

