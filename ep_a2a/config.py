"""What an all-to-all is built from: payload specs, the construction options (checked once,
frozen, and the tuple every rank must agree on), and the dtype tables shared with `moe`."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

from .interop.tensor import Tensor, as_dtype as lookup_dtype
from .layout import MAX_PAYLOADS, MAX_RANKS, MAX_TOP_K, Q8_BLOCK, sentinel_kind
from .schedule import sentinel_max_tokens
from .validate import require

PROTOCOLS = ("fence", "sentinel", "auto")
ON_TIMEOUT = ("trap", "abort")
# dtypes combine reduces and finalize reads or writes, and the suffix of their kernels
REDUCE_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
# How long a kernel waits for a peer. An engine's host can stall for seconds (a late JIT,
# autotuning, a garbage collection) and, with on_timeout="trap", a timeout costs every
# rank's CUDA context: so minutes in steady state and far longer for the first steps, while
# peers load weights and compile. Overridden per all-to-all by argument, or for the process
# by the environment variables below.
TIMEOUT_S, FIRST_TIMEOUT_S = 300.0, 1800.0
TIMEOUT_ENV, FIRST_TIMEOUT_ENV = "EP_A2A_TIMEOUT_S", "EP_A2A_FIRST_TIMEOUT_S"


def default_timeout(value, env: str, default: float) -> float:
    """`value`, else the float in $env, else `default` (a bad variable is a ValueError naming it)."""
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{env}: must be a number of seconds, got {raw!r}") from None


# The protocols' flags use gpu scope when every rank lives on one GPU (kernels/protocol.cuh
# says why that suffices); "sys" in this variable keeps system scope there too, to compare.
PEER_SCOPE_ENV = "EP_A2A_PEER_SCOPE"


def peers_on_device(ranks_on_device: int, ep_size: int) -> int:
    """1 when the rank's flags may use gpu scope: every rank on its GPU and no override."""
    scope = os.environ.get(PEER_SCOPE_ENV, "auto")
    require(scope in ("auto", "sys"), PEER_SCOPE_ENV, f"must be 'auto' or 'sys', got {scope!r}")
    return int(scope == "auto" and ranks_on_device == ep_size)


@dataclass(frozen=True)
class PayloadSpec:
    """One dispatch payload: `shape` and `dtype` of one token's data (any bytes: BF16 hidden
    states, FP8 with scales, packed FP4, router weights, opaque uint8)."""
    name: str
    shape: tuple
    dtype: str = "uint8"

    @property
    def bytes_per_token(self) -> int:
        return math.prod(int(s) for s in self.shape) * lookup_dtype(self.dtype).itemsize


class Fp8Partial(NamedTuple):
    """The FP8 combine input of one rank (combine_quant="fp8"), from combine_input(T^, fp8=True):
    views of its workspace that the MoE epilogue fills (moe.finalize does), so that combine
    skips its own quantize pass. Value j of a slot is values[..., j] * scales[..., j // 128]."""
    values: Tensor  # float8_e4m3fn [ep_size, T^, hidden]
    scales: Tensor  # float32 [ep_size, T^, hidden / 128]
    dtype: str      # the combine dtype: each partial value is rounded to it before quantizing


@dataclass(frozen=True)
class Options:
    """The construction arguments of MoeAlltoAll, checked (see its docstring for each)."""
    ep_size: int
    max_tokens_per_rank: int
    top_k: int
    num_experts: int
    payloads: tuple
    combine_hidden_size: int
    combine_dtype: object          # interop.tensor.DType
    protocol: str
    timeout_s: float
    first_timeout_s: float
    validate_expert_ids: bool
    pdl: bool
    threads_per_block: int
    crossover_tokens: int
    on_timeout: str
    combine_quant: str | None

    @classmethod
    def check(cls, ep_size, *, max_tokens_per_rank, top_k, num_experts, payloads, combine_hidden_size,
              combine_dtype, protocol, timeout_s, first_timeout_s, validate_expert_ids, pdl, threads_per_block,
              crossover_tokens, on_timeout, combine_quant) -> "Options":
        """The options, or a ValueError/TypeError naming the first argument that breaks its rule."""
        ep = ep_size
        require(1 <= ep <= MAX_RANKS, "group", f"ep_size must be in 1..{MAX_RANKS}, got {ep}")
        require(1 <= top_k <= MAX_TOP_K, "top_k", f"must be in 1..{MAX_TOP_K}, got {top_k}")
        require(num_experts >= 1, "num_experts", f"must be >= 1, got {num_experts}")
        require(1 <= max_tokens_per_rank < 2 ** 23, "max_tokens_per_rank", f"must be in 1..2**23-1, got {max_tokens_per_rank}")
        require(combine_hidden_size >= 1, "combine_hidden_size", f"must be >= 1, got {combine_hidden_size}")
        require(protocol in PROTOCOLS, "protocol", f"must be one of {PROTOCOLS}, got {protocol!r}")
        require(on_timeout in ON_TIMEOUT, "on_timeout", f"must be one of {ON_TIMEOUT}, got {on_timeout!r}")
        timeout_s = default_timeout(timeout_s, TIMEOUT_ENV, TIMEOUT_S)
        first_timeout_s = default_timeout(first_timeout_s, FIRST_TIMEOUT_ENV, FIRST_TIMEOUT_S)
        require(timeout_s > 0 and first_timeout_s > 0, "timeout_s", "timeouts must be > 0 seconds")
        require(max(timeout_s, first_timeout_s) < 2 ** 63 / 1e9, "timeout_s", "timeouts must fit the kernels' u64 nanoseconds")
        require(combine_quant in (None, "fp8"), "combine_quant", f"must be None or 'fp8', got {combine_quant!r}")
        if combine_quant:
            require(protocol == "fence", "combine_quant", f"'fp8' needs protocol='fence', got {protocol!r}")
            require(combine_hidden_size % Q8_BLOCK == 0, "combine_quant",
                    f"'fp8' needs combine_hidden_size to be a multiple of {Q8_BLOCK}, got {combine_hidden_size}")
        cdt = lookup_dtype(combine_dtype)
        require(cdt.name in REDUCE_DTYPES, "combine_dtype", f"must be one of {tuple(REDUCE_DTYPES)}, got {cdt.name}")
        payloads = tuple(payloads)
        require(len(payloads) <= MAX_PAYLOADS - 1, "payloads", f"at most {MAX_PAYLOADS - 1} payloads, got {len(payloads)}")
        for p in payloads:
            require(isinstance(p, PayloadSpec), "payloads", f"expected PayloadSpec entries, got {type(p).__name__}")
            require(p.bytes_per_token > 0, "payloads", f"payload {p.name!r} has no bytes per token")
        threads = int(threads_per_block)
        require(threads % 32 == 0 and 96 <= threads <= 512, "threads_per_block", "must be a multiple of 32 in 96..512")
        crossover = sentinel_max_tokens() if crossover_tokens is None else int(crossover_tokens)
        return cls(ep, max_tokens_per_rank, top_k, num_experts, payloads, combine_hidden_size, cdt, protocol,
                   timeout_s, first_timeout_s, validate_expert_ids, pdl, threads, crossover, on_timeout, combine_quant)

    @property
    def payload_kinds(self) -> tuple:
        """The SENTINEL escape kind of each dispatched tensor (the expert ids first: raw)."""
        return (0,) + tuple(sentinel_kind(lookup_dtype(p.dtype).name) for p in self.payloads)

    @property
    def payload_bytes(self) -> tuple:
        """Bytes per token of each dispatched tensor, the expert ids first."""
        return (4 * self.top_k,) + tuple(p.bytes_per_token for p in self.payloads)

    def agreement(self) -> tuple:
        """The integers every rank of a group must construct with (checked collectively): every
        argument exactly, dtypes by their DLPack (code, bits) so that formats of one width
        (bf16 and fp16, e4m3 and e5m2) are told apart, timeouts in nanoseconds."""
        out = [self.max_tokens_per_rank, self.top_k, self.num_experts, self.combine_hidden_size,
               *self.combine_dtype.dlpack[:2], PROTOCOLS.index(self.protocol), self.crossover_tokens,
               int(self.combine_quant is not None), ON_TIMEOUT.index(self.on_timeout),
               round(self.timeout_s * 1e9), round(self.first_timeout_s * 1e9), int(bool(self.validate_expert_ids)),
               int(bool(self.pdl)), self.threads_per_block, len(self.payloads)]
        for p in self.payloads:
            out += [*lookup_dtype(p.dtype).dlpack[:2], len(p.shape), *(int(d) for d in p.shape)]
        return tuple(out)
