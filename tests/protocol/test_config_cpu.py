"""Construction options: the tuple the ranks of a process group must agree on tells apart
every argument, also formats of the same width and payloads of the same byte count."""
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
