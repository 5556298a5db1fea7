"""The MoE router before dispatch: logits -> top-k expert ids and their softmax weights in one
kernel per call (moe_route_* in kernels/moe_compute.cu), one warp per token. `moe.route` is
the same function (ep_a2a.moe re-exports this module's names).
"""
from __future__ import annotations

import ctypes

from .driver.device import Device, get_device
from .driver.launch import Launch
from .driver.module import load
from .driver.stream import stream_handle
from .interop.tensor import float32, int32
from .validate import cuda_tensor

# The router (route()): logits in registers, 32 * N per warp with N a power of two up to 32; 1024
# is also the widest row torch's one-warp softmax takes, whose steps the weights follow.
ROUTE_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
ROUTE_MAX_EXPERTS = 1024
ROUTE_MAX_TOP_K = 32           # one selection per lane
_ROUTE_WARPS = 8
ROUTE_KERNELS = tuple(f"moe_route_{d}_{n}" for d in ROUTE_DTYPES.values() for n in (1, 2, 4, 8, 16, 32))


def route_unsupported(num_experts: int, top_k: int, dtype: str):
    """Why the fused router does not take these logits (None: it does). dtype: the logits'
    dtype name (ep_a2a's, which is torch's without the prefix)."""
    if dtype not in ROUTE_DTYPES:
        return f"logits dtype {dtype} (the kernel reads {', '.join(ROUTE_DTYPES)})"
    if not 1 <= num_experts <= ROUTE_MAX_EXPERTS:
        return f"num_experts={num_experts} (the kernel holds 1..{ROUTE_MAX_EXPERTS} logits per token)"
    if not 1 <= top_k <= min(ROUTE_MAX_TOP_K, num_experts):
        return f"top_k={top_k} (the kernel takes 1..min({ROUTE_MAX_TOP_K}, num_experts))"
    return None


class Router:
    """The fused router kernels of one GPU (moe_route_*), fetched at construction (so never
    during a graph capture), with their launches kept between calls."""

    def __init__(self, device):
        self.device = device if isinstance(device, Device) else get_device(int(device))
        self._module = load("moe_compute", self.device)
        for name in ROUTE_KERNELS:
            self._module.function(name)
        self._launches = {}
        self.last_issued = ()  # the Launch of the last call (ops/torch_views.Replays)

    def __call__(self, logits, ids, weights, *, renormalize: bool = True, stream=None) -> None:
        """route() on this GPU."""
        s = 0 if stream is None else stream_handle(stream)
        dev = self.device.ordinal
        x = cuda_tensor(logits, "logits", s, dev)
        if x.ndim != 2:
            raise ValueError(f"logits: shape must be [tokens, num_experts], got {list(x.shape)}")
        (T, E), i, w = x.shape, cuda_tensor(ids, "ids", s, dev), cuda_tensor(weights, "weights", s, dev)
        if i.dtype != int32 or w.dtype != float32:
            raise ValueError(f"ids, weights: dtypes must be int32 and float32, got {i.dtype.name} and {w.dtype.name}")
        k = i.shape[1] if i.ndim == 2 else 0
        if not (i.ndim == 2 and i.shape[0] == T and w.shape == i.shape):
            raise ValueError(f"ids, weights: shapes must both be [tokens={T}, top_k], got {list(i.shape)} and "
                             f"{list(w.shape)}")
        why = route_unsupported(E, k, x.dtype.name)
        if why is not None:
            raise ValueError(f"logits: the fused router does not take {why}")
        if T == 0:
            self.last_issued = ()
            return
        n = 1 << max(0, (E - 1) // 32).bit_length()  # logits per lane: a power of two
        name = f"moe_route_{ROUTE_DTYPES[x.dtype.name]}_{n}"
        grid = max(1, min(-(-T // _ROUTE_WARPS), 4 * self.device.sm_count))
        args = [ctypes.c_uint64(x.ptr), ctypes.c_uint64(i.ptr), ctypes.c_uint64(w.ptr), ctypes.c_int32(T),
                ctypes.c_int32(E), ctypes.c_int32(k), ctypes.c_int32(1 if renormalize else 0)]
        launch = self._launches.get(name)
        if launch is None:
            launch = self._launches[name] = Launch(self.device, self._module.function(name), args, grid,
                                                   32 * _ROUTE_WARPS)
        else:
            for mine, new in zip(launch.args, args):
                mine.value = new.value
        launch.grid = grid
        launch.stamp += 1
        self.device.make_current()
        launch(s)
        self.last_issued = (launch,)


_ROUTERS = {}


def router_for(device) -> Router:
    """The Router of a GPU (a Device or an ordinal), made on first use."""
    ordinal = device.ordinal if isinstance(device, Device) else int(device)
    r = _ROUTERS.get(ordinal)
    if r is None:
        r = _ROUTERS[ordinal] = Router(device)
    return r


def route(logits, ids, weights, *, renormalize: bool = True, stream=None) -> None:
    """The MoE router: ids[t] = the top_k experts of the largest logits[t] (descending; equal
    logits: the lower expert first), weights[t] = softmax over those k logits (renormalize=True),
    or the softmax over all experts' logits at those k (renormalize=False).

    logits: fp32 / bf16 / fp16 [tokens, num_experts <= 1024], contiguous; ids: int32 and
    weights: fp32 [tokens, top_k], top_k <= min(32, num_experts), written. NaN logits rank
    above all others (as torch.topk ranks them). The weights take the steps of torch's one-warp
    softmax (x - max, expf, per-lane then butterfly sums, a division); see docs/layer.md for
    what is checked against torch.topk + torch.softmax. One warp per token, one launch.
    stream: where to run (default: the legacy default stream).
    """
    x = cuda_tensor(logits, "logits", None if stream is None else stream_handle(stream))
    router_for(x.device[1])(x, ids, weights, renormalize=renormalize, stream=stream)
