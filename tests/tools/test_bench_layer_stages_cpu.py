"""The graphed layer benchmark's arithmetic without a GPU: kernel names (as torch, cuBLAS,
CUTLASS and our cubins give them in kineto chrome traces) into stages, back-to-back replays cut
apart, stage spans over concurrent ranks, the summary table and the stage plot. Timelines are
drawn fresh: 8 ranks whose kernels start at random offsets, several replays, chrome-trace
event dicts as torch.profiler exports them."""
import json

import numpy as np
import pytest

from common import fresh_rng
from ep_a2a.tools import bench_layer, bench_layer_report, bench_layer_stages as st

# names as kineto reports them (demangled; our kernels are extern "C")
NAMES = {
    "router": ["void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float, "
               "unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int, at::cuda::detail::TensorInfo"
               "<float, unsigned int>, unsigned int, at::cuda::detail::TensorInfo<long, unsigned int>, unsigned int)",
               "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long, at::native::GTOp<float, true>, "
               "unsigned int>(at::cuda::detail::TensorInfo<float, unsigned int>, unsigned int, unsigned int, unsigned int)",
               "void (anonymous namespace)::softmax_warp_forward<float, float, float, 3, false, false>(float*, float const*, "
               "int, int, int, bool const*, int, bool)",
               "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
               "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(long)#1}, "
               "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>>(int, ...)"],
    "dispatch": ["fence_dispatch"],
    "index": ["moe_index_fused"],
    "gather": ["moe_gather_rows"],
    "fc1": ["Memcpy DtoD (Device -> Device)",
            "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
            "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int>>, ...>>>(...)"],
    "activation": ["void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel"
                   "(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::"
                   "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul>>(int, ...)",
                   "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
                   "BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::"
                   "MulFunctor<float>>>(at::TensorIteratorBase&, ...)"],
    "fc2": ["void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
            "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int>>, ...>>>(...)"],
    "finalize": ["moe_finalize_bf16_bf16"],
    "combine": ["fence_combine_bf16"],
}


def _cat(name):
    return "gpu_memcpy" if name.startswith("Memcpy") else "kernel"


def _covered(intervals) -> float:
    """Length of the union of intervals: every piece between consecutive boundaries that some
    interval holds."""
    cuts = sorted({x for iv in intervals for x in iv})
    return sum(b - a for a, b in zip(cuts, cuts[1:]) if any(s <= a and b <= e for s, e in intervals))


def _timeline(rng, ranks, replays):
    """Chrome-trace events of `replays` back-to-back replays of one step of `ranks` ranks
    whose stages follow each other on every rank with random lengths and offsets, and the
    expected span of every stage per replay."""
    events, want, t = [], [], 0.0
    for _ in range(replays):
        spans = {s: [np.inf, -np.inf] for s in st.OURS_STAGES}
        ends, glue = [], []
        for r in range(ranks):
            clock = t + rng.uniform(0, 3)
            for stage in st.OURS_STAGES:
                for name in NAMES[stage]:
                    clock += rng.uniform(0, 1)
                    dur = rng.uniform(0.5, 20)
                    events.append(dict(ph="X", cat=_cat(name), name=name, ts=clock, dur=dur,
                                       args={"stream": 100 + r}))
                    spans[stage][0] = min(spans[stage][0], clock)
                    spans[stage][1] = max(spans[stage][1], clock + dur)
                    if stage in ("index", "gather", "finalize"):
                        glue.append((clock, clock + dur))
                    clock += dur
            ends.append(clock)
        want.append({s: b - a for s, (a, b) in spans.items()})
        want[-1]["glue_busy"] = _covered(glue)
        t = max(ends) + rng.uniform(1, 5)
    events.append(dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", ts=0.0, dur=5.0))  # a host record
    order = rng.permutation(len(events))
    return [events[i] for i in order], want


def test_names_classify_into_the_stages():
    for stage, names in NAMES.items():
        for name in names:
            cls = st.kernel_class(name, _cat(name))
            got = st.OURS_MAP.get(cls, "gemm" if cls == "gemm" else None)
            assert got in (stage, "gemm"), (stage, name, cls)
    assert st.kernel_class("sentinel_dispatch_send") == "dispatch"   # a protocol split into halves
    assert st.kernel_class("void cub::CUB_300000_SM_900::DeviceRadixSortOnesweepKernel<...>") == "sort"
    assert st.kernel_class("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
                           "at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>>>>") == "reduce"
    assert st.kernel_class("nvjet_tst_128x64_64x6_1x1_h_bz_TNT") == "gemm"
    assert st.kernel_class("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long>") \
        == "index_select"
    assert st.kernel_class("some_unknown_kernel") == "other"
    assert st.kernel_class("memcpy32_post") == st.kernel_class("Memcpy DtoD", "gpu_memcpy") == "memcpy"  # (a graph's copy node)


@pytest.mark.parametrize("ranks,replays", [(8, 5), (2, 3), (1, 1)])
def test_stage_spans_over_concurrent_ranks(ranks, replays):
    rng, seed = fresh_rng()
    events, want = _timeline(rng, ranks, replays + 1)
    got = st.ours_stage_times(events, replays + 1, skip=1)
    assert got["replays"] == replays and got["records_per_replay"] == ranks * sum(len(v) for v in NAMES.values())
    for stage in st.OURS_STAGES:  # (each rank on a stream of its own: FC1 / FC2 split per stream)
        spans = [w[stage] for w in want[1:]]
        assert got["mean_us"][stage] == pytest.approx(np.mean(spans), rel=1e-9), (seed, stage)
        assert got["median_us"][stage] == pytest.approx(np.median(spans), rel=1e-9), (seed, stage)
    assert got["mean_us"]["glue"] >= max(got["mean_us"]["index"], got["mean_us"]["gather"]) - 1e-9
    assert got["mean_us"]["glue_busy"] == pytest.approx(np.mean([w["glue_busy"] for w in want[1:]]), rel=1e-9), seed
    assert got["mean_us"]["layer"] >= got["mean_us"]["compute"]
    assert "fence_dispatch" in got["kernels"]["dispatch"]


def test_fc1_fc2_split_by_start_order():
    """Two ranks whose FC2s start after both FC1s: the first half of the GEMMs is FC1."""
    g = NAMES["fc2"][0]
    recs = [(0.0, 10.0, g, "kernel"), (1.0, 12.0, g, "kernel"), (15.0, 20.0, g, "kernel"), (13.0, 30.0, g, "kernel")]
    by = st.classify_replay(sorted(recs), st.OURS_MAP, st.OURS_STAGES)
    assert st.span(by["fc1"]) == 12.0 and st.span(by["fc2"]) == 17.0


def test_fc1_fc2_split_per_stream_when_the_records_carry_rank_streams():
    """Rank 1's FC2 starts before rank 2's FC1: by stream the split is still right."""
    g = NAMES["fc2"][0]
    recs = sorted([(0.0, 5.0, g, "kernel", 11), (6.0, 9.0, g, "kernel", 11),      # rank 1: FC1, FC2
                   (7.0, 20.0, g, "kernel", 12), (21.0, 30.0, g, "kernel", 12)])  # rank 2: FC1, FC2
    fc1, fc2 = st.split_fc(recs)
    assert [r[0] for r in fc1] == [0.0, 7.0] and [r[0] for r in fc2] == [6.0, 21.0]
    one_stream = [r[:4] + (7,) for r in recs]
    fc1, fc2 = st.split_fc(one_stream)   # graph kernels on the launch stream: by start order
    assert [r[0] for r in fc1] == [0.0, 6.0] and [r[0] for r in fc2] == [7.0, 21.0]


def test_replays_that_overlap_or_do_not_divide_are_refused():
    rng, _ = fresh_rng()
    events, _ = _timeline(rng, 4, 3)
    recs = st.device_records(events)
    with pytest.raises(ValueError, match="replays"):
        st.split_replays(recs[:-1], 3)   # one record short: the name counts no longer divide
    one = [(0.0, 10.0, "fence_dispatch", "kernel", 7), (5.0, 15.0, "fence_combine_bf16", "kernel", 7)]
    overlapping = one + [(a + 12.0, b + 12.0, n, c, x) for a, b, n, c, x in one]   # the second starts before 15
    with pytest.raises(ValueError, match="overlap"):
        st.split_replays(overlapping, 2)
    stray = recs + [(recs[-1][1] + 1, recs[-1][1] + 2, "Memset (Device)", "gpu_memset", 7)]
    assert len(st.split_replays(sorted(stray), 3)) == 3   # a record of no replay is dropped


def test_busy_is_the_union():
    assert st.busy([(0, 2, "a"), (1, 3, "b"), (5, 6, "c")]) == 4
    assert st.span([(0, 2, "a"), (5, 6, "c")]) == 6 and st.span([]) == 0.0


def _row(rng, T, routing):
    step = lambda: dict(step_us=float(rng.uniform(10, 100)), spread_us=0.5, graph_overhead_us=3.0, replay_us=[1, 2])  # noqa
    rng2, _ = fresh_rng()
    events, _ = _timeline(rng2, 8, 3)
    row = dict(tokens_per_rank=T, routing=routing, load_imbalance=1.0, eager_host_us_per_rank=50.0,
               graph_equals_eager=True, weight_bytes_read=10 ** 9, ours=step(), baseline=step(), gemm_floor=step())
    row["ours"]["stages"] = st.ours_stage_times(events, 3)
    row["baseline"]["stages"] = dict(error="no CUPTI")
    from ep_a2a.tools.bench_layer_graphs import derive_figures
    derive_figures(row, 4.0)
    return row


def test_table_and_svg_from_rows(tmp_path):
    rng, seed = fresh_rng()
    rows = [_row(rng, T, r) for T in (1, 128) for r in ("perfect", "zipf1.25")]
    text = bench_layer_report.table(rows)
    assert len(text.splitlines()) == 5 and "zipf1.25" in text
    assert rows[0]["weight_read_floor_us"] == pytest.approx(250.0)
    assert 0 < rows[0]["glue_share"] and 0 < rows[0]["glue_busy_share"]
    doc = dict(device="NVIDIA H200", config=dict(profile="small", ranks=8), rows=rows)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "s.svg"
    assert bench_layer_report.main([str(path), str(out)]) == 0
    svg = out.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>") and svg.count("<rect") > 4 * 9


def test_graph_options():
    a = bench_layer.parse_args(["--graph", "--tokens", "1,4", "--routing", "perfect,zipf1", "--out", "/tmp/x.json"])
    assert a.tokens == [1, 4] and a.routing == ["perfect", "zipf1"] and a.protocol == "fence"
    assert bench_layer.parse_args(["--out", "/tmp/x.json"]).tokens == [1, 16, 128, 1024]
    a = bench_layer.parse_args(["--graph", "--compute-graphs", "--out", "/tmp/x.json"])
    assert a.compute_graphs and bench_layer.result_file(dict(device="NVIDIA H200"), a) == \
        "moe-layer-h200-8ranks-small-torch-graph-compute-graphs"
    for bad in (["--graph", "--gemm", "loop"], ["--graph", "--combine-quant", "fp8"], ["--routing", "zipf2"],
                ["--compute-graphs", "--gemm", "loop"], ["--compute-graphs", "--framework", "jax"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(bad + ["--out", "/tmp/x.json"])


def test_replays_are_cut_by_the_graph_launch_that_tagged_them():
    """Records with CUPTI correlation ids: each replay is its launch's records, even where a
    stray kernel shares a name with a replay's (the name counts then no longer divide)."""
    rng, _ = fresh_rng()
    events, _ = _timeline(rng, 4, 3)
    recs = st.device_records(events)
    k = len(recs) // 3
    tagged = [r[:5] + (100 + i // k,) for i, r in enumerate(recs)]
    stray = (tagged[-1][1] + 1, tagged[-1][1] + 2, tagged[0][2], tagged[0][3], 7, 999)
    got = st.split_replays(sorted(tagged + [stray]), 3)
    assert got == [tagged[i * k:(i + 1) * k] for i in range(3)]
    assert st.split_replays(sorted(tagged), 2) == [tagged[k:2 * k], tagged[2 * k:]]   # the last launches


def test_kernels_launched_one_by_one_are_cut_by_their_name_counts():
    """Records whose correlation ids are each their own (kernels launched one by one, as XLA
    does without command buffers) hold no graph launch: the replays are cut by the name counts,
    not taken as the last single records."""
    rng, _ = fresh_rng()
    events, _ = _timeline(rng, 4, 3)
    recs = st.device_records(events)
    k = len(recs) // 3
    single = [r[:5] + (1000 + i,) for i, r in enumerate(recs)]
    got = st.split_replays(single, 3)
    assert [len(c) for c in got] == [k, k, k] and got == [single[i * k:(i + 1) * k] for i in range(3)]
    # a step in two graphs of different sizes: the larger alone is not a replay
    two = [r[:5] + (2000 + 2 * (i // k) + (i % k >= 2 * k // 3),) for i, r in enumerate(recs)]
    assert st.split_replays(two, 3) == [two[i * k:(i + 1) * k] for i in range(3)]


def test_trace_events_reads_a_profile_back():
    """trace_events: a finished torch.profiler profile's chrome-trace events (CPU activity here)."""
    torch = pytest.importorskip("torch")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
    events = st.trace_events(prof)
    assert isinstance(events, list) and any("add_" in str(e.get("name", "")) for e in events), events[:5]
