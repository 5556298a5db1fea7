"""python -m ep_a2a.stress --mixed: the mixed soak, what users combine in one process.

In-process ranks on one GPU run, for --minutes (setup included) or --steps, steps of the
registered kinds (stress_kinds.py: eager protocols and auto, FP8 combine, active-rank
changes, CUDA graphs per T^ replayed in random order between eager steps, torch ops), drawn
by weight from a generator seeded by (seed, step). Before the clock starts every kind runs
once (the warm-up: every kind's all-to-alls, graphs and caches exist from then on). Every
--sample-s seconds (60: once a minute) a line reports this process's device memory, RSS,
open fds, /proc maps and the library's live VMM allocations, mappings and graphs
(stress_sampling.py). The verdict fails (exit 1) on any mismatch or error, or on growth from
the first sample after one interval (minute 1) to the last beyond stress_sampling.TOLERANCE; a run by --minutes too short for
three samples fails (it proves nothing about growth), one by --steps is not judged then.
"""
from __future__ import annotations

import datetime
import sys
import time

import numpy as np

from ..driver.memory import release_held
from . import exits, stress_sampling as sampling
from .result_paths import device_slug, output_path, result_name, write_json
from .stress_kinds import Soak, draw, load_kinds, usable

TEARDOWN_FRACTION = 0.04   # of --minutes kept free at the end for closing and the report (22 s of 9 min)


def plan_kinds(wanted) -> tuple:
    """({name: StepKind}, {name: why skipped}) for --kinds (None: every registered kind)."""
    return usable(load_kinds(), wanted)


def _count(table: dict, key, checked: bool) -> None:
    row = table.setdefault(key, [0, 0])
    row[0] += 1
    row[1] += int(checked)


class Tally:
    """Steps, checks, mismatches and bytes, overall and per kind and label."""

    def __init__(self):
        self.steps = self.checked = self.mismatch_count = self.errors = 0
        self.dispatch_bytes = self.combine_bytes = 0
        self.kinds, self.labels, self.protocols = {}, {}, {}
        self.failures = []

    def add(self, kind: str, out, step: int) -> None:
        self.steps += 1
        self.checked += int(out.checked)
        self.dispatch_bytes += int(out.dispatch_bytes)
        self.combine_bytes += int(out.combine_bytes)
        _count(self.kinds, kind, out.checked)
        _count(self.labels, out.label, out.checked)
        if out.protocol:
            self.protocols[out.protocol] = self.protocols.get(out.protocol, 0) + 1
        if out.mismatches:
            self.mismatch_count += len(out.mismatches)
            if len(self.failures) < 20:
                self.failures.append(f"step {step} ({kind}): {out.mismatches[:3]}")

    def error(self, kind: str, step: int, err: BaseException) -> None:
        self.errors += 1
        self.failures.append(f"step {step} ({kind}): {type(err).__name__}: {err}")

    def as_json(self) -> dict:
        return dict(steps=self.steps, steps_checked=self.checked, mismatches=self.mismatch_count, errors=self.errors,
                    dispatch_bytes=self.dispatch_bytes, combine_bytes=self.combine_bytes,
                    kinds={k: dict(steps=v[0], checked=v[1]) for k, v in self.kinds.items()},
                    labels={k: dict(steps=v[0], checked=v[1]) for k, v in sorted(self.labels.items())},
                    protocols=self.protocols, first_failures=self.failures)


def _checked(step: int, every) -> bool:
    if every is not None:
        return step % every == 0
    return step < 50 or step % 4 == 0


def _one(soak, kinds, tally, step: int, kind=None) -> bool:
    """Run step `step` (of `kind`, else one drawn); False when it raised (the soak stops)."""
    rng = np.random.default_rng([soak.seed, step])
    k = kind or draw(rng, kinds)
    try:
        out = k.run(soak, rng, _checked(step, soak.args.check_every))
    except Exception as e:  # the ranks may be mid-step, or the context lost: stop here
        tally.error(k.name, step, e)
        print(f"ERROR at step {step} ({k.name}, seed {soak.seed}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return False
    tally.add(k.name, out, step)
    if out.mismatches:
        print(f"MISMATCH at step {step} ({k.name}, seed {soak.seed}): {out.mismatches[:3]}", file=sys.stderr, flush=True)
    return True


def run(args, facts: dict) -> int:
    """The mixed soak for parsed arguments (stress.parser) on a usable GPU (`facts`: its name,
    capability and driver, stress.device_facts); returns the exit status."""
    import ep_a2a
    t_begin = time.monotonic()
    kinds, skipped = plan_kinds(args.kinds)
    if not kinds:
        return exits.missing("ep_a2a.stress --mixed", f"no step kind can run here ({skipped})")
    seed = args.seed
    print(f"ep_a2a.stress --mixed: seed {seed} ({args.ranks} ranks on cuda:{args.device}, "
          f"{f'{args.steps} steps' if args.steps else f'{args.minutes:g} min'}; kinds {', '.join(kinds)}"
          + "".join(f"; {n} skipped: {why}" for n, why in skipped.items()) + ")", flush=True)
    deadline = None if args.steps else t_begin + 60.0 * args.minutes * (1 - TEARDOWN_FRACTION)
    group = ep_a2a.LocalGroup([args.device] * args.ranks)
    soak = Soak(group, args, seed)
    pci = group.ranks[0].device.pci_bus_id
    close_errors = []
    try:
        tally, samples, wall = drive(soak, kinds, args, pci, deadline)
    finally:
        close_errors = soak.close()
        try:
            group.close()
        except Exception as e:
            close_errors.append(f"group: {type(e).__name__}: {e}")
    for e in close_errors:
        print(f"close failed: {e}", file=sys.stderr)

    ok, judged, grown_ok, reasons, grew = judge(tally, samples, bool(args.steps), close_errors)
    _summary(tally, samples, grew, wall, time.monotonic() - t_begin, seed)
    result = dict(tool="ep_a2a.stress --mixed", **facts, commit=_commit(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(), args=vars(args),
                  kinds_skipped=skipped, **tally.as_json(), samples=sampling.as_json(samples), growth=grew,
                  tolerance=sampling.TOLERANCE, growth_failures=reasons, close_errors=close_errors,
                  wall_s=round(wall, 3), verdict="PASS" if ok else "FAIL")
    length = f"{args.steps}steps" if args.steps else f"{args.minutes:g}min"
    path = output_path(args.out, result_name("stress-mixed", device_slug(facts["device"]), f"{args.ranks}ranks", length))
    print(f"wrote {write_json(path, result)}")
    for r in reasons:
        print(f"  growth: {r}")
    print(f"VERDICT: {'PASS' if ok else 'FAIL'}: {tally.steps} steps ({tally.checked} checked), "
          f"{tally.mismatch_count} mismatches, {tally.errors} errors, "
          + (f"growth {'within' if grown_ok else 'beyond'} tolerance" if judged else "growth not judged")
          + (f", {len(close_errors)} close errors" if close_errors else "")
          + ("" if ok else f" (reproduce with --seed {seed})"), flush=True)
    return exits.OK if ok else exits.FAILED


def drive(soak, kinds: dict, args, pci=None, deadline=None) -> tuple:
    """The soak's steps: the warm-up (every kind once), then kinds drawn until `deadline`
    (time.monotonic) or args.steps, a sample after the warm-up, every args.sample_s seconds
    and at the end. Returns (Tally, samples, seconds since the warm-up)."""
    tally, samples, step = Tally(), [], 0

    def sample(t_s):
        # between steps no rank waits for a launch: free what the last step's inputs queued
        # (driver.memory holds frees while in-process ranks exist), so that a sample counts
        # only what outlives a step
        release_held()
        samples.append(sampling.take(t_s, tally.steps, pci))
    ok = True
    for k in kinds.values():  # warm-up: every kind once, before the clock
        ok = _one(soak, kinds, tally, step, k)
        step += 1
        if not ok:
            break
    start = time.monotonic()
    sample(0.0)
    print(samples[-1].line() + "  (after the warm-up)", flush=True)
    next_sample = start + args.sample_s
    while ok:
        now = time.monotonic()
        if (tally.steps >= args.steps) if args.steps else (now >= deadline):
            break
        ok = _one(soak, kinds, tally, step)
        step += 1
        now = time.monotonic()
        if now >= next_sample:
            next_sample += args.sample_s
            sample(now - start)
            print(samples[-1].line() + f", mismatches {tally.mismatch_count}, errors {tally.errors}", flush=True)
    now = time.monotonic()
    if now - start - samples[-1].t_s >= min(10.0, args.sample_s / 2):  # the end, unless a sample was just taken
        sample(now - start)
        print(samples[-1].line() + "  (end)", flush=True)
    return tally, samples, now - start



def judge(tally, samples: list, by_steps: bool, close_errors=()) -> tuple:
    """(ok, growth judged, growth ok, growth reasons, growth) of a soak: ok needs no mismatch,
    no error, no close error and growth within tolerance; a run by --steps with fewer than
    three samples reproduces steps and is not judged on growth."""
    grown_ok, reasons, grew = sampling.verdict(samples)
    judged = not (by_steps and len(samples) < 3)
    if not judged:
        grown_ok, reasons = True, [f"not judged: {len(samples)} samples"]
    ok = tally.mismatch_count == 0 and tally.errors == 0 and grown_ok and not close_errors
    return ok, judged, grown_ok, reasons, grew

def _commit() -> str:
    from .bench_report import commit
    return commit()


def _summary(tally, samples, grew, wall, total, seed) -> None:
    print(f"steps run      {tally.steps} ({tally.checked} checked against the reference)")
    for name, (n, c) in tally.kinds.items():
        print(f"  {name:<12} {n:6d} steps, {c:6d} checked")
    print(f"protocols      {tally.protocols}\n"
          f"bytes moved    {(tally.dispatch_bytes + tally.combine_bytes) / 1e9:.3f} GB logical\n"
          f"mismatches     {tally.mismatch_count}\n"
          f"errors         {tally.errors}\n"
          f"wall time      {wall:.1f} s of steps ({total:.1f} s in all)\n"
          f"seed           {seed}")
    if grew:
        dev = "n/a" if grew["device_bytes"] is None else f"{grew['device_bytes'] / sampling.MIB:+.1f} MiB"
        live = {k: v for k, v in grew["live"].items() if v}
        print(f"growth minute 1 -> end ({samples[1].t_s / 60:.2f} -> {samples[-1].t_s / 60:.2f} min): device {dev}, "
              f"rss {grew['rss_bytes'] / sampling.MIB:+.1f} MiB, fds {grew['fds']:+d}, maps {grew['maps']:+d}, "
              f"live resources {live or 'unchanged'}")
