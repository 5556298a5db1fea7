"""Construction and close of the all-to-all under hostile arguments (property-based,
hypothesis), use after close, and misaligned inputs, on in-process ranks of one GPU; the
call-level hostile input is in test_hostile_input_gpu.py."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
GPU_SETTINGS = settings(max_examples=60, deadline=None, database=None, print_blob=True,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                               HealthCheck.filter_too_much])


# ------------------------------------------------------------------------ construction and close

@GPU_SETTINGS
@given(data=st.data())
def test_hostile_constructor_arguments(data):
    import ep_a2a
    from ep_a2a import PayloadSpec
    from ep_a2a.driver.vmm import live_counts
    good = dict(max_tokens_per_rank=8, top_k=2, num_experts=4, payloads=[PayloadSpec("x", (16,), "bfloat16")],
                combine_hidden_size=16)
    arg = data.draw(st.sampled_from(["max_tokens_per_rank", "top_k", "num_experts", "combine_hidden_size",
                                     "protocol", "combine_dtype", "payloads", "threads_per_block"]), label="argument")
    bad = {
        "max_tokens_per_rank": st.one_of(st.integers(-2 ** 40, 0), st.integers(2 ** 23, 2 ** 40)),
        "top_k": st.one_of(st.integers(-100, 0), st.integers(23, 10 ** 6)),
        "num_experts": st.integers(-2 ** 31, 0),
        "combine_hidden_size": st.integers(-2 ** 31, 0),
        "protocol": st.text(max_size=12).filter(lambda s: s not in ("fence", "sentinel", "auto")),
        "combine_dtype": st.sampled_from(["int32", "uint8", "float8_e4m3fn", "float64", "int64"]),
        "payloads": st.one_of(
            st.lists(st.just(PayloadSpec("x", (4,), "uint8")), min_size=9, max_size=12),
            st.just([PayloadSpec("x", (4,), "uint8"), PayloadSpec("x", (8,), "int32")])),  # (empty shapes: PayloadSpec refuses them)
        "threads_per_block": st.one_of(st.integers(-64, 95), st.integers(513, 4096),
                                       st.integers(3, 16).map(lambda n: 32 * n + 1)),
    }[arg]
    kw = dict(good, **{arg: data.draw(bad, label="value")})
    before = live_counts()
    with ep_a2a.LocalGroup([0, 0]) as group:
        with pytest.raises(ValueError, match=arg):
            ep_a2a.MoeAlltoAll(group, **kw)
    assert live_counts() == before, "a rejected construction left VMM objects behind"


def test_use_after_close_raises_state_error():
    import ep_a2a
    from ep_a2a import StateError
    from ep_a2a.testing.formats import payload_formats
    from ep_a2a.testing.harness import run_step
    from ep_a2a.interop.arrays import from_numpy
    rng = np.random.default_rng()
    group = ep_a2a.LocalGroup([0, 0])
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=8, top_k=2, num_experts=4,
                             payloads=payload_formats(16, 2)["bf16"], combine_hidden_size=16)
    ranks = list(a2a.ranks)
    assert not run_step(a2a, rng, [3, 8], 8).mismatches
    a2a.close()
    a2a.close()  # idempotent
    dev = group.ranks[0].device
    ids = from_numpy(np.zeros((1, 2), np.int32), dev, "int32")
    pay = [from_numpy(np.zeros((1, 16), np.uint16), dev, "bfloat16"), from_numpy(np.zeros((1, 2), np.float32), dev)]
    for r in ranks:
        with pytest.raises(StateError, match="closed"):
            r.dispatch(ids, pay, 8)
        with pytest.raises(StateError, match="closed"):
            r.combine(from_numpy(np.zeros((16, 16), np.uint16), dev, "bfloat16"), 8)
    with pytest.raises(StateError):
        a2a.dispatch(ids, pay, 8)
    with pytest.raises(StateError):
        a2a.combine(None, 8)
    group.close()


def test_combine_input_after_close_raises_state_error():
    """combine_input hands out a view into the workspace: after close() that memory is gone."""
    import ep_a2a
    from ep_a2a import StateError
    from ep_a2a.testing.formats import payload_formats
    group = ep_a2a.LocalGroup([0, 0])
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=8, top_k=2, num_experts=4,
                             payloads=payload_formats(16, 2)["bf16"], combine_hidden_size=16)
    r = a2a.ranks[0]
    a2a.close()
    try:
        with pytest.raises(StateError, match="closed"):
            r.combine_input(8)
    finally:
        group.close()


# ------------------------------------------------------------------------ misalignment (child process)

def test_misaligned_inputs_rejected_or_delivered_exactly():
    """Tensors whose data pointer is not aligned to their element size (DLPack byte offsets can
    produce them): either a ValueError before launch, or results equal to the reference, never a
    fault. Run in a child process: a misaligned access traps and loses the CUDA context."""
    seed = int(np.random.default_rng().integers(2 ** 31))
    code = f"""
        import numpy as np, ep_a2a
        from ep_a2a.testing.formats import payload_formats
        from ep_a2a.testing.harness import run_step
        from ep_a2a.interop.arrays import copy_from_numpy, empty
        from ep_a2a.interop.tensor import Tensor
        keep = []
        def upload(array, device, dtype):
            a = np.ascontiguousarray(array)
            raw = empty((a.nbytes + 64,), "uint8", device)
            keep.append(raw)
            off = 1 if a.itemsize > 1 else 3  # odd: misaligned for every multi-byte element type
            t = Tensor(raw.ptr + off, a.shape, dtype, device=(2, device.ordinal), owner=raw)
            copy_from_numpy(t, a)
            return t
        g = ep_a2a.LocalGroup([0, 0, 0])
        for proto in ("fence", "sentinel"):
            a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=8, top_k=3, num_experts=6, payloads=payload_formats(24, 3)["bf16"],
                                   combine_hidden_size=24, protocol=proto, timeout_s=5, first_timeout_s=5)
            try:
                rep = run_step(a, np.random.default_rng({seed}), [5, 8, 1], 8, upload=upload)
                print("RESULT", proto, "mismatches" if rep.mismatches else "exact", rep.mismatches[:2])
            except ValueError as e:
                print("RESULT", proto, "rejected", e)
            a.close()
        """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert r.returncode == 0 and len(lines) == 2, f"seed {seed}: rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    for ln in lines:
        assert ln[2] in ("exact", "rejected"), f"seed {seed}: {ln}"
