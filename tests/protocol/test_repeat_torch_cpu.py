"""The torch ops' vouched repeats (ops/torch.py: a call whose argument slots saw no change
repeats the all-to-all's last call through dispatch_same / combine_same) launch exactly what
the full path launches, on the CPU with the launches recorded (test_repeat_cpu's rank; host
tensors stand for the GPU's). A random plan of steps mixes what engines do (the same tensors
again, rewritten in place) with every way a call can differ or fail: other tensors, a
tensor moved in place (set_), other token counts, staged and workspace partials, out given
or not, a combine input marked as written on another stream, calls the slots or the
all-to-all refuse (after a slot already took a new tensor), and direct calls of the
all-to-all with its own Tensors in between."""
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ep_a2a.interop.torch_tensor as torch_tensor  # noqa: E402
from ep_a2a import fastpath  # noqa: E402
from ep_a2a.interop.tensor import Tensor  # noqa: E402
from ep_a2a.interop.torch_tensor import TensorSlot  # noqa: E402
from ep_a2a.ops import torch as ops  # noqa: E402
from ep_a2a.ops.torch_views import TorchRank  # noqa: E402
from test_repeat_cpu import EP, H, TMAX, _rank, recorder  # noqa: E402,F401 (recorder: the fixture)

T_HATS = (8, 16)


def _tensors():
    """Every host tensor the plan uses, made once: both runs must pass the same addresses."""
    z = torch.zeros
    return dict(
        ids=[z(TMAX, 8, dtype=torch.int32) for _ in range(3)],  # the third is moved by set_
        storages=[z(TMAX, 8, dtype=torch.int32) for _ in range(2)],  # where set_ moves it
        x=[z(TMAX, H, dtype=torch.bfloat16) for _ in range(2)], w=z(TMAX, 8, dtype=torch.float32),
        staged=[{tm: z(EP, tm, H, dtype=torch.bfloat16) for tm in T_HATS} for _ in range(2)],
        out=[z(TMAX, H, dtype=torch.bfloat16) for _ in range(3)],  # the third: combine's own (out=None)
        views={tm: z(EP, tm, H, dtype=torch.bfloat16) for tm in T_HATS})


def _bind(r, a2a, t):
    """A TorchRank over the recorded rank; its workspace views are host tensors that the
    core's combine_input Tensors point at (so both are one view), and combine's own outputs
    (out=None) are slices of one host tensor."""
    b = TorchRank.__new__(TorchRank)
    b.r, b.a2a, b.ordinal, b.validate_expert_ids = r, a2a, 0, False
    b.hidden, b.combine_dtype = H, torch.bfloat16
    b.out_like = types.SimpleNamespace(new_empty=lambda rows, hidden: t["out"][2][:rows])
    b.ids_slot = TensorSlot("token_selected_experts")
    b.payload_slots = [TensorSlot(f"payloads[{q}] ({s.name})") for q, s in enumerate(a2a.payload_specs)]
    b.partial_slot, b.out_slot = TensorSlot("partial"), TensorSlot("out")
    b.local_tokens, b.vouched_dispatch, b.vouched_combine = None, None, (None, None)
    b._dispatch, b._combine, b._fp8 = {}, {}, {}
    for tmax in T_HATS:
        core = r.combine_input(tmax)
        core.ptr = t["views"][tmax].data_ptr()
        b._combine[tmax] = (t["views"][tmax], core)
        b._dispatch[tmax] = (torch.zeros(1), [])
    return b


def _plan(rng, steps):
    kinds = ["again"] * 10 + ["ids", "x", "set_", "tokens", "tmax", "staged", "out", "out_none", "bad_out",
                              "sparse", "fp16", "core", "view_stream"]
    return [kinds[int(rng.integers(len(kinds)))] for _ in range(steps)]


def _run(plan, seed, t, fast, rec, monkeypatch):
    """The plan's steps over the tensors `t`; returns (what was recorded, vouched calls that repeated)."""
    monkeypatch.setattr(fastpath, "REPEAT_FAST_PATH", fast)
    rec.clear()
    a2a, r, specs = _rank()
    a2a.protocol = "fence"
    b = _bind(r, a2a, t)
    hits = [0]
    for name in ("dispatch_same", "combine_same"):
        def counted(*args, _f=getattr(r, name)):
            got = _f(*args)
            hits[0] += got is not None
            return got
        monkeypatch.setattr(r, name, counted)
    rng = np.random.default_rng(seed)
    pool, xs, w, staged, outs = t["ids"], t["x"], t["w"], t["staged"], t["out"]
    pool[2].set_(t["storages"][0])
    cur = dict(ids=pool[0], x=xs[0], T=4, tmax=8, part=None, out=outs[0])
    for kind in plan:
        c = cur
        if kind == "ids":
            c["ids"] = pool[int(rng.integers(3))]
        elif kind == "x":
            c["x"] = xs[int(rng.integers(2))]
        elif kind == "set_":  # the same tensor object, moved onto other memory
            c["ids"] = pool[2]
            pool[2].set_(t["storages"][int(rng.integers(2))])
        elif kind == "tokens":
            c["T"] = int(rng.integers(1, c["tmax"] + 1))
        elif kind == "tmax":
            c["tmax"] = T_HATS[int(rng.integers(2))]
            c["T"] = min(c["T"], c["tmax"])
        elif kind == "staged":
            c["part"] = None if c["part"] is not None else staged[int(rng.integers(2))]
        elif kind == "out":
            c["out"] = outs[int(rng.integers(2))]
        elif kind == "out_none":
            c["out"] = None if c["out"] is not None else outs[0]
        elif kind == "view_stream":  # a caller of the all-to-all marks its combine input as still
            core = b._combine[c["tmax"]][1]  # written on another stream (then done again)
            core.stream = 9 if core.stream is None else None
        T, tmax = c["T"], c["tmax"]
        ids, x = c["ids"][:T], c["x"][:T]
        if kind == "core":  # the all-to-all called directly with its own Tensors in between
            r.dispatch(Tensor(1 << 45, (T, 8), "int32", device=(2, 0)),
                       [Tensor((1 << 45) + (1 << 30) * (q + 1), (T,) + tuple(s.shape), s.dtype, device=(2, 0))
                        for q, s in enumerate(specs)], tmax)
            r.combine(r.combine_input(tmax), tmax)
            continue
        if kind in ("sparse", "fp16"):  # a call that fails after the ids slot took other ids; the
            # step's own call then passes those ids (a slot that still reads "unchanged" to them)
            c["ids"] = pool[(next(i for i, p in enumerate(pool) if p is c["ids"]) + 1) % 3]
            ids = c["ids"][:T]
            if kind == "sparse":  # a payload's data_ptr() raises, in its slot
                with pytest.raises(RuntimeError):
                    ops.run_dispatch(b, ids, [x.to_sparse(), w[:T]], tmax, -1)
            else:  # the all-to-all refuses the dtype the payload slot took
                with pytest.raises(TypeError, match="payloads"):
                    ops.run_dispatch(b, ids, [x.to(torch.float16), w[:T]], tmax, -1)
        ops.dispatch(b, ids, [x, w[:T]], tmax)
        if kind == "bad_out":  # the partial slot takes another staged partial, then the out slot
            c["part"] = staged[1] if c["part"] is staged[0] else staged[0]  # refuses; the step's
            with pytest.raises(TypeError, match="out"):  # own call then passes that partial
                ops.run_combine(b, c["part"][tmax], None, tmax, torch.zeros(T, H, dtype=torch.complex64), -1)
        part = b._combine[tmax][0] if c["part"] is None else c["part"][tmax]
        ops.combine(b, part, tmax, out=None if c["out"] is None else c["out"][:T])
    return list(rec), hits[0]


def test_vouched_repeats_launch_exactly_what_the_full_path_launches(recorder, monkeypatch):
    monkeypatch.setattr(torch_tensor, "CPU", 2)  # host tensors read as on CUDA device 0 (the rank's)
    monkeypatch.setattr(ops, "current_stream_handle", lambda ordinal: 7)
    seed = int(np.random.default_rng().integers(2 ** 63))
    plan = _plan(np.random.default_rng(seed), 600)
    t = _tensors()
    full, none = _run(plan, seed, t, False, recorder, monkeypatch)
    fast, hits = _run(plan, seed, t, True, recorder, monkeypatch)
    assert none == 0
    assert hits > len(plan) // 4, f"seed={seed}: the vouched repeat ran {hits} times"
    bad = [i for i, (x, y) in enumerate(zip(full, fast)) if x != y]
    assert len(full) == len(fast) and not bad, \
        f"seed={seed}: {len(bad)} of {len(full)} records differ, first {full[bad[0]][:2] if bad else ''} at {bad[:1]}"
