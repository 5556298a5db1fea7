"""Stage times of the MoE layer from profiler kernel records (the paper's Appendix B), apart
from any GPU: kernels are classified by name into stages, the records of back-to-back graph
replays are cut into replays, and a stage of one replay spans from its first kernel's start
(on any rank) to its last kernel's end (on any rank). Nothing is inserted between stages.

Records are the device events of a torch.profiler (kineto / CUPTI) chrome trace: dicts with
"name", "cat" ("kernel", "gpu_memcpy", "gpu_memset"), "ts" and "dur" in µs, "args"."stream".
Kernels of a graph replay need not carry their rank's stream (graph nodes run on streams of
the driver's choosing), so FC1 and FC2, the same GEMM kernel, are told apart by order: per
stream where the GEMMs spread over several streams with an even count on each (a stream's
first half is FC1), else over the whole step (the first half by start time: every rank's
FC1 is ready before any FC2, which waits for its FC1 and activation).
"""
from __future__ import annotations

import re
import statistics

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

# (class, pattern) in order, the first match wins; matched on the lower-cased name. Our own
# kernels are extern "C" (no namespace, no template): the protocols' dispatch / combine (any
# split of them into halves keeps the words), the fused router, and the expert index, gather,
# activation and finalize.
_CLASSES = (
    ("memcpy", re.compile(r"^memcpy\d+_")),  # (a copy node of a CUDA graph runs as such a kernel)
    ("route", re.compile(r"^moe_route")),
    ("dispatch", re.compile(r"^(fence|sentinel)\w*dispatch")),
    ("combine", re.compile(r"^(fence|sentinel)\w*combine")),
    ("index", re.compile(r"^moe_index")),
    ("gather", re.compile(r"^moe_gather")),
    ("finalize", re.compile(r"^moe_finalize")),
    ("expert_fc1", re.compile(r"^moe_expert_fc1")),
    ("expert_fc2", re.compile(r"^moe_expert_fc2")),
    ("topk", re.compile(r"topk|kvinplace|radixfindkth|computeblockwise")),
    ("softmax", re.compile(r"softmax")),
    ("sort", re.compile(r"radixsort|onesweep|segmented_?sort|devicesegmented|\bsort")),
    ("search", re.compile(r"searchsorted|bucketize")),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|grouped_?mm|groupmm|wgmma|sm90_|sm100_|ampere_|hopper_")),
    ("silu", re.compile(r"silu|swiglu")),
    ("mul", re.compile(r"mulfunctor|mul_kernel")),
    ("index_select", re.compile(r"indexselect|index_select")),
    ("index_add", re.compile(r"indexfunc|index_add|indexadd")),
    ("reduce", re.compile(r"reduce_kernel|reduceop|sum_functor")),
    ("fill", re.compile(r"fillfunctor|fill_kernel")),
    ("copy", re.compile(r"copy")),
)

# Stage of each class, per implementation. Ours: the paper's stages of the layer. Baseline:
# its collectives are the stage boundaries (router | all-gather | compute | reduce-scatter).
OURS_STAGES = ("router", "dispatch", "index", "gather", "fc1", "activation", "fc2", "finalize", "combine")
OURS_MAP = {"route": "router", "topk": "router", "softmax": "router", "copy": "router", "dispatch": "dispatch",
            "index": "index", "gather": "gather", "memcpy": "fc1", "silu": "activation", "mul": "activation",
            "finalize": "finalize", "combine": "combine",
            "expert_fc1": "fc1", "expert_fc2": "fc2"}  # torch's gemm: fc1 / fc2 by order
BASELINE_STAGES = ("router", "allgather", "compute", "reducescatter")
BASELINE_MAP = {"route": "router", "topk": "router", "memcpy": "allgather", "reduce": "reducescatter",
                "copy": "reducescatter"}
# (every other class of the baseline is its compute: select, gather, GEMMs, activation, weighted reduce)
FLOOR_STAGES = ("fc1", "fc2")
FLOOR_MAP = {}


def kernel_class(name: str, cat: str = "kernel") -> str:
    """The class of one device record: 'memcpy' / 'memset' by category, else by name ('other'
    when nothing matches)."""
    if cat == "gpu_memcpy":
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    low = name.lower()
    for cls, pat in _CLASSES:
        if pat.search(low):
            return cls
    return "other"


def trace_events(prof) -> list:
    """The chrome-trace events of a finished torch.profiler profile (its export is a file)."""
    import json
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def device_records(trace_events) -> list:
    """The device records of a chrome trace's events, as (start µs, end µs, name, cat, stream,
    correlation id), sorted by start."""
    out = []
    for e in trace_events:
        if e.get("ph", "X") == "X" and e.get("cat") in DEVICE_CATS and "ts" in e:
            ts, dur, args = float(e["ts"]), float(e.get("dur", 0.0)), e.get("args") or {}
            out.append((ts, ts + dur, str(e.get("name", "")), e["cat"], args.get("stream"), args.get("correlation")))
    out.sort(key=lambda r: (r[0], r[1]))
    return out


def split_replays(records, replays: int) -> list:
    """The records (sorted by start) of `replays` back-to-back replays of one graph, cut into
    one list per replay. Replays of a graph on one stream never overlap, so each holds the
    same number of records, in start order. Records whose name occurs fewer than `replays`
    times (a stray memset of the profiler or of the replay) are dropped first."""
    if not (isinstance(replays, int) and replays >= 1):
        raise ValueError(f"replays: must be an int >= 1, got {replays!r}")
    by_launch = _by_graph_launch(records, replays)
    if by_launch is not None:
        return by_launch
    if len(records) % replays:
        counts = {}
        for r in records:
            counts[r[2]] = counts.get(r[2], 0) + 1
        records = [r for r in records if counts[r[2]] >= replays]
    if not records or len(records) % replays:
        raise ValueError(f"{len(records)} device records do not split into {replays} replays")
    k = len(records) // replays
    chunks = [records[i * k:(i + 1) * k] for i in range(replays)]
    for a, b in zip(chunks, chunks[1:]):
        if max(r[1] for r in a) > min(r[0] for r in b) + 1e-3:
            raise ValueError("replays overlap in time: the records are not of back-to-back replays of one graph")
    return chunks


def _by_graph_launch(records, replays: int):
    """The last `replays` graph launches' records, where CUPTI tagged them: every kernel and
    copy of one graph launch carries that launch's correlation id, so strays of the profiler
    or of work outside the replays (their own ids, fewer records) fall away. None where the
    records carry no ids, too few launches hold the full graph, or the full launches are not
    (nearly) all the records: kernels launched one by one (each its own id) or a step split
    over several graphs, which the name counts cut instead."""
    if not records or any(len(r) < 6 or r[5] is None for r in records):
        return None
    groups = {}
    for r in records:
        groups.setdefault(r[5], []).append(r)
    full = max(len(g) for g in groups.values())
    launches = sorted((g for g in groups.values() if len(g) == full), key=lambda g: g[0][0])
    if full < 2 or len(launches) < replays or full * len(launches) < 0.9 * len(records):
        return None
    return launches[-replays:]


def classify_replay(chunk, mapping: dict, stages: tuple, default: str = None) -> dict:
    """stage -> records of one replay. Classes missing from `mapping` go to `default`, else to
    'other'; GEMMs not mapped split into fc1 (first half by start) and fc2."""
    out = {s: [] for s in stages}
    gemms = []
    for rec in chunk:
        cls = kernel_class(rec[2], rec[3])
        stage = mapping.get(cls)
        if stage is None and cls == "gemm" and "fc1" in stages:
            gemms.append(rec)
            continue
        if stage is None:
            stage = default or "other"
        out.setdefault(stage, []).append(rec)
    if gemms:
        fc1, fc2 = split_fc(gemms)
        out["fc1"] += fc1
        out["fc2"] += fc2
    return out


def split_fc(gemms) -> tuple:
    """(FC1 records, FC2 records) of a step's GEMM records (sorted by start); see the module
    docstring."""
    by_stream = {}
    for rec in gemms:
        by_stream.setdefault(rec[4] if len(rec) > 4 else None, []).append(rec)
    if len(by_stream) > 1 and None not in by_stream and all(len(v) % 2 == 0 for v in by_stream.values()):
        fc1 = [r for v in by_stream.values() for r in v[:len(v) // 2]]
        fc2 = [r for v in by_stream.values() for r in v[len(v) // 2:]]
        return sorted(fc1), sorted(fc2)
    half = len(gemms) // 2 if len(gemms) > 1 else 1
    return gemms[:half], gemms[half:]


def span(recs) -> float:
    """µs from the first record's start to the last record's end (0.0 for none)."""
    return max(r[1] for r in recs) - min(r[0] for r in recs) if recs else 0.0


def busy(recs) -> float:
    """µs during which at least one of the records ran (their union)."""
    total, end = 0.0, float("-inf")
    for s, e, *_ in sorted(recs):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def stage_times(trace_events, replays: int, mapping: dict, stages: tuple, default: str = None,
                groups: dict = None, busy_groups: dict = None, skip: int = 0) -> dict:
    """Per stage: mean and median over replays of its span (µs), the layer's span (first
    record to last), the groups' spans (e.g. 'compute': index..finalize), the busy groups'
    busy time (the union of their records) and the names found per stage (one replay), so a
    misclassified kernel shows in the JSON. The first `skip` replays (warm-up) are left out."""
    chunks = split_replays(device_records(trace_events), replays)[skip:]
    per = {}
    names = {}
    for i, chunk in enumerate(chunks):
        by = classify_replay(chunk, mapping, stages, default)
        per.setdefault("layer", []).append(span(chunk))
        for st, recs in by.items():
            per.setdefault(st, []).append(span(recs))
            if i == 0:
                names[st] = sorted({_short(r[2]) for r in recs})
        for g, members in (groups or {}).items():
            per.setdefault(g, []).append(span([r for m in members for r in by.get(m, [])]))
        for g, members in (busy_groups or {}).items():
            per.setdefault(g, []).append(busy([r for m in members for r in by.get(m, [])]))
    return dict(replays=len(chunks), records_per_replay=len(chunks[0]),
                mean_us={k: statistics.fmean(v) for k, v in per.items()},
                median_us={k: statistics.median(v) for k, v in per.items()},
                kernels=names)


def _short(name: str, limit: int = 90) -> str:
    return name if len(name) <= limit else name[:limit - 3] + "..."


OURS_GROUPS = {"compute": ("index", "gather", "fc1", "activation", "fc2", "finalize"),
               "glue": ("index", "gather"), "experts": ("fc1", "activation", "fc2")}
# A span runs from the first rank's kernel to the last rank's, so with ranks sharing a GPU it
# can take in their stagger; the union of the glue kernels' records is the time one of them runs.
OURS_BUSY = {"glue_busy": ("index", "gather", "finalize")}


def ours_stage_times(trace_events, replays: int, skip: int = 0) -> dict:
    """stage_times of our layer's replays (stages OURS_STAGES, groups OURS_GROUPS)."""
    return stage_times(trace_events, replays, OURS_MAP, OURS_STAGES, groups=OURS_GROUPS, busy_groups=OURS_BUSY,
                       skip=skip)


def baseline_stage_times(trace_events, replays: int, skip: int = 0) -> dict:
    """stage_times of the baseline's replays (BASELINE_STAGES; unmatched kernels: compute)."""
    return stage_times(trace_events, replays, BASELINE_MAP, BASELINE_STAGES, default="compute", skip=skip)


def floor_stage_times(trace_events, replays: int, skip: int = 0) -> dict:
    """stage_times of the GEMM-only floor's replays (fc1 / fc2)."""
    return stage_times(trace_events, replays, FLOOR_MAP, FLOOR_STAGES, skip=skip)
