"""The workspace-size check (its rule as a pure function, its call site through a group whose
devices are stand-ins and a given free-memory figure) and the groups' own arguments, without
a GPU: every refusal comes before the first driver call."""
import types

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from ep_a2a import symmetric  # noqa: E402
from ep_a2a.validate import check_workspace_fits  # noqa: E402

CPU = settings(max_examples=200, deadline=None, database=None)
GIB = 2 ** 30


def fake_group(ordinals, free=None):
    """A local group's shape as the construction path reads it: ranks with a device ordinal
    whose free memory is `free` bytes."""
    ranks = [types.SimpleNamespace(rank=i, device=types.SimpleNamespace(ordinal=o, free_memory=lambda: free))
             for i, o in enumerate(ordinals)]
    return types.SimpleNamespace(ranks=ranks, ep_size=len(ranks), is_local=True, bootstrap=None)


@CPU
@given(nbytes=st.integers(1, 2 ** 44), ranks=st.integers(1, 72), free=st.integers(0, 2 ** 48))
def test_the_rule_sums_the_ranks_that_share_a_gpu(nbytes, ranks, free):
    if nbytes * ranks <= free:
        check_workspace_fits(nbytes, ranks, free, "cuda:0")
        return
    with pytest.raises(ValueError) as e:
        check_workspace_fits(nbytes, ranks, free, "cuda:0")
    msg = str(e.value)
    assert msg.startswith("max_tokens_per_rank: the workspace needs") and "cuda:0" in msg
    assert f"{nbytes} bytes" in msg and f"{nbytes * ranks} bytes" in msg and f"{free} bytes free" in msg


@CPU
@given(ordinals=st.lists(st.integers(0, 3), min_size=1, max_size=16), nbytes=st.integers(1, 64 * GIB),
       free=st.lists(st.integers(0, 160 * GIB), min_size=4, max_size=4))
def test_the_call_site_checks_every_gpu_of_the_process(ordinals, nbytes, free):
    group = fake_group(ordinals)
    asked = []

    def free_of(device):
        asked.append(device.ordinal)
        return free[device.ordinal]
    over = [o for o in dict.fromkeys(ordinals) if ordinals.count(o) * nbytes > free[o]]
    if not over:
        symmetric.check_memory(group, nbytes, free_of)
        assert sorted(asked) == sorted(set(ordinals))  # each GPU once
        return
    with pytest.raises(ValueError, match=f"x {ordinals.count(over[0])} rank\\(s\\) on cuda:{over[0]} ") as e:
        symmetric.check_memory(group, nbytes, free_of)
    assert f"{nbytes * ordinals.count(over[0])} bytes" in str(e.value)


def test_unknown_free_memory_skips_the_check():
    symmetric.check_memory(fake_group([0, 0]), 2 ** 60, lambda device: None)


def test_a_workspace_too_large_is_refused_before_any_allocation():
    """The whole constructor, with the device's free memory given: max_tokens_per_rank=2**22
    on 8 ranks of one GPU needs more than an H200 has; the error names the bytes, and nothing
    was allocated (the group's devices are stand-ins: an allocation would fail otherwise)."""
    import ep_a2a
    from ep_a2a.driver.vmm import live_counts
    before = live_counts()
    with pytest.raises(ValueError, match=r"^max_tokens_per_rank: the workspace needs \d+ bytes .* x 8 rank\(s\) on cuda:0"):
        ep_a2a.MoeAlltoAll(fake_group([0] * 8, 139 * GIB), max_tokens_per_rank=2 ** 22, top_k=8, num_experts=64,
                           payloads=[ep_a2a.PayloadSpec("hidden", (7168,), "bfloat16")], combine_hidden_size=7168)
    assert live_counts() == before


@pytest.mark.parametrize("kw,exc,arg", [
    (dict(top_k=8.0), TypeError, "top_k"), (dict(max_tokens_per_rank=2.5), TypeError, "max_tokens_per_rank"),
    (dict(top_k=8, num_experts=4), ValueError, "top_k"), (dict(pdl="no"), TypeError, "pdl"),
    (dict(top_k=True), TypeError, "top_k"), (dict(timeout_s="10"), TypeError, "timeout_s"),
    (dict(crossover_tokens=-1), ValueError, "crossover_tokens"), (dict(top_k="8"), TypeError, "top_k"),
])
def test_the_constructor_checks_before_the_driver(kw, exc, arg):
    """No GPU here: a check that came after a driver call would raise NoDriverError instead."""
    import ep_a2a
    args = {**dict(max_tokens_per_rank=8, top_k=2, num_experts=8, combine_hidden_size=16), **kw}
    with pytest.raises(exc, match=f"^{arg}: "):
        ep_a2a.MoeAlltoAll(fake_group([0] * 8), **args)


@pytest.mark.parametrize("devices,exc", [([], ValueError), ([0.0], TypeError), ([True, 0], TypeError),
                                         ([-1], ValueError), ("0", TypeError), (0, TypeError), ([0] * 73, ValueError),
                                         ([None], TypeError)])
def test_local_group_devices_are_checked_before_the_driver(devices, exc):
    import ep_a2a
    with pytest.raises(exc, match="^devices: "):
        ep_a2a.LocalGroup(devices)
    with pytest.raises(TypeError, match="^check_topology: "):
        ep_a2a.LocalGroup([np.int64(0)], check_topology="yes")


class _Bootstrap:
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def allgather(self, data):
        raise AssertionError("a refused ProcessGroup must not reach its bootstrap")

    barrier = allgather


@pytest.mark.parametrize("bootstrap,device,exc,arg", [
    (object(), 0, TypeError, "bootstrap"), (_Bootstrap(0, 2), 0.0, TypeError, "device"),
    (_Bootstrap(0, 2), -1, ValueError, "device"), (_Bootstrap(2, 2), 0, ValueError, "bootstrap.rank"),
    (_Bootstrap(0, 0), 0, ValueError, "bootstrap.world_size"), (_Bootstrap(0, True), 0, TypeError, "bootstrap.world_size"),
])
def test_process_group_arguments_are_checked_before_the_driver(bootstrap, device, exc, arg):
    import ep_a2a
    with pytest.raises(exc, match=f"^{arg}: "):
        ep_a2a.ProcessGroup(bootstrap, device)
