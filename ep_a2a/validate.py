"""The argument rules that the all-to-all and the MoE helpers share, checked before any
launch. Each rule has one exception type: a missing tensor or a wrong dtype is a TypeError,
a wrong device, layout, alignment, shape or range a ValueError; the message names the
argument and the rule."""
from __future__ import annotations

import math
import weakref

import numpy as np

from .driver.memory import copy_dtoh
from .errors import ArgumentTypeError
from .driver.stream import synchronize_stream
from .interop.tensor import CUDA, Tensor, as_dtype as lookup_dtype, as_tensor


def require(ok: bool, arg: str, rule: str) -> None:
    """A ValueError "arg: rule" unless `ok`."""
    if not ok:
        raise ValueError(f"{arg}: {rule}")


def is_int(x) -> bool:
    """An integer as the API takes one: int or NumPy integer, never a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_int(x, name: str, lo: int, hi: int = None) -> int:
    """x as a Python int in [lo, hi] (hi None: no upper bound): a TypeError naming `name` for a
    non-integer (bools and floats included), a ValueError for one out of range."""
    rule = f"must be an int in {lo}..{'' if hi is None else hi}"
    if not is_int(x):
        raise TypeError(f"{name}: {rule}, got {type(x).__name__} {x!r}")
    v = int(x)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}: {rule}, got {v}")
    return v


def check_bool(x, name: str) -> bool:
    """x as a Python bool (True/False or a NumPy bool), else a TypeError naming `name`."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: must be True or False, got {type(x).__name__} {x!r}")
    return bool(x)


def check_choice(x, name: str, choices: tuple):
    """x, one of `choices` exactly (strings, or None where listed): a TypeError for another
    type, a ValueError for another value."""
    if not (isinstance(x, str) or (x is None and None in choices)):
        raise TypeError(f"{name}: must be one of {choices}, got {type(x).__name__} {x!r}")
    require(x in choices, name, f"must be one of {choices}, got {x!r}")
    return None if x is None else str(x)


def check_seconds(x, name: str, most: float) -> float:
    """x as a float of seconds: a real number (no bool), finite, > 0 and at most `most`."""
    if not isinstance(x, (int, float, np.integer, np.floating)) or isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: must be a number of seconds, got {type(x).__name__} {x!r}")
    v = float(x)
    require(math.isfinite(v) and 0 < v <= most, name, f"timeouts must be > 0 seconds, finite and at most {most:g}, got {x!r}")
    return v


def check_workspace_fits(nbytes: int, ranks: int, free: int, where: str) -> None:
    """The rule of the workspace-size check: `ranks` workspaces of `nbytes` (the ranks of this
    process that share the GPU `where`) must fit its `free` bytes, a ValueError naming the sizes."""
    need = nbytes * ranks
    require(need <= free, "max_tokens_per_rank",
            f"the workspace needs {nbytes} bytes ({nbytes / 2 ** 30:.2f} GiB) per rank x {ranks} rank(s) on {where} "
            f"= {need} bytes, more than the {free} bytes free there: lower max_tokens_per_rank, the payloads "
            "or combine_hidden_size")


def check_runtime_max(runtime_max, max_tokens_per_rank: int) -> None:
    """T^ of a call: an int (NumPy integers too, never a bool) in 1..max_tokens_per_rank, else a
    ValueError, or for a wrong type an ArgumentTypeError (a TypeError and a ValueError both)."""
    if type(runtime_max) is int and 1 <= runtime_max <= max_tokens_per_rank:
        return
    rule = f"must be an int in 1..max_tokens_per_rank={max_tokens_per_rank}, got {runtime_max!r}"
    if not is_int(runtime_max):
        raise ArgumentTypeError(f"runtime_max_tokens_per_rank: {rule}")
    require(1 <= runtime_max <= max_tokens_per_rank, "runtime_max_tokens_per_rank", rule)


def check_dispatch_inputs(tokens: int, runtime_max: int, payloads, specs, at: str = "") -> None:
    """A dispatch's token count fits T^ and it got one tensor per PayloadSpec (`at`: which
    rank's arguments, for the messages of a call that takes every rank's)."""
    if tokens > runtime_max:
        raise ValueError(f"token_selected_experts{at}: {tokens} local tokens exceed runtime_max_tokens_per_rank={runtime_max}")
    if not isinstance(payloads, (list, tuple)):
        raise TypeError(f"payloads{at}: expected a list of tensors, got {type(payloads).__name__}")
    if len(payloads) != len(specs):
        raise ValueError(f"payloads{at}: expected {len(specs)} tensors ({', '.join(p.name for p in specs)}), "
                         f"got {len(payloads)}")


def check_combine_runtime_max(runtime_max: int, dispatched: int) -> None:
    """combine's T^ must be the one its step's dispatch used."""
    if runtime_max != dispatched:
        raise ValueError(f"runtime_max_tokens_per_rank: combine got {runtime_max} but the dispatch of this step "
                         f"used {dispatched}")


def check_partial_shape(shape, ep_size: int, runtime_max: int, hidden: int, name: str = "partial") -> None:
    """combine's partial results: [ep_size, T^, hidden] or [ep_size * T^, hidden]."""
    if shape[:-1] not in ((ep_size * runtime_max,), (ep_size, runtime_max)):
        raise ValueError(f"{name}: must be [ep_size={ep_size}, runtime_max_tokens_per_rank={runtime_max}, {hidden}], "
                         f"got {shape}")


def cuda_tensor(obj, name: str, stream, ordinal=None, what: str = "", dtype: str = None) -> Tensor:
    """`obj` (any DLPack / CUDA-array-interface producer) as a Tensor of `dtype` (when given:
    checked first, a TypeError) on a CUDA GPU (cuda:`ordinal` when given), contiguous,
    aligned to its elements. A framework tensor's producer orders its pending work before
    `stream` (as_tensor's stream argument). `what` describes the GPU in the message."""
    if obj is None:
        raise TypeError(f"{name}: expected a tensor, got None")
    try:
        t = as_tensor(obj, stream=stream)
    except (TypeError, ValueError, BufferError, RuntimeError) as e:  # (RuntimeError: e.g. torch's own refusals)
        if type(e) not in (TypeError, ValueError, BufferError, RuntimeError):
            raise  # our own errors (CudaError, ...) and other subclasses keep their type and fields
        raise type(e)(f"{name}: {e}") from None
    if dtype is not None:
        want = lookup_dtype(dtype)
        if t.dtype != want:
            raise TypeError(f"{name}: dtype must be {want.name}, got {t.dtype.name}")
    if t.device[0] != CUDA or (ordinal is not None and t.device[1] != ordinal):
        raise ValueError(f"{name}: must be on cuda:{'?' if ordinal is None else ordinal}{what}, got device {t.device}")
    if not t.is_contiguous:
        raise ValueError(f"{name}: must be contiguous (row-major), got strides {t.strides} for shape {t.shape}")
    if t.ptr % t.dtype.itemsize:  # kernels read whole elements (a DLPack byte offset can break this)
        raise ValueError(f"{name}: data pointer 0x{t.ptr:x} is not aligned to its {t.dtype.itemsize}-byte elements")
    return t


def token_tensor(obj, name: str, inner: tuple, dtype: str, rows, stream: int, *, ordinal: int,
                 max_tokens: int, leading_dims=(1,)) -> Tensor:
    """A per-token argument of dispatch/combine: cuda_tensor on this rank's GPU, of `dtype`,
    shaped [*leading, *inner] with len(leading) in leading_dims, and `rows` rows when given."""
    # (0, the legacy stream, is spelled None in DLPack's stream argument here)
    t = cuda_tensor(obj, name, stream or None, ordinal, " (this rank's GPU)", dtype)
    if leading_dims != (1,):
        if t.ndim - len(inner) not in leading_dims or tuple(t.shape[-len(inner):]) != inner:
            raise ValueError(f"{name}: last dimension must be {inner}, got shape {t.shape}")
        return t
    if t.ndim != 1 + len(inner) or tuple(t.shape[1:]) != inner:
        raise ValueError(f"{name}: shape must be [tokens, {', '.join(map(str, inner))}], got {list(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name}: has {t.shape[0]} rows but token_selected_experts has {rows}")
    require(t.shape[0] <= max_tokens, name, f"{t.shape[0]} tokens exceed max_tokens_per_rank={max_tokens}")
    return t


class CheckedInputs:
    """token_tensor with a memory: engines pass the same tensors step after step, and an
    ep_a2a Tensor already checked under this argument name, with the same geometry, is not
    checked again. A weak reference: holding the tensor would move its
    cuMemFree into a later dispatch, where it would block the host between two in-process
    ranks' launches (deadlock)."""

    def __init__(self, ordinal: int, max_tokens: int):
        self.ordinal, self.max_tokens = ordinal, max_tokens
        self.seen = {}  # argument name -> (weak ref, geometry) of the last tensor checked

    def __call__(self, obj, name: str, inner: tuple, dtype: str, rows, stream: int, leading_dims=(1,)) -> Tensor:
        seen = self.seen.get(name)  # (a dead reference reads None: None itself never matches)
        if seen is not None and obj is not None and seen[0]() is obj and seen[1] == (
                obj.ptr, obj.shape, obj.strides, obj.dtype, obj.device, rows, inner, dtype):
            return obj if obj.stream is None or obj.stream == stream else as_tensor(obj, stream=stream)
        t = token_tensor(obj, name, inner, dtype, rows, stream, ordinal=self.ordinal, max_tokens=self.max_tokens,
                         leading_dims=leading_dims)
        if type(obj) is Tensor:
            self.seen[name] = (weakref.ref(obj), (obj.ptr, obj.shape, obj.strides, obj.dtype, obj.device, rows,
                                                  inner, dtype))
        return t


def expert_id_error(host_ids, num_experts: int):
    """The ValueError for the first id of a host copy of token_selected_experts outside
    0..num_experts-1 and -1, or None when all are valid."""
    bad = (host_ids < -1) | (host_ids >= num_experts)
    if not bad.any():
        return None
    i, k = map(int, np.argwhere(bad)[0])
    return ValueError(f"token_selected_experts: ids must be in 0..num_experts-1={num_experts - 1} "
                      f"or -1 (no expert); token {i}, selection {k} is {int(host_ids[i, k])}")


def check_expert_ids_on_host(ids: Tensor, stream: int, num_experts: int) -> None:
    """validate_expert_ids: copy the ids to the host once `stream` is done with them (a
    synchronization) and raise expert_id_error's ValueError, if any."""
    host = np.empty(ids.shape, np.int32)
    synchronize_stream(stream)
    copy_dtoh(host.ctypes.data, ids.ptr, host.nbytes)
    err = expert_id_error(host, num_experts)
    if err is not None:
        raise err


def check_fp8_partial(partial, runtime_max: int, combine_quant, fp8_input) -> None:
    """An Fp8Partial is only ever this rank's own workspace views for this T^ (the kernel
    reads the section in place; there is nothing to stage from elsewhere): fp8_input()
    gives that rank's combine_input(T^, fp8=True) and the (ptr, shape, dtype) its views had
    when they were made (a caller may change a Tensor's fields)."""
    require(combine_quant == "fp8", "partial",
            f"an Fp8Partial needs combine_quant='fp8' (this all-to-all has {combine_quant!r})")
    want, geometry = fp8_input()
    for got, geo, name in zip(partial[:2], geometry, ("values", "scales")):
        if type(got) is not Tensor or (got.ptr, got.shape, got.dtype.name) != geo:
            raise ValueError(f"partial: an Fp8Partial must be this rank's combine_input({runtime_max}, fp8=True); its "
                             f"{name} is not that view")
    require(partial.dtype == want.dtype, "partial", f"dtype must be {want.dtype!r}, got {partial.dtype!r}")
