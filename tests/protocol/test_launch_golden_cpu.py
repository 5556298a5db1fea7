"""The host side launches exactly what 05ee552 launched: the kernel, cluster shape, grid,
stream and parameter-block bytes of every launch, and every copy, memset and returned view,
over a sweep of protocols (fence, sentinel, auto), T^ and T, FP8 combine, PDL, ranks per GPU,
repeated calls (the fast path), staged partials, outs, streams, dispatch-only steps,
active-rank changes and a rejected step (launch_trace.py records it; the golden file holds
05ee552's trace)."""
import json

from launch_trace import GOLDEN, trace


def test_every_launch_matches_05ee552_byte_for_byte(monkeypatch):
    want = json.loads(GOLDEN.read_text())
    got = trace(monkeypatch.setattr)
    assert sum(e[0] == "launch" for e in got) > 3000
    bad = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)
    where = None if bad is None else next(e for e in reversed(want[:bad + 1]) if e[0] == "config")
    assert bad is None and len(got) == len(want), \
        f"event {bad} differs (in {where}): 05ee552 {want[bad] if bad is not None else len(want)}, now {got[bad] if bad is not None else len(got)}"
