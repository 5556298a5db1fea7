"""SENTINEL's launch shapes and its layout section for the combine's has bytes (CPU only)."""
from ep_a2a import layout
from ep_a2a.schedule import Schedule


def _schedule(max_grid=66, hidden=7168, elt=2):
    return Schedule(ep_size=8, top_k=8, threads=256, combine_hidden_size=hidden, combine_bytes=hidden * elt,
                    fp8_combine=False, pdl=True, max_grid=max_grid)


def test_sentinel_combine_grid_keeps_pushers_and_reducers_apart_within_half_the_share():
    s = _schedule()
    for T in (1, 2):
        blocks, splits = s.combine_want(T, T, "sentinel", 16)
        # the kernel's split: blocks [0, spare) push, then T*splits reducers, then the publisher
        assert blocks == 8 * T + T * splits + 1 and blocks <= s.max_grid // 2
        assert s.grid(blocks, s.dispatch_want(T, T, "sentinel"), prev_early=True)[1], "early trigger kept"
    for T in (3, 16):  # too large to keep apart within half: grid-strided, plus the publisher
        blocks, splits = s.combine_want(T, T, "sentinel", 16)
        assert blocks == max(T * splits, 8 * T) + 1


def test_sentinel_combine_splits_whatever_the_output_vector():
    # SENTINEL polls and reduces 16-byte groups whatever the output's vectors: the split no
    # longer falls back to one block per token when the output is not 16-byte aligned
    s = _schedule()
    for vec in (16, 8, 4, 2):
        assert s.combine_want(1, 1, "sentinel", vec)[1] == -(-7168 * 2 // 16 // 256)
    assert s.combine_want(1, 1, "sentinel", 2)[1] > 1


def test_has_section_is_sentinel_only_and_disjoint():
    L = layout.WorkspaceLayout.build(8, 64, 8, (32, 14336, 32), 14336, sentinel=True)
    assert L.off_sentinel_has % layout.ALIGN == 0 and L.off_sentinel_has + 8 * 64 <= L.size
    ends = sorted((o, o + n) for o, n, _ in L.sentinel_ranges())
    assert all(L.off_sentinel_has >= b or L.off_sentinel_has + 8 * 64 <= a for a, b in ends)
    p = layout.A2AParams()
    L.fill_params(p, (0, layout.KIND_F16, layout.KIND_F32))
    assert p.off_sentinel_has == L.off_sentinel_has
    assert layout.WorkspaceLayout.build(8, 64, 8, (32, 14336, 32), 14336, sentinel=False).off_sentinel_has == 0
