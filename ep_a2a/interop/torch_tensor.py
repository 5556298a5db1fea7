"""torch tensors and ep_a2a Tensors without a DLPack exchange per call.

A DLPack exchange costs tens of µs per tensor (torch builds stream objects and records an
event each time), more than a whole dispatch launch. The torch ops (ep_a2a/ops/torch.py)
instead keep one ep_a2a Tensor per argument position (`TensorSlot`) and rewrite its fields
from each torch tensor passed there: data pointer, shape, strides, dtype and device, read
through torch's cheap accessors. The all-to-all then checks that Tensor by its usual rules
(and skips them when nothing changed: validate.CheckedInputs, fastpath.Repeat), with the
usual messages naming the argument. Nothing is ordered between streams here: the ops launch
on the stream the tensors are used on (torch's current stream), which is what makes that safe.

The all-to-all's own repeat fast path reads torch tensors passed to it directly through
`geometry` and `current_stream` (interop/readers.py), for the same reason.

The other direction, `torch_view`, turns a workspace view into a torch tensor once (one
DLPack exchange, made when a view is first needed and then cached by the caller).
torch is imported only when one of these runs.
"""
from __future__ import annotations

from .tensor import CPU, CUDA, DTYPES, Tensor, contiguous_strides

_BY_TORCH = {}   # torch.dtype -> DType (filled on first use: importing this module needs no torch)
_TO_TORCH = {}   # DType name -> torch.dtype


def _tables() -> dict:
    if not _BY_TORCH:
        import torch
        for name, d in DTYPES.items():
            t = getattr(torch, name, None)
            if isinstance(t, torch.dtype):
                _BY_TORCH[t], _TO_TORCH[name] = d, t
    return _BY_TORCH


def torch_dtype(name: str):
    """The torch.dtype of an ep_a2a dtype name (TypeError when torch has none)."""
    _tables()
    t = _TO_TORCH.get(name)
    if t is None:
        raise TypeError(f"dtype {name}: this torch has no such dtype")
    return t


def _strides_of(t, shape: tuple) -> tuple:
    """(strides, dense): the strides the slot's Tensor takes from torch tensor t of this shape,
    and whether they are the row-major ones. Row-major when torch calls t contiguous: they
    address every element of t exactly as t's own strides do (torch's is_contiguous() ignores
    the stride of an extent of 1, and any strides of an empty tensor); else t's own. So a
    slot's Tensor is dense exactly when its torch tensor is contiguous, and a later contiguous
    tensor of the same shape is seen by is_contiguous() alone, at every batch size (extents
    of 1 included)."""
    if t.is_contiguous():
        return contiguous_strides(shape), True
    return t.stride(), False


class TensorSlot:
    """One argument position's ep_a2a Tensor, rewritten in place from each torch tensor passed
    there. The same Tensor object every call lets the all-to-all's repeat fast path recognise
    a call whose tensors sit where the last call's did (a steady-state engine, where the
    caching allocator hands out the same blocks); any change of address, shape, strides,
    dtype or device takes the full checks, as for a Tensor changed in place. The slot holds
    no reference to the torch tensor: the caller does, for the call, and the kernels run on
    the stream it is used on."""
    __slots__ = ("name", "tensor", "torch_dtype", "ordinal", "dense")

    def __init__(self, name: str):
        # (torch_dtype None until the first fill: no torch dtype is None, so that fill takes _refill)
        self.name, self.tensor, self.torch_dtype, self.ordinal, self.dense = name, None, None, None, False

    def update(self, t) -> bool:
        """Rewrite the slot's Tensor from torch tensor `t`; True when that changed nothing (t
        has the address, shape, strides, dtype and device of the tensor filled in last), which
        lets the torch ops vouch for a repeated call (RankAlltoAll.dispatch_same)."""
        # (hot path: five accessor calls, ~0.35 µs, when the dtype and device are the last call's;
        # the slot alone writes its Tensor's geometry, so its fields still hold what they were
        # set to. is_contiguous() costs less than stride(), and stands for it when the last
        # tensor was contiguous too and the shape is unchanged: _strides_of.)
        dt, ordinal = t.dtype, t.get_device()
        if dt is not self.torch_dtype or ordinal != self.ordinal:
            self._refill(t, dt, ordinal)
            return False
        w, ptr, shape = self.tensor, t.data_ptr(), t.shape
        if shape == w.shape:  # (a torch.Size equals the tuple of its extents)
            if t.is_contiguous() if self.dense else t.stride() == w.strides:
                if ptr == w.ptr:
                    return True
                w.ptr = ptr
                return False
        else:
            w.shape = tuple(shape)
        w.ptr = ptr
        w.strides, self.dense = _strides_of(t, w.shape)
        return False

    def fill(self, t) -> Tensor:
        """The slot's Tensor, rewritten from torch tensor `t`."""
        self.update(t)
        return self.tensor

    __call__ = fill  # (slot(t) reads well; the hot paths call slot.update(t) or slot.fill(t): a bound-method
    #                  call costs less than a call through __call__, ~30 ns against ~75 on CPython 3.11)

    def _refill(self, t, dt, ordinal: int) -> Tensor:
        d = (_BY_TORCH or _tables()).get(dt)
        if d is None:
            raise TypeError(f"{self.name}: torch dtype {dt} has no ep_a2a equivalent "
                            f"(ep_a2a handles {', '.join(DTYPES)})")
        device = (CUDA, ordinal) if ordinal >= 0 else (CPU, 0)  # -1 on the CPU: the all-to-all's device rule names it
        w, shape = self.tensor, tuple(t.shape)
        strides, dense = _strides_of(t, shape)
        if w is None:
            w = self.tensor = Tensor(t.data_ptr(), shape, d, device=device, strides=strides)
        else:
            w.ptr, w.shape, w.strides, w.dtype, w.device = t.data_ptr(), shape, strides, d, device
        self.torch_dtype, self.ordinal, self.dense = dt, ordinal, dense
        return w


def geometry(t) -> tuple:
    """What a torch tensor's conversion to an ep_a2a Tensor depends on, read through torch's
    accessors (well under a µs, where a DLPack exchange costs tens): address, shape, strides,
    dtype, device, and requires_grad (torch refuses to export a tensor that requires grad).
    A write into the values changes none of it; moving, resizing or restriding the tensor in
    place (set_, resize_, as_strided_, .data =) does. interop/readers.py uses it."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device(), t.requires_grad


def device_ordinal(t) -> int:
    return t.get_device()


_current = []  # [torch's current-stream reader] (made on first use: importing this module needs no torch)


def current_stream(ordinal: int) -> int:
    """torch's current stream on cuda:`ordinal` as a raw handle: where torch queues the work
    that produces a tensor, which its DLPack export orders before the consumer's stream."""
    if not _current:
        import torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (building a Stream object costs far more)
        _current.append(raw or (lambda i: torch.cuda.current_stream(i).cuda_stream))
    return _current[0](ordinal)


def standing_tensor(t) -> Tensor:
    """An ep_a2a Tensor over torch tensor t's memory that owns nothing (the caller holds t)."""
    d = (_BY_TORCH or _tables()).get(t.dtype)
    if d is None:
        raise TypeError(f"torch dtype {t.dtype} has no ep_a2a equivalent")
    ordinal, shape = t.get_device(), tuple(t.shape)
    return Tensor(t.data_ptr(), shape, d, device=(CUDA, ordinal) if ordinal >= 0 else (CPU, 0),
                  strides=_strides_of(t, shape)[0])


def torch_view(t: Tensor):
    """A torch tensor over the memory of a contiguous CUDA ep_a2a Tensor (one DLPack exchange,
    as bytes, then viewed as its dtype: float8 and the unsigned types cross whatever this
    torch's DLPack import supports). It keeps `t` (hence its owner) alive."""
    import torch
    if not t.is_contiguous:
        raise ValueError(f"torch_view: needs a contiguous tensor, got strides {t.strides} for shape {t.shape}")
    raw = Tensor(t.ptr, (t.nbytes,), "uint8", device=t.device, owner=t)
    return torch.from_dlpack(raw).view(torch_dtype(t.dtype.name)).view(t.shape)
