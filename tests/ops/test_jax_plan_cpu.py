"""The native JAX path without a GPU: the launch plans made at trace time (ep_a2a/ops/jax_plan.py)
hold the parameter blocks eager dispatch and combine launch for the same call, byte for byte
(tests/protocol/launch_trace.py's rank, driver replaced, launches recorded by
testing.hooks.dry_run); their encoding names every XLA buffer where the kernels read it; and
the native library (native/ffi/ep_a2a_ffi.cc) loads with ctypes, exports its handlers and
reads the plans (parse only: no GPU)."""
import ctypes
import importlib.util
import pathlib
import random

import numpy as np
import pytest

from ep_a2a.layout import A2AParams, PayloadDesc
from ep_a2a.ops import jax_ffi, jax_plan
from ep_a2a.testing import hooks

_spec = importlib.util.spec_from_file_location(
    "launch_trace_for_plan", pathlib.Path(__file__).resolve().parents[1] / "protocol" / "launch_trace.py")
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)

CONFIGS = [(proto, q, pdl, rod) for proto in ("fence", "sentinel", "auto") for q in (None, "fp8")
           for pdl in (True, False) for rod in (8, 1) if not (q and proto != "fence")]


def _eager_step(r, ids, pays, tmax, out):
    """Blocks of one eager dispatch + combine of a fresh rank, as launched."""
    seen = []
    with hooks.dry_run(lambda launch, stream: seen.append((launch.function, launch.grid, bytes(launch.args[0])))):
        r.dispatch(ids, pays, tmax)
        r.combine(r.combine_input(tmax), tmax, out=out)
    return seen


def _block(data: bytes, **fields) -> bytes:
    p = A2AParams.from_buffer_copy(data)
    for k, v in fields.items():
        setattr(p, k, v)
    return bytes(p)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_planned_blocks_equal_eager_launches(monkeypatch, cfg):
    rng = random.Random()
    events = []
    trace.patch_driver(monkeypatch.setattr, events)
    for _ in range(4):
        tmax = rng.choice([1, 2, 4, 16, 64, 128, 1024])
        T = rng.randint(0, tmax)
        with hooks.dry_run():
            a2a, r = trace.make_rank(events, *cfg, local=True)
        ids, pays = trace._tensors(rng.randrange(4), T, rng.choice([0, 0, 4]))
        out = trace.Tensor((1 << 39) + rng.choice([0, 2, 16]), (T, trace.H), "bfloat16", device=(2, 0))
        eager = _eager_step(r, ids, pays, tmax, out)
        d, c = jax_plan.steady_pair(r.plan, r.state.tag_hi, a2a.protocol, T, tmax, [ids.ptr] + [p.ptr for p in pays], out.ptr, False)
        d_bytes, c_bytes = jax_plan.pair_params(r.plan, d, c)
        first = r.plan.first_timeout_ns  # (the eager step is a first step: the handler patches this in)
        (fd, gd, bd), (fc, gc, bc) = eager
        assert (d.launch.function, d.grid) == (fd, gd) and (c.launch.function, c.grid) == (fc, gc)
        # (the dispatch's block holds the previous combine's fields: this step's, in a jitted loop)
        assert _block(d_bytes, timeout_ns=first) == _block(bd, **dict(c.fields))
        assert _block(c_bytes, timeout_ns=first) == _block(bc, trigger_early=0)
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


def _lib():
    lib = jax_ffi.load()
    if lib is None:
        pytest.skip(f"native JAX library absent: {jax_ffi._why}")
    return lib


def test_library_exports_the_handlers_and_has_no_python_abi():
    lib = _lib()
    for name in jax_ffi.SYMBOLS:
        assert hasattr(lib, name), name
    assert lib.ep_a2a_ffi_plan_version() == jax_plan.VERSION
    assert lib.ep_a2a_ffi_api_version() >= 3  # XLA FFI API 0.3 or newer
    data = jax_ffi.LIBRARY.read_bytes()
    assert b"libpython" not in data and b"PyObject_" not in data and b"Py_Initialize" not in data
    assert jax_ffi.info_line().startswith("JAX native library: present")


def test_library_reads_plans_and_refuses_malformed_ones():
    _lib()
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
    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("ep_a2a_build_for_test", root / "kernels" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
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
