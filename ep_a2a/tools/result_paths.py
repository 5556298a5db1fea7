"""Where the tools write their JSON: the checkout's bench/results when the package runs from a
checkout (a `.git` or `pyproject.toml` beside the ep_a2a/ folder), otherwise only where --out
says, never a path relative to the working directory. Default names follow bench/results'
convention (docs/benchmarks.md): `<benchmark>-<device>-<ranks>[-<profile>][-<variant>].json`,
one file per benchmark and configuration; the date and commit go inside the file."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]   # the ep_a2a/ folder


def checkout_root() -> Path | None:
    """The source checkout this package runs from, or None for an installed package."""
    root = PACKAGE.parent
    return root if (root / ".git").exists() or (root / "pyproject.toml").is_file() else None


def results_dir() -> Path | None:
    root = checkout_root()
    return None if root is None else root / "bench" / "results"


OUT_HELP = ("JSON path (default: bench/results/<name>.json in the ep_a2a checkout this runs from; "
            "required when ep_a2a is installed rather than run from a checkout)")


def check_out(parser: argparse.ArgumentParser, out) -> None:
    """A command-line error (status 2) when there is neither --out nor a checkout to write into."""
    if out is None and results_dir() is None:
        parser.error(f"--out is required: ep_a2a runs from {PACKAGE}, not from a checkout, "
                     "so there is no bench/results to write into")


def slug(text) -> str:
    """Lower case, runs of anything but letters, digits and dots as one '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", str(text).lower()).strip("-")


def device_slug(name: str, gpus: int = 1) -> str:
    """'NVIDIA H200' -> 'h200'; two of them -> '2xh200'."""
    s = slug(re.sub(r"(?i)^nvidia\s+", "", name))
    return f"{gpus}x{s}" if gpus > 1 else s


def result_name(benchmark: str, device: str, ranks: str, *variant) -> str:
    """The file stem of one benchmark and configuration: parts joined by '-', empty ones left out."""
    return "-".join(slug(p) for p in (benchmark, device, ranks, *variant) if p not in (None, ""))


def output_path(out, name: str) -> Path:
    """--out as given, else <checkout>/bench/results/<name>.json."""
    if out is not None:
        return Path(out)
    d = results_dir()
    if d is None:  # check_out at parse time makes this unreachable from the tools
        raise ValueError("no --out and no checkout to write bench/results into")
    return d / f"{name}.json"


def write_json(path: Path, doc: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path
