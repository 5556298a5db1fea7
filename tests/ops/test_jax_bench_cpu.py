"""The JAX host-time benchmark's pieces without a GPU: the trivial jitted call that measures
JAX's own cost per call, and the summary table."""
import numpy as np
import pytest

from common import fresh_rng


def test_the_trivial_call_does_one_elementwise_op_per_rank():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from ep_a2a.ops import jax_bench
    rng, seed = fresh_rng()
    n = int(rng.integers(1, 5))
    xs = [jnp.asarray(rng.standard_normal((3, 8)).astype(np.float32)).astype(jnp.bfloat16) for _ in range(n)]
    ids = [jnp.zeros((3, 2), jnp.int32)] * n
    ws = [jnp.ones((3, 2), jnp.float32)] * n
    out = jax.block_until_ready(jax_bench._trivial()(ids, xs, ws))
    assert len(out) == n, seed
    for x, y in zip(xs, out):
        want = (np.asarray(x, np.float32) * np.float32(1.0001)).astype(jnp.bfloat16)
        assert y.dtype == x.dtype and np.array_equal(np.asarray(y), np.asarray(want)), seed


def test_the_table_shows_the_host_time_beyond_jax():
    from ep_a2a.ops import jax_bench
    row = dict(tokens=16, path="native", ranks=8, wall_us=300.0, pipelined_us=250.0, device_us=60.0,
               host_us=240.0, host_us_per_rank=30.0, jax_us=80.0, host_beyond_jax_us_per_rank=20.0,
               issue_us=70.0, jax_issue_us=45.0, issue_beyond_jax_us_per_rank=3.125, handler_runs_per_call=0.5,
               node_updates_per_call=2.25)
    lines = jax_bench.table([row, {"tokens": 1, "path": "python", "skipped": "no library"}])
    assert "beyond jax/rank" in lines[0] and "runs/call" in lines[0] and "updates/call" in lines[0] and len(lines) == 3
    assert lines[1].split()[-6:] == ["80.0", "20.00", "70.0", "45.0", "0.50", "2.25"] and "skipped: no library" in lines[2]
