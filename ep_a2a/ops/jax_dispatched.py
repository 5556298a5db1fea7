"""Dispatched: what dispatch and dispatch_to_experts (ops/jax.py) and dispatch_recv
(jax_halves.py) return under jax.jit, a pytree whose static facts pair it with its combine."""
from __future__ import annotations

import jax


@jax.tree_util.register_pytree_node_class
class Dispatched:
    """What dispatch returns under jit: the received expert ids [ep_size, T^, top_k] and payloads
    [ep_size, T^, ...] (dispatch_to_experts: the expert-major rows and the counts instead) per
    rank, the ticket combine takes, and the static step facts (T^, tokens per rank, whether the
    call took one rank's arrays rather than a list per rank)."""

    def __init__(self, expert_ids, payloads, ticket, *, ops, kind: str, tmax: int, num_tokens: tuple, site: int = 0,
                 single: bool):
        self.expert_ids, self.payloads, self.ticket = expert_ids, payloads, ticket
        self.ops, self.kind, self.tmax, self.num_tokens, self.site = ops, kind, tmax, num_tokens, site
        self.single = single

    @property
    def rows(self):
        """dispatch_to_experts: the gathered rows per rank, [ep_size * T^ * top_k, *row shape]."""
        return self.payloads

    @property
    def counts(self):
        """dispatch_to_experts: int32 [local experts] rows of each local expert, per rank (None
        with counts=False)."""
        return self.expert_ids

    def tree_flatten(self):
        return (self.expert_ids, self.payloads, self.ticket), \
            (self.ops, self.kind, self.tmax, self.num_tokens, self.site, self.single)

    @classmethod
    def tree_unflatten(cls, aux, children):
        ops, kind, tmax, num_tokens, site, single = aux
        return cls(*children, ops=ops, kind=kind, tmax=tmax, num_tokens=num_tokens, site=site, single=single)
