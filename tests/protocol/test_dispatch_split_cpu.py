"""schedule.Schedule.dispatch_splits: how many blocks share one token's FENCE pushes."""
import dataclasses

from ep_a2a import schedule
from ep_a2a.schedule import Schedule

# deepseek-v3 bf16 on one H200 with 8 in-process ranks: 14,400 B per token (hidden 7168 bf16,
# ids and weights [8]), 66 blocks per rank
DSV3 = Schedule(8, 8, 256, 7168, 14336, False, pdl=True, max_grid=66, dispatch_bytes=14400)


def test_a_large_token_is_split_and_the_grid_still_triggers_early():
    assert DSV3.dispatch_splits(1) == schedule.DISPATCH_MAX_SPLITS
    half = DSV3.max_grid // 2
    for T in range(1, schedule.DISPATCH_TABLE_TOKENS + 1):
        n = DSV3.dispatch_splits(T)
        assert 1 <= n <= schedule.DISPATCH_MAX_SPLITS
        assert T * n <= max(T, half), (T, n)          # never pushes a small grid past half the share
        assert DSV3.dispatch_want(T, T, "fence") == max(T * n, 1)
        grid, early = DSV3.grid(DSV3.dispatch_want(T, T, "fence"), 1, False)
        assert early == (T <= half), T                 # the split keeps the early trigger where it was


def test_no_split_past_the_table_or_without_tokens():
    for T in (0, schedule.DISPATCH_TABLE_TOKENS + 1, 4096):
        assert DSV3.dispatch_splits(T) == 1
    assert DSV3.dispatch_want(0, 16, "fence") == 1     # (rejected step: the sanitize pass alone)


def test_small_tokens_stay_in_one_block():
    # below DISPATCH_SPLIT_MIN_BYTES of pushes one block (no election) beats a split
    small = dataclasses.replace(DSV3, dispatch_bytes=576)
    assert small.dispatch_splits(1) == 1
    assert small.dispatch_want(1, 1, "fence") == 1
    assert small.dispatch_splits(4) == 1               # 4.6 KB per token: one block each
    unknown = dataclasses.replace(DSV3, dispatch_bytes=0)
    assert unknown.dispatch_splits(1) == unknown.dispatch_splits(16) == 1


def test_a_small_share_never_splits():
    tiny = dataclasses.replace(DSV3, max_grid=3)
    for T in range(1, 40):
        assert tiny.dispatch_splits(T) == 1
    assert Schedule(8, 8, 256, 7168, 14336, False, True, 66).dispatch_splits(1) == 1  # (no bytes given)


def test_sentinel_is_not_split():
    assert DSV3.dispatch_want(1, 1, "sentinel") == 8 * 1
