"""The step kinds of the mixed soak (`python -m ep_a2a.stress --mixed`) and their registry.

A step kind is one function `run(soak, rng, verify) -> Outcome`: it runs one whole step on
the soak's in-process ranks with inputs drawn from `rng` (the step's own generator: a step
reproduces from (seed, step)), checks its outputs bitwise against the NumPy reference when
`verify` is true, and says what it ran. It keeps what outlives a step (all-to-alls, captured
graphs, buffers) through `soak.resource(key, make, close)`, built at its first step and
closed when the soak ends, so that what it made is in use from minute 1 to the end and the
growth verdict sees leaks, not warm-up.

Extension point: a new kind is one decorated function in a module named
`ep_a2a/tools/stress_kind_<name>.py`; load_kinds() imports every such module, so the
function joins the soak's draw with its weight, its steps counted and reported apart:

    from .stress_kinds import Outcome, step_kind

    @step_kind("split", weight=1.0)
    def split_step(soak, rng, verify):
        a2a = soak.alltoall("split", protocol="auto", ...)   # built once, closed at the end
        ...                                                   # one step, checked when verify
        return Outcome("split/fence", protocol="fence", checked=verify, mismatches=[...])

`needs="torch"` makes a kind run only where torch with CUDA is importable (skipped and said
otherwise). A kind raises on anything that leaves the ranks mid-step; the soak then stops.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class Outcome:
    """What one step ran and found."""
    label: str                       # e.g. "eager/bf16/float32" (counted per label in the report)
    protocol: str | None = None      # the protocol its dispatch ran ("fence" / "sentinel")
    checked: bool = False            # its outputs were compared with the reference
    mismatches: list = field(default_factory=list)
    dispatch_bytes: int = 0          # logical bytes (stress.logical_bytes)
    combine_bytes: int = 0


@dataclass(frozen=True)
class StepKind:
    name: str
    run: Callable
    weight: float
    needs: str | None


KINDS: dict = {}


def step_kind(name: str, weight: float = 1.0, needs: str | None = None):
    """Register `run(soak, rng, verify) -> Outcome` as the step kind `name`, drawn with
    probability proportional to `weight`."""
    if not weight > 0:
        raise ValueError(f"step kind {name!r}: weight must be > 0, got {weight}")
    if needs not in (None, "torch"):
        raise ValueError(f"step kind {name!r}: needs must be None or 'torch', got {needs!r}")

    def register(run):
        if name in KINDS and KINDS[name].run is not run:
            raise ValueError(f"step kind {name!r} is registered twice ({KINDS[name].run.__module__}, {run.__module__})")
        KINDS[name] = StepKind(name, run, float(weight), needs)
        return run
    return register


def load_kinds() -> dict:
    """Import every ep_a2a/tools/stress_kind_*.py (each registers its kinds); the registry."""
    here = Path(__file__).parent
    for info in pkgutil.iter_modules([str(here)]):
        if info.name.startswith("stress_kind_"):
            importlib.import_module(f"{__package__}.{info.name}")
    return KINDS


def torch_missing() -> str | None:
    """Why the torch kinds cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not importable"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def usable(kinds: dict, wanted=None) -> tuple:
    """({name: StepKind} to run, {name: why skipped}) from the registry and --kinds."""
    names = list(kinds) if wanted is None else list(wanted)
    unknown = [n for n in names if n not in kinds]
    if unknown:
        raise ValueError(f"unknown step kinds {unknown} (registered: {sorted(kinds)})")
    run, skipped = {}, {}
    why_torch = torch_missing() if any(kinds[n].needs == "torch" for n in names) else None
    for n in names:
        if kinds[n].needs == "torch" and why_torch:
            skipped[n] = why_torch
        else:
            run[n] = kinds[n]
    return run, skipped


def draw(rng, kinds: dict) -> StepKind:
    """One kind, with probability proportional to its weight."""
    items = list(kinds.values())
    w = [k.weight for k in items]
    return items[int(rng.choice(len(items), p=[x / sum(w) for x in w]))]


class Soak:
    """What a step function is given: the group, the command line, and the resources that
    outlive a step (closed in reverse order of making when the soak ends)."""

    def __init__(self, group, args, seed: int):
        self.group, self.args, self.seed = group, args, seed
        self.ep_size = group.ep_size
        self._made: dict = {}   # key -> (object, close)

    def resource(self, key, make: Callable, close: Callable | None = None):
        """The object made by `make()` at the first call with `key`, the same one after."""
        got = self._made.get(key)
        if got is None:
            obj = make()
            got = self._made[key] = (obj, close or (lambda o: o.close()))
        return got[0]

    def alltoall(self, key, **options):
        """A MoeAlltoAll on the soak's group, built at the first call with `key`."""
        import ep_a2a
        options.setdefault("timeout_s", 20.0)
        return self.resource(("alltoall", key), lambda: ep_a2a.MoeAlltoAll(self.group, **options))

    def drop(self, key) -> None:
        """Close and forget the resource `key` (a kind that rebuilds what it made)."""
        got = self._made.pop(key, None)
        if got is not None:
            got[1](got[0])

    def close(self) -> list:
        """Close every resource, newest first; the errors, as strings (after a lost context
        closing fails: reported, not raised over the soak's own result)."""
        errors = []
        for key in reversed(list(self._made)):
            obj, close = self._made.pop(key)
            try:
                close(obj)
            except Exception as e:
                errors.append(f"closing {key}: {type(e).__name__}: {e}")
        return errors
