"""python -m ep_a2a.stress --mixed: its command line, the step-kind registry, the samples of
this process and the growth verdict on them (CPU), and a short mixed soak (GPU)."""
import json
import os

import numpy as np
import pytest

from ep_a2a.tools import stress, stress_kinds, stress_sampling as sampling


@pytest.mark.parametrize("argv", [["--kinds", "eager"], ["--list-kinds"], ["--mixed", "--kinds", "eager,nope"],
                                  ["--mixed", "--kinds", ""], ["--mixed", "--kinds", "eager,,graph"],
                                  ["--mixed", "--sample-s", "0"], ["--mixed", "--sample-s", "inf"],
                                  ["--mixed", "--minutes", "1", "--steps", "3"], ["--mixed", "--ranks", "0"]])
def test_mixed_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        stress.main(argv)
    assert e.value.code == 2


def test_mixed_defaults_and_kinds_parse():
    ap = stress.parser()
    args = ap.parse_args(["--mixed", "--kinds", "graph, eager", "--sample-s", "7.5"])
    assert args.mixed and args.kinds == ["graph", "eager"] and args.sample_s == 7.5
    assert stress.parser().parse_args([]).ranks is None  # resolved after parsing: 4 plain, 8 mixed
    resolve = stress.parse_args
    assert resolve(["--mixed", "--out", "x.json"]).ranks == 8
    assert resolve(["--out", "x.json"]).ranks == 4
    got = resolve(["--mixed", "--ranks", "3", "--minutes", "9", "--out", "x.json"])
    assert got.ranks == 3 and got.minutes == 9.0 and got.steps is None and got.seed >= 0


def test_list_kinds_names_every_registered_kind(capsys):
    assert stress.main(["--mixed", "--list-kinds"]) == 0
    out = capsys.readouterr().out
    for name in ("eager", "fp8", "active", "graph", "torch"):
        assert any(line.split()[0] == name for line in out.splitlines()), out


def test_mixed_without_gpu_exits_3(capsys, tmp_path):
    from ep_a2a.driver.device import available
    if available():
        pytest.skip("this machine has a GPU")
    assert stress.main(["--mixed", "--steps", "3", "--out", str(tmp_path / "m.json")]) == 3
    assert "no usable CUDA GPU" in capsys.readouterr().err


# -- the registry -----------------------------------------------------------------------------

def test_the_builtin_kinds_register_from_their_modules():
    kinds = stress_kinds.load_kinds()
    assert {"eager", "fp8", "active", "graph", "torch"} <= set(kinds)
    for k in kinds.values():
        assert k.run.__module__.startswith("ep_a2a.tools.stress_kind_") and k.weight > 0
    assert kinds["torch"].needs == "torch" and kinds["eager"].needs is None


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as loaded, restored after the test (a test registers kinds of its own)."""
    monkeypatch.setattr(stress_kinds, "KINDS", dict(stress_kinds.load_kinds()))
    return stress_kinds.KINDS


def test_a_new_kind_is_one_registered_function(scratch_registry):
    seen = []

    @stress_kinds.step_kind("probe", weight=0.5)
    def probe(soak, rng, verify):
        seen.append((soak, verify))
        return stress_kinds.Outcome("probe/x", protocol="fence", checked=verify)
    assert stress_kinds.KINDS["probe"].run is probe and stress_kinds.KINDS["probe"].weight == 0.5
    run, skipped = stress_kinds.usable(stress_kinds.KINDS, ["probe"])
    out = run["probe"].run("soak", np.random.default_rng(), True)
    assert seen == [("soak", True)] and out.label == "probe/x" and out.checked and out.mismatches == []
    stress_kinds.step_kind("probe", weight=0.5)(probe)  # the same function again (a re-import): accepted

    def other(soak, rng, verify):
        return None
    with pytest.raises(ValueError, match="registered twice"):
        stress_kinds.step_kind("probe")(other)
    with pytest.raises(ValueError, match="weight"):
        stress_kinds.step_kind("w", weight=0)
    with pytest.raises(ValueError, match="needs"):
        stress_kinds.step_kind("n", needs="jax")
    with pytest.raises(ValueError, match="unknown step kinds"):
        stress_kinds.usable(stress_kinds.KINDS, ["probe", "absent"])


def test_torch_kinds_are_skipped_with_the_reason_where_torch_has_no_cuda():
    run, skipped = stress_kinds.usable(stress_kinds.load_kinds())
    why = stress_kinds.torch_missing()
    if why is None:
        assert "torch" in run and not skipped
    else:
        assert skipped == {"torch": why} and "torch" not in run and "eager" in run


def test_draws_follow_the_weights(scratch_registry):
    """Drawn counts of three kinds with weights 1:2:5 over 8000 draws, each within 5 sigma of
    its expectation (a fresh seed each run)."""
    kinds = {}
    for name, w in (("a", 1.0), ("b", 2.0), ("c", 5.0)):
        stress_kinds.step_kind(name, weight=w)(lambda soak, rng, verify, _n=name: _n)
        kinds[name] = stress_kinds.KINDS[name]
    seed = int(np.random.default_rng().integers(2 ** 31))
    rng = np.random.default_rng(seed)
    n = 8000
    counts = {k: 0 for k in kinds}
    for _ in range(n):
        counts[stress_kinds.draw(rng, kinds).name] += 1
    for name, w in (("a", 1), ("b", 2), ("c", 5)):
        p = w / 8
        sigma = (n * p * (1 - p)) ** 0.5
        assert abs(counts[name] - n * p) < 5 * sigma, (seed, counts)


class _Closable:
    def __init__(self, log, name, fail=False):
        self.log, self.name, self.fail = log, name, fail

    def close(self):
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} cannot close")


def test_soak_resources_are_made_once_and_closed_newest_first():
    class Group:
        ep_size = 3
    log, made = [], []
    soak = stress_kinds.Soak(Group(), None, 7)

    def make(name, fail=False):
        made.append(name)
        return _Closable(log, name, fail)
    a = soak.resource("a", lambda: make("a"))
    assert soak.resource("a", lambda: make("a again")) is a and made == ["a"]
    soak.resource("b", lambda: make("b", fail=True))
    soak.resource("c", lambda: make("c"))
    soak.drop("c")
    assert log == ["c"]
    soak.resource("c", lambda: make("c2"))
    errors = soak.close()
    assert log == ["c", "c2", "b", "a"], log
    assert len(errors) == 1 and "b cannot close" in errors[0]
    assert soak.close() == []  # nothing left


# -- samples of this process and the growth verdict ----------------------------------------------

def test_samples_read_this_process():
    s = sampling.take(1.5, 10)
    assert s.rss_bytes > 10 * sampling.MIB and s.fds >= 3 and s.maps > 10, s
    assert s.device_bytes is None and s.device_scope == "none"  # no GPU named
    with open(f"/proc/{os.getpid()}/status") as f:
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(s.rss_bytes - vmrss) < 16 * sampling.MIB, (s.rss_bytes, vmrss)
    assert "steps 10" in s.line() and "fds" in s.line()


def test_a_quiet_process_passes_the_growth_verdict():
    samples = [sampling.take(t, t) for t in (0.0, 1.0, 2.0, 3.0)]
    ok, reasons, grew = sampling.verdict(samples)
    assert ok, reasons
    assert set(grew) == {"device_bytes", "rss_bytes", "fds", "maps", "live"} and grew["fds"] == 0


def test_real_growth_of_fds_and_memory_fails_the_verdict():
    samples = [sampling.take(0.0, 0), sampling.take(1.0, 1)]
    pipes = [os.pipe() for _ in range(2)]
    blob = np.ones(96 * sampling.MIB, np.uint8)  # touched: resident
    try:
        samples.append(sampling.take(2.0, 2))
        ok, reasons, grew = sampling.verdict(samples)
        assert not ok
        assert grew["fds"] == 4 and any(r.startswith("fds grew by 4") for r in reasons), reasons
        assert grew["rss_bytes"] >= 90 * sampling.MIB and any(r.startswith("rss_bytes grew") for r in reasons), reasons
        ok, reasons, _ = sampling.verdict(samples, {"fds": 4, "rss_bytes": 200 * sampling.MIB})
        assert ok, reasons  # within a stated, wider tolerance
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)
        del blob


def test_growth_is_measured_from_minute_1_not_from_the_warm_up():
    """What the warm-up makes (here: fds opened between the first and second samples) is not
    growth; what is made after minute 1 is."""
    first = sampling.take(0.0, 0)
    pipe = os.pipe()
    try:
        samples = [first, sampling.take(1.0, 1), sampling.take(2.0, 2)]
        assert sampling.verdict(samples)[0], sampling.verdict(samples)[1]
    finally:
        os.close(pipe[0])
        os.close(pipe[1])
    samples.append(sampling.take(3.0, 3))  # fds fell: no growth
    ok, _, grew = sampling.verdict(samples)
    assert ok and grew["fds"] == -2


def test_the_verdict_needs_three_samples_and_counts_live_resources():
    two = [sampling.take(0.0, 0), sampling.take(1.0, 1)]
    ok, reasons, _ = sampling.verdict(two)
    assert not ok and "only 2 samples" in reasons[0]
    a, b, c = (sampling.take(t, t) for t in (0.0, 1.0, 2.0))
    c.live = dict(b.live, mappings=b.live.get("mappings", 0) + 8)
    ok, reasons, grew = sampling.verdict([a, b, c])
    assert not ok and grew["live"]["mappings"] == 8 and any("live mappings grew by 8" in r for r in reasons)
    b.device_bytes, b.device_scope, c.device_bytes, c.device_scope = 100, "process", 100 + 65 * sampling.MIB, "process"
    c.live = dict(b.live)
    ok, reasons, grew = sampling.verdict([a, b, c])
    assert not ok and grew["device_bytes"] == 65 * sampling.MIB and reasons[0].startswith("device_bytes grew by 65.0 MiB")
    c.device_scope = "device"  # samples of different scopes are not compared
    assert sampling.verdict([a, b, c])[2]["device_bytes"] is None


# -- on the GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_a_short_mixed_soak_passes(tmp_path, capsys):
    seed = int(np.random.default_rng().integers(2 ** 31))
    out = tmp_path / "mixed.json"
    rc = stress.main(["--mixed", "--minutes", "0.75", "--sample-s", "8", "--ranks", "4", "--max-tokens", "32",
                      "--seed", str(seed), "--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0, f"seed {seed}:\n{text.out[-4000:]}\n{text.err[-4000:]}"
    res = json.loads(out.read_text())
    assert res["verdict"] == "PASS" and res["mismatches"] == 0 and res["errors"] == 0
    want = {"eager", "fp8", "active", "graph", "halves"} | ({"torch"} if not res["kinds_skipped"] else set())
    assert set(res["kinds"]) == want, res["kinds"]
    assert len(res["samples"]) >= 3 and res["steps_checked"] > 0
    assert set(res["protocols"]) == {"fence", "sentinel"}
    assert "VERDICT: PASS" in text.out


def test_the_tally_counts_per_kind_label_and_protocol():
    from ep_a2a.tools.stress_mixed import Tally
    from ep_a2a.tools.stress_kinds import Outcome
    t = Tally()
    rng = np.random.default_rng()
    n = int(rng.integers(5, 40))
    want_checked = 0
    for step in range(n):
        checked = bool(rng.random() < 0.5)
        want_checked += checked
        t.add("graph" if step % 2 else "eager", Outcome(f"l{step % 3}", "fence" if step % 3 else "sentinel", checked,
                                                       [], 10, 3), step)
    t.add("eager", Outcome("bad", "fence", True, ["x differs", "y differs"]), n)
    t.error("torch", n + 1, RuntimeError("lost"))
    doc = t.as_json()
    assert doc["steps"] == n + 1 and doc["steps_checked"] == want_checked + 1
    assert doc["mismatches"] == 2 and doc["errors"] == 1 and len(doc["first_failures"]) == 2
    assert doc["dispatch_bytes"] == 10 * n and doc["combine_bytes"] == 3 * n
    assert sum(v["steps"] for v in doc["kinds"].values()) == n + 1
    assert sum(doc["protocols"].values()) == n + 1
    json.dumps(doc)  # the report is JSON


# -- the soak's loop and verdict with kinds that run on the CPU ----------------------------------

class _Group:
    ep_size = 2


def _cpu_args(**kw):
    args = stress.parser().parse_args(["--mixed"])
    args.steps, args.sample_s, args.check_every = None, 0.25, None
    vars(args).update(kw)
    return args


def _cpu_kinds(scratch, leak_mib: int):
    """Two real CPU kinds: 'work' (a NumPy sort, compared with a reference) and 'hold', which keeps
    leak_mib MiB of touched memory per step in a soak resource (a real leak when leak_mib > 0)."""
    @stress_kinds.step_kind("work", weight=1.0)
    def work(soak, rng, verify):
        x = rng.standard_normal(20000)
        got = np.sort(x)
        bad = [] if not verify or np.array_equal(got, sorted(x)) else ["sort differs"]
        return stress_kinds.Outcome("work/sort", "fence", verify, bad, x.nbytes, 0)

    @stress_kinds.step_kind("hold", weight=1.0)
    def hold(soak, rng, verify):
        kept = soak.resource("kept", list, lambda kept: kept.clear())
        if leak_mib:
            kept.append(np.ones(leak_mib * sampling.MIB, np.uint8))
        return stress_kinds.Outcome("hold", "sentinel", False)
    return {"work": scratch["work"], "hold": scratch["hold"]}


def test_a_clean_cpu_soak_passes_and_samples_on_time(scratch_registry):
    import time
    from ep_a2a.tools import stress_mixed
    kinds = _cpu_kinds(scratch_registry, 0)
    soak = stress_kinds.Soak(_Group(), _cpu_args(), int(np.random.default_rng().integers(2 ** 31)))
    t0 = time.monotonic()
    tally, samples, wall = stress_mixed.drive(soak, kinds, soak.args, None, t0 + 1.6)
    soak.close()
    assert 1.0 < wall < 2.5 and tally.steps > 10 and tally.errors == 0 and tally.mismatch_count == 0
    assert set(tally.kinds) == {"work", "hold"} and tally.checked >= min(50, tally.steps)
    assert len(samples) >= 5 and samples[0].t_s == 0.0
    assert all(b.t_s > a.t_s for a, b in zip(samples, samples[1:]))
    ok, judged, grown_ok, reasons, grew = stress_mixed.judge(tally, samples, False)
    assert ok and judged and grown_ok, reasons


def test_a_leaking_cpu_soak_fails_on_growth(scratch_registry):
    import time
    from ep_a2a.tools import stress_mixed
    kinds = _cpu_kinds(scratch_registry, 2)
    soak = stress_kinds.Soak(_Group(), _cpu_args(), 1)
    try:
        t0 = time.monotonic()
        tally, samples, _ = stress_mixed.drive(soak, kinds, soak.args, None, t0 + 1.6)
        held = len(soak.resource("kept", list))
    finally:
        soak.close()
    ok, judged, grown_ok, reasons, grew = stress_mixed.judge(tally, samples, False)
    assert held * 2 > 64, f"only {held} steps of 2 MiB: the run was too short to leak past the tolerance"
    assert not ok and judged and not grown_ok
    assert any(r.startswith("rss_bytes grew") for r in reasons), (reasons, grew)
    ok, judged, _, reasons, _ = stress_mixed.judge(tally, samples[:2], True)
    assert ok and not judged and reasons[0].startswith("not judged")  # a short --steps run
    assert not stress_mixed.judge(tally, samples[:2], False)[0]       # a short --minutes run


def test_a_step_that_raises_stops_the_soak(scratch_registry):
    from ep_a2a.tools import stress_mixed

    @stress_kinds.step_kind("boom")
    def boom(soak, rng, verify):
        raise RuntimeError("the context is lost")
    soak = stress_kinds.Soak(_Group(), _cpu_args(steps=50), 3)
    tally, samples, _ = stress_mixed.drive(soak, {"boom": stress_kinds.KINDS["boom"]}, soak.args)
    assert tally.errors == 1 and tally.steps == 0 and "the context is lost" in tally.failures[0]
    assert not stress_mixed.judge(tally, samples, True)[0]


def test_the_active_kind_builds_a_valid_all_to_all_for_every_rank_count_and_top_k():
    """Its num_experts takes every top_k the soak draws, also with few ranks (3 ranks and
    top_k 8 once asked for 8 of 7 experts: the all-to-all refused it, the soak failed)."""
    from ep_a2a.tools.stress import TOP_K
    from ep_a2a.tools.stress_kind_core import active_num_experts
    for ep in range(1, 9):
        for top_k in TOP_K:
            n = active_num_experts(ep, top_k)
            assert n > top_k and n >= 2 * ep + 1, (ep, top_k, n)


def test_every_registered_kind_is_a_step_function():
    """Each kind's registered function takes (soak, rng, verify) (a decorator once sat on a
    helper above the step it was meant for, and the soak failed at its first draw of it)."""
    import inspect
    from ep_a2a.tools import stress_kinds
    import ep_a2a.tools.stress  # noqa: F401  (registers every kind)
    assert {"eager", "fp8", "active", "graph", "halves"} <= set(stress_kinds.KINDS)
    for name, kind in stress_kinds.KINDS.items():
        if name == "boom":
            continue
        assert list(inspect.signature(kind.run).parameters) == ["soak", "rng", "verify"], name
