"""run_phases' order and its `between` marks without a GPU (stand-in layers, one per GPU
ordinal, so the cross-rank gate has nothing to join), and the layer benchmark's eager
host-phase timer, which times run_phases at those marks."""
import types

from ep_a2a.layers.base import run_phases


class _Layer:
    def __init__(self, rank, log):
        self.rank, self.log = rank, log
        self.a2a_rank = types.SimpleNamespace(device=types.SimpleNamespace(ordinal=rank))
        self.device, self.stream = rank, f"stream{rank}"

    def prepare(self, x, router, runtime_max):
        self.log.append(("prepare", self.rank, runtime_max))

    def drop_step(self):
        self.log.append(("drop", self.rank))

    def dispatch(self):
        self.log.append(("dispatch", self.rank))

    def compute(self):
        self.log.append(("compute", self.rank))

    def combine(self):
        self.log.append(("combine", self.rank))
        return self.rank


def _xs(*rows):
    return [types.SimpleNamespace(shape=(n, 8)) for n in rows]


def test_every_rank_finishes_a_phase_before_any_starts_the_next_and_between_marks_each():
    log = []
    layers = [_Layer(r, log) for r in range(3)]
    out = run_phases(layers, _xs(2, 5, 0), [None] * 3, between=lambda stage: log.append(("mark", stage)))
    assert out == [0, 1, 2]
    want = [("prepare", r, 5) for r in range(3)] + [("mark", "prepare")] + [("dispatch", r) for r in range(3)] + \
        [("mark", "dispatch")] + [("compute", r) for r in range(3)] + [("mark", "compute")] + \
        [("combine", r) for r in range(3)]
    assert log == want


def test_the_eager_host_phase_timer_reports_the_four_phases():
    from ep_a2a.tools.bench_layer_graphs import eager_host_phases_us
    log, waits = [], []
    stream = types.SimpleNamespace(wait_stream=waits.append)
    cuda = types.SimpleNamespace(synchronize=lambda: None, current_stream=lambda device: stream)
    fake_torch = types.SimpleNamespace(cuda=cuda)
    layers = [_Layer(r, log) for r in range(2)]
    got = eager_host_phases_us(fake_torch, layers, _xs(1, 1), [None, None], 1, iters=3)
    assert set(got) == {"prepare", "dispatch", "compute", "combine"} and all(v >= 0 for v in got.values())
    assert sum(e[0] == "combine" for e in log) == 6 and waits == ["stream0", "stream1"] * 3
