"""The benchmark's command line, rank placement, cross-process reduction, process
supervision, the method's arithmetic and the report: everything of `python -m ep_a2a.bench`
that runs without a GPU."""
import importlib.util
import multiprocessing as mp
import os
import threading
import time
import uuid

import numpy as np
import pytest

from ep_a2a.tools import bench, bench_cli, bench_method, bench_procs, bench_report
from ep_a2a.bootstrap import UnixSocketBootstrap
from ep_a2a.driver import device
from ep_a2a.layout import MAX_RANKS


@pytest.mark.parametrize("argv,words", [
    (["--mode", "threads"], "invalid choice"),
    (["--mode", "procs", "--procs", "1"], "--procs: must be in 2..72"),
    (["--mode", "procs", "--procs", str(MAX_RANKS + 1)], "--procs: must be in 2..72"),
    (["--mode", "procs", "--procs", "two"], "--procs: expected an integer"),
    (["--procs", "2"], "--procs needs --mode procs"),
    (["--mode", "procs", "--ranks", "4"], "--ranks is for --mode inproc"),
    (["--mode", "procs", "--device", "1"], "--device is for --mode inproc"),
    (["--mode", "procs", "--profile-host"], "--profile-host is for --mode inproc"),
    (["--ranks", "0"], "--ranks: must be in 1..72"),
    (["--device", "-1"], "--device: must be >= 0"),
    (["--tokens", "1,,8"], "comma-separated list of integers"),
    (["--tokens", "4,0"], "--tokens: must be >= 1, got 0"),
    (["--protocol", "fence,eager"], "['eager'] not among fence, sentinel, auto"),
    (["--rounds", "0"], "--rounds: must be >= 1"),
    (["--replays", "0"], "--replays: must be >= 1"),
    (["--threads", "100"], "multiple of 32 in 96..512"),
    (["--threads", "64"], "--threads: must be in 96..512"),
    (["--threads", "1024"], "--threads: must be in 96..512"),
    (["--profile", "custom", "--hidden", "64"], "--profile custom needs"),
])
def test_bad_arguments_exit_with_a_message(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        bench_cli.parse_args(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_defaults_per_mode():
    a = bench_cli.parse_args([])
    assert (a.mode, a.ranks, a.device, a.procs) == ("inproc", 8, 0, None)
    assert a.tokens == [2 ** i for i in range(13)] and a.protocol == "fence,sentinel,auto"
    p = bench_cli.parse_args(["--mode", "procs", "--procs", "3", "--tokens", "1,8", "--protocol", "fence"])
    assert (p.mode, p.procs, p.ranks, p.device) == ("procs", 3, None, None)  # placement decides the GPUs
    assert p.tokens == [1, 8] and p.protocol == "fence"
    c = bench_cli.parse_args(["--profile", "custom", "--hidden", "64", "--top-k", "2", "--experts", "8", "--ranks", "2"])
    assert (c.hidden, c.top_k, c.experts, c.ranks) == (64, 2, 8, 2)


@pytest.mark.parametrize("procs,gpus,want", [
    (None, 8, list(range(8))),
    (None, 2, [0, 1]),
    (5, 2, [0, 1, 0, 1, 0]),
    (2, 1, [0, 0]),
    (3, 4, [0, 1, 2]),
])
def test_placement_round_robin(procs, gpus, want):
    assert bench_procs.placement(procs, gpus) == want


@pytest.mark.parametrize("procs,gpus,words", [
    (None, 1, "--procs N"),
    (None, 0, "no visible GPU"),
    (MAX_RANKS + 1, 8, f"at most {MAX_RANKS}"),
])
def test_placement_refuses(procs, gpus, words):
    with pytest.raises(ValueError, match=words):
        bench_procs.placement(procs, gpus)


@pytest.mark.skipif(device.available(), reason="checks the no-GPU exit; this machine has a GPU")
@pytest.mark.parametrize("mode", [["--mode", "inproc"], ["--mode", "procs", "--procs", "2"]])
def test_main_without_gpu_says_so(mode, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_cli.main(mode + ["--tokens", "1", "--out", str(out)]) == 3
    assert "no usable CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def _in_threads(n, fn):
    """fn(rank) in n threads; their results in rank order (the first exception re-raised)."""
    out, errs = [None] * n, []

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)
    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), "a rank thread hung"
    if errs:
        raise errs[0]
    return out


def test_gather_over_a_real_bootstrap_gives_every_rank_every_row(tmp_path):
    name, n = "g" + uuid.uuid4().hex[:12], 3
    rng = np.random.default_rng()
    rows = rng.standard_normal((n, 5))
    rows[1, 2] = np.nan  # a floor one rank could not measure travels as NaN

    def rank(r):
        with UnixSocketBootstrap(r, n, name=name, base_dir=tmp_path, timeout=10) as b:
            return bench_report.gather(b, list(rows[r]))
    got = _in_threads(n, rank)
    for g in got:
        np.testing.assert_array_equal(g, rows)  # bit-exact, NaN included, in rank order
    # without a bootstrap (one process holds every rank) the values come back as one row
    np.testing.assert_array_equal(bench_report.gather(None, rows[0]), rows[:1])


def test_gather_refuses_ranks_passing_different_counts(tmp_path):
    name, n = "g" + uuid.uuid4().hex[:12], 2

    def rank(r):
        with UnixSocketBootstrap(r, n, name=name, base_dir=tmp_path, timeout=10) as b:
            with pytest.raises(ValueError, match=r"ranks passed \[3, 4\] values"):
                bench_report.gather(b, [1.0] * (3 + r))
    _in_threads(n, rank)


def _supervise(*targets):
    """Start one spawned process per (function, args) and supervise them as the bench does."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=f, args=a) for f, a in targets]
    try:
        for p in procs:
            p.start()
        return bench_procs._wait(procs), procs
    finally:
        bench_procs._stop(procs)


def test_a_failing_rank_stops_the_others_at_once():
    t0 = time.monotonic()
    rc, (sleeper, failer) = _supervise((time.sleep, (60,)), (os._exit, (3,)))
    assert rc == 1 and time.monotonic() - t0 < 30
    assert failer.exitcode == 3 and sleeper.exitcode not in (None, 0)  # the sleeper was stopped
    assert not sleeper.is_alive()


def test_all_ranks_succeeding_is_success():
    rc, procs = _supervise(*[(time.sleep, (0.2 * i,)) for i in range(3)])
    assert rc == 0 and [p.exitcode for p in procs] == [0, 0, 0]


def _row(T, rt, disp, peer):
    """A row as measure() lays it out, from round numbers (the table must print every case)."""
    r = dict(protocol="fence", tokens_per_rank=T, round_trip_us=rt, floor_round_trip_us=rt / 2,
             round_trip_over_floor=2.0, dispatch_us=disp, combine_us=None if disp is None else rt - disp,
             copy_floor_tbps=3.0, peer_copy_floor_tbps=peer)
    if disp is not None:
        r.update(floor_dispatch_us=disp / 2, dispatch_tbps=1.5, dispatch_over_copy_bw=0.5)
    return r


@pytest.mark.parametrize("mode,procs,gpus,shared,peer", [
    ("inproc", 1, 1, False, None), ("procs", 2, 1, True, None), ("procs", 4, 2, True, 0.4), ("procs", 8, 8, False, 0.5)])
def test_table_prints_every_mode(mode, procs, gpus, shared, peer, capsys):
    res = dict(device="GPU", mode=mode, ep_size=procs if mode == "procs" else 4, procs=procs, gpus=gpus,
               shared_gpu=shared, peer_copy_floor_reason=bench.ONE_GPU if gpus == 1 else None, commit="abc",
               config=dict(ranks=procs if mode == "procs" else 4, profile="deepseek-v3", format="bf16",
                           routing="perfect"),
               rows=[_row(1, 20.0, 12.0, peer), _row(8, 30.0, None, peer)], measured_sentinel_max_tokens=None,
               host_overhead=[dict(tokens_per_rank=1, host_us_per_rank_step=9.0, two_bare_launches_us=5.0,
                                   python_us_per_rank_step=4.0)])
    bench_report.table(res)
    out = capsys.readouterr().out
    assert ("in-process ranks" in out) == (mode == "inproc")
    assert (f"{procs} rank processes on {gpus} GPU(s)" in out) == (mode == "procs")
    assert ("NOT performance" in out) == shared
    assert ("peer copy floor: none" in out) == (gpus == 1)
    if peer is not None:
        assert f"{peer:.2f}" in out


# -- the method's arithmetic (bench_method) ------------------------------------------------

def test_per_round_takes_what_two_graph_lengths_share_out():
    rng = np.random.default_rng()
    for _ in range(20):
        R, x, shared = int(rng.integers(1, 50)), rng.uniform(0.5, 3000), rng.uniform(0, 80)
        per, outside = bench_method.per_round(shared + R * x, shared + 2 * R * x, R)
        assert per == pytest.approx(x, rel=1e-12) and outside == pytest.approx(shared, rel=1e-9, abs=1e-9)
    for bad in (0, -1, 2.0, None):
        with pytest.raises(ValueError, match="rounds: must be an int >= 1"):
            bench_method.per_round(1.0, 2.0, bad)


def test_offsets_and_bytes_follow_the_distinct_targets():
    rng = np.random.default_rng()
    targets = [list(rng.permutation(8)[:rng.integers(1, 9)]) for _ in range(int(rng.integers(1, 40)))]
    offs = bench_method.row_offsets(targets)
    assert offs.dtype == np.int32 and offs[0] == 0 and list(np.diff(offs)) == [len(t) for t in targets]
    b = bench_method.phase_bytes(targets, 14400, 14336, 14336)
    sends = sum(map(len, targets))
    assert b == dict(dispatch_read=len(targets) * 14400, dispatch_written=sends * 14400,
                     combine_read=sends * 14336, combine_written=len(targets) * 14336)
    assert [bench_method.padded(n) for n in (1, 16, 17, 14400, 7393)] == [16, 16, 32, 14400, 7408]


def _gather_bytewise(partials, offsets, out_bytes):
    """ep_floor_gather's rule, one byte at a time (independent of gather_reference)."""
    in_bytes = partials.shape[1]
    out = np.zeros((len(offsets) - 1, out_bytes), np.uint8)
    for t in range(len(offsets) - 1):
        for b in range(out_bytes):
            j, tail = divmod(b, 16)
            if b < out_bytes // 16 * 16:  # a vector byte: seed = vector index j, little-endian, in bytes 0..3
                v, src = (j >> (8 * tail)) & 0xFF if tail < 4 else 0, (b if j < in_bytes // 16 else None)
            else:  # a tail byte: seed = its index in the tail
                k = b - out_bytes // 16 * 16
                v, src = k, (in_bytes // 16 * 16 + k if k < in_bytes % 16 else None)
            for r in range(offsets[t], offsets[t + 1]):
                if src is not None:
                    v ^= int(partials[r, src])
            out[t, b] = v
    return out


@pytest.mark.parametrize("in_bytes,out_bytes", [(64, 64), (37, 70), (132, 256), (90, 41), (7, 7)])
def test_gather_reference_is_the_kernels_rule(in_bytes, out_bytes):
    rng = np.random.default_rng()
    targets = [list(range(int(rng.integers(0, 12)))) for _ in range(5)]  # up to 11 rows: two load chunks
    offs = bench_method.row_offsets(targets)
    partials = rng.integers(0, 256, (int(offs[-1]), in_bytes), dtype=np.uint8)
    np.testing.assert_array_equal(bench_method.gather_reference(partials, offs, out_bytes),
                                  _gather_bytewise(partials, offs, out_bytes))
    src = rng.integers(0, 256, (5, in_bytes), dtype=np.uint8)
    rep = bench_method.scatter_reference(src, offs)
    assert rep.shape == (offs[-1], in_bytes)
    for t in range(5):
        assert all((rep[r] == src[t]).all() for r in range(offs[t], offs[t + 1]))


def _stamps(rng, replays, ranks, rounds, d, c, skew=0.0):
    """Stamps of streams whose dispatches take d[rank] ns and combines c[rank] (plus up to
    0.5 ns jitter), round 0's dispatch `skew` longer."""
    s = np.zeros((replays, ranks, 2 * rounds + 1), np.int64)
    s[:, :, 0] = rng.integers(10 ** 12, 2 * 10 ** 12, (replays, ranks))
    for i in range(rounds):
        s[:, :, 2 * i + 1] = s[:, :, 2 * i] + np.asarray(d) + (skew if i == 0 else 0)
        s[:, :, 2 * i + 2] = s[:, :, 2 * i + 1] + np.asarray(c)
    return s


def test_stamp_split_leaves_round_zero_out_and_averages_ranks():
    rng = np.random.default_rng()
    d, c = rng.integers(2000, 9000, 4), rng.integers(1000, 5000, 4)
    got = bench_method.stamp_split(_stamps(rng, 3, 4, 5, d, c, skew=50_000))
    assert got["dispatch_us"] == pytest.approx(d.mean() / 1e3) and got["combine_us"] == pytest.approx(c.mean() / 1e3)
    assert (got["rounds_used"], got["samples"]) == (4, 3 * 4 * 4)
    assert got["smallest_step_ns"] == min(d.min(), c.min())
    one = bench_method.stamp_split(_stamps(rng, 2, 1, 1, [3000], [1000], skew=500))  # one round: kept
    assert (one["rounds_used"], one["dispatch_us"]) == (1, pytest.approx(3.5))
    disp, comb = bench_method.split_round_trip(12.0, got["dispatch_us"], got["combine_us"])
    assert disp + comb == pytest.approx(12.0) and disp / comb == pytest.approx(d.mean() / c.mean())


def test_stamp_split_refuses_what_is_not_one_clock():
    rng = np.random.default_rng()
    s = _stamps(rng, 2, 2, 3, [100, 100], [100, 100])
    s[1, 0, 3] = s[1, 0, 2] - 1
    with pytest.raises(ValueError, match="earlier than the one before it"):
        bench_method.stamp_split(s)
    with pytest.raises(ValueError, match=r"expected \[replays, ranks, 2 \* rounds \+ 1\]"):
        bench_method.stamp_split(s[:, :, :4])
    with pytest.raises(ValueError, match="nothing to split by"):
        bench_method.split_round_trip(10.0, 0.0, 0.0)


def test_table_prints_the_per_round_method_floors_and_split(capsys):
    r = _row(4096, 2100.0, 1200.0, None)
    r.update(split_method="device timestamps", dispatch_of_bytes_floor=0.876, combine_of_bytes_floor=0.912,
             bytes_floor_dispatch_us=1051.0, bytes_floor_combine_us=820.0, bytes_floor_in_turn_us=1987.5,
             stamped_dispatch_us=1230.0, stamped_combine_us=905.0, stamped_round_trip_us=2135.0,
             globaltimer_smallest_step_ns=32)
    res = dict(device="GPU", mode="inproc", ep_size=8, procs=1, gpus=1, shared_gpu=False, peer_copy_floor_reason=None,
               commit="abc", graph_rounds=[20, 40], config=dict(ranks=8, profile="deepseek-v3", format="bf16",
                                                               routing="perfect", rounds=20),
               rows=[r], measured_sentinel_max_tokens=None, host_overhead=[],
               torch_host_overhead=[dict(tokens_per_rank=1, torch_host_us_per_rank_step=140.5)])
    bench_report.table(res)
    out = capsys.readouterr().out
    assert "(t(40) - t(20)) / 20 rounds" in out and " ts " in out and " 88 " in out and " 91 " in out
    assert "1230.0/905.0" in out and "timer step >= 32 ns" in out
    assert " 1987.5 " in out and "bf turn = both byte floors in turn" in out
    assert "torch host overhead: tokens_per_rank=1, torch_host_us_per_rank_step=140.5" in out


def test_no_torch_rows_without_torch():
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is importable here: bench_torch's rows are measured on a GPU")
    assert bench.torch_host_rows(None, [1, 128]) is None


def test_host_figures_are_taken_in_turn_and_reported_as_medians():
    order = []
    def measure(name, values):
        it = iter(values)
        def m():
            order.append(name)
            return next(it)
        return m
    med, samples = bench_method.interleaved_medians(
        dict(a=measure("a", [5.0, 1.0, 3.0]), b=measure("b", [10.0, 30.0, 20.0])), 3, warmup=0)
    assert order == ["a", "b"] * 3                       # in turn, never all of one first
    assert med == {"a": 3.0, "b": 20.0} and samples == {"a": [5.0, 1.0, 3.0], "b": [10.0, 30.0, 20.0]}
    order.clear()                                        # the default: one warm-up round, in turn too, dropped
    med, samples = bench_method.interleaved_medians(
        dict(a=measure("a", [90.0, 5.0, 1.0, 3.0]), b=measure("b", [99.0, 10.0, 30.0, 20.0])), 3)
    assert order == ["a", "b"] * 4
    assert med == {"a": 3.0, "b": 20.0} and samples == {"a": [5.0, 1.0, 3.0], "b": [10.0, 30.0, 20.0]}
    for bad in (0, 1.5, None):
        with pytest.raises(ValueError, match="repeats"):
            bench_method.interleaved_medians(dict(a=lambda: 1.0), bad)
    for bad in (-1, 1.0, None):
        with pytest.raises(ValueError, match="warmup"):
            bench_method.interleaved_medians(dict(a=lambda: 1.0), 1, bad)


def test_host_time_runs_the_warmup_then_times_only_the_loop_between_two_settles():
    calls = []
    us = bench_method.host_time_us(lambda i: calls.append(i), 4, 2, lambda: calls.append("settle"), indexed=True)
    assert calls == [0, 1, "settle", 0, 1, 2, 3, "settle"] and us >= 0
    calls.clear()
    bench_method.host_time_us(lambda: calls.append("x"), 2, 1, lambda: calls.append("settle"))
    assert calls == ["x", "settle", "x", "x", "settle"]


def test_the_timed_bodies_call_every_rank_in_order(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_method.hooks, "launch_empty", lambda r: calls.append(("e", r.i)))

    class R:
        def __init__(self, i):
            self.i = i
        def dispatch(self, ids, pays, T):
            calls.append(("d", self.i, ids, tuple(pays), T))
        def combine(self, c, T):
            calls.append(("c", self.i, c, T))
    ranks = [R(0), R(1)]
    bench_method.eager_step(ranks, [("i0", ["p0"]), ("i1", ["p1"])], ["c0", "c1"], 7)
    assert calls == [("d", 0, "i0", ("p0",), 7), ("d", 1, "i1", ("p1",), 7), ("c", 0, "c0", 7), ("c", 1, "c1", 7)]
    calls.clear()
    bench_method.bare_launches(ranks)
    assert calls == [("e", 0), ("e", 0), ("e", 1), ("e", 1)]

