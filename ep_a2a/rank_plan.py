"""One rank's fixed plan (schedule.RankPlan): its parameter block, kernels and launch rules,
built once when the all-to-all is constructed."""
from __future__ import annotations

import dataclasses

from . import schedule
from .config import REDUCE_DTYPES, peers_on_device
from .driver.launch import Launch, cluster_launch, occupancy, prefer_max_shared
from .driver.module import load
from .layout import A2AParams, sentinel_kind
from .schedule import RankPlan


def half_launches(protocols, q8: str, reduce_dtype: str, dev, launch) -> dict:
    """protocol -> {operation: (send Launch, receive Launch)}: the halves' kernels (halves.py),
    built in cubins of their own (kernels/*_halves.cu). Like every protocol kernel they prefer
    the largest shared-memory carveout: a kernel that needs another carveout waits for SMs
    drained of blocks, and a spinning block drains only once its peers' halves have run."""
    halves = {}
    for protocol in protocols:
        module = load(f"{protocol}_halves", dev)
        halves[protocol] = {
            op: tuple(launch(prefer_max_shared(module.function(f"{protocol}_{op}_{part}{suffix}")))
                      for part in ("send", "recv"))
            for op, suffix in (("dispatch", ""), ("combine", f"_{q8}{reduce_dtype}"))}
    return halves


def build_plan(a2a, index: int, rank, record_address: int) -> RankPlan:
    """The plan of `rank` (a group.Rank) of `a2a`, its failures recorded at `record_address`."""
    options, layout, dev = a2a.options, a2a.layout, rank.device
    base = a2a.workspace.base(index)
    params = A2AParams()
    for peer, address in enumerate(a2a.workspace.peers(index)):
        params.peer_base[peer] = address
    params.error_record = record_address
    layout.fill_params(params, options.payload_kinds)
    params.rank, params.ep_size = rank.rank, options.ep_size
    params.top_k, params.num_experts = options.top_k, options.num_experts
    params.experts_per_rank, params.experts_remainder = divmod(options.num_experts, options.ep_size)
    params.combine_vec = schedule.vector_bytes(layout.combine_bytes, base + layout.off_combine)
    params.combine_kind = sentinel_kind(options.combine_dtype.name)
    params.abort_on_timeout = int(options.on_timeout == "abort")
    params.peers_on_device = peers_on_device(rank.ranks_on_device, options.ep_size)

    reduce_dtype = REDUCE_DTYPES[options.combine_dtype.name]
    protocols = ("fence", "sentinel") if options.protocol == "auto" else (options.protocol,)
    q8 = "q8_" if options.combine_quant else ""
    kernels = {protocol: (prefer_max_shared(load(protocol, dev).function(f"{protocol}_dispatch")),
                          prefer_max_shared(load(protocol, dev).function(f"{protocol}_combine_{q8}{reduce_dtype}")))
               for protocol in protocols}
    blocks_per_sm = min(occupancy(kernel, options.threads_per_block) for pair in kernels.values() for kernel in pair)
    # kernels of every rank sharing this GPU spin on each other: all must be resident
    max_grid = max(1, blocks_per_sm * dev.sm_count // rank.ranks_on_device)
    descs = tuple(params.payloads[index] for index in range(params.num_payloads))  # (indexing makes a new wrapper)
    payload_bytes = tuple(desc.bytes_per_token for desc in descs)
    rules = schedule.Schedule(options.ep_size, options.top_k, options.threads_per_block, options.combine_hidden_size,
                              layout.combine_bytes, bool(options.combine_quant), bool(options.pdl), max_grid,
                              schedule.push_groups(payload_bytes, options.threads_per_block))
    cluster = "fence" in kernels and rules.clusters_fit(blocks_per_sm, dev.sm_count, rank.ranks_on_device) and \
        cluster_launch(dev, kernels["fence"][0], [params], schedule.CLUSTER_BLOCKS, options.threads_per_block,
                       options.pdl, rank.ranks_on_device)
    if cluster:
        rules = dataclasses.replace(rules, clusters=True)

    def launch(fn):
        return Launch(dev, fn, [params], 1, options.threads_per_block, pdl=options.pdl)
    return RankPlan(halves=half_launches(protocols, q8, reduce_dtype, dev, launch), rank=rank.rank, params=params, descs=descs, payload_bytes=payload_bytes,
                    launches={protocol: (launch(pair[0]), launch(pair[1])) for protocol, pair in kernels.items()},
                    cluster=cluster or None, empty=launch(load("util", dev).function("ep_empty")), schedule=rules,
                    crossover_tokens=options.crossover_tokens, combine_bytes=layout.combine_bytes,
                    combine_input=base + layout.off_combine, fp8_combine=options.combine_quant == "fp8",
                    timeout_ns=int(1e9 * options.timeout_s), first_timeout_ns=int(1e9 * options.first_timeout_s))
