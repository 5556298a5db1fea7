"""What the argument rules accept works: a sample of the configurations
test_arguments_cpu.valid_options draws (every option, NumPy integers and dtype objects
among them) is built on 8 in-process ranks of one GPU and runs one step, bitwise against
the reference; and a workspace larger than the GPU is refused, naming its bytes, before
any allocation."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from test_arguments_cpu import valid_options  # noqa: E402
from test_fence_gpu import run  # noqa: E402

pytestmark = pytest.mark.gpu
EP = 8


@pytest.fixture(scope="module")
def group():
    import ep_a2a
    with ep_a2a.LocalGroup([0] * EP) as g:
        yield g


@settings(max_examples=30, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kw=valid_options(small=True), data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_accepted_configurations_build_and_run_one_step(group, kw, data, seed):
    import ep_a2a
    rng = np.random.default_rng(seed)
    kw = dict(kw, timeout_s=20.0, first_timeout_s=60.0)  # (a failure ends in seconds, not minutes)
    maxt = int(kw["max_tokens_per_rank"])
    tmax = data.draw(st.integers(1, maxt), label="runtime_max")
    tokens = data.draw(st.lists(st.integers(0, tmax), min_size=EP, max_size=EP), label="tokens")
    with ep_a2a.MoeAlltoAll(group, **kw) as a2a:
        run(a2a, rng, tokens, tmax, exact=kw["combine_quant"] is None)


def test_a_workspace_larger_than_the_gpu_is_refused_naming_its_bytes(group):
    import ep_a2a
    from ep_a2a.driver.vmm import live_counts
    before = live_counts()
    with pytest.raises(ValueError, match=r"^max_tokens_per_rank: the workspace needs \d+ bytes .* x 8 rank\(s\) on "
                                         r"cuda:0 = \d+ bytes, more than the \d+ bytes free"):
        ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=2 ** 22, top_k=8, num_experts=64,
                           payloads=[ep_a2a.PayloadSpec("hidden", (7168,), "bfloat16")], combine_hidden_size=7168)
    assert live_counts() == before
