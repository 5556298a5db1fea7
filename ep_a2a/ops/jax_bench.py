"""Host time of a jitted all-to-all call: `python -m ep_a2a.ops.jax_bench` (docs/jax.md).

One jitted step is dispatch + combine of every in-process rank of GPU 0 (one call each, the
single controller), the combine's output fed back as the next step's hidden states. Per token
count and path (native: the FFI handler, python: the buffer_callback fallback) it times:

  wall     one call of the step, then block_until_ready (median over --iters)
  device   per step of a program of K+1 chained steps minus a program of 1, over K: the
           step's GPU time (the handler of step i+1 is issued while step i runs, so the host
           hides behind the GPU as long as it is the faster)
  host     wall - device: what one jitted call costs beyond its GPU work (JAX's dispatch,
           XLA's thunks, our handler or callback, the final synchronization)
  jax      wall of a jitted call of one elementwise op per rank on the same arrays: JAX's
           own dispatch and synchronization, which host includes and no handler can remove
  issue    the time until the call returns, before blocking (JAX dispatches asynchronously):
           the host thread's own cost, without the wait for the GPU; jax_issue likewise for
           the elementwise call
  handler runs per call  how often our FFI handler ran per timed call (1: on every call;
           under command buffers, 0 once XLA has recorded it, re-recording shows as more)

    python -m ep_a2a.ops.jax_bench --tokens 1 16 128 --ranks 8 --out bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (before jax: room for the workspaces)


def _chain(ops, tmax: int, steps: int):
    import jax

    def run(ids, xs, ws):
        for _ in range(steps):
            d = ops.dispatch(ids, [[x, w] for x, w in zip(xs, ws)], tmax)
            xs = ops.combine([p[0] for p in d.payloads], d)
        return xs
    return jax.jit(run)


def _trivial():
    """The same arguments as _chain's step, one elementwise op per rank's hidden states: a
    jitted call whose host cost is JAX's alone."""
    import jax
    import jax.numpy as jnp

    def run(ids, xs, ws):
        return [(x.astype(jnp.float32) * 1.0001).astype(x.dtype) for x in xs]
    return jax.jit(run)


def _median_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def issue_us(fn, iters: int, warmup: int = 0) -> float:
    """Median time until a call of fn returns (JAX dispatches asynchronously: the host thread's
    own cost of the call), each call's results waited for before the next call; the first
    `warmup` calls untimed."""
    import jax
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        out = fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return statistics.median(times) * 1e6


def measure(a2a, path: str, T: int, hidden: int, iters: int, chain: int, rng) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from . import jax_ffi
    from .jax import JaxAlltoAll
    os.environ["EP_A2A_JAX_NATIVE"] = "1" if path == "native" else "0"
    n, E, K = len(a2a.ranks), a2a.num_experts, a2a.top_k
    dev = jax.devices("gpu")[0]
    put = lambda a: jax.device_put(jnp.asarray(a), dev)  # noqa: E731
    ids = [put(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)) for _ in range(n)]
    xs = [put(rng.standard_normal((T, hidden)).astype(np.float32) / 64).astype(jnp.bfloat16) for _ in range(n)]
    ws = [put(rng.random((T, K)).astype(np.float32) / K) for _ in range(n)]
    with JaxAlltoAll(a2a) as ops:
        if (path == "native") != ops.native:
            return {"tokens": T, "path": path, "skipped": jax_ffi.why()}
        one, many = _chain(ops, T, 1), _chain(ops, T, chain + 1)
        for f in (one, many):
            for _ in range(3):
                jax.block_until_ready(f(ids, xs, ws))
        runs, updates = ops.native_calls(), ops.native_calls(updates=True)
        wall = _median_us(lambda: jax.block_until_ready(one(ids, xs, ws)), iters)
        runs, updates = (ops.native_calls() - runs) / iters, (ops.native_calls(updates=True) - updates) / iters
        issue = issue_us(lambda: one(ids, xs, ws), iters)
        wall_many = _median_us(lambda: jax.block_until_ready(many(ids, xs, ws)), iters)
        t0 = time.perf_counter()
        for _ in range(iters):
            out = one(ids, xs, ws)
        jax.block_until_ready(out)
        pipelined = (time.perf_counter() - t0) / iters * 1e6
        trivial = _trivial()
        for _ in range(3):
            jax.block_until_ready(trivial(ids, xs, ws))
        jax_us = _median_us(lambda: jax.block_until_ready(trivial(ids, xs, ws)), iters)
        jax_issue = issue_us(lambda: trivial(ids, xs, ws), iters)
    device = (wall_many - wall) / chain
    return {"tokens": T, "path": path, "ranks": n, "wall_us": wall, "pipelined_us": pipelined,
            "device_us": device, "host_us": wall - device, "host_us_per_rank": (wall - device) / n,
            "jax_us": jax_us, "host_beyond_jax_us_per_rank": (wall - device - jax_us) / n,
            "issue_us": issue, "jax_issue_us": jax_issue, "issue_beyond_jax_us_per_rank": (issue - jax_issue) / n,
            "handler_runs_per_call": runs, "node_updates_per_call": updates}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.ops.jax_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8, help="in-process ranks on GPU 0 (default 8)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128], help="tokens per rank = T^ (default 1 16 128)")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size, bf16 (default 7168)")
    ap.add_argument("--experts", type=int, default=256, help="number of experts (default 256)")
    ap.add_argument("--top-k", dest="top_k", type=int, default=8, help="experts per token (default 8)")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per measurement (default 50)")
    ap.add_argument("--chain", type=int, default=8, help="extra chained steps of the device-time program (default 8)")
    ap.add_argument("--paths", nargs="+", default=["native", "python"], choices=("native", "python"))
    ap.add_argument("--out", help="write the results as JSON here")
    return ap.parse_args(argv)


def table(rows) -> list:
    """The summary table's lines, a row per token count and path."""
    lines = [f"{'T':>5} {'path':>7} {'wall':>9} {'pipelined':>10} {'device':>9} {'host':>9} {'host/rank':>10} "
             f"{'jax':>7} {'beyond jax/rank':>16} {'issue':>7} {'jax issue':>10} {'runs/call':>10} {'updates/call':>13}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['tokens']:>5} {r['path']:>7}  skipped: {r['skipped']}")
            continue
        lines.append(f"{r['tokens']:>5} {r['path']:>7} {r['wall_us']:>9.1f} {r['pipelined_us']:>10.1f} "
                     f"{r['device_us']:>9.1f} {r['host_us']:>9.1f} {r['host_us_per_rank']:>10.2f} {r['jax_us']:>7.1f} "
                     f"{r['host_beyond_jax_us_per_rank']:>16.2f} {r['issue_us']:>7.1f} {r['jax_issue_us']:>10.1f} "
                     f"{r['handler_runs_per_call']:>10.2f} {r.get('node_updates_per_call', 0):>13.2f}")
    return lines


def main(argv=None) -> int:
    import numpy as np

    import ep_a2a
    from ep_a2a.config import PayloadSpec
    args = parse_args(argv)
    rng = np.random.default_rng()
    rows = []
    with ep_a2a.LocalGroup([0] * args.ranks) as group, \
            ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max(args.tokens), top_k=args.top_k, num_experts=args.experts,
                               payloads=[PayloadSpec("hidden", (args.hidden,), "bfloat16"),
                                         PayloadSpec("weights", (args.top_k,), "float32")],
                               combine_hidden_size=args.hidden, timeout_s=20.0) as a2a:
        for T in args.tokens:
            for path in args.paths:
                rows.append(measure(a2a, path, T, args.hidden, args.iters, args.chain, rng))
                print(json.dumps(rows[-1]), flush=True)
        name = group.ranks[0].device.name
    from ..tools.bench_report import commit as measured_commit
    from .jax_ffi import handler_settings
    commit = measured_commit()  # ($EP_A2A_COMMIT on a machine whose tree copy has no .git)
    import jax
    result = {"device": name, "date": time.strftime("%Y-%m-%d"), "commit": commit, "jax": jax.__version__,
              "ranks": args.ranks, "hidden": args.hidden, "top_k": args.top_k, "experts": args.experts,
              "command_buffers": os.environ.get("XLA_FLAGS", ""), "handler": handler_settings(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{name}, {args.ranks} in-process ranks, hidden {args.hidden}, top_k {args.top_k}; us per jitted "
          f"dispatch+combine call of every rank")
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
