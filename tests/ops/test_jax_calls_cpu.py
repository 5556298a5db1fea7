"""jax_calls.DeviceRanks without a GPU: the events the native handler gets."""
import types


def test_native_events_are_the_fork_and_join_events_run_uses():
    from ep_a2a.ops.jax_calls import DeviceRanks
    ev = lambda h: types.SimpleNamespace(handle=h)  # noqa: E731
    d = DeviceRanks.__new__(DeviceRanks)
    d.ranks = [object(), object(), object()]
    d._fork, d._joins = ev(7), [ev(11), ev(12), ev(13)]
    assert d.native_events() == (7, [11, 12, 13])
    d._fork, d._joins = None, []  # one rank on its GPU (or closed): XLA's own stream, no events
    assert d.native_events() == (None, [None, None, None])
