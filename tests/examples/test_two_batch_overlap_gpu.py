"""examples/two_batch_overlap.py on a GPU, as a user runs it (a subprocess from the checkout):
it exits 0 and says the overlapped step equals the sequential one, eagerly and from a graph."""
import pytest
from test_examples_gpu import EXAMPLES, need, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_two_batch_overlap_equals_the_sequential_step(protocol):
    need("torch")
    out = run([str(EXAMPLES / "two_batch_overlap.py"), "--protocol", protocol])
    assert "two_batch_overlap:" in out and "bit for bit: eager True, CUDA graph True" in out, out
