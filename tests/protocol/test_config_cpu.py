"""Construction options: the tuple the ranks of a process group must agree on tells apart
every argument, also formats of the same width and payloads of the same byte count."""
import re

import pytest

from ep_a2a.config import Options, PayloadSpec

BASE = dict(max_tokens_per_rank=64, top_k=8, num_experts=64, combine_hidden_size=256, combine_dtype="bfloat16",
            payloads=(PayloadSpec("hidden", (256,), "bfloat16"), PayloadSpec("w", (8,), "float32")),
            protocol="fence", timeout_s=10.0, first_timeout_s=60.0, validate_expert_ids=True, pdl=True,
            threads_per_block=256, crossover_tokens=None, on_timeout="trap", combine_quant=None)


def _agreement(**kw):
    return Options.check(4, **{**BASE, **kw}).agreement()


def test_same_arguments_agree_and_are_integers():
    a = _agreement()
    assert a == _agreement() and all(type(v) is int for v in a)


@pytest.mark.parametrize("change", [
    dict(combine_dtype="float16"),                                                   # same width as bf16
    dict(payloads=(PayloadSpec("hidden", (256,), "float16"), PayloadSpec("w", (8,), "float32"))),
    dict(payloads=(PayloadSpec("hidden", (512,), "float8_e4m3fn"), PayloadSpec("w", (8,), "float32"))),
    dict(payloads=(PayloadSpec("hidden", (2, 128), "bfloat16"), PayloadSpec("w", (8,), "float32"))),  # same bytes
    dict(payloads=(PayloadSpec("w", (8,), "float32"), PayloadSpec("hidden", (256,), "bfloat16"))),    # order
    dict(timeout_s=11.0), dict(first_timeout_s=61.0), dict(validate_expert_ids=False), dict(pdl=False),
    dict(threads_per_block=128), dict(on_timeout="abort"), dict(crossover_tokens=16), dict(protocol="auto"),
])
def test_every_argument_is_compared_exactly(change):
    assert _agreement(**change) != _agreement()


def test_fp8_payload_formats_of_one_width_differ():
    e4m3 = _agreement(payloads=(PayloadSpec("hidden", (256,), "float8_e4m3fn"),))
    e5m2 = _agreement(payloads=(PayloadSpec("hidden", (256,), "float8_e5m2"),))
    assert e4m3 != e5m2


@pytest.mark.parametrize("built,allowed", [("auto", ("fence", "sentinel", "auto")), ("fence", ("fence",)),
                                           ("sentinel", ("sentinel",))])
def test_use_protocol_switches_only_among_the_kernels_it_has(built, allowed):
    """An all-to-all built with protocol="auto" loads both protocols' kernels; one built with a
    single protocol has only that one's (a switch would fail at the next dispatch)."""
    import types
    from ep_a2a.alltoall import MoeAlltoAll
    from ep_a2a.errors import StateError
    a = types.SimpleNamespace(built_protocol=built, protocol=built, ranks=[types.SimpleNamespace(mid_step=False, rank=0)])
    for p in ("fence", "sentinel", "auto"):
        if p in allowed:
            MoeAlltoAll.use_protocol(a, p)
            assert a.protocol == p
        else:
            with pytest.raises(ValueError, match=re.escape(f"protocol: must be one of {allowed!r}")):
                MoeAlltoAll.use_protocol(a, p)
    a.ranks[0].mid_step = True
    with pytest.raises(StateError, match="between dispatch and combine"):
        MoeAlltoAll.use_protocol(a, allowed[0])


def test_timeouts_default_to_minutes_for_engines_and_follow_the_environment(monkeypatch):
    """One host stall of seconds (a late JIT, autotuning, a GC pause) must not trap every
    rank: the defaults are minutes, overridable per process and per all-to-all."""
    from ep_a2a import config
    monkeypatch.delenv(config.TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(config.FIRST_TIMEOUT_ENV, raising=False)
    kw = {**BASE, "timeout_s": None, "first_timeout_s": None}
    o = Options.check(4, **kw)
    assert (o.timeout_s, o.first_timeout_s) == (300.0, 1800.0)
    monkeypatch.setenv(config.TIMEOUT_ENV, "42.5")
    monkeypatch.setenv(config.FIRST_TIMEOUT_ENV, "600")
    o = Options.check(4, **kw)
    assert (o.timeout_s, o.first_timeout_s) == (42.5, 600.0)
    assert Options.check(4, **{**kw, "timeout_s": 7.0}).timeout_s == 7.0  # the argument wins
    monkeypatch.setenv(config.TIMEOUT_ENV, "ten")
    with pytest.raises(ValueError, match="EP_A2A_TIMEOUT_S: must be a number of seconds, got 'ten'"):
        Options.check(4, **kw)
    monkeypatch.delenv(config.TIMEOUT_ENV)
    with pytest.raises(ValueError, match="timeout_s: timeouts must be > 0"):
        Options.check(4, **{**kw, "timeout_s": 0.0})


def test_the_alltoall_signature_leaves_the_timeouts_to_the_engine_defaults():
    import inspect
    from ep_a2a.alltoall import MoeAlltoAll
    sig = inspect.signature(MoeAlltoAll.__init__).parameters
    assert sig["timeout_s"].default is None and sig["first_timeout_s"].default is None


def test_flags_take_gpu_scope_only_when_every_rank_shares_the_gpu(monkeypatch):
    from ep_a2a.config import PEER_SCOPE_ENV, peers_on_device
    monkeypatch.delenv(PEER_SCOPE_ENV, raising=False)
    assert peers_on_device(8, 8) == 1 and peers_on_device(1, 1) == 1
    assert peers_on_device(4, 8) == 0 and peers_on_device(1, 2) == 0   # a peer on another GPU: system scope
    monkeypatch.setenv(PEER_SCOPE_ENV, "sys")
    assert peers_on_device(8, 8) == 0
    monkeypatch.setenv(PEER_SCOPE_ENV, "gpu")
    with pytest.raises(ValueError, match=re.escape(PEER_SCOPE_ENV) + ".*'auto' or 'sys'"):
        peers_on_device(8, 8)
