"""The send and receive halves on the host (ep_a2a/halves.py), without a GPU: what each half
launches (kernel, grid, parameter block) against the whole calls, the SM rule of receive
halves (Schedule.receive_grid), and every out-of-order call refused before any launch."""
import random

import pytest

from launch_trace import H, EP, _recorder, _tensors, make_rank, patch_driver
from ep_a2a.errors import HalvesOrderError, StateError
from ep_a2a.testing import hooks

@pytest.fixture
def traced(monkeypatch):
    events = []
    patch_driver(monkeypatch.setattr, events)
    with hooks.dry_run(_recorder(events)):
        yield events


def _launches(events, since):
    return [e for e in events[since:] if e[0] == "launch"]


def _params(event):
    return event[5]  # (the recorder's hash of the parameter block)


def _rank(events, protocol, quant=None, ranks_on_device=8, pdl=True):
    return make_rank(events, protocol, quant, pdl, ranks_on_device, local=True)


@pytest.mark.parametrize("protocol,quant", [("fence", None), ("fence", "fp8"), ("sentinel", None)])
@pytest.mark.parametrize("ranks_on_device", [8, 1])
def test_halves_launch_their_kernels_with_the_whole_calls_fields(traced, protocol, quant, ranks_on_device):
    rng = random.Random()
    for _ in range(4):
        tmax = rng.choice((1, 4, 16, 128, 1024))
        T = rng.randint(0, tmax)
        ids, pays = _tensors(rng.randrange(4), T)
        a2a, r = _rank(traced, protocol, quant, ranks_on_device)
        n = len(traced)
        h = r.dispatch_send(ids, pays, tmax)
        views = h.receive()
        c = r.combine_send(r.combine_input(tmax), tmax)
        y = c.receive()
        halves = _launches(traced, n)
        assert [e[1] for e in halves] == [f"{protocol}_dispatch_send", f"{protocol}_dispatch_recv",
                                          f"{protocol}_combine_send{'_q8' if quant else ''}_bf16",
                                          f"{protocol}_combine_recv{'_q8' if quant else ''}_bf16"]
        # trigger_early: a receive half never lets its successor in early; a send half only within half the share
        assert halves[1][6][3] == 0 and halves[3][6][3] == 0
        assert all(e[6][3] == int(e[3] <= max(1, r.max_grid // 2)) for e in (halves[0], halves[2]))
        # each receive half writes exactly its send half's parameter block
        # (the whole block where the send half's trigger flag is the receive's too, else its fields)
        for send, recv in ((halves[0], halves[1]), (halves[2], halves[3])):
            if send[6][3] == recv[6][3]:
                assert _params(send) == _params(recv)
            else:
                assert send[6][:3] + send[6][4:] == recv[6][:3] + recv[6][4:]
        share = r.max_grid
        assert halves[1][3] <= max(1, share // 2) and halves[3][3] <= max(1, share // 2)  # the SM rule
        assert y.shape == (T, H) and views[0].shape == (EP, tmax, 8)
        # the same step whole on a fresh rank: the same fields (trigger_early and the grid aside)
        a2b, q = _rank(traced, protocol, quant, ranks_on_device)
        m = len(traced)
        q.dispatch(ids, pays, tmax)
        q.combine(q.combine_input(tmax), tmax)
        whole = _launches(traced, m)
        idx = [i for i, name in enumerate(("step_tag", "local_num_tokens", "runtime_max_tokens_per_rank",
                                            "trigger_early", "dispatch_splits", "combine_splits", "combine_vec",
                                            "combine_prequantized", "timeout_ns")) if name != "trigger_early"]
        for half, full in ((halves[0], whole[0]), (halves[2], whole[1])):
            assert [half[6][i] for i in idx] == [full[6][i] for i in idx]
        a2a.close()
        a2b.close()


def test_two_all_to_alls_interleave_in_any_legal_order(traced):
    rng = random.Random()
    a, ra = _rank(traced, "fence")
    b, rb = _rank(traced, "fence")
    for _ in range(20):
        steps = {ra: [], rb: []}
        for r in (ra, rb):
            tmax = rng.choice((1, 16, 128))
            ids, pays = _tensors(0, rng.randint(0, tmax))
            steps[r] = [lambda r=r, ids=ids, pays=pays, tmax=tmax: r.dispatch_send(ids, pays, tmax),
                        lambda r=r: r.dispatch_recv(),
                        lambda r=r, tmax=tmax: r.combine_send(r.combine_input(tmax), tmax),
                        lambda r=r: r.combine_recv()]
        while steps[ra] or steps[rb]:  # a random merge of the two sequences
            r = rng.choice([x for x in (ra, rb) if steps[x]])
            steps[r].pop(0)()
        assert not ra.mid_step and not rb.mid_step
    a.close()
    b.close()


def test_out_of_order_halves_raise_before_any_launch(traced):
    a2a, r = _rank(traced, "fence")
    ids, pays = _tensors(0, 3)

    def refused(call, error=HalvesOrderError):
        n = len(traced)
        with pytest.raises(error):
            call()
        assert not _launches(traced, n), "a refused call launched"

    refused(r.dispatch_recv)                                      # no send before it
    refused(lambda: r.combine_send(r.combine_input(16), 16))      # no dispatch before it
    refused(r.combine_recv)
    h = r.dispatch_send(ids, pays, 16)
    refused(lambda: r.dispatch_send(ids, pays, 16))               # the receive is due
    refused(lambda: r.dispatch(ids, pays, 16), StateError)
    refused(lambda: r.combine(r.combine_input(16), 16))           # combine before the dispatch's receive
    refused(lambda: r.combine_send(r.combine_input(16), 16))
    refused(r.combine_recv)                                       # the dispatch receive is due, not combine's
    h.receive()
    refused(h.receive)                                            # twice
    refused(r.dispatch_recv)
    c = r.combine_send(r.combine_input(16), 16)
    refused(lambda: r.combine(r.combine_input(16), 16))
    refused(h.receive)                                            # a stale handle
    c.receive()
    refused(c.receive)
    # the whole calls and the halves mix freely step by step
    r.dispatch(ids, pays, 16)
    c = r.combine_send(r.combine_input(16), 16)
    r.combine_recv(c)
    r.dispatch_send(ids, pays, 16).receive()
    r.combine(r.combine_input(16), 16)
    a2a.close()


@pytest.mark.parametrize("ranks_on_device", [1, 2, 8])
def test_receive_grids_stay_within_half_the_share(traced, ranks_on_device):
    a2a, r = _rank(traced, "auto", ranks_on_device=ranks_on_device)
    half = max(1, r.max_grid // 2)
    for tmax in (1, 8, 16, 128, 1024):
        ids, pays = _tensors(0, tmax)
        n = len(traced)
        r.dispatch_send(ids, pays, tmax).receive()
        r.combine_send(r.combine_input(tmax), tmax).receive()
        sends, recvs = [], []
        for e in _launches(traced, n):
            (recvs if "_recv" in e[1] else sends).append(e[3])
        assert recvs and max(recvs) <= half
        assert max(sends) <= r.max_grid
    a2a.close()


def test_queued_frees_wait_until_every_active_rank_has_issued_the_same_step():
    """A free synchronizes the device: it must not run while a rank's kernels wait for a rank
    (or a half) the host has still to issue, as when one rank's whole step is issued first."""
    import types
    from ep_a2a.group import settled

    def ranks(*states):  # (steps, mid_step, receive due, active) per rank
        return types.SimpleNamespace(ranks=[types.SimpleNamespace(steps=s, mid_step=m, is_active=a,
                                                                  halves=types.SimpleNamespace(due=d))
                                            for s, m, d, a in states])
    idle = (4, False, None, True)
    assert settled(ranks(idle, idle, idle))
    assert not settled(ranks((5, False, None, True), idle, idle))   # rank 0 issued its next step alone
    assert not settled(ranks(idle, (4, True, None, True), idle))     # mid-step
    assert not settled(ranks(idle, (4, False, object(), True), idle))  # a receive half due
    assert settled(ranks(idle, (1, False, None, False), idle))        # an inactive rank no longer steps
