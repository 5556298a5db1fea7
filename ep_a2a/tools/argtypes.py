"""argparse types shared by the command-line tools: a bad value is an argparse error that
names the option (exit status 2), never a value silently replaced."""
from __future__ import annotations

import argparse


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def int_in(lo: int, hi: int | None = None):
    """An integer in lo..hi (hi None: no upper bound)."""
    def parse(s: str) -> int:
        v = _int(s)
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}, got {v}")
        return v
    parse.__name__ = "integer"   # argparse names the type in its messages
    return parse


positive_int = int_in(1)
nonnegative_int = int_in(0)


def int_list(lo: int = 1, hi: int | None = None):
    """A comma-separated list of integers, each in lo..hi."""
    one = int_in(lo, hi)

    def parse(s: str) -> list:
        parts = [p.strip() for p in s.split(",")]
        if not s.strip() or "" in parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {s!r}")
        try:
            return [one(p) for p in parts]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e}{f' (in {s!r})' if len(parts) > 1 else ''}") from None
    parse.__name__ = "integer list"
    return parse


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


positive_float.__name__ = "number"


def choice_list(choices):
    """A comma-separated list of names, each among `choices`."""
    def parse(s: str) -> list:
        parts = [p.strip() for p in s.split(",")]
        bad = [p for p in parts if p not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad))} not among {', '.join(choices)}")
        return parts
    parse.__name__ = "name list"
    return parse


def check_top_k(ap: argparse.ArgumentParser, top_k: int, experts: int) -> None:
    """--top-k selects distinct experts: at most --experts of them (an argparse error otherwise)."""
    if top_k > experts:
        ap.error(f"--top-k {top_k} exceeds the {experts} experts (--experts)")
