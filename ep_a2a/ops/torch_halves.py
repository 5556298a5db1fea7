"""The send and receive halves (ep_a2a/halves.py) as PyTorch ops, beside ops/torch.py's whole ones.

    ep_ops.dispatch_send(tr, topk_ids, [hidden, topk_w], T_hat)   # returns at once
    ...                                                           # other work on the stream
    ids, (x, w) = ep_ops.dispatch_recv(tr, T_hat)                 # the views, as dispatch returns them
    out = ep_ops.combine_send(tr, ep_ops.combine_input(tr, T_hat), T_hat)
    ...
    ep_ops.combine_recv(tr, out)                                  # out now holds the reduced rows

Under torch.compile (fullgraph) the halves of one operation stay in order because both ops
declare the same tensor mutated: the dispatched ids view for dispatch, `out` for combine
(the fake implementations do nothing, as the whole ops'). A receive half runs on the stream
its send half ran on. These ops always go through the torch dispatcher (no eager shortcut:
an engine that overlaps replays CUDA graphs, where host cost is gone).
"""
from __future__ import annotations

import torch

from ..driver.stream import stream_handle
from ..errors import StateError
from .torch_views import RANKS, TorchRank, bind, current_stream_handle, lookup, register_ops

__all__ = ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "HALF_SCHEMAS"]

HALF_SCHEMAS = {
    "dispatch_send": "dispatch_send(int rank, Tensor token_selected_experts, Tensor[] payloads, "
                     "int runtime_max_tokens_per_rank, Tensor(a!) recv_expert_ids, int stream=-1) -> ()",
    "dispatch_recv": "dispatch_recv(int rank, Tensor(a!) recv_expert_ids, Tensor(b!)[] recv_payloads) -> ()",
    "combine_send": "combine_send(int rank, Tensor partial, Tensor? scales, Tensor dispatched, "
                    "int runtime_max_tokens_per_rank, Tensor(a!) out, int stream=-1) -> ()",
    "combine_recv": "combine_recv(int rank, Tensor(a!) out) -> ()",
}


def _binding(rank) -> TorchRank:
    return rank if isinstance(rank, TorchRank) else bind(rank)


def _stream_arg(stream) -> int:
    return -1 if stream is None else stream_handle(stream)


def _same_or_copy(passed, own) -> None:
    """As ops/torch.py's: a compiler that handed the op a copy of its view gets the result there."""
    if passed.data_ptr() != own.data_ptr():
        passed.copy_(own)


def _stream(b: TorchRank, stream: int) -> tuple:
    return (current_stream_handle(b.ordinal), False) if stream == -1 else b.streams.pick(stream)


def dispatch_send_impl(rank, token_selected_experts, payloads, runtime_max_tokens_per_rank, recv_expert_ids, stream=-1):
    b = lookup(RANKS, rank, "rank")
    s, explicit = _stream(b, stream)
    b.vouched_dispatch = None  # (the slots take these tensors: the whole op's record no longer describes them)
    try:
        ids, pays, _ = b.dispatch_args(token_selected_experts, payloads)
    except (TypeError, ValueError) as e:
        b.r.reject_step(runtime_max_tokens_per_rank, s, e)
        raise
    b.r.dispatch_send(ids, pays, runtime_max_tokens_per_rank, s)
    b.local_tokens = ids.shape[0]
    if explicit:
        b.streams.hold(s, (token_selected_experts, *payloads))


def dispatch_recv_impl(rank, recv_expert_ids, recv_payloads):
    b = lookup(RANKS, rank, "rank")
    runtime_max, due = int(recv_expert_ids.shape[1]), b.r.halves.due
    if due is not None and due.op == "dispatch" and due.result[0].shape[1] != runtime_max:
        raise ValueError(f"runtime_max_tokens_per_rank: the receive half got {runtime_max} but its send half used "
                         f"{due.result[0].shape[1]}")
    b.r.dispatch_recv()
    own_ids, own_pays = b.dispatch_views(runtime_max)
    _same_or_copy(recv_expert_ids, own_ids)
    for got, own in zip(recv_payloads, own_pays):
        _same_or_copy(got, own)


def combine_send_impl(rank, partial, scales, dispatched, runtime_max_tokens_per_rank, out, stream=-1):
    b = lookup(RANKS, rank, "rank")
    s, explicit = _stream(b, stream)
    b.vouched_combine = (None, None)
    part, _ = b.partial_arg(partial, scales, runtime_max_tokens_per_rank)
    b.out_slot.update(out)
    b.r.combine_send(part, runtime_max_tokens_per_rank, s, b.out_slot.tensor)
    b.half_out = out  # (the receive half's `out` may be a compiler's copy of it)
    if explicit:
        b.streams.hold(s, (partial, out))


def combine_recv_impl(rank, out):
    b = lookup(RANKS, rank, "rank")
    b.r.combine_recv()
    sent, b.half_out = b.half_out, None
    if sent is not None:
        _same_or_copy(out, sent)


HALF_IMPLS = {"dispatch_send": dispatch_send_impl, "dispatch_recv": dispatch_recv_impl,
              "combine_send": combine_send_impl, "combine_recv": combine_recv_impl}
LIB = torch.library.Library("ep_a2a", "FRAGMENT")
HALF_OPS = register_ops(LIB, HALF_SCHEMAS, HALF_IMPLS)


def dispatch_send(rank, token_selected_experts, payloads, runtime_max_tokens_per_rank: int, stream=None) -> None:
    """dispatch()'s send half (ops/torch.dispatch's arguments); dispatch_recv delivers."""
    b = _binding(rank)
    ids_v, _ = b.dispatch_views(runtime_max_tokens_per_rank)
    b.local_tokens = token_selected_experts.shape[0]
    HALF_OPS["dispatch_send"](b.handle, token_selected_experts, list(payloads), runtime_max_tokens_per_rank, ids_v,
                              _stream_arg(stream))


def dispatch_recv(rank, runtime_max_tokens_per_rank: int) -> tuple:
    """The receive half: (expert ids view, [payload views]), as ops/torch.dispatch returns them."""
    b = _binding(rank)
    ids_v, pays_v = b.dispatch_views(runtime_max_tokens_per_rank)
    HALF_OPS["dispatch_recv"](b.handle, ids_v, pays_v)
    return ids_v, pays_v


def combine_send(rank, partial, runtime_max_tokens_per_rank: int, out=None, stream=None, num_tokens: int = None):
    """combine()'s send half (ops/torch.combine's arguments); returns `out`, which
    combine_recv(rank, out) fills."""
    b = _binding(rank)
    scales = None
    if type(partial) in (tuple, list):
        partial, scales = partial
    if out is None:
        T = b.local_tokens if num_tokens is None else num_tokens
        if T is None:
            raise StateError(f"rank {b.rank}: combine_send without a dispatch through these ops before it: "
                             "pass out= or num_tokens=")
        out = torch.empty((T, b.hidden), dtype=b.combine_dtype, device=b.device)
    dispatched = b.dispatch_views(runtime_max_tokens_per_rank)[0]
    HALF_OPS["combine_send"](b.handle, partial, scales, dispatched, runtime_max_tokens_per_rank, out,
                             _stream_arg(stream))
    return out


def combine_recv(rank, out):
    """The receive half: `out` (from combine_send) holds the reduced rows once it has run."""
    HALF_OPS["combine_recv"](_binding(rank).handle, out)
    return out
