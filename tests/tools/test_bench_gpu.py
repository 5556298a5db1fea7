"""`python -m ep_a2a.bench` end to end on a GPU, tiny settings: one rank process per rank
(time-sliced on one GPU), and ranks in this process."""
import json
import math

import pytest

from ep_a2a.tools import bench_cli
from ep_a2a.driver import device

MEASURED = ("round_trip_us", "floor_round_trip_us", "copy_floor_tbps", "round_trip_tbps")
SPLIT = ("dispatch_us", "floor_dispatch_us", "dispatch_tbps")


def _positive(row, keys):
    bad = {k: row.get(k) for k in keys if not (isinstance(row.get(k), float) and math.isfinite(row[k]) and row[k] > 0)}
    assert not bad, f"T={row['tokens_per_rank']}: not finite positive: {bad}"


def _common(res, rows_want):
    assert [(r["protocol"], r["tokens_per_rank"]) for r in res["rows"]] == rows_want
    for r in res["rows"]:
        _positive(r, MEASURED)
        assert r["resolved_protocol"] == r["protocol"]
        if r["protocol"] == "fence":
            _positive(r, SPLIT)
            assert math.isfinite(r["combine_us"])
        assert r["dispatch_bytes_written"] > 0 and r["dispatch_bytes_read"] > 0
    for h in res["host_overhead"]:
        for k in ("host_us_per_rank_step", "python_us_per_rank_step", "two_bare_launches_us"):
            assert math.isfinite(h[k]) and h[k] > 0, (k, h)
    assert res["device"] and res["commit"]


@pytest.mark.gpu
def test_procs_mode_two_rank_processes(tmp_path):
    out = tmp_path / "procs.json"
    rc = bench_cli.main(["--mode", "procs", "--procs", "2", "--tokens", "1,8", "--rounds", "2", "--replays", "3",
                     "--protocol", "fence", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    gpus = min(2, device.device_count())
    assert (res["mode"], res["procs"], res["ep_size"], res["gpus"]) == ("procs", 2, 2, gpus)
    assert res["shared_gpu"] is (gpus == 1)
    _common(res, [("fence", 1), ("fence", 8)])
    if gpus == 1:
        assert all(r["peer_copy_floor_tbps"] is None for r in res["rows"])
        assert "one GPU" in res["peer_copy_floor_reason"]
    else:
        for r in res["rows"]:
            _positive(r, ["peer_copy_floor_tbps"])


@pytest.mark.gpu
def test_inproc_mode_smoke(tmp_path):
    out = tmp_path / "inproc.json"
    rc = bench_cli.main(["--ranks", "2", "--tokens", "1,4", "--rounds", "2", "--replays", "3",
                     "--protocol", "fence,sentinel", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert (res["mode"], res["procs"], res["ep_size"], res["gpus"], res["shared_gpu"]) == ("inproc", 1, 2, 1, False)
    _common(res, [("fence", 1), ("fence", 4), ("sentinel", 1), ("sentinel", 4)])
    assert all(r["peer_copy_floor_tbps"] is None for r in res["rows"]) and res["peer_copy_floor_reason"]
    assert res["config"]["ranks"] == 2
