"""The graphed layer benchmark's summary table (printed last) and its stage plot: an SVG written
by hand from the JSON (no plotting library), one horizontal bar per (size, routing) and
implementation, stages as coloured segments placed where they start in the step.

    python -m ep_a2a.tools.bench_layer_report bench/results/<file>.json docs/layer-stages.svg
"""
from __future__ import annotations

import json
import sys
from html import escape

COLOURS = {"router": "#9e9e9e", "dispatch": "#1f77b4", "index": "#ff7f0e", "gather": "#ffbb78", "fc1": "#2ca02c",
           "activation": "#98df8a", "fc2": "#17becf", "finalize": "#d62728", "combine": "#9467bd",
           "allgather": "#1f77b4", "compute": "#2ca02c", "reducescatter": "#9467bd"}


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows) -> str:
    """The summary: per size and routing, µs per step of ours, the baseline and the GEMM floor,
    the speedup, our stages (dispatch / compute / combine), glue share (spans; the time some
    glue kernel runs), weight-read floor and the eager host cost per rank."""
    head = (f"{'T':>5} {'routing':8} {'ours':>9} {'±':>6} {'baseline':>9} {'±':>6} {'x':>5} {'GEMM fl':>8} "
            f"{'disp/comp/comb':>20} {'glue%':>6} {'busy%':>6} {'W floor':>8} {'imba':>5} {'host/rk':>7} {'==':>3}")
    lines = [head]
    for r in rows:
        o, b, f = r["ours"], r["baseline"], r["gemm_floor"]
        st = o.get("stages", {}).get("mean_us") or {}
        stages = "/".join(_fmt(st.get(k)) for k in ("dispatch", "compute", "combine")) if st else "-"
        glue, busy = r.get("glue_share"), r.get("glue_busy_share")
        lines.append(f"{r['tokens_per_rank']:>5} {r['routing']:8} {o['step_us']:>9.1f} {o['spread_us']:>6.1f} "
                     f"{b['step_us']:>9.1f} {b['spread_us']:>6.1f} {_fmt(r.get('speedup_vs_baseline'), '.2f'):>5} "
                     f"{f['step_us']:>8.1f} {stages:>20} {_fmt(None if glue is None else 100 * glue):>6} "
                     f"{_fmt(None if busy is None else 100 * busy):>6} "
                     f"{r['weight_read_floor_us']:>8.1f} {r['load_imbalance']:>5.2f} "
                     f"{r['eager_host_us_per_rank']:>7.1f} {'y' if r.get('graph_equals_eager') else 'N':>3}")
    return "\n".join(lines)


def _stage_bars(impl: dict) -> list:
    """(stage, start µs, length µs) of an implementation's stages, from its mean spans laid
    end to end in the order of the step (spans overlap slightly in the trace; the plot shows
    each stage's length)."""
    st = impl.get("stages", {})
    mean = st.get("mean_us") or {}
    order = [k for k in COLOURS if k in mean and k in (st.get("kernels") or {})]
    bars, x = [], 0.0
    for k in order:
        if mean[k] > 0:
            bars.append((k, x, mean[k]))
            x += mean[k]
    return bars


def svg(doc: dict, width: int = 900) -> str:
    """The stage plot of a graphed run's JSON as SVG text."""
    rows = [r for r in doc["rows"] if r["ours"].get("stages", {}).get("mean_us")]
    bars = []
    for r in rows:
        for name in ("ours", "baseline"):
            bars.append((f"T={r['tokens_per_rank']} {r['routing']} {name}", _stage_bars(r[name]), r[name]["step_us"]))
    most = max([max([s + n for _, s, n in b] + [t]) for _, b, t in bars] + [1.0])
    left, bar_h, gap, top = 190, 14, 6, 40
    scale = (width - left - 20) / most
    h = top + len(bars) * (bar_h + gap) + 60
    cfg = doc.get("config", {})
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="10" y="18" font-size="13">{escape(doc.get("device", ""))}: MoE layer stages, '
           f'{escape(str(cfg.get("profile", "")))} profile, {cfg.get("ranks", "")} ranks, CUDA graphs (µs; '
           f'black tick: step time)</text>']
    for i, (label, segs, total) in enumerate(bars):
        y = top + i * (bar_h + gap)
        out.append(f'<text x="{left - 6}" y="{y + bar_h - 3}" text-anchor="end">{escape(label)}</text>')
        for stage, start, length in segs:
            out.append(f'<rect x="{left + start * scale:.1f}" y="{y}" width="{max(length * scale, 0.5):.1f}" '
                       f'height="{bar_h}" fill="{COLOURS[stage]}"><title>{stage} {length:.1f} µs</title></rect>')
        out.append(f'<rect x="{left + total * scale - 1:.1f}" y="{y - 2}" width="2" height="{bar_h + 4}" fill="black"/>')
    y = top + len(bars) * (bar_h + gap) + 20
    x = left
    for stage, colour in COLOURS.items():
        out.append(f'<rect x="{x}" y="{y - 10}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{x + 13}" y="{y}">{stage}</text>')
        x += 13 + 7 * len(stage) + 12
        if x > width - 80:
            x, y = left, y + 16
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m ep_a2a.tools.bench_layer_report RESULT.json OUT.svg", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    with open(argv[1], "w") as f:
        f.write(svg(doc))
    print(table(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
