"""FENCE dispatch/combine on one GPU with in-process ranks, checked against the reference."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ep_a2a.testing import hooks

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def make(ep, *, fmt="bf16", hidden=256, top_k=8, num_experts=None, max_tokens=128, cdtype="bfloat16", **kw):
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    group = ep_a2a.LocalGroup([0] * ep)
    a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=max_tokens, top_k=top_k,
                             num_experts=num_experts or max(ep * 4, top_k),
                             payloads=payload_formats(hidden, top_k)[fmt], combine_hidden_size=hidden,
                             combine_dtype=cdtype, timeout_s=20.0, **kw)
    return group, a2a


def run(a2a, rng, tokens, tmax, **kw):
    from ep_a2a.testing.harness import run_step
    rep = run_step(a2a, rng, tokens, tmax, **kw)
    assert not rep.mismatches, rep.mismatches[:5]
    if kw.get("verify", True):
        assert rep.combine_rows_checked == sum(tokens)
    return rep


@pytest.mark.parametrize("ep", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
def test_sizes_and_top_k(ep, top_k):
    rng = np.random.default_rng()
    group, a2a = make(ep, top_k=top_k)
    with group, a2a:
        for T in (0, 1, 7, 128):
            run(a2a, rng, [T] * ep, max(T, 1))
        run(a2a, rng, list(rng.integers(0, 100, ep)), 100)  # unequal token counts


@pytest.mark.parametrize("top_k", [16, 22])
@pytest.mark.parametrize("route", ["uniform", "zipf", "perfect"])
def test_large_top_k_and_routing(top_k, route):
    rng = np.random.default_rng()
    group, a2a = make(8, top_k=top_k, num_experts=64)
    with group, a2a:
        for _ in range(3):
            run(a2a, rng, list(rng.integers(1, 129, 8)), 128, route=route, invalid_fraction=0.1)


@pytest.mark.parametrize("ep,top_k,scope", [(2, 4, "auto"), (4, 8, "auto"), (8, 8, "auto"), (8, 8, "sys"),
                                             (8, 16, "auto"), (16, 4, "auto"), (5, 6, "auto")])
@pytest.mark.parametrize("route", ["uniform", "zipf", "perfect"])
def test_split_pushes(ep, top_k, scope, route, monkeypatch):
    """At small batches FENCE spreads each token's pushes over several blocks
    (schedule.dispatch_splits), every block taking the slots the counters would have given
    in token order. Splitting forced down to one 16-byte group per block, so that these small
    tokens split too: bitwise as the reference with invalid ids, repeated targets (zipf, large
    top_k), T < T^ and 0-token ranks, and then with an inactive rank, whose selections are
    counted once per token. 1 token at T^ = 1 runs as one cluster of 8 blocks (the cluster
    barrier), the others elect the last block. The host splits only tokens whose earlier ids
    fit one warp-wide load; lifted here, so that 16 and 40 tokens read them in several rounds.
    top_k 6 (24-byte ids: no 16-byte groups) never splits. "sys": the flags at system scope,
    as between GPUs ($EP_A2A_PEER_SCOPE; "auto" is gpu scope for ranks sharing a GPU)."""
    from ep_a2a import schedule
    from ep_a2a.testing.reference import dropped_selections
    monkeypatch.setattr(schedule, "MIN_SPLIT_GROUPS", 1)
    monkeypatch.setattr(schedule, "MAX_DISPATCH_SPLITS", 64)
    monkeypatch.setattr(schedule, "ids_per_load", lambda top_k: 1 << 30)
    monkeypatch.setenv("EP_A2A_PEER_SCOPE", scope)
    rng = np.random.default_rng()
    group, a2a = make(ep, top_k=top_k, max_tokens=40)
    splits = set()
    with group, a2a:
        assert {r.params.peers_on_device for r in a2a.ranks} == {int(scope == "auto")}
        for T in (1, 2, 5, 16, 40):
            tokens = [T] * ep if T < 40 else list(rng.integers(0, 41, ep))
            tokens[-1] = min(tokens[-1], T - 1)
            run(a2a, rng, tokens, T, route=route, invalid_fraction=0.1)
            splits |= {r.params.dispatch_splits for r in a2a.ranks if tokens[r.rank]}
            if T == 1:  # the grids that were one cluster (8 blocks), or 0
                clustered = {r.schedule.dispatch_cluster(1, 1, r.params.dispatch_splits, hooks.last_grids(r)[0])
                             for r in a2a.ranks if tokens[r.rank]}
        assert (max(splits) > 1) == (top_k != 6), splits
        assert all(r.plan.cluster is not None for r in a2a.ranks)  # (sm_90: clusters_fit holds for up to 16 ranks)
        assert clustered == ({8} if top_k != 6 else {0}), clustered
        before = [r.dropped_selections() for r in a2a.ranks[:-1]]
        a2a.set_active_ranks(list(range(ep - 1)))
        tokens = [3] * (ep - 1) + [0]
        rep = run(a2a, rng, tokens, 4, route=route, invalid_fraction=0.1)
        for r in a2a.ranks[:-1]:
            want = dropped_selections([rep.expert_ids[r.rank]], a2a.num_experts, ep, range(ep - 1))
            assert r.dropped_selections() - before[r.rank] == want, (r.rank, want)


@pytest.mark.parametrize("protocol,route", [("fence", "zipf"), ("sentinel", "perfect")])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4", "opaque"])
@pytest.mark.parametrize("hidden", [7168, 200, 7])  # 7 and 200: byte counts not multiples of 16
def test_payload_formats(fmt, hidden, protocol, route):
    rng = np.random.default_rng()
    group, a2a = make(4, fmt=fmt, hidden=hidden, top_k=6, max_tokens=64, protocol=protocol)
    with group, a2a:
        run(a2a, rng, [64, 3, 0, 17], 64, route=route)


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
@pytest.mark.parametrize("cdtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("zero_copy", [True, False])
def test_combine_dtypes_random_values(cdtype, zero_copy, protocol):
    # random normals: the reference sums in the kernels' order, so even these are bitwise
    rng = np.random.default_rng()
    group, a2a = make(8, cdtype=cdtype, hidden=520, protocol=protocol)
    with group, a2a:
        run(a2a, rng, [33] * 8, 40, exact=False, zero_copy=zero_copy)


def test_4096_tokens_per_rank():
    rng = np.random.default_rng()
    group, a2a = make(8, hidden=512, max_tokens=4096)
    with group, a2a:
        run(a2a, rng, [4096] * 8, 4096, route="perfect")
        run(a2a, rng, list(rng.integers(3000, 4097, 8)), 4096, route="uniform")


def test_1000_steps_changing_routing_and_runtime_max():
    rng = np.random.default_rng()
    group, a2a = make(4, hidden=64, max_tokens=32, top_k=4)
    with group, a2a:
        for step in range(1000):
            tmax = int(rng.integers(1, 33))
            tokens = list(rng.integers(0, tmax + 1, 4))
            run(a2a, rng, tokens, tmax, route=("uniform", "zipf", "perfect")[step % 3], verify=step % 10 == 0)


def identity_step(a2a, rng, tokens, T, graph_replays=0):
    """dispatch -> copy of the received hidden states into the combine input (an identity
    'MoE': results then do not depend on slot order) -> combine, on every in-process rank.
    Checks the eager result against the reference (each token's hidden state summed once per
    distinct target rank, in the kernels' order); with graph_replays, also captures the step
    as one graph over every rank's stream and checks that replays equal eager.
    Returns the eager outputs (host copies)."""
    from cuda.bindings import driver as d
    from ep_a2a.testing import reference as ref
    from ep_a2a.testing.formats import random_payload, routing
    from ep_a2a.interop.arrays import copy_from_numpy, empty, from_numpy, to_numpy
    from ep_a2a.driver.stream import Event, Graph
    ep, k, H = a2a.ep_size, a2a.top_k, a2a.combine_hidden_size
    group = a2a.group
    ids_h = [routing("uniform", rng, tokens[s], k, a2a.num_experts, ep) for s in range(ep)]
    pay_h = [[random_payload(rng, sp, tokens[s]) for sp in a2a.payload_specs] for s in range(ep)]
    devs = [r.device for r in group.ranks]
    ids = [from_numpy(ids_h[s], devs[s], "int32") for s in range(ep)]
    pays = [[from_numpy(x, devs[s], sp.dtype) for x, sp in zip(pay_h[s], a2a.payload_specs)] for s in range(ep)]
    outs = [empty((tokens[s], H), "bfloat16", devs[s]) for s in range(ep)]

    def step():
        views = [r.dispatch(ids[s], pays[s], T) for s, r in enumerate(a2a.ranks)]
        for s, r in enumerate(a2a.ranks):
            hidden = views[s][1][0]
            d.cuMemcpyDtoDAsync(r.combine_input(T).ptr, hidden.ptr, hidden.nbytes, r.default_stream)
        for s, r in enumerate(a2a.ranks):
            r.combine(r.combine_input(T), T, out=outs[s])

    step()
    a2a.synchronize()
    eager = [to_numpy(o) for o in outs]
    owner = ref.expert_owner(a2a.num_experts, ep)
    for s in range(ep):
        x = pay_h[s][0]
        want = np.zeros((tokens[s], H), np.uint16)
        for i in range(tokens[s]):
            n = len(ref.targets_of(ids_h[s][i], owner))
            want[i] = ref.from_float32(ref.tree_sum([ref.to_float32(x[i], "bfloat16")] * n, H), "bfloat16")
        assert np.array_equal(eager[s].view(np.uint16), want)
    if graph_replays:
        for o in outs:
            copy_from_numpy(o, np.full(o.nbytes, 0xFF, np.uint8))
        s0 = group.ranks[0].stream.handle
        Graph.begin(s0)
        fork = Event(devs[0]).record(s0)
        for r in group.ranks[1:]:
            fork.wait_on(r.stream.handle)
        step()
        for r in group.ranks[1:]:
            Event(devs[0]).record(r.stream.handle).wait_on(s0)
        g = Graph.end(s0)
        for _ in range(graph_replays):
            g.launch(s0)
        a2a.synchronize()
        for s in range(ep):
            assert np.array_equal(to_numpy(outs[s]).view(np.uint16), eager[s].view(np.uint16))
        g.close()
    return eager


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_graph_replay_equals_eager(protocol):
    group, a2a = make(4, hidden=256, top_k=4, max_tokens=16, validate_expert_ids=False, protocol=protocol)
    with group, a2a:
        identity_step(a2a, np.random.default_rng(), [16, 3, 0, 9], 16, graph_replays=5)


def _upload_at_end_of_mapping(keep):
    """An uploader that places each input so it ends exactly where its VMM mapping ends:
    a kernel reading past an input then normally faults (the VA after a reservation is
    usually unmapped) instead of silently reading a neighbour."""
    from ep_a2a.interop.arrays import copy_from_numpy
    from ep_a2a.interop.tensor import Tensor
    from ep_a2a.driver.vmm import DeviceBuffer

    def upload(array, device, dtype):
        a = np.ascontiguousarray(array)
        buf = DeviceBuffer(max(a.nbytes, 1), device)
        keep.append(buf)
        t = Tensor(buf.ptr + buf.size - a.nbytes, a.shape, dtype, device=(2, device.ordinal), owner=buf)
        copy_from_numpy(t, a)
        return t
    return upload


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_no_read_past_inputs_when_tokens_below_runtime_max(protocol):
    # ranks with fewer tokens than T^ (and none at all): no kernel may touch input rows past
    # local_num_tokens (SENTINEL once did, for the slots it only sends expert ids for)
    rng = np.random.default_rng()
    group, a2a = make(4, fmt="mxfp8", hidden=200, top_k=4, max_tokens=16, protocol=protocol)
    keep = []
    with group, a2a:
        run(a2a, rng, [5, 0, 16, 1], 16, upload=_upload_at_end_of_mapping(keep))
        a2a.synchronize()
    for b in keep:
        b.close()


def _run_child(code: str, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("protocol,phase", [("fence", "dispatch"), ("sentinel", "sentinel-dispatch")])
def test_timeout_names_missing_peer(protocol, phase):
    # a trap poisons the context: run it in a child process
    r = _run_child(f"""
        import numpy as np, ep_a2a
        from ep_a2a.testing.formats import payload_formats
        from ep_a2a.interop.arrays import from_numpy
        g = ep_a2a.LocalGroup([0, 0, 0])
        a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=4, top_k=2, num_experts=6, payloads=payload_formats(32, 2)["bf16"],
                               combine_hidden_size=32, timeout_s=0.5, first_timeout_s=0.5, protocol="{protocol}")
        ids = [from_numpy(np.array([[0, 5]], np.int32), g.ranks[s].device) for s in range(3)]
        x = [[from_numpy(np.ones((1, 32), np.uint16), g.ranks[s].device, "bfloat16"),
              from_numpy(np.ones((1, 2), np.float32), g.ranks[s].device)] for s in range(3)]
        a.ranks[0].dispatch(ids[0], x[0], 1)
        a.ranks[1].dispatch(ids[1], x[1], 1)   # rank 2 never arrives
        try:
            a.synchronize()
        except ep_a2a.PeerTimeoutError as e:
            print("CAUGHT", e.rank, e.phase, e.peer, e.epoch)
        """)
    assert "CAUGHT" in r.stdout, r.stdout + r.stderr
    rank, got_phase, peer, epoch = r.stdout.split("CAUGHT")[1].split()
    assert got_phase == phase and peer == "2" and epoch == "1" and rank in ("0", "1")


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_runtime_max_mismatch_detected(protocol):
    r = _run_child(f"""
        import numpy as np, ep_a2a
        from ep_a2a.testing.formats import payload_formats
        from ep_a2a.interop.arrays import from_numpy
        g = ep_a2a.LocalGroup([0, 0])
        a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=8, top_k=2, num_experts=4, payloads=payload_formats(32, 2)["bf16"],
                               combine_hidden_size=32, timeout_s=5, protocol="{protocol}")
        ids = [from_numpy(np.array([[0, 3]], np.int32), g.ranks[s].device) for s in range(2)]
        x = [[from_numpy(np.ones((1, 32), np.uint16), g.ranks[s].device, "bfloat16"),
              from_numpy(np.ones((1, 2), np.float32), g.ranks[s].device)] for s in range(2)]
        a.ranks[0].dispatch(ids[0], x[0], 4)
        a.ranks[1].dispatch(ids[1], x[1], 8)
        try:
            a.synchronize()
        except ep_a2a.RuntimeMaxMismatchError as e:
            print("CAUGHT", e)
        """)
    assert "CAUGHT" in r.stdout and "differs" in r.stdout, r.stdout + r.stderr


def test_bad_input_rejected_before_launch_and_workspace_intact():
    from ep_a2a.interop.arrays import from_numpy
    from ep_a2a.testing.formats import routing, random_payload
    rng = np.random.default_rng()
    group, a2a = make(2, hidden=64, top_k=2, max_tokens=8, num_experts=8)
    with group, a2a:
        run(a2a, rng, [5, 3], 8)
        r0, dev = a2a.ranks[0], group.ranks[0].device
        ok_ids = from_numpy(routing("uniform", rng, 4, 2, 8, 2), dev, "int32")
        ok_pay = [from_numpy(random_payload(rng, s, 4), dev, s.dtype) for s in a2a.payload_specs]
        bad = [
            (dict(token_selected_experts=from_numpy(np.zeros((4, 2), np.int64) + 1, dev)), TypeError, "int32"),
            (dict(token_selected_experts=from_numpy(np.ones((4, 3), np.int32), dev)), ValueError, "shape"),
            (dict(token_selected_experts=from_numpy(np.full((4, 2), 8, np.int32), dev)), ValueError, "num_experts"),
            (dict(token_selected_experts=from_numpy(np.full((4, 2), -2, np.int32), dev)), ValueError, "num_experts"),
            (dict(token_selected_experts=np.ones((4, 2), np.int32)), ValueError, "cuda:0"),
            (dict(runtime_max_tokens_per_rank=3), ValueError, "exceed"),
            (dict(runtime_max_tokens_per_rank=9), ValueError, "max_tokens_per_rank"),
            (dict(payloads=ok_pay[:1]), ValueError, "payloads"),
            (dict(payloads=[ok_pay[1], ok_pay[0]]), TypeError, "dtype"),
        ]
        for override, exc, words in bad:
            kw = dict(token_selected_experts=ok_ids, payloads=ok_pay, runtime_max_tokens_per_rank=8)
            kw.update(override)
            with pytest.raises(exc, match=words):
                r0.dispatch(**kw)
        with pytest.raises(ep_a2a_state_error(), match="without a dispatch"):
            r0.combine(r0.combine_input(8), 8)
        run(a2a, rng, [4, 8], 8)  # the next valid step is still right


def ep_a2a_state_error():
    from ep_a2a.alltoall import StateError
    return StateError


@pytest.mark.parametrize("scope", ["auto", "sys"])
@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_flag_scopes_on_one_gpu(scope, protocol, monkeypatch):
    """Ranks sharing one GPU publish their flags at gpu scope ("auto"); $EP_A2A_PEER_SCOPE=sys
    keeps system scope. Both give the reference's results, for both protocols."""
    monkeypatch.setenv("EP_A2A_PEER_SCOPE", scope)
    rng = np.random.default_rng()
    group, a2a = make(8, hidden=7168, protocol=protocol)
    with group, a2a:
        assert {r.params.peers_on_device for r in a2a.ranks} == {int(scope == "auto")}
        for T in (1, 16, 128):
            for _ in range(3):
                run(a2a, rng, [T] * 8, T)
        run(a2a, rng, list(rng.integers(0, 129, 8)), 128, route="zipf")
