"""What an all-to-all is built from: payload specs, the construction options (checked once,
frozen, and the tuple every rank must agree on), and the dtype tables shared with `moe`."""
from __future__ import annotations

import dataclasses
import inspect
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

from .interop.tensor import Tensor, as_dtype as lookup_dtype
from .layout import MAX_PAYLOADS, MAX_RANKS, MAX_TOP_K, Q8_BLOCK, sentinel_kind
from .schedule import SENTINEL_MAX_TOKENS_H200
from .validate import check_bool, check_choice, check_int, check_seconds, is_int, require

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
CROSSOVER_ENV = "EP_A2A_SENTINEL_MAX_TOKENS"  # protocol="auto"'s crossover for the process


MAX_SECONDS = 9e9  # timeouts travel as (signed, in the agreement) 64-bit nanoseconds
MAX_CROSSOVER = 2 ** 31 - 1
MAX_HIDDEN = 2 ** 24        # combine_hidden_size: elements per token (slot offsets are 32-bit)
MAX_PAYLOAD_BYTES = 2 ** 31 - 1  # a payload's bytes per token travel as u32


def sentinel_max_tokens() -> int:
    """The crossover_tokens of an all-to-all built without one: $EP_A2A_SENTINEL_MAX_TOKENS, else
    schedule.SENTINEL_MAX_TOKENS_H200."""
    v = os.environ.get(CROSSOVER_ENV)
    if not v:
        return SENTINEL_MAX_TOKENS_H200
    try:
        n = int(v)
    except ValueError:
        n = -1
    require(0 <= n <= MAX_CROSSOVER, CROSSOVER_ENV, f"must be an int in 0..{MAX_CROSSOVER}, got {v!r}")
    return n


def default_timeout(value, env: str, default: float) -> float:
    """`value`, else the float in $env, else `default` (a bad variable is a ValueError naming it)."""
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{env}: must be a number of seconds, got {raw!r}") from None
    require(math.isfinite(v) and 0 < v <= MAX_SECONDS, env, f"must be a finite number of seconds in (0, {MAX_SECONDS:g}], "
            f"got {raw!r}")
    return v


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
    states, FP8 with scales, packed FP4, router weights, opaque uint8).

    Checked when built: `name` a non-empty str, `shape` a tuple (or list) of positive ints,
    `dtype` any spelling interop.tensor.as_dtype takes ("bfloat16", np.float16,
    torch.bfloat16, jnp.bfloat16, ...), kept as its name."""
    name: str
    shape: tuple
    dtype: str = "uint8"

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"PayloadSpec name: must be a str, got {type(self.name).__name__} {self.name!r}")
        require(bool(self.name), "PayloadSpec name", "must not be empty")
        at = f"PayloadSpec {self.name!r}"
        if not isinstance(self.shape, (tuple, list)) or not all(is_int(d) for d in self.shape):
            raise TypeError(f"{at} shape: must be a tuple of positive ints (one token's shape, e.g. (7168,)), "
                            f"got {self.shape!r}")
        shape = tuple(int(d) for d in self.shape)
        require(len(shape) >= 1 and all(d >= 1 for d in shape), f"{at} shape",
                f"must be a non-empty tuple of positive ints, got {shape}")
        try:
            dtype = lookup_dtype(self.dtype)
        except TypeError as e:
            raise TypeError(f"{at} dtype: {e}") from None
        require(math.prod(shape) * dtype.itemsize <= MAX_PAYLOAD_BYTES, f"{at} shape",
                f"at most {MAX_PAYLOAD_BYTES} bytes per token, got {shape} of {dtype.name}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype.name)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's data: the product of the shape times the dtype's size."""
        return math.prod(self.shape) * lookup_dtype(self.dtype).itemsize


class Fp8Partial(NamedTuple):
    """The FP8 combine input of one rank (combine_quant="fp8"), from combine_input(T^, fp8=True):
    views of its workspace that the MoE epilogue fills (moe.finalize does), so that combine
    skips its own quantize pass. Value j of a slot is values[..., j] * scales[..., j // 128]."""
    values: Tensor  # float8_e4m3fn [ep_size, T^, hidden]
    scales: Tensor  # float32 [ep_size, T^, hidden / 128]
    dtype: str      # the combine dtype: each partial value is rounded to it before quantizing


def group_size(group) -> int:
    """The ep_size of `group` (a LocalGroup / ProcessGroup) or an int ep_size, checked."""
    if is_int(group):
        return check_int(group, "group", 1, MAX_RANKS)
    ep, ranks = getattr(group, "ep_size", None), getattr(group, "ranks", None)
    if not is_int(ep) or not isinstance(ranks, list):
        raise TypeError(f"group: must be a LocalGroup or ProcessGroup, got {type(group).__name__}")
    require(1 <= ep <= MAX_RANKS, "group", f"ep_size must be in 1..{MAX_RANKS}, got {ep}")
    return int(ep)


@dataclass(frozen=True)
class Options:
    """The construction arguments of MoeAlltoAll (by keyword after the group), checked.

      max_tokens_per_rank: most tokens any rank passes in one step (sizes the workspace).
      top_k, num_experts: routing; experts are split over ranks in contiguous blocks, the
        first `num_experts % ep_size` ranks owning one more.
      payloads: PayloadSpec of each dispatched tensor besides the expert ids (at most 8).
      combine_hidden_size, combine_dtype: the partial results combine reduces (bf16, fp16
        or fp32; accumulated in fp32).
      protocol: "fence" (counts + release fence + flags; large batches), "sentinel" (the data
        words signal arrival; small batches; needs the extra workspace listed in layout.py),
        or "auto": per call, SENTINEL while runtime_max_tokens_per_rank <= crossover_tokens
        (default: schedule.SENTINEL_MAX_TOKENS_H200, or $EP_A2A_SENTINEL_MAX_TOKENS), FENCE
        above. Both protocols share the step counter, so consecutive steps may use either.
      timeout_s / first_timeout_s: how long a kernel waits for a peer before it records who
        was missing; the first steps get the longer one (peers may still be loading).
        Defaults TIMEOUT_S and FIRST_TIMEOUT_S, or $EP_A2A_TIMEOUT_S and $EP_A2A_FIRST_TIMEOUT_S.
      combine_quant: None, or "fp8": combine quantizes the partial results to float8 e4m3
        with one fp32 scale per 128 values (hidden must be a multiple of 128) and the
        sources pull those, dequantize and reduce in fp32: about half the combine bytes.
        Error per value of a partial result: at most 1/16 of its 128-block's largest
        magnitude (e4m3 keeps 3 mantissa bits). FENCE only.
      on_timeout: "trap" (default): the kernel then traps; the CUDA context of the process is
        lost and the next CUDA call raises, as PeerTimeoutError. "abort": the kernel tells
        every peer to stop waiting too and returns; the context survives, the step's outputs
        are poisoned (NaN rows, -1 ids: README) and every later call raises (error() polls
        without raising): build a new all-to-all.
      validate_expert_ids: copy the ids to the host and check their range before launching
        (skipped under graph capture; off, out-of-range ids are dropped by the kernel). A rank
        alone in its process that rejects its input still runs the step without tokens, so
        that its peers never wait in vain (rejection.py).
      pdl, threads_per_block: programmatic dependent launch (sm_90+) and the kernels' block size.
    """
    ep_size: int
    max_tokens_per_rank: int
    top_k: int
    num_experts: int
    combine_hidden_size: int
    payloads: tuple = ()
    combine_dtype: object = "bfloat16"  # checked: an interop.tensor.DType
    protocol: str = "fence"
    timeout_s: float = None
    first_timeout_s: float = None
    validate_expert_ids: bool = True
    pdl: bool = True
    threads_per_block: int = 256
    crossover_tokens: int = None
    on_timeout: str = "trap"
    combine_quant: str = None

    @classmethod
    def check(cls, ep_size, **given) -> "Options":
        """The options, or a TypeError (wrong type) / ValueError (wrong value) naming the first
        argument that breaks its rule. `ep_size`: an int, or the group (its ep_size). Nothing
        here touches the driver: a call that fails allocates and launches nothing."""
        try:
            o = cls(ep_size, **given)
        except TypeError as e:  # (a missing or unknown argument)
            raise TypeError(f"MoeAlltoAll: {e}".replace("Options.__init__() ", "")) from None
        ep = group_size(ep_size)
        top_k = check_int(o.top_k, "top_k", 1, MAX_TOP_K)
        experts = check_int(o.num_experts, "num_experts", 1, 2 ** 31 - 1)
        require(top_k <= experts, "top_k", f"must be <= num_experts={experts} (a token picks top_k distinct experts), "
                f"got {top_k}")
        tokens = check_int(o.max_tokens_per_rank, "max_tokens_per_rank", 1, 2 ** 23 - 1)
        hidden = check_int(o.combine_hidden_size, "combine_hidden_size", 1, MAX_HIDDEN)
        protocol = check_choice(o.protocol, "protocol", PROTOCOLS)
        on_timeout = check_choice(o.on_timeout, "on_timeout", ON_TIMEOUT)
        quant = check_choice(o.combine_quant, "combine_quant", (None, "fp8"))
        timeout_s = check_seconds(default_timeout(o.timeout_s, TIMEOUT_ENV, TIMEOUT_S), "timeout_s", MAX_SECONDS)
        first_timeout_s = check_seconds(default_timeout(o.first_timeout_s, FIRST_TIMEOUT_ENV, FIRST_TIMEOUT_S),
                                        "first_timeout_s", MAX_SECONDS)
        if quant:
            require(protocol == "fence", "combine_quant", f"'fp8' needs protocol='fence', got {protocol!r}")
            require(hidden % Q8_BLOCK == 0, "combine_quant",
                    f"'fp8' needs combine_hidden_size to be a multiple of {Q8_BLOCK}, got {hidden}")
        try:
            cdt = lookup_dtype(o.combine_dtype)
        except TypeError as e:
            raise TypeError(f"combine_dtype: {e}") from None
        require(cdt.name in REDUCE_DTYPES, "combine_dtype", f"must be one of {tuple(REDUCE_DTYPES)}, got {cdt.name}")
        if not isinstance(o.payloads, (list, tuple)):
            raise TypeError(f"payloads: must be a list of PayloadSpec, got {type(o.payloads).__name__}")
        payloads = tuple(o.payloads)
        require(len(payloads) <= MAX_PAYLOADS - 1, "payloads", f"at most {MAX_PAYLOADS - 1} payloads, got {len(payloads)}")
        for p in payloads:
            if not isinstance(p, PayloadSpec):
                raise TypeError(f"payloads: must be a list of PayloadSpec, got an entry of type {type(p).__name__}")
        names = [p.name for p in payloads]
        require(len(set(names)) == len(names), "payloads", f"names must be unique, got {names}")
        validate_ids, pdl = check_bool(o.validate_expert_ids, "validate_expert_ids"), check_bool(o.pdl, "pdl")
        threads = check_int(o.threads_per_block, "threads_per_block", 96, 512)
        require(threads % 32 == 0, "threads_per_block", f"must be a multiple of 32 in 96..512, got {threads}")
        crossover = sentinel_max_tokens() if o.crossover_tokens is None else \
            check_int(o.crossover_tokens, "crossover_tokens", 0, MAX_CROSSOVER)
        o = dataclasses.replace(o, ep_size=ep, max_tokens_per_rank=tokens, top_k=top_k, num_experts=experts,
                                combine_hidden_size=hidden, protocol=protocol, on_timeout=on_timeout,
                                combine_quant=quant, validate_expert_ids=validate_ids, pdl=pdl)
        return dataclasses.replace(o, payloads=payloads, combine_dtype=cdt, timeout_s=timeout_s,
                                   first_timeout_s=first_timeout_s, threads_per_block=threads, crossover_tokens=crossover)

    @classmethod
    def signature(cls) -> inspect.Signature:
        """MoeAlltoAll(self, group, *, <every option but ep_size>): its __init__'s, for help() and editors."""
        fields = [f for f in dataclasses.fields(cls) if f.name != "ep_size"]
        return inspect.Signature(
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
             inspect.Parameter("group", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                 **({} if f.default is dataclasses.MISSING else {"default": f.default})) for f in fields])

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
