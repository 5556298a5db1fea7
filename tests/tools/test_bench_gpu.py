"""`python -m ep_a2a.bench` on a GPU: the byte floor and timestamp kernels against their
NumPy rules, then end to end with tiny settings: one rank process per rank (time-sliced on
one GPU), and ranks in this process."""
import json
import math

import numpy as np
import pytest

from ep_a2a.tools import bench_cli, bench_method
from ep_a2a.driver import device

MEASURED = ("round_trip_us", "copy_floor_tbps", "round_trip_tbps",
            "bytes_floor_dispatch_us", "bytes_floor_combine_us", "bytes_floor_in_turn_us", "dispatch_of_bytes_floor",
            "stamped_dispatch_us", "stamped_combine_us", "dispatch_us", "dispatch_tbps")
# Empty kernels chained under PDL overlap almost entirely: their per-round difference is a
# fraction of a µs, and a smoke run's few rounds can put it on either side of zero.
NEAR_ZERO = ("floor_round_trip_us", "floor_dispatch_us")
SPLIT = {"fence": "dispatch-only graph", "sentinel": "device timestamps"}


def _rows(t, nrows, stride, nbytes):
    """uint8 [nrows, nbytes]: the rows of a floor buffer (stride apart)."""
    from ep_a2a.interop.arrays import to_numpy
    return to_numpy(t)[:nrows * stride].reshape(nrows, stride)[:, :nbytes]


@pytest.mark.gpu
@pytest.mark.parametrize("row,partial,out", [(14400, 14336, 14336), (7456, 7392, 14336), (37, 70, 41)])
def test_byte_floors_move_exactly_their_rows(row, partial, out):
    """Dispatch's floor writes each token's row to each of its rows, combine's writes the
    XOR rule of bench_method.gather_reference of its own partial rows; bytes outside the rows
    stay poisoned."""
    import ep_a2a
    from ep_a2a.interop.arrays import copy_from_numpy, to_numpy
    from ep_a2a.tools.bench_floors import ByteFloors
    rng = np.random.default_rng()
    with ep_a2a.LocalGroup([0, 0]) as group:
        targets = [[list(rng.permutation(8)[:rng.integers(1, 9)]) for _ in range(int(rng.integers(1, 50)))]
                   for _ in group.ranks]
        fl = ByteFloors(group.ranks, targets, row, partial, out, pdl=True)
        try:
            ds, ps, os_ = fl.strides
            src, parts = [], []
            for (tok, rows, part, out_, offs), tg in zip(fl.buffers, targets):
                s = rng.integers(0, 256, (len(tg), ds), dtype=np.uint8)
                copy_from_numpy(tok, np.concatenate([s.reshape(-1), np.full(tok.nbytes - s.size, 0xA5, np.uint8)]))
                copy_from_numpy(rows, np.full(rows.nbytes, 0x5A, np.uint8))
                src.append(s[:, :row])
                p = rng.integers(0, 256, (int(bench_method.row_offsets(tg)[-1]), ps), dtype=np.uint8)
                copy_from_numpy(part, np.concatenate([p.reshape(-1), np.full(part.nbytes - p.size, 0xA5, np.uint8)]))
                copy_from_numpy(out_, np.full(out_.nbytes, 0x5A, np.uint8))
                parts.append(p[:, :partial])
            # both in turn, as the benchmark's chained floor runs them: each reads only its own
            # source, so neither may see the other's writes
            fl.round_trip()
            for r in group.ranks:
                r.stream.synchronize()
            for (tok, rows, part, out_, offs), tg, s, p in zip(fl.buffers, targets, src, parts):
                o = bench_method.row_offsets(tg)
                np.testing.assert_array_equal(_rows(rows, o[-1], ds, row), bench_method.scatter_reference(s, o))
                assert (_rows(rows, o[-1], ds, ds)[:, row:] == 0x5A).all()
                assert (to_numpy(rows)[o[-1] * ds:] == 0x5A).all()
                np.testing.assert_array_equal(_rows(out_, len(tg), os_, out), bench_method.gather_reference(p, o, out))
                assert (_rows(out_, len(tg), os_, os_)[:, out:] == 0x5A).all()
                assert (to_numpy(out_)[len(tg) * os_:] == 0x5A).all()
        finally:
            fl.close()


@pytest.mark.gpu
def test_stamps_bracket_the_kernel_between_them():
    """A stamp after a long fill is later than the one before it by about the fill's time
    (events beside them); a slot never stamped is refused, so is a slot past the last."""
    import ctypes
    import ep_a2a
    from ep_a2a.driver.launch import Launch
    from ep_a2a.driver.module import load
    from ep_a2a.driver.stream import Event
    from ep_a2a.interop.arrays import empty
    from ep_a2a.tools.bench_floors import Stamps
    with ep_a2a.LocalGroup([0]) as group:
        r = group.ranks[0]
        st = Stamps([r], 3, pdl=True)
        buf = empty((1 << 28,), "uint32", r.device)  # 1 GiB: a fill of about a millisecond
        fill = Launch(r.device, load("util", r.device).function("ep_fill_u32"),
                      [ctypes.c_uint64(buf.ptr), ctypes.c_uint64(1 << 28), ctypes.c_uint32(7)], 264, 256, pdl=True)
        e0, e1 = Event(r.device, timing=True), Event(r.device, timing=True)
        try:
            st.poison()
            st.mark(0)
            e0.record(r.stream.handle)
            fill(r.stream.handle)
            e1.record(r.stream.handle)
            st.mark(0)
            r.stream.synchronize()
            with pytest.raises(RuntimeError, match="never written"):
                st.read()
            st.mark(0)
            r.stream.synchronize()
            s = st.read()[0].astype(np.int64)
            fill_ns = e0.elapsed_ms(e1) * 1e6
            assert s[2] >= s[1] and 0.5 * fill_ns < s[1] - s[0] < 2 * fill_ns + 50_000, (s, fill_ns)
            with pytest.raises(IndexError, match="used all 3 slots"):
                st.mark(0)
        finally:
            st.close()
            buf.owner.close()
            e0.close()
            e1.close()


def _positive(row, keys):
    bad = {k: row.get(k) for k in keys if not (isinstance(row.get(k), float) and math.isfinite(row[k]) and row[k] > 0)}
    assert not bad, f"T={row['tokens_per_rank']}: not finite positive: {bad}"


def _common(res, rows_want, rounds):
    assert [(r["protocol"], r["tokens_per_rank"]) for r in res["rows"]] == rows_want
    assert res["graph_rounds"] == [rounds, 2 * rounds] and res["per_round_method"] and res["stamps_measure"]
    for r in res["rows"]:
        if res["shared_gpu"]:  # time-sliced: per-round differences are noise, any sign; present they are
            assert all(k in r and (r[k] is None or isinstance(r[k], float)) for k in MEASURED), r
        else:
            _positive(r, MEASURED)
            bad = {k: r.get(k) for k in NEAR_ZERO if not (isinstance(r.get(k), float) and r[k] > -1.0)}
            assert not bad, f"T={r['tokens_per_rank']}: an empty-kernel floor below -1 µs or missing: {bad}"
        assert r["resolved_protocol"] == r["protocol"] and r["split_method"] == SPLIT[r["protocol"]]
        assert r["dispatch_us"] + r["combine_us"] == pytest.approx(r["round_trip_us"])
        assert r["graph_rounds"] == [rounds, 2 * rounds] and math.isfinite(r["round_trip_graph_overhead_us"])
        assert r["stamp_rounds_used"] == max(1, rounds - 1)
        assert r["dispatch_bytes_written"] > 0 and r["dispatch_bytes_read"] > 0
    for h in res["host_overhead"]:
        for k in ("host_us_per_rank_step", "python_us_per_rank_step", "two_bare_launches_us"):
            assert math.isfinite(h[k]) and h[k] > 0, (k, h)
    assert res["device"] and res["commit"]


@pytest.mark.gpu
def test_procs_mode_two_rank_processes(tmp_path):
    out = tmp_path / "procs.json"
    rc = bench_cli.main(["--mode", "procs", "--procs", "2", "--tokens", "1,8", "--rounds", "3", "--stamps", "--replays", "3",
                     "--protocol", "fence", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    gpus = min(2, device.device_count())
    assert (res["mode"], res["procs"], res["ep_size"], res["gpus"]) == ("procs", 2, 2, gpus)
    assert res["shared_gpu"] is (gpus == 1)
    _common(res, [("fence", 1), ("fence", 8)], 3)
    if gpus == 1:
        assert all(r["peer_copy_floor_tbps"] is None for r in res["rows"])
        assert "one GPU" in res["peer_copy_floor_reason"]
    else:
        for r in res["rows"]:
            _positive(r, ["peer_copy_floor_tbps"])


@pytest.mark.gpu
def test_inproc_mode_smoke(tmp_path):
    out = tmp_path / "inproc.json"
    rc = bench_cli.main(["--ranks", "2", "--tokens", "1,4", "--rounds", "4", "--stamps", "--replays", "5",
                     "--protocol", "fence,sentinel", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert (res["mode"], res["procs"], res["ep_size"], res["gpus"], res["shared_gpu"]) == ("inproc", 1, 2, 1, False)
    _common(res, [("fence", 1), ("fence", 4), ("sentinel", 1), ("sentinel", 4)], 4)
    assert all(r["peer_copy_floor_tbps"] is None for r in res["rows"]) and res["peer_copy_floor_reason"]
    assert res["config"]["ranks"] == 2
