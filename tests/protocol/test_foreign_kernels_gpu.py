"""Kernels of the user's between and around the phases, with every rank on one GPU.

Engines put work between dispatch and combine (the MoE itself, profiler markers, the other
micro-batch's compute), and the ranks of one process spin on each other. For each grid-shape
boundary (FENCE's cluster at T^ = 1, SENTINEL's grid reaching a rank's share of the GPU at
ep * T^ > max_grid, full shares at 128), a foreign kernel runs on every rank's stream before
the first dispatch and after every dispatch and combine, eagerly and in a captured graph
replayed several times; the results must equal the reference and no wait may time out. The
foreign kernels range from one warp to a grid that fills the GPU.
"""
import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

EP, H, K, E = 8, 512, 8, 64
TOKENS = (1, 2, 4, 8, 9, 16, 64, 128)
# name -> (blocks as a function of the SM count, threads per block, 32-bit words written,
# dynamic shared memory per block). Small blocks and large shared memory are the shapes whose
# shared-memory configuration differs from the protocol kernels' (kernels/protocol.cuh).
FOREIGN = {
    "one warp": (lambda sm: 1, 32, 32, 0),
    "one warp, long": (lambda sm: 1, 32, 1 << 16, 0),
    "one block": (lambda sm: 1, 256, 256, 0),
    "warps on half the SMs": (lambda sm: sm // 2, 64, 1 << 12, 0),
    "fills the GPU": (lambda sm: 8 * sm, 256, 1 << 20, 0),
    "200 KiB of shared memory": (lambda sm: sm, 256, 1 << 16, 200 << 10),
}


def _foreign(a2a, kind):
    """One launch per rank of the ep_fill_u32 kernel shaped as FOREIGN[kind], each into a
    scratch buffer of its own (nothing of the all-to-all's)."""
    from ep_a2a.driver.launch import Launch
    from ep_a2a.driver.module import load
    from cuda.bindings import driver as d
    from ep_a2a.driver.errors import call
    from ep_a2a.interop.arrays import empty
    blocks, threads, words, smem = FOREIGN[kind]
    out = []
    for r in a2a.group.ranks:
        buf = empty((words,), "uint32", r.device)
        fn = load("util", r.device).function("ep_fill_u32")
        if smem:
            call(d.cuFuncSetAttribute, fn, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        k = Launch(r.device, fn, [ctypes.c_uint64(buf.ptr), ctypes.c_uint64(words), ctypes.c_uint32(0x5A5A5A5A)],
                   blocks(r.device.sm_count), threads, shared_bytes=smem)
        out.append((k, r.stream.handle, buf))
    return out


def _step_and_check(a2a, rng, T, foreign, graph_replays):
    """Every rank dispatches T tokens, the identity 'MoE' copies what it received into its
    combine input, every rank combines; a foreign kernel before and after each phase."""
    from cuda.bindings import driver as d
    from ep_a2a.driver.stream import Event, Graph
    from ep_a2a.interop.arrays import copy_from_numpy, empty, from_numpy, to_numpy
    from ep_a2a.testing import reference as ref
    from ep_a2a.testing.formats import routing
    ranks, devs = a2a.ranks, [r.device for r in a2a.group.ranks]
    ids_h = [routing("uniform", rng, T, K, E, EP) for _ in range(EP)]
    # small integers: any number of copies sums exactly in bf16
    x_h = [ref.from_float32(rng.integers(-4, 5, (T, H)).astype(np.float32), "bfloat16") for _ in range(EP)]
    w_h = [rng.random((T, K), dtype=np.float32) for _ in range(EP)]
    ids = [from_numpy(ids_h[s], devs[s], "int32") for s in range(EP)]
    pays = [[from_numpy(x_h[s], devs[s], "bfloat16"), from_numpy(w_h[s], devs[s], "float32")] for s in range(EP)]
    outs = [empty((T, H), "bfloat16", devs[s]) for s in range(EP)]
    owner = ref.expert_owner(E, EP)
    copies = [np.array([len(ref.targets_of(i, owner)) for i in ids_h[s]], np.float32) for s in range(EP)]
    want = [ref.from_float32(ref.to_float32(x_h[s], "bfloat16") * copies[s][:, None], "bfloat16") for s in range(EP)]

    def mark():
        for k, s, _ in foreign:
            k(s)

    def step():
        views = [r.dispatch(ids[s], pays[s], T) for s, r in enumerate(ranks)]
        mark()
        for s, r in enumerate(ranks):
            hidden = views[s][1][0]
            d.cuMemcpyDtoDAsync(r.combine_input(T).ptr, hidden.ptr, hidden.nbytes, foreign[s][1])
        for s, r in enumerate(ranks):
            r.combine(r.combine_input(T), T, out=outs[s])
        mark()

    def check(what):
        a2a.synchronize()
        assert a2a.error() is None, f"{what}: {a2a.error()}"
        for s in range(EP):
            got = to_numpy(outs[s]).view(np.uint16)
            assert np.array_equal(got, want[s]), f"{what}: rank {s} combined other values"

    mark()
    step()
    check("eager")
    if graph_replays:
        s0 = foreign[0][1]
        Graph.begin(s0)
        fork = Event(devs[0]).record(s0)
        for _, s, _ in foreign[1:]:
            fork.wait_on(s)
        mark()
        for _ in range(3):
            step()
        for _, s, _ in foreign[1:]:
            Event(devs[0]).record(s).wait_on(s0)
        g = Graph.end(s0)
        try:
            for _ in range(graph_replays):
                for o in outs:
                    copy_from_numpy(o, np.full(o.nbytes, 0xFF, np.uint8))
                g.launch(s0)
                check("graph replay")
        finally:
            g.close()


@pytest.mark.parametrize("kind", list(FOREIGN))
@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_foreign_kernels_between_and_around_the_phases(protocol, kind):
    import ep_a2a
    from ep_a2a.testing.formats import payload_formats
    rng = np.random.default_rng()
    with ep_a2a.LocalGroup([0] * EP) as group, ep_a2a.MoeAlltoAll(
            group, max_tokens_per_rank=max(TOKENS), top_k=K, num_experts=E, payloads=payload_formats(H, K)["bf16"],
            combine_hidden_size=H, protocol=protocol, on_timeout="abort", timeout_s=5.0, first_timeout_s=5.0,
            validate_expert_ids=False) as a2a:
        foreign = _foreign(a2a, kind)
        try:
            for T in TOKENS:
                _step_and_check(a2a, rng, T, foreign, graph_replays=3)
        finally:
            group.ranks[0].device.synchronize()
            for _, _, buf in foreign:
                buf.owner.close()
