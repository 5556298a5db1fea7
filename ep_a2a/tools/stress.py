"""python -m ep_a2a.stress: a soak of dispatch/combine on in-process ranks sharing one GPU.

Every step draws, from a per-step seed, a random configuration: one of the all-to-alls built
up front (one per payload format and combine dtype, each with its own hidden size, top_k and
expert count), the protocol (fence, sentinel, or auto around a crossover inside the token
range, so auto switches step to step), runtime_max_tokens_per_rank, the token count of each
rank (zeros included), the routing (uniform, zipf, perfect; a fraction of the selections
-1), exact or random-normal partial results, zero-copy or staged combine, and for the FP8
combine whether combine quantizes or the stand-in epilogue wrote the FP8 input itself.
Every step runs the real dispatch and combine on random data; the checked steps also
compare every byte with the NumPy reference (ep_a2a/testing/harness.py, the harness the tests use).

Bytes moved are logical, as in the paper's Appendix B: per step,
  dispatch: sum of tokens * min(ep_size, top_k) * activation bytes per token (hidden states
            and their scales; expert ids and router weights left out),
  combine:  sum of tokens * min(ep_size, top_k) * hidden * combine dtype size.
With --mixed the command runs the mixed soak instead (stress_mixed.py): eager steps of both
protocols and auto, FP8 combine, active-rank changes, CUDA graphs per T^ replayed between
eager steps and torch-op steps, one kind per step, with a sample of memory, fds and VMM
mappings every minute and a verdict on their growth.
Exit status: 0 all good, 1 a mismatch, an error or (--mixed) growth, 2 a bad command line,
3 no usable GPU.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time

import numpy as np

from ..config import PROTOCOLS, REDUCE_DTYPES
from . import exits
from .argtypes import int_in, nonnegative_int, positive_float, positive_int
from .result_paths import OUT_HELP, check_out, device_slug, output_path, result_name, write_json

FORMATS = ("bf16", "mxfp8", "nvfp4", "opaque")
COMBINE_DTYPES = tuple(REDUCE_DTYPES)
ROUTES = ("uniform", "zipf", "perfect")
MODES = PROTOCOLS
HIDDEN = (7, 96, 200, 512, 1024)   # 7 and 200: byte counts that are not multiples of 16
TOP_K = (1, 2, 4, 6, 8)
PROGRESS_S = 30.0


EPILOG = f"""examples:
  python -m ep_a2a.stress --minutes 5
      a 5-minute soak, 4 in-process ranks on GPU 0
  python -m ep_a2a.stress --steps 200 --ranks 8 --seed 1234
      200 steps, reproducing a run's draws from its seed

  python -m ep_a2a.stress --mixed --minutes 9 --out /tmp/soak.json
      the mixed soak: 8 in-process ranks, every step kind, a sample line per minute and a
      final "VERDICT: PASS" or "VERDICT: FAIL" line
  python -m ep_a2a.stress --mixed --list-kinds
      the registered step kinds (ep_a2a/tools/stress_kind_*.py) and their weights

The summary goes to bench/results/stress-<gpu>-<M>min.json (stress-mixed-<gpu>-<R>ranks-<M>min
.json with --mixed; -<S>steps for --steps) in the checkout, or to --out.
{exits.EPILOG}"""


def parser() -> argparse.ArgumentParser:
    """The command line's options, each with its help."""
    from ..layout import MAX_RANKS
    ap = argparse.ArgumentParser(prog="python -m ep_a2a.stress", description=__doc__.split("\n")[0], epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    dur = ap.add_mutually_exclusive_group()
    dur.add_argument("--minutes", type=positive_float, default=None, help="run this long (default 3)")
    dur.add_argument("--steps", type=positive_int, default=None, help="run this many steps instead")
    ap.add_argument("--check-every", type=positive_int, default=None,
                    help="check every k-th step against the reference (default: every one of the first 50, "
                         "then every 10th; every 4th with --mixed)")
    ap.add_argument("--ranks", type=int_in(1, MAX_RANKS), default=None,
                    help="in-process ranks on --device (default 4; 8 with --mixed)")
    ap.add_argument("--device", type=nonnegative_int, default=0, help="the GPU ordinal (default 0)")
    ap.add_argument("--max-tokens", type=int_in(1, 2 ** 23 - 1), default=128,
                    help="max_tokens_per_rank of every all-to-all (default 128)")
    ap.add_argument("--seed", type=nonnegative_int, default=None, help="seed of every draw; one step reproduces from (seed, step) (default: drawn at random and printed)")
    ap.add_argument("--out", "--json", dest="out", default=None, help=OUT_HELP + "; --json is the older name")
    mixed = ap.add_argument_group("mixed soak")
    mixed.add_argument("--mixed", action="store_true", help="run the mixed soak (every registered step kind)")
    mixed.add_argument("--kinds", type=name_list, default=None,
                       help="comma-separated step kinds of the mixed soak (default: every registered one)")
    mixed.add_argument("--sample-s", type=positive_float, default=60.0,
                       help="seconds between two samples of memory, fds and mappings (default 60: once a minute)")
    mixed.add_argument("--list-kinds", action="store_true", help="list the registered step kinds and exit")
    return ap


def name_list(s: str) -> list:
    """A comma-separated list of names (checked against the registry once it is loaded)."""
    parts = [p.strip() for p in s.split(",")]
    if not s.strip() or "" in parts:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {s!r}")
    return parts


name_list.__name__ = "name list"


def parse_args(argv):
    """The parsed command line, defaults resolved (--ranks, --minutes, --seed); exit 2 on a bad one."""
    ap = parser()
    args = ap.parse_args(argv)
    if not args.mixed and (args.kinds is not None or args.list_kinds):
        ap.error("--kinds and --list-kinds belong to the mixed soak: add --mixed")
    if args.kinds is not None:
        from .stress_kinds import load_kinds
        unknown = sorted(set(args.kinds) - set(load_kinds()))
        if unknown:
            ap.error(f"--kinds: unknown step kinds {', '.join(unknown)} (registered: {', '.join(sorted(load_kinds()))})")
    if args.ranks is None:
        args.ranks = 8 if args.mixed else 4
    if args.minutes is None and args.steps is None:
        args.minutes = 3.0
    if args.seed is None:
        args.seed = int(np.random.default_rng().integers(2 ** 31))
    check_out(ap, args.out)
    return args


def build_alltoalls(group, args, rng, built: dict) -> dict:
    """One all-to-all per (format, combine dtype), shapes drawn from `rng`, protocol "auto" so
    that both protocols' kernels and workspace exist; the step picks the protocol. Filled into
    `built` as they are made, so the caller closes those made before a failure."""
    import ep_a2a
    from ..testing.formats import payload_formats
    ep = group.ep_size
    for fmt in FORMATS:
        for cdt in COMBINE_DTYPES:
            hidden, top_k = int(rng.choice(HIDDEN)), int(rng.choice(TOP_K))
            experts = int(rng.integers(max(top_k, ep), 8 * ep + 3))
            crossover = int(rng.integers(1, args.max_tokens)) if args.max_tokens > 1 else 1
            a2a = ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=args.max_tokens, top_k=top_k, num_experts=experts,
                                     payloads=payload_formats(hidden, top_k)[fmt], combine_hidden_size=hidden,
                                     combine_dtype=cdt, protocol="auto", crossover_tokens=crossover, timeout_s=20.0)
            built[fmt, cdt] = a2a
    for cdt in COMBINE_DTYPES:  # FP8 combine (FENCE only; hidden a multiple of 128)
        hidden, top_k = int(rng.choice([128, 256, 384])), int(rng.choice(TOP_K))
        experts = int(rng.integers(max(top_k, ep), 8 * ep + 3))
        built["bf16+fp8-combine", cdt] = ep_a2a.MoeAlltoAll(
            group, max_tokens_per_rank=args.max_tokens, top_k=top_k, num_experts=experts,
            payloads=payload_formats(hidden, top_k)["bf16"], combine_hidden_size=hidden, combine_dtype=cdt,
            protocol="fence", combine_quant="fp8", timeout_s=20.0)
    return built


def logical_bytes(tokens, ep_size: int, top_k: int, payload_specs, hidden: int, combine_itemsize: int) -> tuple:
    """(dispatch, combine) logical bytes of one step (see the module docstring)."""
    fan = min(ep_size, top_k) * int(sum(tokens))
    act = sum(s.bytes_per_token for s in payload_specs if s.name != "weights")
    return fan * act, fan * hidden * combine_itemsize


def step_bytes(a2a, tokens) -> tuple:
    """logical_bytes of one step of `a2a` with these token counts."""
    return logical_bytes(tokens, a2a.ep_size, a2a.top_k, a2a.payload_specs, a2a.combine_hidden_size,
                         a2a.combine_dtype.itemsize)


def draw_step(rng, a2as, max_tokens: int, ep: int) -> dict:
    key = list(a2as)[int(rng.integers(len(a2as)))]
    u = rng.random()
    tmax = 1 if u < 0.1 else max_tokens if u < 0.2 else int(rng.integers(1, max_tokens + 1))
    tokens = rng.integers(0, tmax + 1, ep)
    tokens[rng.random(ep) < 0.15] = 0       # idle ranks
    tokens[rng.random(ep) < 0.15] = tmax    # full ranks
    return dict(key=key, mode=str(rng.choice(MODES)), tmax=tmax, tokens=[int(t) for t in tokens],
                route=str(rng.choice(ROUTES)), invalid=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
                alpha=float(rng.uniform(0.6, 2.0)), exact=bool(rng.random() < 0.6),
                zero_copy=bool(rng.random() < 0.7), prequantize=bool(rng.random() < 0.5))


def _checked(step: int, every) -> bool:
    if every is not None:
        return step % every == 0
    return step < 50 or step % 10 == 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_kinds:
        from .stress_kinds import load_kinds
        for kind in load_kinds().values():
            print(f"{kind.name:<10} weight {kind.weight:g}{'  (needs torch with CUDA)' if kind.needs else ''}  "
                  f"{kind.run.__module__}.{kind.run.__name__}")
        return exits.OK
    missing = exits.require_gpu("ep_a2a.stress")
    if missing is not None:
        return missing
    facts = device_facts(args.device)
    if args.mixed:
        from .stress_mixed import run
        return run(args, facts)
    return run_classic(args, facts)


def run_classic(args, facts: dict) -> int:
    """The soak of one kind of step (dispatch + combine over random formats, protocols and
    sizes): until --steps or --minutes, checked against the reference every --check-every."""
    import ep_a2a
    from ..testing.harness import run_step

    seed = args.seed
    print(f"ep_a2a.stress: seed {seed} ({args.ranks} ranks on cuda:{args.device}, "
          f"{f'{args.steps} steps' if args.steps else f'{args.minutes:g} min'})", flush=True)
    t0 = time.monotonic()
    fig = dict(steps=0, steps_checked=0, dispatch_bytes=0, combine_bytes=0, bytes_moved=0, bytes_checked=0,
               mismatches=0, errors=0, protocols={}, formats={}, first_failures=[])
    group = ep_a2a.LocalGroup([args.device] * args.ranks)
    a2as = {}
    try:
        build_alltoalls(group, args, np.random.default_rng([seed, 1 << 40]), a2as)
        setup_s = time.monotonic() - t0
        start = next_report = time.monotonic()
        next_report += PROGRESS_S
        deadline = None if args.steps else start + 60.0 * args.minutes
        step = 0
        while (step < args.steps) if args.steps else (time.monotonic() < deadline):
            rng = np.random.default_rng([seed, step])  # one step reproduces from (seed, step)
            d = draw_step(rng, a2as, args.max_tokens, args.ranks)
            a2a = a2as[d["key"]]
            # an "auto" all-to-all runs either protocol's kernels; FP8 combine is FENCE only
            a2a.use_protocol("fence" if a2a.combine_quant else d["mode"])
            proto = a2a.protocol_for(d["tmax"])
            verify = _checked(step, args.check_every)
            # FP8 combine: half the steps an epilogue wrote the FP8 input itself
            prequantize = d["prequantize"] and a2a.combine_quant == "fp8"
            try:
                rep = run_step(a2a, rng, d["tokens"], d["tmax"], route=d["route"], exact=d["exact"],
                               zero_copy=d["zero_copy"], verify=verify, alpha=d["alpha"],
                               invalid_fraction=d["invalid"], prequantize=prequantize)
            except Exception as e:  # the ranks may be mid-step (or the context lost): stop here
                fig["errors"] += 1
                fig["first_failures"].append(f"step {step} ({d}): {type(e).__name__}: {e}")
                print(f"ERROR at step {step} (seed {seed}, {d}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                break
            _tally(fig, a2a, d, rep, proto, prequantize, verify, step, seed)
            step += 1
            now = time.monotonic()
            if now >= next_report:
                next_report = now + PROGRESS_S
                print(f"[{now - start:6.0f} s] {fig['steps']} steps ({fig['steps_checked']} checked), "
                      f"{(fig['dispatch_bytes'] + fig['combine_bytes']) / 1e9:.2f} GB moved, "
                      f"{fig['mismatches']} mismatches, {fig['errors']} errors, protocols {fig['protocols']}", flush=True)
        wall = time.monotonic() - start
    finally:
        for a in a2as.values():
            try:
                a.close()
            except Exception as e:  # after a kernel trap the context is gone; report, do not mask
                print(f"close failed: {type(e).__name__}: {e}", file=sys.stderr)
        try:
            group.close()
        except Exception as e:
            print(f"group close failed: {type(e).__name__}: {e}", file=sys.stderr)

    fig["bytes_moved"] = fig["dispatch_bytes"] + fig["combine_bytes"]
    fig.update(wall_s=round(wall, 3), setup_s=round(setup_s, 3))
    _report(fig, wall, setup_s, seed)
    _write_json(args, fig, facts)
    ok = fig["mismatches"] == 0 and fig["errors"] == 0
    print("OK" if ok else f"FAILED (reproduce with --seed {seed})", flush=True)
    return exits.OK if ok else exits.FAILED


def _tally(fig: dict, a2a, d: dict, rep, proto: str, prequantize: bool, verify: bool, step: int, seed: int) -> None:
    """Adds one step's figures to the classic soak's tally; a mismatch is printed at once."""
    db, cb = step_bytes(a2a, d["tokens"])
    fig["steps"] += 1
    fig["dispatch_bytes"] += db
    fig["combine_bytes"] += cb
    fig["protocols"][proto] = fig["protocols"].get(proto, 0) + 1
    name = "/".join(d["key"]) + ("/epilogue-fp8" if prequantize else "")
    fig["formats"][name] = fig["formats"].get(name, 0) + 1
    if verify:
        fig["steps_checked"] += 1
        fig["bytes_checked"] += rep.dispatch_bytes_checked
        if rep.combine_rows_checked != sum(d["tokens"]):
            rep.mismatches.append(f"combine checked {rep.combine_rows_checked} rows of {sum(d['tokens'])}")
    if rep.mismatches:
        fig["mismatches"] += len(rep.mismatches)
        if len(fig["first_failures"]) < 20:
            fig["first_failures"].append(f"step {step} ({d}): {rep.mismatches[:3]}")
        print(f"MISMATCH at step {step} (seed {seed}, {d}): {rep.mismatches[:3]}", file=sys.stderr, flush=True)


def _report(fig: dict, wall: float, setup_s: float, seed: int) -> None:
    """The classic soak's summary lines."""
    print(f"steps run      {fig['steps']}\n"
          f"steps checked  {fig['steps_checked']} ({fig['bytes_checked'] / 1e6:.1f} MB of dispatched bytes compared)\n"
          f"bytes moved    {fig['bytes_moved'] / 1e9:.3f} GB logical (dispatch {fig['dispatch_bytes'] / 1e9:.3f}, "
          f"combine {fig['combine_bytes'] / 1e9:.3f})\n"
          f"protocols      {fig['protocols']}\n"
          f"mismatches     {fig['mismatches']}\n"
          f"errors         {fig['errors']}\n"
          f"wall time      {wall:.1f} s (+{setup_s:.1f} s setup)\n"
          f"seed           {seed}", flush=True)


def device_facts(ordinal: int) -> dict:
    """Taken before the run: after a kernel trap the context is gone, and the summary is still due."""
    from ..driver.device import driver_version, get_device
    dev = get_device(ordinal)
    return dict(device=dev.name, compute_capability=list(dev.compute_capability), driver=driver_version())


def _write_json(args, fig, facts: dict) -> None:
    from .bench_report import commit
    result = dict(tool="ep_a2a.stress", **facts, commit=commit(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(), args=vars(args), **fig)
    length = f"{args.steps}steps" if args.steps else f"{args.minutes:g}min"
    path = output_path(args.out, result_name("stress", device_slug(facts["device"]), length))
    print(f"wrote {write_json(path, result)}")


if __name__ == "__main__":
    sys.exit(main())
