"""The repeat fast path with framework tensors (fastpath.Repeat reading them through
interop/readers.py) against the full path (their DLPack exchange and every check), on the
CPU with the launches recorded (test_repeat_cpu's rank).

A stand-in framework shows torch's side of it: its tensors expose torch's accessors (read by
torch's own reader functions), export through DLPack as torch does (the framework's current
stream is ordered before the consumer's unless they are one; a tensor that requires grad is
refused), and can be written, moved, resized and marked in place. A random plan of steps
mixes the steady state (the same tensors, their values written in place) with every change
a call must see; both paths must record the same launches, waits (one per distinct
producer: the full path waits once per tensor), host id checks, returned views and errors.
With real torch tensors (CPU): which changes the geometry read sees, and which it must not.
"""
import gc
import os
import types

import numpy as np
import pytest

import ep_a2a.alltoall as A
from ep_a2a import fastpath
from ep_a2a.interop import readers, torch_tensor
from ep_a2a.interop.tensor import Tensor, as_dtype, contiguous_strides
from test_repeat_cpu import EP, H, TMAX, _rank, recorder  # noqa: F401 (recorder: the fixture)


class Frame:
    """A framework tensor as torch shows one (see the module docstring)."""
    current = [7]   # the framework's current stream
    log = None      # where its DLPack export records the waits it makes (the recorder)

    def __init__(self, ptr, shape, dtype):
        self.ptr, self.shape, self.dtype, self.requires_grad = ptr, tuple(shape), as_dtype(dtype), False

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return contiguous_strides(self.shape)

    def get_device(self):
        return 0

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *, stream=None, max_version=None):
        if self.requires_grad:
            raise BufferError("Can't export tensors that require gradient")
        consumer = 0 if stream in (None, 1) else stream  # (DLPack's legacy default stream: the NULL one)
        if stream != -1 and consumer != Frame.current[0]:
            Frame.log.append(("wait", consumer, Frame.current[0]))
        return Tensor(self.ptr, self.shape, self.dtype, device=(2, 0)).__dlpack__(max_version=max_version)


readers.register(Frame, readers.Reader(torch_tensor.geometry, lambda t: t.get_device(), lambda ordinal: Frame.current[0],
                                       lambda t: Tensor(t.ptr, t.shape, t.dtype, device=(2, 0))))


def _collapsed(rec):
    """The records with runs of one wait merged (the full path waits once per tensor)."""
    out = []
    for x in rec:
        if not (x[0] == "wait" and out and out[-1] == x):
            out.append(x)
    return out


def _run(seed, fast, rec, monkeypatch, steps):
    """A random plan of steps (the same draws whatever happens); returns (records, repeats that
    held framework tensors)."""
    monkeypatch.setattr(fastpath, "REPEAT_FAST_PATH", fast)
    monkeypatch.setattr(A, "is_capturing", lambda handle: False)
    monkeypatch.setattr(A, "check_expert_ids_on_host", lambda ids, s, n: rec.append(("ids", ids.ptr, ids.shape, s)))
    hits = [0]
    order = fastpath.Repeat.order_producers

    def counted(self):
        hits[0] += self.readers is not None
        return order(self)
    monkeypatch.setattr(fastpath.Repeat, "order_producers", counted)
    rec.clear()
    Frame.log, Frame.current[0] = rec, 7
    rng = np.random.default_rng(seed)
    a2a, r, specs = _rank()
    a2a.protocol = "fence"
    addresses = iter(range(1 << 33, 1 << 40, 1 << 24))  # (a fresh aligned region per new tensor)

    def new(shape, dtype):
        return Frame(next(addresses), shape, dtype)

    T, tmax, stream, part, out = 8, 16, None, "cin", None
    ids, pays = new((T, 8), "int32"), [new((T,) + tuple(s.shape), s.dtype) for s in specs]
    staged, undo = new((EP, tmax, H), "bfloat16"), []
    for _ in range(steps):
        u, pick, k = rng.random(), int(rng.integers(1 << 30)), int(rng.integers(1, 4))
        live = [ids, *pays, staged] + ([out] if out is not None else [])
        if u < 0.08:
            live[pick % len(live)].ptr += 4096 * k        # moved in place (set_, .data =)
        elif u < 0.12:
            T = min(tmax, max(0, T + k - 2))              # resized in place, all of a step's tensors
            for t in [ids, *pays] + ([out] if out is not None else []):
                t.shape = (T,) + t.shape[1:]
        elif u < 0.14:
            undo.append(lambda t=ids, shape=ids.shape: setattr(t, "shape", shape))
            ids.shape = (max(0, T - k),) + ids.shape[1:]  # the ids alone, this step: the full path refuses
        elif u < 0.17:
            t = live[pick % len(live)]
            if type(t) is Frame:
                t.requires_grad = True                    # refused by the export while set (this step)
                undo.append(lambda t=t: setattr(t, "requires_grad", False))
        elif u < 0.22:
            Frame.current[0] = [7, 9, 11][k - 1]           # the caller switched its current stream
        elif u < 0.25:
            stream = [None, 9, 7][k - 1]
        elif u < 0.28:
            tmax = int(rng.integers(max(T, 1), TMAX + 1))
            staged = new((EP, tmax, H), "bfloat16")
        elif u < 0.31:
            ids, pays = new(ids.shape, "int32"), [new(p.shape, p.dtype) for p in pays]  # new objects, same geometry
        elif u < 0.34:
            part = ["cin", "staged"][k % 2]
        elif u < 0.37:
            out = [None, new((T, H), "bfloat16"), None][k - 1]
        elif u < 0.39:
            r.validate_expert_ids = not r.validate_expert_ids
        elif u < 0.41:
            ids = Tensor(next(addresses), ids.shape, "int32", device=(2, 0)) if type(ids) is Frame else \
                new(ids.shape, "int32")                   # an ep_a2a Tensor beside framework payloads, and back
        # (else: the same call again; a write into the values changes nothing the call reads)
        try:
            step(r, ids, pays, tmax, stream, staged if part == "staged" else None, out, rec)
        finally:
            while undo:
                undo.pop()()
    return _collapsed(rec), hits[0]


def step(r, ids, pays, tmax, stream, staged, out, rec):
    """One dispatch and combine (staged: the partial, else the workspace's), recorded with
    their results or errors; a refused combine is followed by one from the workspace."""
    try:
        views = r.dispatch(ids, pays, tmax, stream=stream)
        rec.append(("views", views[0].ptr, views[0].shape, views[1][0].ptr))
    except (TypeError, ValueError, BufferError) as e:
        rec.append(("error", type(e).__name__, str(e)))
        return
    for partial, out in ((r.combine_input(tmax) if staged is None else staged, out), (r.combine_input(tmax), None)):
        try:
            y = r.combine(partial, tmax, stream=stream, out=out)
            rec.append(("out", y.ptr, y.shape, y.stream))
            return
        except (TypeError, ValueError, BufferError) as e:
            rec.append(("error", type(e).__name__, str(e)))


@pytest.mark.parametrize("seed", [0, 1, None], ids=["0", "1", "fresh"])
def test_framework_repeats_launch_exactly_what_the_full_path_launches(seed, recorder, monkeypatch):
    seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
    full, none = _run(seed, False, recorder, monkeypatch, 800)
    fast, hits = _run(seed, True, recorder, monkeypatch, 800)
    assert none == 0 and hits > 400, (seed, hits)  # (the fast path ran, and often)
    assert sum(x[0] == "wait" for x in full) > 10 and sum(x[0] == "error" for x in full) > 10
    assert sum(x[0] == "ids" for x in full) > 10
    assert len(full) == len(fast), seed
    bad = [i for i, (x, y) in enumerate(zip(full, fast)) if x != y]
    assert not bad, f"seed={seed}: {len(bad)} of {len(full)} records differ, first {full[bad[0]]} vs {fast[bad[0]]} at {bad[0]}"


def test_a_repeat_reads_the_current_stream_at_every_call(recorder, monkeypatch):
    """The producer is read at each repeat, not recorded: a caller that switches its current
    stream between two identical calls gets the wait the full path would make, and none once
    the current stream is the call's."""
    monkeypatch.setattr(A, "is_capturing", lambda handle: False)
    a2a, r, specs = _rank()
    a2a.protocol = "fence"
    Frame.log, Frame.current[0] = recorder, 7  # (the rank's stream: 7)
    ids = Frame(1 << 33, (4, 8), "int32")
    pays = [Frame((1 << 34) + (1 << 30) * q, (4,) + tuple(s.shape), s.dtype) for q, s in enumerate(specs)]
    for _ in range(8):
        r.dispatch(ids, pays, 16)
        r.combine(r.combine_input(16), 16)
    assert r.last_repeats[0] is not None and r.last_repeats[0].readers is not None
    for current, waits in ((9, [("wait", 7, 9)]), (7, []), (11, [("wait", 7, 11)])):
        Frame.current[0] = current
        recorder.clear()
        r.dispatch(ids, pays, 16)
        assert [x for x in recorder if x[0] == "wait"] == waits
        assert [x[0] for x in recorder] == [x[0] for x in waits] + ["launch"]  # (a repeat: no checks, one launch)
        r.combine(r.combine_input(16), 16)


def test_records_hold_framework_tensors_weakly():
    """A record keeps no framework tensor alive; a dropped one never matches; types without a
    reader (or without weak references) are not recorded."""
    t = Frame(1 << 40, (4, H), "bfloat16")
    rep = fastpath.Repeat.of(None, 4, [t, None], 0, None, None)
    assert rep is not None and rep.matches(t, (None,), 4, None) and rep.first.ptr == t.ptr
    t.ptr += 64
    assert not rep.matches(t, (None,), 4, None)
    t.ptr -= 64
    assert not rep.matches(Frame(1 << 40, (4, H), "bfloat16"), (None,), 4, None)  # the same geometry, another object
    del t
    gc.collect()
    assert not rep.matches(None, (None,), 4, None)
    assert fastpath.Repeat.of(None, 4, [types.SimpleNamespace(), None], 0, None, None) is None
    assert fastpath.Repeat.of(None, 4, [np.zeros((4, H)), None], 0, None, None) is None


# -- real torch tensors (CPU): the geometry read ---------------------------------------------
def test_torch_geometry_sees_every_move_and_no_write():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    t = torch.tensor(rng.standard_normal((6, 8)), dtype=torch.float32)
    g = torch_tensor.geometry(t)
    for write in (lambda: t.add_(1), lambda: t.copy_(torch.randn(6, 8)), lambda: t.fill_(3.0),
                  lambda: t.__setitem__(0, 5.0), lambda: t.mul_(torch.randn(8))):
        write()
        assert torch_tensor.geometry(t) == g  # (the values changed: the launch does not depend on them)
    for move in (lambda: t.resize_(8, 8), lambda: t.set_(torch.randn(6, 8)), lambda: t.as_strided_((6, 4), (8, 1)),
                 lambda: t.t_(), lambda: t.unsqueeze_(0), lambda: t.requires_grad_(True),
                 lambda: setattr(t, "data", torch.randn(6, 8)), lambda: t.resize_(0)):
        before = torch_tensor.geometry(t)
        move()
        assert torch_tensor.geometry(t) != before, "a change the full path would see"
        t = t.detach().requires_grad_(False) if t.requires_grad else t


def test_the_torch_reader_takes_exactly_torch_tensors_and_records_match_them():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 8, dtype=torch.int32)
    assert readers.reader_of(t) is not None and readers.reader_of(t).geometry is torch_tensor.geometry
    assert readers.reader_of(torch.nn.Parameter(torch.zeros(2))) is None  # (a subclass may export otherwise)
    assert readers.reader_of(np.zeros(2)) is None
    rep = fastpath.Repeat.of(None, 4, [t, None], 0, None, None)
    assert rep is not None and rep.readers is not None and rep.first.shape == (4, 8) and rep.first.dtype.name == "int32"
    t.random_(0, 100)
    assert rep.matches(t, (None,), 4, None)
    assert not rep.matches(t[:], (None,), 4, None)  # another object over the same memory
    assert not rep.matches(t, (None,), 5, None) and not rep.matches(t, (None,), 4, 9)
    t.resize_(5, 8)
    assert not rep.matches(t, (None,), 4, None)
    t.resize_(4, 8)  # (back to the same geometry: the memory it describes is the tensor's now)
    assert rep.matches(t, (None,), 4, None) == (torch_tensor.geometry(t) == rep.geometry[0])
    del t
    gc.collect()
    assert not rep.matches(None, (None,), 4, None)


def test_the_cupy_reads_take_byte_strides_and_the_legacy_stream_as_cupy_does(monkeypatch):
    """interop/cupy_array.py on an object with CuPy's attributes (no cupy here): the geometry
    is its fields, the standing Tensor counts strides in elements, and CuPy's current stream
    0 is read as the legacy stream (its DLPack export compares that)."""
    import sys
    from ep_a2a.interop import cupy_array
    a = types.SimpleNamespace(data=types.SimpleNamespace(ptr=1 << 36, device_id=0), shape=(4, 6), strides=(48, 8),
                              dtype=np.dtype(np.float32))
    assert cupy_array.geometry(a) == (1 << 36, (4, 6), (48, 8), np.dtype(np.float32), 0)
    t = cupy_array.standing_tensor(a)
    assert (t.ptr, t.shape, t.strides, t.dtype.name, t.device) == (1 << 36, (4, 6), (12, 2), "float32", (2, 0))
    current = types.SimpleNamespace(ptr=0)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: current))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert cupy_array.current_stream(0) == 1
    current.ptr = 0x5000
    assert cupy_array.current_stream(0) == 0x5000
