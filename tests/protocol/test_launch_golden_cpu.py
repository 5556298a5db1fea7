"""The host side launches exactly what 05ee552 launched: the kernel, cluster shape, grid,
stream and parameter-block bytes of every launch, and every copy, memset and returned view,
over a sweep of protocols (fence, sentinel, auto), T^ and T, FP8 combine, PDL, ranks per GPU,
repeated calls (the fast path), staged partials, outs, streams, dispatch-only steps,
active-rank changes and a rejected step (launch_trace.py records it; the golden file holds
05ee552's trace as 05ee552 recorded it, its parameter blocks hashed over 05ee552's 1,168
bytes; the four host decisions A2AParams gained after it, appended, are checked below
against the rules 05ee552's kernels applied: push_groups, ids_per_round, dispatch_cluster,
combine_push_blocks)."""
import json
import random

import launch_trace
import pytest
from launch_trace import GOLDEN, trace
from ep_a2a.layout import A2AParams, PRELOAD_GROUPS
from ep_a2a.interop.tensor import Tensor
from ep_a2a.testing import hooks


def test_every_launch_matches_05ee552_byte_for_byte(monkeypatch):
    want = json.loads(GOLDEN.read_text())
    got = trace(monkeypatch.setattr)
    assert sum(e[0] == "launch" for e in got) > 3000
    bad = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)
    where = None if bad is None else next(e for e in reversed(want[:bad + 1]) if e[0] == "config")
    assert bad is None and len(got) == len(want), \
        f"event {bad} differs (in {where}): 05ee552 {want[bad] if bad is not None else len(want)}, now {got[bad] if bad is not None else len(got)}"


def _recording(seen):
    """launch_trace's recorder, also keeping every protocol launch as (kernel, cluster, grid,
    its parameter block as launched) in `seen`."""
    record = launch_trace._recorder

    def recorder(events):
        inner = record(events)

        def call(launch, stream):
            inner(launch, stream)
            if isinstance(launch.args[0], A2AParams):
                seen.append((str(launch.function), events[-1][2], launch.grid,
                             A2AParams.from_buffer_copy(bytes(launch.args[0]))))
        return call
    return recorder


def _blocks(monkeypatch):
    """Every protocol launch of the golden sweep and of random halves."""
    seen = []
    recorder = _recording(seen)
    monkeypatch.setattr(launch_trace, "_recorder", recorder)
    trace(monkeypatch.setattr)
    events, rng = [], random.Random()
    with hooks.dry_run(recorder(events)):
        for protocol, quant in (("fence", None), ("fence", "fp8"), ("sentinel", None)):
            for _ in range(6):
                tmax = rng.choice((1, 4, 16, 128, 1024))
                T = rng.randint(0, tmax)
                ids, pays = launch_trace._tensors(rng.randrange(4), T, rng.choice((0, 0, 4)))
                _, r = launch_trace.make_rank(events, protocol, quant, True, rng.choice((8, 1)), local=True)
                r.dispatch_send(ids, pays, tmax).receive()
                r.combine_send(r.combine_input(tmax), tmax).receive()
    return seen


def _check_derived(seen) -> set:
    """Asserts that every launch's host-decided fields equal what the kernels of 05ee552
    computed for themselves from the same launch (their old code, restated here as the
    oracle); returns the kinds of launch seen."""
    kinds = set()
    for name, cluster, grid, p in seen:
        payloads = p.payloads[:p.num_payloads]
        groups = sum(d.bytes_per_token // 16 for d in payloads)
        preload = groups if all(d.vec == 16 for d in payloads) and groups <= PRELOAD_GROUPS * 256 else 0
        assert p.ids_per_round == 32 // p.top_k * p.top_k
        if name.startswith("fence_dispatch"):
            kinds.add((name, p.dispatch_cluster, bool(p.push_groups)))
            assert p.push_groups == preload or p.local_num_tokens == 0, (name, p.push_groups, preload)
            # the kernels split only tokens that preload (05ee552: S = preload && splits > 1 ? splits : 1)
            assert p.dispatch_splits == 1 or p.push_groups, (name, p.dispatch_splits)
            assert p.dispatch_cluster == int(grid > 1 and cluster == grid), (name, grid, cluster)
        if name.startswith("sentinel_combine") and "_recv_" not in name:
            slots = p.ep_size * p.runtime_max_tokens_per_rank
            spare = grid - 1 - p.local_num_tokens * p.combine_splits
            old = max(1, grid - 1) if "_send_" in name else (spare if spare >= slots else grid)
            kinds.add((name, p.combine_push_blocks < grid))
            assert p.combine_push_blocks == old, (name, grid, p.combine_push_blocks, old)
    return kinds


def test_the_kernels_get_what_they_derived_before(monkeypatch):
    """The fields that carry the host's decisions hold what the kernels of 05ee552 computed for
    themselves from the same launch."""
    kinds = _check_derived(_blocks(monkeypatch))
    assert {("fence_dispatch", 1, True), ("fence_dispatch", 0, False), ("fence_dispatch_send", 0, True),
            ("sentinel_combine_bf16", True), ("sentinel_combine_bf16", False),
            ("sentinel_combine_send_bf16", True)} <= kinds, kinds


def test_the_fields_at_three_ranks_and_top_k_22(monkeypatch):
    """As above, for 3 ranks, top_k 22 and hidden 128 (tests/moe/test_moe_gpu.py's 3-22-128
    case): 88-byte ids and weights (no 16-byte groups), T = T^ = 128 on grids smaller than T
    (8 ranks to a GPU) or not, a rank with no tokens, halves and a rejected step."""
    for name, value in (("EP", 3), ("TOP_K", 22), ("H", 128), ("MAX_TOKENS", 128)):
        monkeypatch.setattr(launch_trace, name, value)
    seen, events, rng = [], [], random.Random()
    launch_trace.patch_driver(monkeypatch.setattr, events)
    with hooks.dry_run(_recording(seen)(events)):
        for protocol in ("fence", "sentinel"):
            for ranks_on_device in (3, 8):
                _, r = launch_trace.make_rank(events, protocol, None, True, ranks_on_device, local=True)
                for T in (128, 0, rng.randint(1, 127), 128):
                    ids, pays = launch_trace._tensors(rng.randrange(4), T)
                    r.dispatch(ids, pays, 128)
                    r.combine(r.combine_input(128), 128)
                    r.dispatch_send(ids, pays, 128).receive()
                    r.combine_send(r.combine_input(128), 128).receive()
            _, r = launch_trace.make_rank(events, protocol, None, True, 3, local=False)
            ids, pays = launch_trace._tensors(0, 4)
            r.dispatch(ids, pays, 128)
            r.combine(r.combine_input(128), 128)
            bad = [Tensor(p.ptr, p.shape, "float16", device=(2, 0)) for p in pays]
            with pytest.raises(TypeError):
                r.dispatch(ids, bad, 128)  # rejected: the step runs without tokens
    kinds = _check_derived(seen)
    assert any(p.top_k == 22 and p.payloads[0].vec == 8 and p.local_num_tokens == 128 and grid < 128
               for name, _, grid, p in seen if name == "fence_dispatch"), "no grid smaller than T"
    assert {("fence_dispatch", 0, False), ("fence_dispatch_send", 0, False), ("sentinel_combine_bf16", False),
            ("sentinel_combine_send_bf16", True)} <= kinds, kinds  # (384 slots: pushers never apart)
